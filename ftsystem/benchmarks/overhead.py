"""``ftsystem bench overhead``: steady-state throughput without failures, against plain DDP.

For each model size, one invocation trains the same model on the same data with the same batch,
optimizer and number of replicas (one process each, one compute thread each) on these systems:

- ``ddp``: plain ``torch.nn.parallel.DistributedDataParallel`` over Gloo, one process per
  rank;
- ``ftsystem``: ``ftsystem run`` (etcd, controller, one agent per replica), no failures, with
  its defaults (on CPU, gradients of 100 MiB or more overlap their all-reduce with backward);
- ``ftsystem-overlap``: the same with ``--overlap on`` at every size: gradient buckets
  all-reduced during backward instead of one all-reduce after it, to show what the overlap is
  worth where it is off by default;
- ``ftsystem-digest10``: the same as ``ftsystem`` with the replicas' state digests compared
  every 10 steps, ten times as often as by default, to show what divergence detection costs
  (``ftsystem bench fingerprint`` times the digest alone);
- ``torchft``: torchft 0.2.0's Manager + Lighthouse (``ftsystem.baselines``), no failures.

Every system runs the same minimal loop (``ftsystem.example.train --loop plain``: averaged gradients,
then ``optimizer.step()``), as the baselines do.

Throughput is committed steps per second from each replica's commit timeline, after the first
``warmup`` commits (start-up, first allocations) and up to the last one; the job's figure is the
median over its replicas (they step in lockstep). No failure is injected.
"""

from __future__ import annotations

import datetime
import functools
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

from ftsystem.measure import report
from ftsystem.cli import bench_app

ENV_FINGERPRINT_EVERY = "FTSYSTEM_FINGERPRINT_EVERY"  # ftsystem.training.settings'; not imported: torch

SYSTEMS = ("ddp", "ftsystem", "ftsystem-overlap", "ftsystem-digest10", "torchft")
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

def ddp_replica(*, rank: int, world_size: int, steps: int, model_params: int,
                out: Path) -> None:
    """One DDP rank: train ``steps`` steps, write the commit timeline to ``out/rank<R>.json``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ftsystem.baselines.torchft_replica import BATCH_SIZE, LEARNING_RATE, SEED
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
    torch.manual_seed(SEED)
    model = TinyGPT(ModelConfig.for_params(model_params) if model_params else ModelConfig())
    ddp = DistributedDataParallel(Loss(model))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LEARNING_RATE)
    language = MarkovLanguage(vocab_size=model.cfg.vocab_size, seed=SEED)
    commits = []
    for step in range(steps):
        batch = language.batch(shard=rank, step=step, batch_size=BATCH_SIZE,
                               seq_len=model.cfg.seq_len)
        optimizer.zero_grad()
        ddp(batch).backward()
        optimizer.step()
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


def run_ddp(*, params: int, steps: int, replicas: int, workdir: Path) -> list[list]:
    """Plain DDP, one process per rank; returns each rank's commit timeline."""
    run_ranks("DDP", lambda rank: [
        "-m", "ftsystem.benchmarks.overhead", "--rank", str(rank), "--world-size", str(replicas),
        "--steps", str(steps), "--model-params", str(params), "--out", str(workdir)],
        world_size=replicas, workdir=workdir, timeout_s=DDP_TIMEOUT_S,
        finished=lambda rank: (workdir / f"rank{rank}.json").exists())
    return [json.loads(p.read_text())["commits"] for p in sorted(workdir.glob("rank*.json"))]


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
    FileStore's file already gone) must not hold the benchmark for the whole timeout."""
    deadline = time.monotonic() + timeout_s
    all_finished_at = None
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]
        for index, code in enumerate(codes):
            if code not in (None, 0):
                return index, code
        if all(code == 0 for code in codes):
            return None
        if all(code == 0 or finished(index) for index, code in enumerate(codes)):
            all_finished_at = all_finished_at or time.monotonic()
            if time.monotonic() - all_finished_at > teardown_s:
                return None  # the caller stops the ones still tearing down
        time.sleep(0.1)
    return next((i for i, proc in enumerate(procs) if proc.poll() is None), 0), None


# --- ftsystem and torchft -------------------------------------------------------------------------

def run_ftsystem(*, params: int, steps: int, replicas: int, workdir: Path,
                 overlap: str = "auto", fingerprint_every: int | None = None) -> list[list]:
    """``run_job`` without failures; returns each replica's commit timeline."""
    from ftsystem.baselines.torchft_replica import BATCH_SIZE, LEARNING_RATE, SEED
    from ftsystem.launch.launcher import RunConfig, run_job

    train_args = ["--model-params", str(params), "--batch-size", str(BATCH_SIZE),
                  "--lr", str(LEARNING_RATE), "--seed", str(SEED),
                  "--overlap", overlap, "--loop", "plain"]
    cfg = RunConfig(num_replicas=replicas, num_steps=steps, job="overhead",
                    out_dir=workdir, train_args=train_args, show_progress=False)
    saved = os.environ.get(ENV_FINGERPRINT_EVERY)
    if fingerprint_every is not None:  # the agents pass it on to the replicas
        os.environ[ENV_FINGERPRINT_EVERY] = str(fingerprint_every)
    try:
        summary = run_job(cfg)
    finally:
        if saved is None:
            os.environ.pop(ENV_FINGERPRINT_EVERY, None)
        else:
            os.environ[ENV_FINGERPRINT_EVERY] = saved
    if not summary["agents_ok"] or summary["steps"] != steps:
        raise RuntimeError(f"ftsystem run failed ({summary['steps']} of {steps} steps); "
                           f"see the logs in {workdir}")
    return [json.loads(p.read_text())["commits"]
            for p in sorted((workdir / "results").glob("*.json"))]


def run_torchft(*, params: int, steps: int, replicas: int, workdir: Path) -> list[list]:
    """torchft 0.2.0's failover scenario with no failure; returns the commit timelines."""
    from ftsystem.baselines.torchft_scenario import run_torchft_failover

    out = run_torchft_failover(num_replicas=replicas, num_failures=0, steps=steps,
                               model_params=params, workdir=workdir, kill_interval_s=0.0,
                               victim=0)
    if out["crashed"]:
        raise RuntimeError(f"torchft replicas crashed without a failure: {out['crashed']}")
    return [r["commits"] for r in out["results"]]


RUNNERS = {"ddp": run_ddp, "ftsystem": run_ftsystem,
           "ftsystem-overlap": functools.partial(run_ftsystem, overlap="on"),
           "ftsystem-digest10": functools.partial(run_ftsystem,
                                                  fingerprint_every=DIGEST_STRESS_EVERY),
           "torchft": run_torchft}


def measure(params: int, *, steps: int, replicas: int, systems: Sequence[str], rounds: int,
            workdir: Path) -> dict:
    """One model size on every system, ``rounds`` times in turn: steps/s (median and min/max
    over the rounds), ratio to DDP (of the medians, and per round, paired within it), median
    step time. The order reverses every round (``report.in_rounds``): a drift in the
    machine's load then favours no system."""
    from ftsystem.measure import stall

    warmup = warmup_steps(steps)

    def run(name: str, round_: int) -> dict:
        timelines = RUNNERS[name](params=params, steps=steps, replicas=replicas,
                                  workdir=workdir / f"{name}-{params}-{round_}")
        return {"steps_per_s": job_rate(timelines, warmup),
                "step_s": statistics.median(stall.normal_step_time(tl) for tl in timelines)}

    runs = report.in_rounds(systems, rounds, run)
    per_round = {name: [r["steps_per_s"] for r in rs] for name, rs in runs.items()}
    spreads = {name: report.spread(values) for name, values in per_round.items()}
    rates = {name: spread["median"] for name, spread in spreads.items()}
    paired = [ratios({name: per_round[name][r] for name in systems}) for r in range(rounds)]
    return {"params": params, "steps": steps, "warmup_steps": warmup, "steps_per_s": rates,
            "steps_per_s_spread": spreads, "ratio_vs_ddp": ratios(rates),
            "ratio_vs_ddp_spread": {name: report.spread([p[name] for p in paired])
                                    for name in systems},
            "median_step_s": {name: report.spread([r["step_s"] for r in rs])["median"]
                              for name, rs in runs.items()},
            "steps_per_s_by_round": per_round}


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
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ftsystem-bench-overhead-") as tmp:
        models = [measure(p, steps=steps or (QUICK_STEPS if quick else default_steps(p)),
                          replicas=replicas, systems=systems, rounds=rounds,
                          workdir=Path(tmp))
                  for p in params_list]
    rows = [(m["params"], name, m["steps_per_s"][name], _range(m["steps_per_s_spread"][name]),
             m["ratio_vs_ddp"][name], _range(m["ratio_vs_ddp_spread"][name]),
             m["median_step_s"][name]) for m in models for name in systems]
    report.print_table(f"overhead: steady-state throughput, {replicas} replicas, no failures, "
                       f"{rounds} round(s)", ["params", "system", "steps/s (median)",
                                              "steps/s [min, max]", "vs DDP", "vs DDP [min, max]",
                                              "median step (s)"], rows)
    report.write_json(json_path, {
        "models": models, "replicas": replicas, "rounds": rounds,
        # Other work on a shared machine moves these figures more than the target's 3%.
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "target": "ftsystem ratio_vs_ddp >= 0.97 and steps/s >= torchft's",
        "machine": report.machine()})


def _ddp_main(rank: Annotated[int, typer.Option()],
              world_size: Annotated[int, typer.Option()],
              steps: Annotated[int, typer.Option()],
              out: Annotated[Path, typer.Option()],
              model_params: Annotated[int, typer.Option()] = 0) -> None:
    ddp_replica(rank=rank, world_size=world_size, steps=steps, model_params=model_params,
                out=out)


if __name__ == "__main__":  # one DDP rank, started by run_ddp
    typer.run(_ddp_main)


def _range(spread: dict) -> str:
    return "-" if spread["min"] is None else f"[{spread['min']:.3g}, {spread['max']:.3g}]"
