"""``ftsystem sim halos``, ``ftsystem bench halos`` and ``ftsystem halos run`` (real mode)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ftsystem.cli import app, bench_app, sim_app
from ftsystem.halos.config import DEFAULT_SETUP, DEFAULT_TRACE, PaperSetup, SetupError

if TYPE_CHECKING:
    from ftsystem.halos.experiment import StudyConfig

ALL_METHODS = "halos,diloco,diloco_dynupd,async_local_sgd,sync"


@dataclass(frozen=True)
class Preset:
    """A size of ``bench halos-studies``: the model, the budget, the evaluations."""

    model: str
    """A ``workload.TEXT_MODELS`` name."""
    iters: int
    """Global iterations per run."""
    eval_points: int
    """Held-out evaluations per run."""
    eval_sequences: int
    """Held-out windows per evaluation."""


# bench halos-studies runs HALoS alone, 19 variants x 3 seeds: the tiny model fits minutes of CPU.
STUDIES_QUICK = Preset(model="tiny", iters=16, eval_points=8, eval_sequences=32)
STUDIES_FULL = Preset(model="tiny", iters=64, eval_points=16, eval_sequences=128)
SEEDS = "0,1,2"
# bench halos --quick: every stage of the tuned regime on the tiny model, a smoke run.
REGIME_QUICK = {"model": "tiny", "iters": 32, "eval_points": 16, "eval_sequences": 64,
                "noise_every": 4, "step_probe": 8, "outer_scales": (1.0, 2.0)}

SETUP_OPT = typer.Option(DEFAULT_SETUP, "--setup", help="The paper's setup YAML.")
TRACE_OPT = typer.Option(DEFAULT_TRACE, "--trace", help="Step-time/size trace of Pythia models.")
JOBS_OPT = typer.Option(1, min=1, help="Runs at once (forked processes, one core each).")
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
    iters: int = typer.Option(384, help="Global iterations per method (the paper: 6144)."),
    methods: str = typer.Option(ALL_METHODS, help="Comma-separated methods to compare (sync "
                                "runs in any case: it sets the targets)."),
    data: str = typer.Option("text", help="text (the King James Bible) or markov (synthetic)."),
    model: str = typer.Option("small", help="Character model for text: tiny, small, base."),
    seeds: str = typer.Option("0", help="Comma-separated seeds; each method runs each."),
    ablation: bool = typer.Option(False, "--ablation", help="Also FedAH, +momentum, +merging."),
    non_iid: bool = typer.Option(False, "--non-iid", help="Per region its own share of the "
                                 "text (markov: its own language)."),
    local_batch: int = typer.Option(4, help="Sequences per local step of the small model."),
    branching: int = typer.Option(8, help="Likely successors per token of the markov data."),
    eval_points: int = typer.Option(32, help="Held-out evaluations per run."),
    eval_sequences: int = typer.Option(128, help="Held-out windows per evaluation."),
    link_sharing: bool = typer.Option(False, "--link-sharing", help="Concurrent transfers "
                                      "on a link share its bandwidth (default: each gets all "
                                      "of it, as in the authors' simulator)."),
    jobs: int = JOBS_OPT,
    json_path: Path = typer.Option(None, "--json", help="Write the figures here."),
    plot: Path = typer.Option(Path("bench/results/halos_sim.png"), help="Ratio and loss "
                              "curves (PNG)."),
) -> None:
    """Trace-driven simulation of HALoS and its baselines in virtual time (real loss)."""
    paper, cfg = _load(setup, trace, pythia=pythia, step_time_ms=step_time_ms, iters=iters,
                       eval_points=eval_points, local_batch=local_batch, branching=branching,
                       non_iid=non_iid, data=data, model=model, eval_sequences=eval_sequences,
                       seeds=seeds, methods=methods, ablation=ablation, jobs=jobs)
    paper.time_model.link_sharing = link_sharing
    _run("sim halos", paper, trace, cfg, json_path, plot)


@bench_app.command("halos")
def bench_halos(
    json_path: Path = typer.Option(..., "--json", help="Write the figures here."),
    quick: bool = typer.Option(False, "--quick", help="The tiny model, 32 iterations: every "
                               "stage in a smoke run (not the small model, 1536)."),
    tune_only: bool = typer.Option(False, "--tune-only", help="Stop after the tuning and write "
                                   "its figures (grid, choices, targets) to --json."),
    setup: Path = SETUP_OPT,
    trace: Path = TRACE_OPT,
    iters: int = typer.Option(None, help="Override the number of global iterations."),
    model: str = typer.Option(None, help="Override the model: tiny, small, base."),
    seeds: str = typer.Option(SEEDS, help="Comma-separated seeds of the measured runs (at "
                              "least 3 for a spread)."),
    jobs: int = JOBS_OPT,
    cache: Path = typer.Option(None, help="Keep each finished run here, so that a stopped "
                               "bench resumes (default: ~/.cache/ftsystem/halos-runs)."),
    no_cache: bool = typer.Option(False, "--no-cache", help="Run everything, keep nothing."),
    plot: Path = typer.Option(None, help="Ratio and loss curves (PNG) (default: beside the "
                              "JSON)."),
) -> None:
    """Tune every method, fix targets, then time to the targets over seeds, the ablation, the
    K sweep and the time-model check, on real text (docs/halos.md)."""
    from ftsystem.halos import regime, runcache

    try:
        paper = _setup(setup, trace)
        cfg = regime.RegimeConfig(**(REGIME_QUICK if quick else {}), seeds=_seeds(seeds),
                                  jobs=jobs)
        if iters or model:
            cfg = dataclasses.replace(cfg, iters=iters or cfg.iters, model=model or cfg.model)
        cfg.sim("test")  # an unknown model or a missing corpus fails before any run
    except (SetupError, ValueError, RuntimeError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    store = None if no_cache else runcache.RunCache(cache or runcache.DEFAULT_DIR)
    _run_regime("bench halos" + (" --quick" if quick else ""), paper, cfg, json_path,
                plot or json_path.with_suffix(".png"), store, tune_only)


def _setup(setup: Path, trace: Path) -> PaperSetup:
    from ftsystem.halos.config import load_setup

    return load_setup(setup, trace=trace)


def _run_regime(title: str, paper: PaperSetup, cfg, json_path: Path, plot: Path, cache,
                tune_only: bool) -> None:
    """Tune, fix the targets, measure; print the tables, write the JSON and the PNG."""
    import torch

    from ftsystem.halos import corpus, regime
    from ftsystem.measure import report

    torch.set_num_threads(1)  # small tensors: threads cost more than they give on shared cores
    tuned = regime.tune(paper, cfg, _progress, cache)
    targets = regime.targets_from(tuned)
    tuning = regime.tuning_summary(paper, cfg, tuned, targets)
    report.print_table(f"{title}: tuning (validation half, seed {cfg.tune_seed})",
                       regime.TUNING_COLUMNS, regime.tuning_rows(tuning))
    typer.echo("targets (fixed from the tuning runs): " + ", ".join(f"{t:.2f}" for t in targets),
               err=True)
    num_params, model = _model_of(cfg.sim("test").workload.model)
    if tune_only:
        report.write_json(json_path, {"corpus": corpus.describe(), "model": model,
                                      "model_params": num_params, **tuning,
                                      "machine": report.machine()})
        typer.echo(f"figures: {json_path}")
        return
    measured = regime.measure(paper, regime.tuned_setups(paper, tuned), cfg, _progress, cache)
    out = regime.summary(paper, cfg, tuned=tuned, targets=targets, measured=measured,
                         corpus=corpus.describe(), num_params=num_params, model=model)
    out["machine"] = report.machine()
    seeds = f"median [min, max] over seeds {cfg.seeds}"
    report.print_table(f"{title}: time to the targets ({seeds}); paper: pythia-70m",
                       regime.TABLE_COLUMNS, regime.table_rows(out))
    report.print_table(f"{title}: ablation (tokens to the targets)", regime.ABLATION_COLUMNS,
                       regime.ablation_rows(out))
    report.print_table(f"{title}: K sweep", regime.K_COLUMNS, regime.k_rows(out))
    report.print_table(f"{title}: time-model check (the trained model's size and step time)",
                       regime.TIME_CHECK_COLUMNS, regime.time_check_rows(out))
    if not out["all_reached"]:
        typer.echo("note: not every method reached every target in every seed", err=True)
    report.write_json(json_path, out)
    regime.plot(out, plot, f"{title}: {model} ({num_params:,} parameters) on the King James "
                f"Bible, {cfg.iters} iterations, seeds {cfg.seeds}")
    typer.echo(f"plot: {plot}; figures: {json_path}")


@bench_app.command("halos-studies")
def bench_halos_studies(
    json_path: Path = typer.Option(..., "--json", help="Write the figures here."),
    quick: bool = typer.Option(False, "--quick", help=f"{STUDIES_QUICK.iters} iterations, "
                               f"not {STUDIES_FULL.iters} (a smoke run)."),
    study: str = typer.Option("grouping,sweep,non-iid,link-sharing", help="Comma-separated "
                              "studies: grouping, sweep, non-iid, link-sharing."),
    workers_per_region: str = typer.Option("2,4,4,6", help="The grouping study's workers per "
                                           "region (speeds: the region's published ones, "
                                           "repeated)."),
    setup: Path = SETUP_OPT,
    trace: Path = TRACE_OPT,
    iters: int = typer.Option(None, help="Override the number of global iterations."),
    model: str = typer.Option(None, help="Override the model: tiny, small, base."),
    seeds: str = typer.Option(SEEDS, help="Comma-separated seeds (at least 3 for a spread)."),
    jobs: int = JOBS_OPT,
) -> None:
    """HALoS's heterogeneous grouping, sweeps of K, alpha and the betas, non-i.i.d. data with
    global momentum on and off, and link sharing, at targets fixed from sync."""
    size = STUDIES_QUICK if quick else STUDIES_FULL
    paper, cfg = _load(setup, trace, pythia="pythia-70m", step_time_ms=None,
                       iters=iters or size.iters, eval_points=size.eval_points, local_batch=4,
                       branching=8, non_iid=False, data="text", model=model or size.model,
                       eval_sequences=size.eval_sequences, seeds=seeds, methods="halos,sync",
                       ablation=False, jobs=jobs)
    counts = _ints(workers_per_region, "--workers-per-region")
    _run_studies("bench halos-studies" + (" --quick" if quick else ""), paper, cfg,
                 studies=[s.strip() for s in study.split(",") if s.strip()], counts=counts,
                 json_path=json_path)


def _ints(text: str, option: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r}: give comma-separated integers, e.g. 2,4,4,6",
                                 param_hint=option) from None


def _run_studies(title: str, paper: PaperSetup, base: StudyConfig, *, studies: list[str],
                 counts: list[int], json_path: Path) -> None:
    """Run the studies; print the table, write the JSON."""
    import torch
    from rich.markup import escape  # "[min, max]" in a title would read as a style tag

    from ftsystem.halos import corpus
    from ftsystem.halos import studies as studies_mod
    from ftsystem.measure import report

    torch.set_num_threads(1)
    try:
        cfg = studies_mod.StudiesConfig(studies=studies, seeds=base.seeds, sim=base.sim,
                                        workers_per_region=counts, jobs=base.jobs)
        studies_mod.study_rows(paper, cfg)  # a bad --workers-per-region fails before any run
    except (SetupError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    curves, targets = studies_mod.run_studies(paper, cfg, progress=_progress,
                                              on_targets=_print_targets)
    num_params, model = _model_of(base.sim.workload.model)
    out = studies_mod.summary(curves, targets, paper, cfg, corpus=corpus.describe(),
                              num_params=num_params, model=model)
    out["machine"] = report.machine()
    names = [f"{t['loss']:.4f}" for t in targets]
    report.print_table(escape(f"{title}: HALoS studies, median [min, max] over seeds "
                              f"{cfg.seeds}; paper: {out['paper']['grouping']}; "
                              f"{out['paper']['non-iid']}"),
                       [escape(c.format(*names)) for c in studies_mod.COLUMNS],
                       studies_mod.table_rows(out))
    report.write_json(json_path, out)
    typer.echo(f"figures: {json_path}")


def _progress(c, seed: int) -> None:
    typer.echo(f"{c.method} seed {seed}: final loss {c.final_loss:.4f} after "
               f"{c.time_s[-1] / 3600:.2f} virtual h ({c.wall_s:.0f} s, {c.cpu_s:.0f} s CPU)",
               err=True)


def _print_targets(targets: list[dict]) -> None:
    typer.echo("targets (fixed from sync): " + ", ".join(
        f"{t['loss']:.4f} at {t['fraction']:.0%}" for t in targets), err=True)


def _model_of(m) -> tuple[int, str]:
    """The parameter count of the ``ModelConfig`` ``m`` and its one-line description."""
    from ftsystem.example.workload import TinyGPT
    from ftsystem.example.workload import num_params as num_params_of

    return num_params_of(TinyGPT(m)), (f"TinyGPT d{m.d_model} L{m.num_layers} "
                                       f"heads{m.num_heads} ctx{m.seq_len} vocab{m.vocab_size}")


def _methods(methods: str) -> list[str]:
    from ftsystem.halos.simulator import METHODS

    chosen = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = sorted(set(chosen) - set(METHODS)) or ([] if chosen else ["(none)"])
    if unknown:
        raise typer.BadParameter(f"unknown methods {unknown}; choose from {', '.join(METHODS)}",
                                 param_hint="--methods")
    return chosen


def _seeds(seeds: str) -> list[int]:
    try:
        chosen = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        chosen = []
    if not chosen or len(set(chosen)) != len(chosen):
        raise typer.BadParameter(f"{seeds!r}: give distinct integers, e.g. 0,1,2",
                                 param_hint="--seeds")
    return chosen


def _load(setup: Path, trace: Path, *, pythia: str, step_time_ms: float | None, iters: int,
          eval_points: int, local_batch: int, branching: int, non_iid: bool, data: str,
          model: str, eval_sequences: int, seeds: str, methods: str, ablation: bool,
          jobs: int) -> tuple[PaperSetup, StudyConfig]:
    """The setup and the study's configuration; a user's mistake exits with its reason."""
    # torch and simpy only when a command runs: every ftsystem command imports this module.
    from ftsystem.halos.config import load_setup
    from ftsystem.halos.corpus import CorpusError
    from ftsystem.halos.experiment import StudyConfig
    from ftsystem.halos.simulator import SimConfig
    from ftsystem.halos.workload import WorkloadConfig, small_model, text_model

    chosen, seed_list = _methods(methods), _seeds(seeds)
    try:
        paper = load_setup(setup, trace=trace, model=pythia, step_time_ms=step_time_ms)
        net = text_model(model) if data == "text" else small_model()
        sim = SimConfig(total_iters=iters, eval_points=eval_points, workload=WorkloadConfig(
            model=net, data=data, local_batch=local_batch, branching=branching,
            non_iid=non_iid, eval_sequences=eval_sequences))
    except (SetupError, CorpusError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    return paper, StudyConfig(methods=chosen, seeds=seed_list, ablation=ablation, sim=sim,
                              jobs=jobs)


def _run(title: str, paper: PaperSetup, trace: Path, cfg: StudyConfig, json_path: Path | None,
         plot: Path) -> None:
    """Run the study; print the tables, write the JSON and the PNG."""
    import torch

    from ftsystem.halos import corpus, experiment
    from ftsystem.halos.config import trace_params
    from ftsystem.measure import report

    torch.set_num_threads(1)  # small tensors: threads cost more than they give on shared cores
    work = cfg.sim.workload
    study = experiment.run_study(paper, cfg, progress=_progress, on_targets=_print_targets)
    num_params, model = _model_of(cfg.sim.workload.model)
    data = corpus.describe() if work.data == "text" else {
        "name": f"synthetic Markov language ({work.branching} likely successors)", "bytes": 0}
    out = experiment.summary(
        study, paper, cfg, corpus=data, num_params=num_params, model=model,
        paper_model=experiment.closest_paper_model(paper, trace_params(trace), num_params))
    out["machine"] = report.machine()
    report.print_table(f"{title}: virtual time to targets fixed from sync "
                       f"(median [min, max] over seeds {cfg.seeds}); paper: "
                       f"{out['paper']['model']}", experiment.TABLE_COLUMNS,
                       experiment.table_rows(out))
    if "ablation" in out:
        report.print_table(f"{title}: ablation (tokens to the targets)",
                           experiment.ABLATION_COLUMNS, experiment.ablation_rows(out))
    report.write_json(json_path, out)
    experiment.plot(out, plot, f"{title}: {out['model']} ({num_params:,} parameters) on "
                    f"{'the King James Bible' if work.data == 'text' else 'a Markov language'}"
                    f", {cfg.sim.total_iters} iterations, seeds {cfg.seeds}")
    typer.echo(f"plot: {plot}" + (f"; figures: {json_path}" if json_path else ""))


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
        min=0.0, help="Emulated seconds per local step of a speed-1.0 worker: a worker of "
        "speed s takes step-time / s per step, its job of H_s steps at least H_s times that "
        "(0: as fast as the CPU goes).")] = 0.0,
    speeds: Annotated[str | None, typer.Option(
        help="Worker speeds: 'setup' (the setup's worker_speeds of the first regions' first "
        "workers) or one comma-separated speed per worker; H is rescaled to ceil(H * speed "
        "/ max_speed). Default: all alike.")] = None,
    shape: Annotated[bool, typer.Option(
        "--shape", help="Every node in its own network namespace, each link shaped with tc "
        "htb to the setup's bandwidth scaled to this model and --step-time (root; "
        "docs/halos.md).")] = False,
    compare_sim: Annotated[bool, typer.Option(
        "--compare-sim", help="After a --shape run, simulate the same configuration and add "
        "the comparison to the summary.")] = False,
    prometheus_sd: Annotated[Path | None, typer.Option(
        help="Keep a Prometheus file_sd list of the nodes' and agents' metrics endpoints "
        "here while the run lasts.")] = None,
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

    from ftsystem.halos import shaping
    from ftsystem.launch.netns import NetnsError

    if compare_sim and not shape:
        raise typer.BadParameter("the simulator is compared with a shaped run: add --shape "
                                 "(and --step-time)", param_hint="--compare-sim")
    if shape and (why := shaping.unsupported()) is not None:
        typer.echo(f"error: --shape needs network namespaces and tc htb, and here {why}; run "
                   "as root on Linux with iproute2 (ip, tc) and the sch_htb module, or leave "
                   "out --shape", err=True)
        raise typer.Exit(2)
    paper, cfg = _real_config(setup, trace, updates=updates, regions=regions, seed=seed, lr=lr,
                              workers_per_region=workers_per_region, local_steps=local_steps,
                              accumulation_k=accumulation_k, local_step_s=step_time,
                              speeds=speeds, shape=shape)
    try:
        kills = [real.parse_kill(k, cfg) for k in kill_at or []]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kill-at") from e
    try:
        launch = real.LaunchConfig(real=cfg, etcd=etcd, job=_job_id(job), out_dir=out,
                                   kills=kills, deadline_s=deadline, netns=shape,
                                   prometheus_sd=prometheus_sd,
                                   progress=lambda m: typer.echo(m, err=True))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--etcd") from e
    try:
        summary = real.run(launch)
    except (StoreError, EtcdNotInstalledError, EtcdStartError, real.RunTimeoutError,
            NetnsError, shaping.ShapingError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    _print_real(summary)
    if compare_sim:
        summary["simulator"] = _compare_sim(paper, cfg, summary)
    report.write_json(json_path, summary | {"machine": report.machine()})
    if summary["problems"]:
        raise typer.Exit(1)


def _compare_sim(paper: PaperSetup, cfg, summary: dict) -> dict:
    """Simulate the run's configuration; the comparison, also printed."""
    import torch

    from ftsystem.halos import compare
    from ftsystem.measure import report

    torch.set_num_threads(1)
    steps = sum(w.get("local_steps", 0) for w in summary["workers"].values())
    curve = compare.simulate(cfg, paper, steps)
    out = compare.compare(summary["loss_curve_s"], curve.time_s, curve.loss)
    out |= {"budget_local_steps": steps, "sim_updates": len(curve.time_s) - 1,
            "sim_wall_s": round(curve.wall_s, 1)}
    report.print_table("halos run vs the simulator: time to the GPS model's loss",
                       ["after updates", "loss", "real s", "simulated s", "real / sim"],
                       [[t["update"], t["loss"], t["real_s"], t["sim_s"], t["ratio_real_to_sim"]]
                        for t in out["targets"]])
    per = out["per_update"]
    typer.echo(f"per global update, wall / virtual time: median {per['ratio_median']} "
               f"[{per['ratio_min']}, {per['ratio_max']}] over {out['updates_compared']} updates")
    return out


def _job_id(job: str) -> str:
    from ftsystem.control.keys import InvalidIdError, check_id

    try:
        return check_id("job", job)
    except InvalidIdError as e:
        raise typer.BadParameter(str(e), param_hint="--job") from e


def _real_config(setup: Path, trace: Path, *, lr: float | None, seed: int, speeds: str | None,
                 shape: bool, **layout):
    """The paper's setup, and its hyperparameters with the run's layout, speeds and scaled
    bandwidths; a user's mistake exits with its reason."""
    import dataclasses

    from ftsystem.halos import shaping
    from ftsystem.halos.config import load_setup
    from ftsystem.halos.realconfig import RealConfig, speeds_of_regions
    from ftsystem.halos.workload import WorkloadConfig

    try:
        paper = load_setup(setup, trace=trace)
        if lr is not None:
            paper.worker.lr = lr
        cfg = RealConfig.from_setup(paper, workload=WorkloadConfig(seed=seed),
                                    num_regions=layout.pop("regions"),
                                    num_updates=layout.pop("updates"), **layout)
        if speeds == "setup":
            speeds_list = speeds_of_regions(paper.network.worker_speeds, cfg.num_regions,
                                            cfg.workers_per_region)
        elif speeds:
            speeds_list = _floats(speeds)
        else:
            speeds_list = []
        bandwidths = shaping.scaled_bandwidths(
            paper.network.bandwidth_gbps, cfg.num_regions, model_bytes=cfg.model_bytes,
            paper_model_bytes=paper.time_model.model_bytes, step_s=cfg.local_step_s,
            paper_step_s=paper.time_model.local_step_time_s) if shape else []
        return paper, dataclasses.replace(cfg, worker_speeds=speeds_list,
                                          bandwidth_bps=bandwidths,
                                          gps_region=paper.network.gps_region)
    except (SetupError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--speeds {text!r}: give 'setup' or one number per worker, e.g. "
                         "1,0.5,0.25,1") from None


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
    if "shaping" in summary:
        report.print_table("halos run: shaped links", ["from", "to", "kbit/s",
                                                       "model transfer s", "bytes sent"],
                           [[r["from"], r["to"], round(r["bps"] / 1e3, 1), r["model_transfer_s"],
                             r["bytes_sent"]] for r in summary["shaping"]["links"]])
    typer.echo(f"{summary['updates']}/{summary['num_updates']} global updates in "
               f"{summary['wall_s']:.1f} s (started after {summary['startup_s']} s); "
               f"held-out loss {initial:.4f} -> {final:.4f}; "
               f"kills {len(summary['kills'])}; "
               f"{'consistent' if not summary['problems'] else 'PROBLEMS: '}"
               + "; ".join(summary["problems"]))
