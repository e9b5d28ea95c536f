"""``ftsystem sim halos``, ``ftsystem bench halos`` and ``ftsystem halos run`` (real mode)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ftsystem.cli import app, bench_app, sim_app
from ftsystem.halos.config import DEFAULT_SETUP, DEFAULT_TRACE, PaperSetup, SetupError

if TYPE_CHECKING:
    from ftsystem.halos.simulator import SimConfig

ALL_METHODS = "halos,diloco,diloco_dynupd,async_local_sgd,sync"
QUICK_ITERS, FULL_ITERS = 384, 1536

SETUP_OPT = typer.Option(DEFAULT_SETUP, "--setup", help="The paper's setup YAML.")
TRACE_OPT = typer.Option(DEFAULT_TRACE, "--trace", help="Step-time/size trace of Pythia models.")
halos_app = typer.Typer(no_args_is_help=True, help="HALoS in real mode: the GPS, the LPSs and "
                        "the workers as processes under agents, coordinated through etcd.")
app.add_typer(halos_app, name="halos")


@sim_app.command("halos")
def sim_halos(
    setup: Path = SETUP_OPT,
    trace: Path = TRACE_OPT,
    pythia: str = typer.Option("pythia-70m", help="Trace entry whose size the transfers charge."),
    step_time_ms: float = typer.Option(None, help="Local step time of a speed-1.0 worker "
                                       "(default: the YAML's, else the trace's H200 time)."),
    iters: int = typer.Option(FULL_ITERS, help="Global iterations per method (the paper: 6144)."),
    methods: str = typer.Option(ALL_METHODS, help="Comma-separated methods to compare."),
    non_iid: bool = typer.Option(False, "--non-iid", help="A different language per region."),
    local_batch: int = typer.Option(8, help="Sequences per local step of the small model."),
    branching: int = typer.Option(8, help="Likely successors per token of the language."),
    seed: int = typer.Option(0, help="Seed of data and initial model."),
    eval_points: int = typer.Option(64, help="Held-out evaluations per method."),
    json_path: Path = typer.Option(None, "--json", help="Write the figures here."),
    plot: Path = typer.Option(Path("bench/results/halos_sim.png"), help="Loss curves (PNG)."),
) -> None:
    """Trace-driven simulation of HALoS and its baselines in virtual time (real loss)."""
    paper, cfg = _load(setup, trace, pythia=pythia, step_time_ms=step_time_ms, iters=iters,
                       eval_points=eval_points, local_batch=local_batch, branching=branching,
                       non_iid=non_iid, seed=seed)
    _run("sim halos", paper, cfg, _methods(methods), json_path, plot)


@bench_app.command("halos")
def bench_halos(
    json_path: Path = typer.Option(..., "--json", help="Write the figures here."),
    quick: bool = typer.Option(False, "--quick", help=f"{QUICK_ITERS} iterations, "
                               f"not {FULL_ITERS}."),
    setup: Path = SETUP_OPT,
    trace: Path = TRACE_OPT,
    iters: int = typer.Option(None, help="Override the number of global iterations."),
    plot: Path = typer.Option(None, help="Loss curves (PNG) (default: beside the JSON)."),
) -> None:
    """Time-to-target-loss of the five methods in the paper's 4x4 setup (simulated)."""
    iters = iters or (QUICK_ITERS if quick else FULL_ITERS)
    paper, cfg = _load(setup, trace, pythia="pythia-70m", step_time_ms=None, iters=iters,
                       eval_points=64, local_batch=8, branching=8, non_iid=False, seed=0)
    _run("bench halos" + (" --quick" if quick else ""), paper, cfg, _methods(ALL_METHODS),
         json_path, plot or json_path.with_suffix(".png"))


def _methods(methods: str) -> list[str]:
    from ftsystem.halos.simulator import METHODS

    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(METHODS)) or ([] if chosen else ["(none)"])
    if unknown:
        raise typer.BadParameter(f"unknown methods {unknown}; choose from {', '.join(METHODS)}",
                                 param_hint="--methods")
    return chosen


def _load(setup: Path, trace: Path, *, pythia: str, step_time_ms: float | None, iters: int,
          eval_points: int, local_batch: int, branching: int, non_iid: bool,
          seed: int) -> tuple[PaperSetup, SimConfig]:
    """The setup and the run's configuration; a user's mistake exits with its reason."""
    # torch and simpy only when a command runs: every ftsystem command imports this module.
    from ftsystem.halos.config import load_setup
    from ftsystem.halos.simulator import SimConfig
    from ftsystem.halos.workload import WorkloadConfig

    try:
        paper = load_setup(setup, trace=trace, model=pythia, step_time_ms=step_time_ms)
        cfg = SimConfig(total_iters=iters, eval_points=eval_points, workload=WorkloadConfig(
            local_batch=local_batch, branching=branching, non_iid=non_iid, seed=seed))
    except (SetupError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    return paper, cfg


def _run(title: str, paper: PaperSetup, cfg: SimConfig, methods: list[str],
         json_path: Path | None, plot: Path) -> None:
    """Compare ``methods``; print the table, write the JSON and the PNG."""
    import torch

    from ftsystem.measure import report
    from ftsystem.halos import experiment

    torch.set_num_threads(1)  # tiny tensors: threads cost more than they give on shared cores
    comp = experiment.compare(paper, cfg, methods, progress=lambda c: typer.echo(
        f"{c.method}: final loss {c.final_loss:.4f} after {c.time_s[-1] / 3600:.2f} virtual h "
        f"({c.wall_s:.0f} s)", err=True))
    report.print_table(f"{title}: virtual time to the target loss {comp.target_loss:.4f} "
                       f"({experiment.TARGET_RULE}); paper: x HALoS at the largest Pythia",
                       experiment.TABLE_COLUMNS, experiment.table_rows(comp, paper))
    report.write_json(json_path, experiment.summary(comp, paper, cfg)
                      | {"machine": report.machine()})
    iid = "non-IID" if cfg.workload.non_iid else "IID"
    experiment.plot(comp, plot, f"{title}: {cfg.total_iters} iterations, {iid}, "
                    f"target {comp.target_loss:.3f}")
    typer.echo(f"loss curves: {plot}" + (f"; figures: {json_path}" if json_path else ""))


@halos_app.command("run")
def halos_run(
    updates: Annotated[int, typer.Option(min=1, help="Global updates (LPS deltas applied by "
                                         "the GPS) after which the run ends.")] = 16,
    regions: Annotated[int, typer.Option(min=1, help="Regions, one LPS each.")] = 2,
    workers_per_region: Annotated[int, typer.Option(min=1, help="Workers per region.")] = 2,
    local_steps: Annotated[int | None, typer.Option(
        min=1, help="H (default: the setup's).")] = None,
    accumulation_k: Annotated[int | None, typer.Option(
        min=1, help="K (default: the setup's).")] = None,
    lr: Annotated[float | None, typer.Option(
        help="The workers' peak AdamW lr (default: the setup's).")] = None,
    step_time: Annotated[float, typer.Option(
        min=0.0, help="Emulated seconds per local step: a worker's job of H steps lasts at "
        "least H times this (0: as fast as the CPU goes).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the data and the initial model.")] = 0,
    kill_at: Annotated[list[str] | None, typer.Option(
        help="UPDATE:NODE: SIGKILL NODE (gps, lps0.., w0..) once the GPS has applied UPDATE "
             "updates; repeatable.")] = None,
    etcd: Annotated[str | None, typer.Option(
        help="etcd endpoints (default: an embedded etcd).")] = None,
    job: Annotated[str, typer.Option(help="Job id; an earlier run's keys are deleted.")] = "halos",
    out: Annotated[Path, typer.Option(
        help="Logs (agent-NODE.log), the GPS checkpoint, summary.json.")] = Path("runs/halos"),
    deadline: Annotated[float, typer.Option(
        help="Seconds after which the run is stopped as failed.")] = 600.0,
    setup: Path = SETUP_OPT,
    trace: Path = TRACE_OPT,
    json_path: Annotated[Path | None, typer.Option(
        "--json", help="Write the summary here as well.")] = None,
) -> None:
    """Run HALoS for real on this machine: GPS, 1 LPS per region, workers, all supervised."""
    from ftsystem.measure import report
    from ftsystem.control.etcd_server import EtcdNotInstalledError, EtcdStartError
    from ftsystem.halos import real
    from ftsystem.control.store import StoreError

    cfg = _real_config(setup, trace, updates=updates, regions=regions, seed=seed, lr=lr,
                       workers_per_region=workers_per_region, local_steps=local_steps,
                       accumulation_k=accumulation_k, local_step_s=step_time)
    try:
        kills = [real.parse_kill(k, cfg) for k in kill_at or []]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kill-at") from e
    launch = real.LaunchConfig(real=cfg, etcd=etcd, job=_job_id(job), out_dir=out, kills=kills,
                               deadline_s=deadline, progress=lambda m: typer.echo(m, err=True))
    try:
        summary = real.run(launch)
    except (StoreError, EtcdNotInstalledError, EtcdStartError, real.RunTimeoutError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    _print_real(summary)
    report.write_json(json_path, summary | {"machine": report.machine()})
    if summary["problems"]:
        raise typer.Exit(1)


def _job_id(job: str) -> str:
    from ftsystem.control.keys import InvalidIdError, check_id

    try:
        return check_id("job", job)
    except InvalidIdError as e:
        raise typer.BadParameter(str(e), param_hint="--job") from e


def _real_config(setup: Path, trace: Path, *, lr: float | None, seed: int, **shape):
    """The paper's hyperparameters with the run's shape; a user's mistake exits with its reason."""
    from ftsystem.halos.config import load_setup
    from ftsystem.halos.realconfig import RealConfig
    from ftsystem.halos.workload import WorkloadConfig

    try:
        paper = load_setup(setup, trace=trace)
        if lr is not None:
            paper.worker.lr = lr
        return RealConfig.from_setup(paper, workload=WorkloadConfig(seed=seed),
                                     num_regions=shape.pop("regions"),
                                     num_updates=shape.pop("updates"), **shape)
    except (SetupError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


def _print_real(summary: dict) -> None:
    from ftsystem.measure import report

    nodes = {"gps": summary["gps"], **summary["lps"], **summary["workers"]}
    rows = [[name, summary["restarts"].get(name, 0), stats.get("updates", "-"),
             stats.get("pushes", "-"), stats.get("merges", "-"),
             stats.get("per_lps") or stats.get("per_worker") or "-"]
            for name, stats in nodes.items()]
    report.print_table("halos run: nodes", ["node", "restarts", "global updates", "pushes",
                                            "merges", "by sender"], rows)
    initial, final = summary["initial_loss"], summary["final_loss"]
    typer.echo(f"{summary['updates']}/{summary['num_updates']} global updates in "
               f"{summary['wall_s']:.1f} s; held-out loss {initial:.4f} -> {final:.4f}; "
               f"kills {len(summary['kills'])}; "
               f"{'consistent' if not summary['problems'] else 'PROBLEMS: '}"
               + "; ".join(summary["problems"]))
