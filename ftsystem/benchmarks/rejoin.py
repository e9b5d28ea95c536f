"""``ftsystem bench rejoin``: what a joining replica costs the members, as the model grows.

For each model size, the same scenario on each system in one invocation: two members train;
a third replica is launched mid-run and joins. Measured: the members' stall (their longest
inter-commit gap from the joiner's launch to its second commit, minus their normal step time),
the joiner's time from launch to its first commit, and the rate of its state transfer.

The window takes in the step after the join: a joiner's first forward and backward runs in a
fresh process (cold caches, first allocations), and the members wait for it at that step's
all-reduce. torchft's joiner computes it in the step it heals at; ftsystem's joiner takes its
join step with zeros (phase ``JOIN_STEP`` of ``FTReplica``), so its first computed step is the next
one: warm, its warm-up step came before its catch-up (cold in ``cold-join``). A window that
ended at the joiner's first commit counted that step only when a member's commit happened to
precede the joiner's by a fraction of a millisecond.

- ``ftsystem``: a warm-up step of the loop, thrown away, while the donor's snapshot arrives,
  then non-blocking catch-up (that snapshot loaded, the donor's update log replayed), then a
  join epoch (``FTSYSTEM_WARM_UP=1``, the default where the model is on a GPU);
- ``cold-join``: the same without the warm-up step (``FTSYSTEM_WARM_UP=0``, the default on a
  CPU): the joiner's first forward and backward run in a cold process after it joined, while
  the members wait;
- ``blocking``: a join without catch-up: the whole state is broadcast inside the join epoch;
- ``torchft``: torchft 0.2.0 healing inside a quorum step.

Every system's joiner is started at the lowest CPU priority (``nice 19``). Replicas of a real
job run on hosts of their own; here three share two cores, and a joiner importing torch and
building its model slows the members' compute, a cost of this machine, not of any join
protocol. But both systems start every replica in a session of its own, and with the kernel's
autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, recorded in the JSON as
``joiner_priority``) a nice value orders only the threads of one session: the joiner then
competes as an equal of each member, for both systems alike. Nicing its sessions' groups
instead would starve its transfer (measured here: 0.1 GB/s against 0.7-1.3 GB/s beside two busy
processes), so the bench leaves it so and says it.

Transfer rates: ftsystem's joiner times its snapshot from the donor's first byte to its last
(``transport.Snapshot``); torchft's joiner logs how long its ``HTTPTransport`` took to fetch and
load the checkpoint, for the same model and AdamW state. Neither includes waiting for the donor
to take its copy. ``blocking`` sends its state inside the join epoch's collective: not timed on
its own (null). The wire's own rate, ``loopback_bytes_per_s``, is measured once per round by
:func:`loopback_rate`.

Launch phase: the joiner is launched a fraction of a step after one of the members' commits,
``(r + 0.5) / N`` in round r of N (the members' normal step time from their commits so far),
the same for every system in a round. A joiner can join only at one of the members'
all-reduces, so its time to join is a sawtooth of when it is launched in their step: launched
always right after a commit, every round would measure one point of it.
Spread over the step, the rounds sample the whole tooth, and each system meets the same points.

Every system trains one spec per size (``harness.RunSpec``): two members, the same model,
batch and learning rate (the example program's defaults, 16 and 3e-3, the torchft baseline's
too), data, steps and emulated compute; each run records it (``spec``).

``--rounds N`` runs every size N times, the order of the runs reversed every other round; each
figure is reported as its median and min/max over the rounds. Each round records the
machine's load average before and after it (other work on a shared machine makes figures
noisy), in ``round_log``. ``--sizes`` picks some of the sizes (``1M,10M,100M``).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import typer

from ftsystem.benchmarks import harness
from ftsystem.benchmarks.harness import RunSpec
from ftsystem.measure import report, stall
from ftsystem.cli import bench_app
from ftsystem.control.etcd_server import EmbeddedEtcd
from ftsystem.launch.launcher import ProcessGroup, agent_command, run_job
from ftsystem.control.store import Store
from ftsystem.control.tokens import ENV_TOKEN

WARMUP_STEPS = 5
MEMBERS = ("r0", "r1")
JOINER = "r2"
JOINER_NICENESS = 19
# (steps, emulated compute per step) per model size: enough steps to outlast the join.
PLANS = {1_000_000: (200, 0.05), 10_000_000: (60, 0.0), 100_000_000: (18, 0.0)}
QUICK_PLAN = {1_000_000: (250, 0.05)}
"""``--quick``: a smoke run of the wiring and the JSON, not figures. The members train about
40 s after the joiner starts (steps of 0.15 s and more): its imports alone took 30 s on a loaded
machine, and a joiner that arrives after the last step has nothing to join."""
SYSTEMS = ("ftsystem", "cold-join", "blocking", "torchft")
LOOPBACK_BYTES, LOOPBACK_CHUNK, LOOPBACK_TRIES = 1 << 30, 64 << 20, 3
PHASE_TIMEOUT_S = 300.0
"""How long the bench waits for a member's next commit before it launches the joiner."""
QUICK_LOOPBACK = (256 << 20, 1)
TARGETS = {"transfer_bytes_per_s": "ftsystem >= 1e9 and >= 0.2 x loopback at 100M",
           "join_stall_s": "ftsystem <= torchft at every size",
           "time_to_join_s": "ftsystem <= torchft at 100M"}
FIGURES = {"join_stall_s": "join_stall_s", "join_step_stall_s": "join_step_stall_s",
           "time_to_join_s": "time_to_join_s", "transfer_bytes_per_s": "transfer_bytes_per_s",
           "step_s": "step_s"}
"""What each run gives, reported over the rounds (see ``report.per_round``)."""
# torchft's HTTPTransport logs "fetching checkpoint from <url> took <seconds>s".
TORCHFT_FETCH = re.compile(r"fetching checkpoint from \S+ took ([0-9.e-]+)s")
TORCHFT_TIMEOUT_S = 1800.0
"""How long torchft's replicas may take to finish: at 100M parameters on a loaded 2-core
machine its 18 steps took longer than the scenario's default 600 s."""


def loopback_rate(total_bytes: int = LOOPBACK_BYTES, tries: int = LOOPBACK_TRIES) -> float:
    """Bytes/s of one TCP stream on 127.0.0.1, the median of a few tries.

    A forked sender process ``sendall()``s a 64 MiB buffer until ``total_bytes`` are sent;
    this process ``recv_into()``s one reused 64 MiB buffer; the rate is the bytes over the
    time from connecting to the last byte. Both buffers are reused: the wire, not page faults.
    """
    rates = []
    for _ in range(tries):
        with socket.create_server(("127.0.0.1", 0)) as server:
            sender = multiprocessing.get_context("fork").Process(
                target=_send_zeros, args=(server.getsockname()[1], total_bytes), daemon=True)
            sender.start()
            buffer = memoryview(bytearray(LOOPBACK_CHUNK))
            started, received = time.monotonic(), 0
            connection, _ = server.accept()
            with connection:
                while received < total_bytes:
                    got = connection.recv_into(buffer)
                    if not got:
                        raise RuntimeError("the loopback sender stopped early")
                    received += got
            rates.append(received / (time.monotonic() - started))
            sender.join()
    return statistics.median(rates)


def _send_zeros(port: int, total_bytes: int) -> None:
    buffer = memoryview(bytearray(LOOPBACK_CHUNK))
    with socket.create_connection(("127.0.0.1", port)) as connection:
        for _ in range(total_bytes // LOOPBACK_CHUNK):
            connection.sendall(buffer)


def _admit_when_warm(etcd: str, job: str, replica: str) -> None:
    """Once both members have committed ``WARMUP_STEPS``, add ``replica`` to the job's spec,
    as an operator scaling the job up would: agents of replicas the spec does not list are
    refused. One event loop for it all: grpc.aio binds to every loop that used it, and a loop
    per poll left callbacks failing on closed loops in the bench's output."""
    import asyncio
    from ftsystem.control import keys

    async def admit() -> None:
        async with Store(etcd) as store:
            while True:
                items, _ = await store.get_prefix(keys.replicas(job))
                steps = [json.loads(v)["step"] for v in items.values()]
                if len(steps) >= 2 and min(steps) >= WARMUP_STEPS:
                    break
                await asyncio.sleep(0.1)
            spec = await store.get_json(keys.spec(job))
            await store.put_json(keys.spec(job), spec | {
                "replica_ids": [*spec["replica_ids"], replica]})
    asyncio.run(admit())


def launch_phase(round_index: int, rounds: int) -> float:
    """Where in the members' step round ``round_index`` of ``rounds`` launches the joiner
    (0: at a commit, 1: at the next): evenly over the step, the same for every system."""
    return (round_index + 0.5) / rounds


def _wait_for_phase(commits: Callable[[], list], phase: float) -> None:
    """Wait for a member's next commit (``commits`` reads its timeline so far), then for
    ``phase`` of its normal step."""
    seen = len(commits())
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while len(timeline := commits()) <= seen or \
            (at := stall.phase_instant(timeline, phase)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no member committed in {PHASE_TIMEOUT_S:.0f} s")
        time.sleep(0.02)
    time.sleep(max(0.0, at - time.time()))


def plan_spec(params: int, plan: tuple[int, float]) -> RunSpec:
    """What every system trains at ``params`` parameters: the members, ``plan``'s steps and
    emulated compute, the example program's batch, learning rate and seed."""
    steps, sleep = plan
    return RunSpec(num_replicas=len(MEMBERS), model_params=params, steps=steps,
                   sleep_per_step=sleep)


def run_ftsystem(spec: RunSpec, *, mode: str, workdir: Path, warm_up: bool = True,
                 phase: float = 0.0) -> dict:
    """The members via ``run_job``; the joiner's agent launched once they are warm."""
    # Inherited by every replica.
    variables = {"FTSYSTEM_CATCHUP": mode, "FTSYSTEM_WARM_UP": str(int(warm_up))}
    with harness.environment(variables), EmbeddedEtcd(data_dir=workdir / "etcd") as etcd:
        cfg = harness.ftsystem_config(spec, etcd=etcd.url, job="rejoin", out_dir=workdir / "run")
        runner = threading.Thread(target=run_job, args=(cfg,), daemon=True)
        runner.start()
        _admit_when_warm(etcd.url, cfg.job, JOINER)
        _wait_for_phase(lambda: stall.read_timeline(
            cfg.out_dir / "results" / f"{MEMBERS[0]}.commits"), phase)
        launched = time.time()
        extra = ProcessGroup(cfg.out_dir)
        # The run's token, which its agents hand to their ranks' state servers.
        token = (cfg.out_dir / "api-token").read_text()
        joiner = extra.start(f"agent-{JOINER}", [
            "nice", "-n", str(JOINER_NICENESS), *agent_command(cfg, etcd.url, len(MEMBERS))],
            env=os.environ | {ENV_TOKEN: token})
        joiner.wait()
        runner.join()
    result = cfg.out_dir / "results" / f"{JOINER}.json"
    if not result.exists():
        tail = (cfg.out_dir / f"agent-{JOINER}.log").read_text().splitlines()[-5:]
        raise RuntimeError("the joiner wrote no result; its agent's log ends with:\n"
                           + "\n".join(tail))
    catchup = json.loads(result.read_text())["catchup"]
    timelines = harness.read_timelines("ftsystem", cfg.out_dir)
    return _measure({r: timelines[r] for r in MEMBERS}, timelines[JOINER], launched) | {
        "catchup": catchup, "transfer_bytes_per_s": catchup.get("transfer_bytes_per_s"),
        **({} if mode != "blocking" else
           {"transfer_note": "sent inside the join epoch's state sync: not timed apart"})}


def run_torchft(spec: RunSpec, *, workdir: Path, phase: float = 0.0) -> dict:
    """The members on torchft; its joiner launched at ``phase`` of their step, once they are
    warm."""
    from ftsystem.baselines.torchft_scenario import run_torchft_rejoin
    out = run_torchft_rejoin(**harness.torchft_training(spec), workdir=workdir,
                             timeout_s=TORCHFT_TIMEOUT_S, joiner_niceness=JOINER_NICENESS,
                             wait_to_join=lambda commits: _wait_for_phase(commits, phase))
    timelines = harness.read_timelines("torchft", workdir)
    fetch_s = _torchft_fetch_s(workdir)
    nbytes = state_bytes(spec.model_params)
    joiner = str(spec.num_replicas)  # torchft's replicas are numbered, the joiner last
    members = {index: timelines.get(index, []) for index in map(str, range(spec.num_replicas))}
    return _measure(members, timelines.get(joiner, []), out["join_started"]) | {
        "crashed": out["crashed"], "transfer_s": fetch_s, "transfer_bytes": nbytes,
        "transfer_bytes_per_s": nbytes / fetch_s if fetch_s else None}


def _torchft_fetch_s(workdir: Path) -> float | None:
    """How long the joiner's healing fetch took, from its log (None: it did not heal)."""
    for path in workdir.rglob("replica2_gen*.log"):
        if found := TORCHFT_FETCH.findall(path.read_text(errors="replace")):
            return float(found[0])
    return None


def state_bytes(params: int) -> int:
    """Bytes of the tensors a joiner receives with both baselines' workload: the model's
    parameters and AdamW's two moments (its step counters are left out: a few bytes)."""
    import torch

    from ftsystem.example.workload import ModelConfig, TinyGPT
    with torch.device("meta"):
        model = TinyGPT(ModelConfig.for_params(params))
    return 3 * sum(p.nbytes for p in model.parameters())


def _measure(members: dict, joiner_commits: list, launched: float) -> dict:
    if not joiner_commits:
        return {"join_stall_s": None, "time_to_join_s": None, "step_s": None,
                "join_step_stall_s": None}
    join_step, joined = joiner_commits[0]
    _, computed = joiner_commits[min(1, len(joiner_commits) - 1)]  # its first computed step
    stalls = [s for tl in members.values()
              if (s := stall.window_stall(tl, launched, computed)) is not None]
    at_join = [s for tl in members.values() if (s := _step_stall(tl, join_step)) is not None]
    return {"join_stall_s": max(stalls, default=None), "time_to_join_s": joined - launched,
            "step_s": stall.distribution([stall.normal_step_time(tl)
                                          for tl in members.values()])["median"],
            "join_step_stall_s": max(at_join, default=None)}


def _step_stall(timeline: list, step: int) -> float | None:
    """How much longer than a normal step the members took to commit ``step``, the joiner's
    first: the join itself, apart from the joiner's start slowing the members' compute on a
    shared machine (the rest of ``join_stall_s``'s window)."""
    times = dict(timeline)
    if step not in times or step - 1 not in times:
        return None
    return max(0.0, times[step] - times[step - 1] - stall.normal_step_time(timeline))


def run_system(name: str, spec: RunSpec, *, workdir: Path, phase: float = 0.0) -> dict:
    """One run of ``spec``, its joiner launched at ``phase`` of the members' step, recorded
    with the spec; a run that fails is recorded with its error and no figures, and the bench
    goes on (a round of every size takes most of an hour here)."""
    try:
        if name == "torchft":
            figures = run_torchft(spec, workdir=workdir, phase=phase)
        else:
            figures = run_ftsystem(spec, workdir=workdir, phase=phase,
                                   mode="blocking" if name == "blocking" else "nonblocking",
                                   warm_up=name != "cold-join")
    except (RuntimeError, TimeoutError) as e:
        typer.echo(f"{name} at {spec.model_params:,} parameters failed: {e}", err=True)
        figures = {figure: None for figure in FIGURES} | {"error": str(e)}
    return figures | {"launch_phase": phase} | harness.ran_with(name, spec)


def joiner_priority() -> str:
    """What the joiner's ``nice`` does on this machine (see the module's docstring)."""
    try:
        autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        autogroup = False
    if autogroup:
        return (f"nice {JOINER_NICENESS}, voided by autogroup scheduling (every replica runs in "
                "a session of its own): the joiner competes as an equal of each member")
    return f"nice {JOINER_NICENESS}: the joiner yields to the members"


def parse_sizes(text: str) -> dict[int, tuple[int, float]]:
    """The plans of the sizes named in ``text`` (``1M,10M,100M`` or parameter counts)."""
    chosen = {}
    for item in filter(None, (part.strip().upper() for part in text.split(","))):
        params = int(float(item[:-1]) * 1e6) if item.endswith("M") else int(item)
        if params not in PLANS:
            raise typer.BadParameter(f"unknown size {item}: pick from "
                                     + ", ".join(f"{p // 1_000_000}M" for p in PLANS),
                                     param_hint="--sizes")
        chosen[params] = PLANS[params]
    return chosen


def run_rounds(systems: list[str], plans: dict[int, tuple[int, float]], rounds: int,
               root: Path, loopback: tuple[int, int] = (LOOPBACK_BYTES, LOOPBACK_TRIES),
               after_run: Callable[[list[dict], dict], None] = lambda *_: None
               ) -> tuple[list[dict], dict[tuple[int, str], list[dict]]]:
    """Every size on every system, ``rounds`` times, the order of the runs reversed every
    other round (``report.in_rounds``): the round log, with each round's loopback rate, and
    each run's results by (size, system) in round order. ``after_run`` sees them after every
    run (a long bench keeps what it measured)."""
    specs = {params: plan_spec(params, plan) for params, plan in plans.items()}

    def run(unit: tuple[int, str], r: int) -> dict:
        params, name = unit
        typer.echo(f"round {r + 1}/{rounds}: {params:,} parameters, {name} ...", err=True)
        return run_system(name, specs[params], phase=launch_phase(r, rounds),
                          workdir=root / f"round{r}" / f"{name}-{params}")

    runs, log = report.in_rounds(
        [(params, name) for params in plans for name in systems], rounds, run,
        at_round_start=lambda _: {"loopback_bytes_per_s": loopback_rate(*loopback)},
        after_run=lambda runs, log: after_run(log, runs))
    return log, runs


def summarize(log: list[dict], runs: dict[tuple[int, str], list[dict]]) -> dict:
    """The JSON's figures (pure): per size and system, each figure's spread over the rounds
    and every run in full; the loopback rate's spread, and the round log."""
    sizes: dict[int, dict] = {}
    for (params, name), system_runs in runs.items():
        sizes.setdefault(params, {})[name] = report.over_rounds(system_runs, FIGURES)
    return {"sizes": [{"params": params, **by_system} for params, by_system in sizes.items()],
            "loopback_bytes_per_s": report.spread([r["loopback_bytes_per_s"] for r in log]),
            "round_log": log}


def _rows(summary: dict) -> list[tuple]:
    def cell(figure: dict, scale: float = 1.0, digits: int = 2) -> str:
        if figure["median"] is None:
            return "-"
        return (f"{figure['median'] / scale:.{digits}f} "
                f"[{figure['min'] / scale:.{digits}f}, {figure['max'] / scale:.{digits}f}]")
    loopback = cell(summary["loopback_bytes_per_s"], 1e9)
    return [(size["params"], name, cell(r["step_s"]), cell(r["join_stall_s"]),
             cell(r["join_step_stall_s"], digits=3), cell(r["time_to_join_s"]),
             cell(r["transfer_bytes_per_s"], 1e9), loopback)
            for size in summary["sizes"] for name, r in size.items() if isinstance(r, dict)]


@bench_app.command("rejoin")
def rejoin(json_path: Optional[Path] = typer.Option(None, "--json", help="write results here"),
           quick: bool = typer.Option(False, help="one 1M-parameter round, fewer steps: a "
                                      "smoke run of the wiring (about a minute per system)"),
           rounds: int = typer.Option(2, min=1, help="runs of every size and system, the "
                                      "order of the systems alternated per round"),
           systems: str = typer.Option(",".join(SYSTEMS), help="comma-separated, of "
                                       + ", ".join(SYSTEMS)),
           skip_torchft: bool = typer.Option(False, help="leave torchft out"),
           sizes: str = typer.Option("1M,10M,100M", help="comma-separated model sizes, of "
                                     "1M, 10M, 100M")
           ) -> None:
    """Members' stall, joiner's time to join and transfer rate: ftsystem (with and without
    its warm-up step) vs blocking vs torchft 0.2.0, with the machine's loopback rate beside."""
    chosen = [name.strip() for name in systems.split(",") if name.strip()]
    if unknown := sorted(set(chosen) - set(SYSTEMS)):
        raise typer.BadParameter(f"unknown system(s) {', '.join(unknown)}: pick from "
                                 f"{', '.join(SYSTEMS)}", param_hint="--systems")
    chosen = [name for name in chosen if not (skip_torchft and name == "torchft")]
    plans, rounds = (QUICK_PLAN, 1) if quick else (parse_sizes(sizes), rounds)
    loopback = QUICK_LOOPBACK if quick else (LOOPBACK_BYTES, LOOPBACK_TRIES)

    def save(log: list[dict], runs: dict) -> None:
        report.write_json(json_path, {
            **summarize(log, runs), "rounds": len(log), "systems": chosen,
            "targets": TARGETS, "joiner_niceness": JOINER_NICENESS,
            "joiner_priority": joiner_priority(),
            "launch_phases": [launch_phase(r, rounds) for r in range(rounds)],
            "loopback_method": " ".join(loopback_rate.__doc__.split("\n\n")[1].split()),
            "machine": report.machine()})

    with tempfile.TemporaryDirectory(prefix="ftsystem-bench-rejoin-") as tmp:
        log, runs = run_rounds(chosen, plans, rounds, Path(tmp), loopback, save)
    summary = summarize(log, runs)
    report.print_table("rejoin: members' stall, joiner's time to join, transfer rate "
                       "(median [min, max] over rounds)",
                       ["params", "system", "normal step (s)", "join stall (s)",
                        "at the join step (s)", "time to join (s)", "transfer (GB/s)",
                        "loopback (GB/s)"],
                       _rows(summary))
