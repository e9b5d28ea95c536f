"""``ftsystem sim halos`` and ``ftsystem bench halos``."""

from __future__ import annotations

from pathlib import Path

import typer

from ftsystem.cli import bench_app, sim_app
from ftsystem.halos.config import DEFAULT_SETUP, DEFAULT_TRACE, SetupError

ALL_METHODS = "halos,diloco,diloco_dynupd,async_local_sgd,sync"
QUICK_ITERS, FULL_ITERS = 384, 1536

SETUP_OPT = typer.Option(DEFAULT_SETUP, "--setup", help="The paper's setup YAML.")
TRACE_OPT = typer.Option(DEFAULT_TRACE, "--trace", help="Step-time/size trace of Pythia models.")


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
    """Trace-driven simulation of HALoS and its baselines in virtual time (real small-model loss)."""
    _run(title="sim halos", setup=setup, trace=trace, pythia=pythia, step_time_ms=step_time_ms,
         iters=iters, methods=methods, non_iid=non_iid, local_batch=local_batch,
         branching=branching, seed=seed, eval_points=eval_points, json_path=json_path, plot=plot)


@bench_app.command("halos")
def bench_halos(
    json_path: Path = typer.Option(..., "--json", help="Write the figures here."),
    quick: bool = typer.Option(False, "--quick", help=f"{QUICK_ITERS} iterations, not {FULL_ITERS}."),
    setup: Path = SETUP_OPT,
    trace: Path = TRACE_OPT,
    iters: int = typer.Option(None, help="Override the number of global iterations."),
    plot: Path = typer.Option(None, help="Loss curves (PNG) (default: beside the JSON)."),
) -> None:
    """Time-to-target-loss of the five methods in the paper's 4x4 setup (simulated)."""
    iters = iters or (QUICK_ITERS if quick else FULL_ITERS)
    _run(title="bench halos" + (" --quick" if quick else ""), setup=setup, trace=trace,
         pythia="pythia-70m", step_time_ms=None, iters=iters, methods=ALL_METHODS, non_iid=False,
         local_batch=8, branching=8, seed=0, eval_points=64, json_path=json_path,
         plot=plot or json_path.with_suffix(".png"))


def _run(*, title: str, setup: Path, trace: Path, pythia: str, step_time_ms: float | None,
         iters: int, methods: str, non_iid: bool, local_batch: int, branching: int, seed: int,
         eval_points: int, json_path: Path | None, plot: Path) -> None:
    # Heavy imports here, not at the top: every ftsystem command imports this module.
    import torch

    from ftsystem import report
    from ftsystem.halos import experiment
    from ftsystem.halos.config import load_setup
    from ftsystem.halos.simulator import METHODS, SimConfig
    from ftsystem.halos.workload import WorkloadConfig

    torch.set_num_threads(1)  # small tensors: threads cost more than they give on shared cores
    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(METHODS)) or ([] if chosen else ["(none)"])
    if unknown:
        raise typer.BadParameter(f"unknown methods {unknown}; choose from {', '.join(METHODS)}",
                                 param_hint="--methods")
    try:
        paper = load_setup(setup, trace=trace, model=pythia, step_time_ms=step_time_ms)
        cfg = SimConfig(total_iters=iters, eval_points=eval_points, workload=WorkloadConfig(
            local_batch=local_batch, branching=branching, non_iid=non_iid, seed=seed))
    except (SetupError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    comp = experiment.compare(paper, cfg, chosen, progress=lambda c: typer.echo(
        f"{c.method}: final loss {c.final_loss:.4f} after {c.time_s[-1] / 3600:.2f} virtual h "
        f"({c.wall_s:.0f} s)", err=True))
    data = experiment.summary(comp, paper, cfg) | {"machine": report.machine()}
    report.print_table(f"{title}: virtual time to the target loss {comp.target_loss:.4f} "
                       f"({experiment.TARGET_RULE}); paper: x HALoS at the largest Pythia",
                       experiment.TABLE_COLUMNS, experiment.table_rows(comp, paper))
    report.write_json(json_path, data)
    experiment.plot(comp, plot, f"{title}: {cfg.total_iters} iterations, "
                    f"{'non-IID' if non_iid else 'IID'}, target {comp.target_loss:.3f}")
    typer.echo(f"loss curves: {plot}" + (f"; figures: {json_path}" if json_path else ""))
