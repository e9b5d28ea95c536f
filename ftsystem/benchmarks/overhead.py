"""``ftsystem bench overhead``: steady-state throughput without failures, against plain DDP.

For each model size, one invocation trains the same model on the same data with the same batch,
optimizer and number of replicas (one process each, one compute thread each) on these systems:

- ``ddp``: plain ``torch.nn.parallel.DistributedDataParallel`` over Gloo, one process per
  rank;
- ``ddp-control-plane``: the same beside an idle control plane (an embedded etcd and a
  controller of a job that never starts): what ftsystem's services cost the machine by their
  presence, apart from what its ``commit()`` costs;
- ``ftsystem``: ``ftsystem run`` (etcd, controller, one agent per replica), no failures, with
  its defaults (on CPU, gradients of 100 MiB or more overlap their all-reduce with backward);
- ``ftsystem-overlap``: the same with ``--overlap on`` at every size: gradient buckets
  all-reduced during backward instead of one all-reduce after it, to show what the overlap is
  worth where it is off by default;
- ``ftsystem-digest10``: the same as ``ftsystem`` with the replicas' state digests compared
  every 10 steps, ten times as often as by default, to show what divergence detection costs
  (``ftsystem bench fingerprint`` times the digest alone);
- ``torchft``: torchft 0.2.0's Manager + Lighthouse (``ftsystem.baselines``), no failures.

Every system trains one spec (``harness.RunSpec``: the example program's batch, learning rate
and seed at every size) in the same loop, recorded by each system's runs (``runs`` in the
JSON): ``--loop plain`` (averaged gradients, then ``optimizer.step()``), which every system
has, or ``--loop real``, the example program's real loop (LR schedule, gradient scaler,
clipping, dropout, a shuffling stateful loader), which ftsystem registers and DDP runs as is
(torchft's replica has the plain loop only).

Throughput is committed steps per second from each replica's commit timeline, after the first
``warmup`` commits (start-up, first allocations) and up to the last one; the job's figure is the
median over its replicas (they step in lockstep). No failure is injected. ``--rounds N`` runs
every system N times, the order alternated per round, the machine's load recorded per round.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import typer

from ftsystem.benchmarks import harness
from ftsystem.benchmarks.harness import RunSpec
from ftsystem.measure import report
from ftsystem.cli import bench_app

ENV_FINGERPRINT_EVERY = "FTSYSTEM_FINGERPRINT_EVERY"  # ftsystem.training.settings'; not imported: torch

SYSTEMS = ("ddp", "ddp-control-plane", "ftsystem", "ftsystem-overlap", "ftsystem-digest10",
           "torchft")
DIGEST_STRESS_EVERY = 10
"""``ftsystem-digest10`` compares state digests every this many steps, 10 times the default
(``FTSYSTEM_FINGERPRINT_EVERY``): the runs are too short for a digest at the default."""
DEFAULT_SIZES = "10M,100M"
QUICK_SIZES = "100K"
QUICK_STEPS = 20
DDP_TIMEOUT_S = 1800.0
COLLECTIVE_TIMEOUT_S = 300.0
"""A DDP rank's store and collective waits give up after this (gloo's default is 30 min): a
rank whose peer is gone fails with its log instead of holding the benchmark."""
TEARDOWN_S = 30.0
"""How long ranks whose results are on disk may take to exit before they are stopped."""
_SUFFIXES = {"K": 10**3, "M": 10**6, "G": 10**9}


# --- pure logic -------------------------------------------------------------------------------

def parse_sizes(text: str) -> list[int]:
    """``"10M,100M"`` -> ``[10_000_000, 100_000_000]`` (suffixes K, M, G; plain integers)."""
    sizes = []
    for part in filter(None, (p.strip().upper() for p in text.split(","))):
        scale = _SUFFIXES.get(part[-1], 1)
        number = part[:-1] if part[-1] in _SUFFIXES else part
        try:
            sizes.append(int(float(number) * scale))
        except ValueError:
            raise ValueError(f"malformed model size {part!r} in {text!r}: expected e.g. "
                             "10M,100M") from None
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"no positive model size in {text!r}: expected e.g. 10M,100M")
    return sizes


def parse_systems(text: str) -> list[str]:
    """``"ftsystem,torchft"`` -> ``["ddp", "ftsystem", "torchft"]``: in :data:`SYSTEMS` order,
    DDP always first (every ratio is to it)."""
    asked = {part.strip() for part in text.split(",") if part.strip()}
    unknown = asked - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown system(s) {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    return [name for name in SYSTEMS if name in asked or name == "ddp"]


def default_steps(params: int) -> int:
    """Steps per system: a minute or two each on one CPU core per replica."""
    return 60 if params <= 30_000_000 else 16


def warmup_steps(steps: int) -> int:
    """Leading commits left out: the first steps pay for allocations and lazy set-up."""
    return max(2, steps // 5)


def steady_rate(commits: Sequence[Sequence[float]], warmup: int) -> float | None:
    """Committed steps per second after step ``warmup`` (None: fewer than 2 such commits)."""
    window = [(step, t) for step, t in commits if step > warmup]
    if len(window) < 2 or window[-1][1] <= window[0][1]:
        return None
    return (window[-1][0] - window[0][0]) / (window[-1][1] - window[0][1])


def job_rate(timelines: Sequence[Sequence[Sequence[float]]], warmup: int) -> float | None:
    """The job's steps per second: the median of its replicas' rates."""
    rates = [r for tl in timelines if (r := steady_rate(tl, warmup)) is not None]
    return statistics.median(rates) if rates else None


def ratios(rates: dict[str, float | None]) -> dict[str, float | None]:
    """Each system's throughput relative to DDP's (1.0: as fast; 0.97: 3% slower)."""
    base = rates.get("ddp")
    return {name: rate / base if rate and base else None for name, rate in rates.items()}


# --- plain DDP ----------------------------------------------------------------------------------

def ddp_replica(*, rank: int, world_size: int, steps: int, model_params: int, batch_size: int,
                lr: float, seed: int, sleep_per_step: float, loop: str, out: Path) -> None:
    """One DDP rank: train ``steps`` steps, write the commit timeline to ``out/rank<R>.json``.

    ``loop``: ``plain`` (batches by step, ``optimizer.step()``) or ``real``, the example
    program's real loop with its defaults (the same LR schedule, scaler, clipping, dropout and
    shuffling stateful loader, from ``ftsystem.example.train``) without ftsystem."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ftsystem.example import train
    from ftsystem.example.workload import MarkovLanguage, ModelConfig, TinyGPT, num_params

    class Loss(torch.nn.Module):
        """DDP reduces the gradients of what runs through its forward: make that the loss."""

        def __init__(self, inner: TinyGPT) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            return self.inner.loss(batch)

    torch.set_num_threads(1)  # as ftsystem.example.train and torchft_replica: one core per replica
    dist.init_process_group("gloo", init_method=rendezvous_file(out).as_uri(), rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    torch.manual_seed(seed)
    args = train.parse_args(["--steps", str(steps), "--batch-size", str(batch_size),
                             "--lr", str(lr), "--seed", str(seed), "--loop", loop])
    if loop == "plain":  # as the example program's plain loop
        args.amp, args.clip, args.dropout = "off", 0.0, 0.0
    cfg = ModelConfig.for_params(model_params) if model_params else ModelConfig()
    cfg.dropout = args.dropout
    model = TinyGPT(cfg)
    ddp = DistributedDataParallel(Loss(model))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=lr)
    language = MarkovLanguage(vocab_size=model.cfg.vocab_size, seed=seed)
    device = torch.device("cpu")
    if loop == "plain":
        batches = (language.batch(shard=rank, step=step, batch_size=batch_size,
                                  seq_len=model.cfg.seq_len) for step in itertools.count())
        scaler, step_fn = torch.amp.GradScaler(device.type, enabled=False), optimizer.step
    else:
        scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "scaler")
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, train.warmup_cosine(args.warmup, args.steps))
        step_fn = train.real_step(model, optimizer, scaler, scheduler, None, args, device)
        batches = iter(train.data_loader(language, model.cfg, args, shard=rank))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.amp == "bf16" \
        else contextlib.nullcontext()
    ddp.train()
    commits = []
    for step in range(steps):
        batch = next(batches)
        optimizer.zero_grad()
        with autocast:
            loss = ddp(batch)
        scaler.scale(loss).backward()
        if sleep_per_step:
            time.sleep(sleep_per_step)
        step_fn()
        commits.append((step + 1, time.time()))
    result = out / f"rank{rank}.json"
    result.with_suffix(".tmp").write_text(json.dumps(
        {"rank": rank, "commits": commits, "num_params": num_params(model)}))
    result.with_suffix(".tmp").replace(result)  # whole or absent: run_ddp may read it at once
    dist.destroy_process_group()


def rendezvous_file(workdir: Path) -> Path:
    """Where the DDP ranks meet: a file, not a port, so no other process can take it first
    (torchrun's ``--standalone`` picks a free port, closes it, and binds it again later)."""
    return workdir / "rendezvous"


def run_ddp(spec: RunSpec, workdir: Path, *, control_plane: bool = False) -> dict[str, list]:
    """Plain DDP, one process per rank; returns each rank's commit timeline. With
    ``control_plane``, beside an idle etcd and controller (``launcher.idle_control_plane``)."""
    from ftsystem.launch.launcher import idle_control_plane

    with idle_control_plane(workdir / "control-plane") if control_plane \
            else contextlib.nullcontext():
        run_ranks("DDP", lambda rank: harness.ddp_rank_command(spec, rank, workdir),
                  world_size=spec.num_replicas, workdir=workdir, timeout_s=DDP_TIMEOUT_S,
                  finished=lambda rank: (workdir / f"rank{rank}.json").exists())
    return harness.read_timelines("ddp", workdir)


def run_ranks(what: str, args_of: Callable[[int], list[str]], *, world_size: int,
              workdir: Path, timeout_s: float,
              finished: Callable[[int], bool] = lambda rank: False) -> None:
    """Run ``python <args_of(rank)>`` for every rank, one process each, meeting at
    :func:`rendezvous_file`; raise with the log of the first rank that failed. A rank is done
    when it exits 0 or, once every rank is ``finished`` (its results on disk), after
    :data:`TEARDOWN_S`: a rank stuck tearing down then is stopped, not waited for."""
    from ftsystem.launch.launcher import ProcessGroup

    workdir.mkdir(parents=True, exist_ok=True)
    rendezvous_file(workdir).unlink(missing_ok=True)
    procs = ProcessGroup(workdir)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        ranks = [procs.start(f"rank{rank}", [sys.executable, *args_of(rank)], env=env)
                 for rank in range(world_size)]
        failed = _wait_all(ranks, timeout_s, finished)
    finally:
        procs.stop_all()
    if failed is not None:
        rank, code = failed
        tail = (workdir / f"rank{rank}.log").read_text(errors="replace")[-2000:]
        how = f"exited with {code}" if code is not None else f"ran past {timeout_s:.0f} s"
        raise RuntimeError(f"{what} rank {rank} {how}; its log ends:\n{tail}")


def _wait_all(procs: list, timeout_s: float,
              finished: Callable[[int], bool] = lambda index: False,
              teardown_s: float = TEARDOWN_S) -> tuple[int, int | None] | None:
    """Wait until every process exited 0 (None), or one failed: (its index, exit code; None
    when the timeout ran out). Its peers would wait for it forever, so stop at the first.
    Once every process exited 0 or is ``finished``, the rest get ``teardown_s`` to exit, then
    count as done: their results are written, and a teardown that hangs (a gloo peer or the
    FileStore's file already gone) must not hold the benchmark for the whole timeout. A
    process that crashes after it is ``finished`` (gloo's threads once aborted a DDP rank's
    exit: "terminate called without an active exception") failed nothing it measured."""
    deadline = time.monotonic() + timeout_s
    all_finished_at = None
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]
        for index, code in enumerate(codes):
            if code not in (None, 0) and not finished(index):
                return index, code
        if all(code is not None for code in codes):  # each 0, or crashed once finished
            return None
        if all(code == 0 or finished(index) for index, code in enumerate(codes)):
            all_finished_at = all_finished_at or time.monotonic()
            if time.monotonic() - all_finished_at > teardown_s:
                return None  # the caller stops the ones still tearing down
        time.sleep(0.1)
    return next((i for i, proc in enumerate(procs) if proc.poll() is None), 0), None


# --- ftsystem and torchft -------------------------------------------------------------------------

def run_ftsystem(spec: RunSpec, workdir: Path, *, overlap: str = "auto",
                 fingerprint_every: int | None = None) -> dict[str, list]:
    """``run_job`` without failures; returns each replica's commit timeline."""
    from ftsystem.launch.launcher import run_job

    cfg = harness.ftsystem_config(spec, variant=["--overlap", overlap], job="overhead",
                                  out_dir=workdir)
    # The agents pass it on to the replicas.
    digests = {} if fingerprint_every is None else {ENV_FINGERPRINT_EVERY: str(fingerprint_every)}
    with harness.environment(digests):
        summary = run_job(cfg)
    if not summary["agents_ok"] or summary["steps"] != spec.steps:
        raise RuntimeError(f"ftsystem run failed ({summary['steps']} of {spec.steps} steps); "
                           f"see the logs in {workdir}")
    return harness.read_timelines("ftsystem", workdir)


def run_torchft(spec: RunSpec, workdir: Path) -> dict[str, list]:
    """torchft 0.2.0's failover scenario with no failure; returns the commit timelines."""
    from ftsystem.baselines.torchft_scenario import run_torchft_failover

    out = run_torchft_failover(**harness.torchft_training(spec), num_failures=0, workdir=workdir,
                               kill_interval_s=0.0, victim=0)
    if out["crashed"]:
        raise RuntimeError(f"torchft replicas crashed without a failure: {out['crashed']}")
    return harness.read_timelines("torchft", workdir)


RUNNERS = {"ddp": run_ddp,
           "ddp-control-plane": functools.partial(run_ddp, control_plane=True),
           "ftsystem": run_ftsystem,
           "ftsystem-overlap": functools.partial(run_ftsystem, overlap="on"),
           "ftsystem-digest10": functools.partial(run_ftsystem,
                                                  fingerprint_every=DIGEST_STRESS_EVERY),
           "torchft": run_torchft}


FIGURES = {"steps_per_s": "steps_per_s", "step_s": "step_s"}
"""What each run gives, reported over the rounds (see ``report.per_round``)."""


def measure(spec: RunSpec, *, systems: Sequence[str], rounds: int, workdir: Path) -> dict:
    """One model size on every system, ``rounds`` times in turn: steps/s (median and min/max
    over the rounds), ratio to DDP (of the medians, and per round, paired within it), median
    step time. The order reverses every round (``report.in_rounds``): a drift in the
    machine's load then favours no system."""
    from ftsystem.measure import stall

    warmup = warmup_steps(spec.steps)

    def run(name: str, round_: int) -> dict:
        out_dir = workdir / f"{name}-{spec.model_params}-{round_}"
        timelines = list(RUNNERS[name](spec, out_dir).values())
        result = {"steps_per_s": job_rate(timelines, warmup),
                  "step_s": statistics.median(stall.normal_step_time(tl) for tl in timelines),
                  **harness.ran_with(name, spec)}
        if name.startswith("ftsystem"):
            result["commit_ms"] = commit_breakdown(out_dir)
            result["start_up_commit_ms"] = commit_breakdown(out_dir, "start_up_commit_ms")
            result["overlapped_commits"] = overlapped_commits(out_dir)
        return result

    runs, log = report.in_rounds(systems, rounds, run)
    summaries = {name: report.over_rounds(system_runs, FIGURES)
                 for name, system_runs in runs.items()}
    rates = {name: summary["steps_per_s"]["median"] for name, summary in summaries.items()}
    return {"params": spec.model_params, "steps": spec.steps, "warmup_steps": warmup,
            "steps_per_s": rates,
            "steps_per_s_spread": {name: summary["steps_per_s"]
                                   for name, summary in summaries.items()},
            "ratio_vs_ddp": ratios(rates),
            "ratio_vs_ddp_spread": {name: report.paired_ratio(runs[name], runs["ddp"],
                                                              "steps_per_s")
                                    for name in systems},
            "median_step_s": {name: summary["step_s"]["median"]
                              for name, summary in summaries.items()},
            "steps_per_s_by_round": {name: [run["steps_per_s"] for run in system_runs]
                                     for name, system_runs in runs.items()},
            "commit_ms": {name: breakdown_over_rounds(runs[name]) for name in systems
                          if name.startswith("ftsystem")},
            "runs": runs, "round_log": log}


def _replica_figures(out_dir: Path, key: str) -> list:
    """``key`` of each replica's result of one run (None where a result lacks it)."""
    return [json.loads(path.read_text()).get(key)
            for path in sorted((out_dir / "results").glob("r*.json"))]


def commit_breakdown(out_dir: Path, key: str = "commit_ms") -> dict[str, float]:
    """Milliseconds per commit of each part of ``commit()`` after the start-up commits
    (``training.commit_times``), the median over the replicas of one run; ``key``
    ``start_up_commit_ms``: the parts summed over the start-up commits instead."""
    parts: dict[str, list[float]] = {}
    for result in _replica_figures(out_dir, key):
        for name, ms in (result or {}).items():
            parts.setdefault(name, []).append(ms)
    return {name: statistics.median(values) for name, values in parts.items()}


def overlapped_commits(out_dir: Path) -> float | None:
    """The median over the replicas of one run of the commits whose gradient buckets went
    out during backward."""
    counts = [c for c in _replica_figures(out_dir, "overlapped_commits") if c is not None]
    return statistics.median(counts) if counts else None


def breakdown_over_rounds(runs: Sequence[dict]) -> dict[str, dict]:
    """Each part's milliseconds per commit over the rounds (median, min, max)."""
    names = sorted({name for run in runs for name in run.get("commit_ms", {})})
    return {name: report.spread([run.get("commit_ms", {}).get(name) for run in runs])
            for name in names}


@bench_app.command("overhead")
def overhead(
    json_path: Annotated[Path | None, typer.Option("--json", help="write results here")] = None,
    sizes: Annotated[str, typer.Option(help="approximate model sizes")] = DEFAULT_SIZES,
    steps: Annotated[int, typer.Option(min=0, help="steps per system (0: by size)")] = 0,
    replicas: Annotated[int, typer.Option(min=1, help="data-parallel replicas")] = 2,
    quick: Annotated[bool, typer.Option(help=f"{QUICK_SIZES} parameters, {QUICK_STEPS} "
                                             "steps (well under a minute)")] = False,
    systems_text: Annotated[str, typer.Option(
        "--systems", help="which to run, comma-separated; ddp always runs (the base of the "
                          "ratios)")] = ",".join(SYSTEMS),
    rounds: Annotated[int, typer.Option(min=1, help="runs per system, in turns")] = 1,
    loop: Annotated[str, typer.Option(help="plain (every system) or real (the example "
                                           "program's loop: ddp and ftsystem)")] = "plain",
) -> None:
    """Steady-state steps/s without failures: ftsystem vs plain DDP vs torchft 0.2.0."""
    if quick and sizes != DEFAULT_SIZES:
        typer.secho(f"warning: --sizes has no effect with --quick ({QUICK_SIZES})", err=True)
    try:
        params_list = parse_sizes(QUICK_SIZES if quick else sizes)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--sizes") from e
    try:
        systems = parse_systems(systems_text)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--systems") from e
    try:
        specs = [RunSpec(num_replicas=replicas, model_params=params, loop=loop,
                         steps=steps or (QUICK_STEPS if quick else default_steps(params)))
                 for params in params_list]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--loop") from e
    if loop != "plain" and "torchft" in systems:
        raise typer.BadParameter("torchft's replica has the plain loop only: leave torchft out "
                                 "of --systems for --loop real", param_hint="--systems")
    with tempfile.TemporaryDirectory(prefix="ftsystem-bench-overhead-") as tmp:
        models = [measure(spec, systems=systems, rounds=rounds, workdir=Path(tmp))
                  for spec in specs]
    rows = [(m["params"], name, m["steps_per_s"][name], _range(m["steps_per_s_spread"][name]),
             m["ratio_vs_ddp"][name], _range(m["ratio_vs_ddp_spread"][name]),
             m["median_step_s"][name]) for m in models for name in systems]
    report.print_table(f"overhead: steady-state throughput, {replicas} replicas, no failures, "
                       f"{loop} loop, {rounds} round(s)", ["params", "system", "steps/s (median)",
                                              "steps/s [min, max]", "vs DDP", "vs DDP [min, max]",
                                              "median step (s)"], rows)
    parts = [(m["params"], name, part, f"{ms['median']:.3g}", _range(ms))
             for m in models for name, breakdown in m["commit_ms"].items()
             for part, ms in breakdown.items()]
    if parts:
        report.print_table("where commit() spends its time (ms per commit, over the rounds)",
                           ["params", "system", "part", "median", "[min, max]"], parts)
    # Other work on a shared machine moves these figures more than the target's 3%: each
    # model's round_log has the load average of every round.
    report.write_json(json_path, {
        "models": models, "replicas": replicas, "rounds": rounds, "loop": loop,
        "target": "ftsystem ratio_vs_ddp >= 0.97 and steps/s >= torchft's",
        "machine": report.machine()})


def _ddp_main(rank: Annotated[int, typer.Option()],
              world_size: Annotated[int, typer.Option()],
              steps: Annotated[int, typer.Option()],
              out: Annotated[Path, typer.Option()],
              model_params: Annotated[int, typer.Option()],
              batch_size: Annotated[int, typer.Option()],
              lr: Annotated[float, typer.Option()],
              seed: Annotated[int, typer.Option()],
              sleep_per_step: Annotated[float, typer.Option()],
              loop: Annotated[str, typer.Option()]) -> None:
    """One DDP rank, its options ``harness.ddp_rank_command``'s: every one is required, so
    that a rank cannot train another spec than the bench's by a default of its own."""
    ddp_replica(rank=rank, world_size=world_size, steps=steps, model_params=model_params,
                batch_size=batch_size, lr=lr, seed=seed, sleep_per_step=sleep_per_step,
                loop=loop, out=out)


if __name__ == "__main__":  # one DDP rank, started by run_ddp
    typer.run(_ddp_main)


def _range(spread: dict) -> str:
    return "-" if spread["min"] is None else f"[{spread['min']:.3g}, {spread['max']:.3g}]"
