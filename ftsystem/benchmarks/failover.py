"""``ftsystem bench failover``: survivor stall per crash, ftsystem against torchft 0.2.0.

One invocation runs the same scenario on both systems: 4 replicas of the same model, step time
and data; one replica (the victim) fails at a fixed interval. Stall = from the failure's
instant to the survivors' next commit, minus their normal step time (``ftsystem.measure.stall``).

``--scenario process`` (default): the victim's training process is SIGKILLed from outside, on
loopback, each time after it has rejoined; its agent lives on and reports the exit. torchft
runs at its default lighthouse timing and at a 1 s heartbeat timeout.

``--scenario host``: a whole host dies with everything on it, silently: its link goes down
first, then every process on it is SIGKILLed at once, so that no socket's reset or FIN tells
the peers (a host that loses power sends nothing; killing its processes with the link up would
announce the death at once). ftsystem runs with every node in its own network namespace
(``run_job(netns=True)``, the default ``--timeout``) and the fault is a ``host-kill`` chaos
order on the victim's host, its agent included; the host "reboots" (link up, its agent starts
again) ``--down`` seconds later. With ``--nodes-per-replica 2`` the host is one node (chosen at
random) of the victim's 2-node replica. torchft has no agent: each of its replicas runs in a
namespace of its own, and the victim's host dies the same way (link down, its whole process
tree SIGKILLed), restarted ``--down`` seconds later; it runs at torchft's default lighthouse
timing and at a 1 s heartbeat timeout.

Every system trains one spec (``harness.RunSpec``): the same replicas, model, batch, learning
rate and data (the example program's defaults), steps and emulated compute; each run records it
(``spec``). Both scenarios run ``--rounds`` rounds, the order of the systems alternated per round
(``report.in_rounds``, the machine's load in ``round_log``); the JSON gives every counted
failure's stall and each round's median.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from ftsystem.benchmarks import harness
from ftsystem.benchmarks.harness import RunSpec
from ftsystem.control import keys

from ftsystem.measure import report, stall
from ftsystem.chaos.spec import ChaosSpec
from ftsystem.cli import bench_app
from ftsystem.control.etcd_server import EmbeddedEtcd
from ftsystem.launch.launcher import replica_id, run_job
from ftsystem.control.store import Store

VICTIM = 1
WARMUP_STEPS = 20
SCENARIOS = ("process", "host")

HOST_INTERVAL_S = 50.0
"""Seconds between host failures (one-node replicas, and torchft; see ``host_interval``). The
victim must be a member again at each: after a host-kill here (2 cores, 4 replicas training)
the host is down ``--down`` seconds, its agent takes 5-15 s to start and open a generation, the
replica's program about 20 s to import, start and catch up; torchft's restart takes 7-25 s. A
failure that finds the victim still restarting is reported but not counted."""
HOST_STEP_OVERHEAD_S = 0.1
"""Seconds a step takes beyond the emulated compute, at least, per node of a replica (here,
4 replicas on 2 cores: 0.10-0.17 s for ftsystem and 0.17-0.26 s for torchft at 1 node per
replica, 0.45 s for ftsystem at 2): sizes the run so that it outlasts the last failure."""
HOST_DOWN_S = 15.0
"""How long a killed host stays down before it "reboots": longer than any detector of either
system here (torchft's collectives give up after 10 s), so that no reboot ends a stall (the
peers' next packets to a rebooted host meet a reset)."""
HOST_TIMEOUT_S = 30.0
"""ftsystem's one timeout in the host scenario: the default (``RunConfig.timeout_s``, lease
TTL 10 s); the point is what a host failure costs at defaults."""
TORCHFT_HOST_TIMEOUT_S = 3600.0
"""How long torchft's replicas may take to finish the host scenario."""
VICTIM_TRAINING_S = 3.0
"""A failure counts only if the victim committed within this long before it: it was a member
then (not still restarting from the previous failure)."""
TORCHFT_SETTINGS = ("torchft", "torchft_1s")
"""The torchft runs of the host scenario: at torchft's default lighthouse timing, and at the
1 s heartbeat timeout of the process scenario (``torchft_scenario`` constants)."""
SYSTEMS = ("ftsystem", *TORCHFT_SETTINGS)
FIGURES = {"round_median_stall_s": "stall_s.median", "step_s": "step_s.median"}
"""What each round gives, reported over the rounds (see ``report.per_round``)."""


def _registration(etcd: str, job: str, rid: str) -> dict | None:
    async def read() -> dict | None:
        async with Store(etcd) as store:
            return await store.get_json(keys.replica(job, rid))
    return asyncio.run(read())


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"failover benchmark: timed out waiting for {what}")
        time.sleep(0.05)


def run_ftsystem(spec: RunSpec, *, num_failures: int, kill_interval_s: float,
                 workdir: Path) -> dict:
    """The scenario on ftsystem: ``run_job`` in a thread, kills from this one."""
    with EmbeddedEtcd(data_dir=workdir / "etcd") as etcd:
        cfg = harness.ftsystem_config(spec, etcd=etcd.url, job="failover",
                                      out_dir=workdir / "run")
        summaries: list[dict] = []
        runner = threading.Thread(target=lambda: summaries.append(run_job(cfg)), daemon=True)
        runner.start()
        victim = replica_id(VICTIM)
        kills = _kill_repeatedly(etcd.url, cfg.job, victim, num_failures, kill_interval_s,
                                 runner)
        runner.join()
    return _stalls(harness.read_timelines("ftsystem", cfg.out_dir), kills, victim) | {
        "bitwise_identical": summaries[0]["bitwise_identical"] if summaries else None,
        "ettr_time": summaries[0]["ettr_time"] if summaries else None}


def _kill_repeatedly(etcd: str, job: str, victim: str, num_failures: int,
                     interval_s: float, runner: threading.Thread) -> list[float]:
    def member_at(generation: int) -> dict | None:
        reg = _registration(etcd, job, victim)
        ok = reg and reg["state"] == "member" and reg["generation"] == generation and \
            reg["step"] >= WARMUP_STEPS
        return reg if ok else None

    kills: list[float] = []
    for generation in range(num_failures):
        _wait(lambda: member_at(generation) or not runner.is_alive(), 300,
              f"{victim} generation {generation} to train")
        if not runner.is_alive():
            break
        time.sleep(max(0.0, (kills[-1] + interval_s if kills else 0) - time.time()))
        reg = member_at(generation)
        if reg is None:
            break
        os.kill(reg["pid"], signal.SIGKILL)
        kills.append(time.time())
    return kills


def run_torchft(spec: RunSpec, *, num_failures: int, kill_interval_s: float, workdir: Path,
                setting: str = "torchft_1s") -> dict:
    """The scenario on torchft; ``setting`` as in ``TORCHFT_SETTINGS``."""
    from ftsystem.baselines.torchft_scenario import run_torchft_failover
    out = run_torchft_failover(**harness.torchft_training(spec), num_failures=num_failures,
                               workdir=workdir, kill_interval_s=kill_interval_s, victim=VICTIM,
                               lighthouse=_lighthouse(setting), until_rejoined=True)
    return _stalls(harness.read_timelines("torchft", workdir), out["failures"], str(VICTIM)) | {
        "bitwise_identical": len({r["state_hash"] for r in out["results"]}) == 1,
        "crashed": out["crashed"], "settings": out["settings"]}


def _lighthouse(setting: str):
    """torchft's lighthouse timing for ``setting``: "torchft" its defaults, "torchft_1s" the
    1 s heartbeat timeout (``torchft_scenario`` constants)."""
    from ftsystem.baselines.torchft_scenario import LighthouseSettings
    if setting not in TORCHFT_SETTINGS:
        raise ValueError(f"torchft setting must be one of {TORCHFT_SETTINGS}, not {setting!r}")
    return LighthouseSettings.torchft_defaults() if setting == "torchft" else LighthouseSettings()


def _stalls(timelines: dict, kills: list[float], victim: str) -> dict:
    measured = [s for t in kills if (s := stall.fault_stall(timelines, t, [victim])) is not None]
    survivors = [tl for rid, tl in timelines.items() if rid != victim]
    return {"failures": len(kills), **_stall_figures(measured),
            "step_s": stall.distribution([stall.normal_step_time(t) for t in survivors])}


def _stall_figures(measured: list[stall.Stall]) -> dict:
    """The failures' stalls (the excess of the gaps each lengthened over the normal step), the
    former whole-step measure beside them, and the measure's resolution."""
    return {"stall_s": stall.distribution([s.excess_s for s in measured]),
            "per_failure_stall_s": [s.excess_s for s in measured],
            "whole_steps_stall_s": stall.distribution([s.whole_steps_s for s in measured]),
            "resolution_s": stall.distribution([s.resolution_s for s in measured])}


@bench_app.command("failover")
def failover(json_path: Optional[Path] = typer.Option(None, "--json", help="write results here"),
             scenario_name: str = typer.Option("process", "--scenario",
                                               help="process: a training process is SIGKILLed; "
                                                    "host: a whole host dies (root, netns)"),
             quick: bool = typer.Option(False, help="2 failures instead of 5 (about 2 min); "
                                                    "host: and 1 round"),
             failures: int = typer.Option(0, help="override the number of failures (host: per "
                                                  "round)"),
             kill_interval: Optional[float] = typer.Option(
                 None, help=f"seconds between failures (process: 8, host: {HOST_INTERVAL_S:g} "
                            "for a one-node replica and torchft, more for several nodes)"),
             sleep_per_step: float = typer.Option(0.05, help="emulated compute per step"),
             model_params: int = typer.Option(0, help="model size (0: the small default)"),
             skip_torchft: bool = typer.Option(False, help="run ftsystem only"),
             systems: str = typer.Option(",".join(SYSTEMS),
                                         help="comma-separated, ftsystem and the torchft "
                                              "settings, of " + ", ".join(SYSTEMS)),
             replicas: int = typer.Option(4, min=2, help="replicas of each run (the victim "
                                                         "is r1)"),
             rounds: int = typer.Option(2, min=1, help="rounds, the order of the systems "
                                                       "alternated per round (quick: 1)"),
             down: float = typer.Option(HOST_DOWN_S, help="host: seconds a host stays down"),
             steps: int = typer.Option(0, help="steps per run (0: enough for the failures; "
                                                "process: (failures + 2) x interval of "
                                                "emulated compute, host: see host_steps)"),
             nodes_per_replica: list[int] = typer.Option(
                 [1], help="host: nodes per replica (repeat for several layouts; the first is "
                           "the JSON's top level, the others under 'layouts')"),
             workdir: Optional[Path] = typer.Option(
                 None, help="host: keep every run's directory (logs) here instead of a "
                            "temporary one")) -> None:
    """Survivor stall per replica crash (or host failure): ftsystem vs torchft 0.2.0."""
    if scenario_name not in SCENARIOS:
        raise typer.BadParameter(f"--scenario must be one of {', '.join(SCENARIOS)}, "
                                 f"not {scenario_name!r}")
    if scenario_name == "host":
        data = run_host_bench(failures=failures or (2 if quick else 5),
                              rounds=1 if quick else rounds,
                              interval_s=kill_interval or HOST_INTERVAL_S, down_s=down,
                              sleep_per_step=sleep_per_step, model_params=model_params,
                              layouts=nodes_per_replica,
                              torchft_settings=[
                                  name for name in _systems(systems, skip_torchft)
                                  if name in TORCHFT_SETTINGS],
                              workdir=workdir, steps=steps, num_replicas=replicas)
        print_host_table(data)
        report.write_json(json_path, data)
        return
    kill_interval = kill_interval or 8.0
    num_failures = failures or (2 if quick else 5)
    if steps and steps <= WARMUP_STEPS:
        raise typer.BadParameter(f"the first kill comes after step {WARMUP_STEPS}: pass more "
                                 "steps", param_hint="--steps")
    data = run_process_bench(num_failures=num_failures, kill_interval_s=kill_interval,
                             sleep_per_step=sleep_per_step, model_params=model_params,
                             rounds=1 if quick else rounds,
                             systems=_systems(systems, skip_torchft), num_replicas=replicas,
                             steps=steps)
    print_process_table(data)
    report.write_json(json_path, data)


def _systems(names: str, skip_torchft: bool) -> list[str]:
    """The systems of ``--systems``, in ``SYSTEMS`` order; ftsystem is always one."""
    chosen = {name.strip() for name in names.split(",") if name.strip()}
    if unknown := sorted(chosen - set(SYSTEMS)):
        raise typer.BadParameter(f"unknown system(s) {', '.join(unknown)}: pick from "
                                 f"{', '.join(SYSTEMS)}", param_hint="--systems")
    if "ftsystem" not in chosen:
        raise typer.BadParameter("every figure is compared with ftsystem's: include ftsystem",
                                 param_hint="--systems")
    return [name for name in SYSTEMS if name in chosen
            and not (skip_torchft and name in TORCHFT_SETTINGS)]


def run_process_bench(*, num_failures: int, kill_interval_s: float, sleep_per_step: float,
                      model_params: int, rounds: int, systems: list[str],
                      num_replicas: int = 4, steps: int = 0) -> dict:
    """The process scenario on ``systems`` (ftsystem, torchft at its defaults and at 1 s),
    ``rounds`` times, the order alternated per round. Every system trains ``steps`` (0: enough
    for the failures); ftsystem's victim catches up from the survivors even once they are done,
    torchft's survivors train on until the victim has rejoined after its last kill."""
    spec = RunSpec(num_replicas=num_replicas, model_params=model_params,
                   sleep_per_step=sleep_per_step,
                   steps=steps or int((num_failures + 2) * kill_interval_s / sleep_per_step))
    failures = dict(num_failures=num_failures, kill_interval_s=kill_interval_s)

    def run(name: str, r: int, root: Path) -> dict:
        print(f"failover: round {r + 1}/{rounds}: {name}", flush=True)
        where = root / f"round{r}" / name
        try:
            out = (run_ftsystem(spec, **failures, workdir=where) if name == "ftsystem"
                   else run_torchft(spec, **failures, workdir=where, setting=name))
        except Exception as e:  # the other runs still count; this one is reported
            print(f"failover: {name} failed: {e!r}", flush=True)
            out = {"error": f"{type(e).__name__}: {e}", "bitwise_identical": False}
        return out | harness.ran_with(name, spec)

    with tempfile.TemporaryDirectory(prefix="ftsystem-bench-failover-") as tmp:
        runs, log = report.in_rounds(systems, rounds, lambda name, r: run(name, r, Path(tmp)))
    ours = _aggregate(runs["ftsystem"])
    data = {"scenario": failures | {"num_replicas": spec.num_replicas, "steps": spec.steps,
                                    "sleep_per_step": spec.sleep_per_step,
                                    "model_params": spec.model_params, "rounds": rounds,
                                    "victim": replica_id(VICTIM)},
            "spec": dataclasses.asdict(spec), "ftsystem": ours}
    for name in TORCHFT_SETTINGS:
        theirs = _aggregate(runs[name]) if name in runs else None
        data[name] = theirs
        data[f"median_stall_ratio_{name}_over_ftsystem"] = (
            _ratio_spread(runs[name], runs["ftsystem"], theirs, ours) if theirs else None)
    if set(systems) & set(TORCHFT_SETTINGS):
        from ftsystem.baselines.torchft_scenario import lighthouse_defaults, manager_defaults
        data["torchft_defaults"] = {"lighthouse": lighthouse_defaults(),
                                    "manager": manager_defaults()}
    return data | {"round_log": log, "target": "ftsystem median stall <= 0.5 s",
                   "machine": report.machine()}


def print_process_table(data: dict) -> None:
    rows = []
    for key, label in (("ftsystem", "ftsystem"), ("torchft", "torchft default"),
                       ("torchft_1s", "torchft 1s")):
        if (r := data.get(key)) is None:
            continue
        rounds = ", ".join("-" if m is None else f"{m:.3g}" for m in r["per_round_median_stall_s"])
        rows.append((label, r["failures"], r["stall_s"]["median"], r["stall_s"]["min"],
                     r["stall_s"]["max"], rounds, r["step_s"]["median"], r["bitwise_identical"]))
    report.print_table(f"failover: survivor stall per crash, {data['scenario']['rounds']} "
                       "round(s)", ["system", "failures", "median stall (s)", "min (s)",
                                    "max (s)", "round medians (s)", "normal step (s)",
                                    "bitwise identical"], rows)


# --- the host scenario -----------------------------------------------------------------------

def host_chaos(*, num_failures: int, interval_s: float, down_s: float, victim: str,
               warmup_steps: int, step_estimate_s: float, seed: int = 0) -> list[ChaosSpec]:
    """The host failures as chaos specs: failure ``i`` is a ``host-kill`` of ``victim``'s host
    (a random node of it) ``(i + 1) * interval_s`` after the orders are submitted, and not
    before the job has reached step ``warmup_steps`` and ``i`` spacings more: should start-up
    take longer than the interval, the failures still come apart (at least about half an
    interval of training between them) instead of all at once when the warm-up ends."""
    spacing = math.ceil(interval_s / 2 / step_estimate_s)
    return [ChaosSpec(actions=("host-kill",), replicas=(victim,), duration_s=down_s,
                      every_s=(i + 1) * interval_s, horizon_s=(i + 1) * interval_s,
                      after_step=warmup_steps + i * spacing, seed=seed + i)
            for i in range(num_failures)]


def host_interval(interval_s: float, nodes_per_replica: int) -> float:
    """The interval for a replica of ``nodes_per_replica`` nodes, ``interval_s`` being a
    one-node replica's: a replica of N nodes takes longer to restart (here 2 nodes: about 30 s
    from launch to the first commit, against 20 s), so it gets half an interval more per
    further node (2 nodes: 60 s at the default)."""
    return interval_s * (1 + (nodes_per_replica - 1) / 2)


def host_step_estimate(sleep_per_step: float, nodes_per_replica: int = 1) -> float:
    """The shortest step expected (``HOST_STEP_OVERHEAD_S``): the nodes of a replica share
    this machine's cores, so each node adds its overhead."""
    return (sleep_per_step + HOST_STEP_OVERHEAD_S) * nodes_per_replica


def host_steps(*, num_failures: int, interval_s: float, sleep_per_step: float,
               nodes_per_replica: int = 1) -> int:
    """Steps that outlast the last failure (``num_failures`` intervals after the orders are
    submitted, before training starts) and half an interval more, at the shortest step
    expected (a longer one only makes the run end later)."""
    step_s = host_step_estimate(sleep_per_step, nodes_per_replica)
    return WARMUP_STEPS + math.ceil((num_failures + 0.5) * interval_s / step_s)


def run_ftsystem_host(spec: RunSpec, *, num_failures: int, interval_s: float, down_s: float,
                      nodes_per_replica: int, workdir: Path, chaos_seed: int = 0) -> dict:
    """The host scenario on ftsystem: ``run_job`` with every node in a network namespace, its
    own embedded etcd, the spec's (default) timeout, and the failures as ``host-kill``
    orders."""
    victim = replica_id(VICTIM)
    cfg = harness.ftsystem_config(
        spec, job="failover-host", out_dir=workdir / "run", netns=True,
        nodes_per_replica=nodes_per_replica,
        chaos=host_chaos(num_failures=num_failures, interval_s=interval_s, down_s=down_s,
                         victim=victim, warmup_steps=WARMUP_STEPS,
                         step_estimate_s=host_step_estimate(spec.sleep_per_step,
                                                            nodes_per_replica),
                         seed=chaos_seed))
    started = time.time()
    summary = run_job(cfg)
    timelines = harness.read_timelines("ftsystem", cfg.out_dir)
    orders = sorted((o for o in summary.get("chaos", []) if o["action"] == "host-kill"),
                    key=lambda o: o["executed_at"] or float("inf"))
    not_done = [o for o in orders if o["state"] != "done" or o["executed_at"] is None]
    faults = [{"at": o["executed_at"], "at_s": o["executed_at"] - started,
               "node": o["node"], "outcome": o["outcome"]}
              for o in orders if o not in not_done]
    return _host_stalls(timelines, faults, victim) | {
        "orders_not_executed": [{"id": o["id"], "state": o["state"], "outcome": o["outcome"]}
                                for o in not_done],
        "bitwise_identical": summary["bitwise_identical"], "agents_ok": summary["agents_ok"],
        "steps": summary["steps"], "wall_s": summary["wall_s"],
        "ettr_time": summary.get("ettr_time"),
        "replica_failures": [{"replica": f["replica"], "reason": f.get("reason"),
                              "at_s": f["time"] - started} for f in summary["failures"]]}


def run_torchft_host(spec: RunSpec, *, num_failures: int, interval_s: float, down_s: float,
                     workdir: Path, setting: str) -> dict:
    """The host scenario on torchft: every replica in a host of its own (a network namespace),
    the victim's host dying silently (its link down, then its process tree SIGKILLed at once)
    and rebooted ``down_s`` later; ``setting`` "torchft" is torchft's default lighthouse
    timing, "torchft_1s" the 1 s heartbeat timeout of the process scenario."""
    from ftsystem.baselines.torchft_scenario import run_torchft_failover
    from ftsystem.launch.netns import HostNetwork, unique_network_name
    started = time.time()
    with HostNetwork(spec.num_replicas, name=unique_network_name("tf")) as network:
        out = run_torchft_failover(**harness.torchft_training(spec), num_failures=num_failures,
                                   workdir=workdir, kill_interval_s=interval_s, victim=VICTIM,
                                   down_s=down_s, lighthouse=_lighthouse(setting),
                                   timeout_s=TORCHFT_HOST_TIMEOUT_S, network=network)
    # Every generation's commits: whether the victim was training at a failure needs them.
    timelines = harness.read_timelines("torchft", workdir)
    faults = [{"at": t, "at_s": t - started} for t in out["failures"]]
    hashes = {r["state_hash"] for r in out["results"]}
    return _host_stalls(timelines, faults, str(VICTIM)) | {
        "bitwise_identical": len(hashes) == 1, "crashed": out["crashed"],
        "rejoin_s": [None if r is None else r - t for r, t in zip(out["rejoins"],
                                                                 out["failures"])],
        "settings": out["settings"]}


def _host_stalls(timelines: dict, faults: list[dict], victim: str) -> dict:
    """Each failure's stall, from its instant; counted only if the victim was training then."""
    counted = []
    for fault in faults:
        before = [t for _, t in timelines.get(victim, []) if t <= fault["at"]]
        fault["victim_last_commit_s"] = fault["at"] - before[-1] if before else None
        fault["victim_was_training"] = bool(before) and fault["at"] - before[-1] <= \
            VICTIM_TRAINING_S
        measured = stall.fault_stall(timelines, fault["at"], [victim])
        fault |= stall.stall_fields(measured)
        if fault["victim_was_training"] and measured is not None:
            counted.append(measured)
    survivors = [tl for rid, tl in timelines.items() if rid != victim]
    return {"failures": len(counted), "failures_injected": len(faults),
            **_stall_figures(counted), "faults": faults,
            "step_s": stall.distribution([stall.normal_step_time(t) for t in survivors])}


def run_host_bench(*, failures: int, rounds: int, interval_s: float, down_s: float,
                   sleep_per_step: float, model_params: int, layouts: list[int],
                   torchft_settings: list[str], workdir: Optional[Path],
                   steps: int = 0, num_replicas: int = 4) -> dict:
    """Every system of the host scenario, ``rounds`` times, the order alternated per round.
    Every system trains ``steps`` (0: the most that any of them needs to outlast its last
    failure, ``host_steps``)."""
    from ftsystem.launch.netns import netns_supported
    if (why := netns_supported()) is not None:
        raise RuntimeError(f"bench failover --scenario host: {why}")
    layouts = list(dict.fromkeys(layouts)) or [1]
    if any(n < 1 for n in layouts):
        raise ValueError(f"--nodes-per-replica must be at least 1, not {layouts}")
    systems = [f"ftsystem_{n}" for n in layouts] + torchft_settings
    # torchft's replica is one process: its runs are sized and timed like a one-node replica.
    nodes = {name: int(name.split("_")[1]) if name.startswith("ftsystem_") else 1
             for name in systems}
    intervals = {name: host_interval(interval_s, nodes[name]) for name in systems}
    spec = RunSpec(num_replicas=num_replicas, model_params=model_params,
                   sleep_per_step=sleep_per_step, timeout_s=HOST_TIMEOUT_S,
                   steps=steps or max(host_steps(
                       num_failures=failures, interval_s=intervals[name],
                       sleep_per_step=sleep_per_step, nodes_per_replica=nodes[name])
                       for name in systems))
    common = dict(num_failures=failures, down_s=down_s)
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ftsystem-bench-host-"))

    def run(name: str, r: int) -> dict:
        where = root / f"round{r}" / name
        print(f"failover host: round {r + 1}/{rounds}: {name}", flush=True)
        try:
            if name.startswith("ftsystem_"):
                out = run_ftsystem_host(spec, **common, workdir=where,
                                        interval_s=intervals[name],
                                        nodes_per_replica=nodes[name], chaos_seed=r * 100)
            else:
                out = run_torchft_host(spec, **common, workdir=where,
                                       interval_s=intervals[name], setting=name)
        except Exception as e:  # the other runs still count; this one is reported
            print(f"failover host: {name} failed: {e!r}", flush=True)
            out = {"error": f"{type(e).__name__}: {e}", "bitwise_identical": False}
        # Under --workdir, if kept.
        return out | {"out_dir": str(where.relative_to(root))} | harness.ran_with(name, spec)

    try:
        runs, log = report.in_rounds(systems, rounds, run)
    finally:
        if workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    setup = {"num_replicas": num_replicas, "victim": replica_id(VICTIM),
             "failures_per_round": failures, "rounds": rounds, "interval_s": intervals,
             "down_s": down_s, "steps": spec.steps,
             "sleep_per_step": sleep_per_step, "model_params": model_params,
             "warmup_steps": WARMUP_STEPS, "ftsystem_timeout_s": spec.timeout_s,
             "victim_training_s": VICTIM_TRAINING_S, "spec": dataclasses.asdict(spec)}
    torchft = {name: _aggregate(runs[name]) for name in TORCHFT_SETTINGS if name in runs}
    if torchft:
        from ftsystem.baselines.torchft_scenario import lighthouse_defaults, manager_defaults
        # What "torchft's defaults" are, read from the installed package (0.2.0: lighthouse
        # heartbeat 5 s, join timeout 60 s, tick 100 ms; Manager timeouts 60 s, heartbeat
        # every 100 ms), beside what each run used (its "settings").
        setup["torchft_defaults"] = {"lighthouse": lighthouse_defaults(),
                                     "manager": manager_defaults()}

    def layout(n: int) -> dict:
        ours = _aggregate(runs[f"ftsystem_{n}"]) | {
            "nodes_per_replica": n, "interval_s": intervals[f"ftsystem_{n}"]}
        out = {"ftsystem": ours}
        for name, theirs in torchft.items():
            out[f"median_stall_ratio_{name}_over_ftsystem"] = _ratio_spread(
                runs[name], runs[f"ftsystem_{n}"], theirs, ours)
        median = ours["stall_s"]["median"]

        def below(name: str) -> bool | None:
            if name not in torchft:
                return None
            theirs = torchft[name]["stall_s"]["median"]
            return median is not None and theirs is not None and median < theirs
        out["targets"] = {"ftsystem_median_stall_at_most_1s": median is not None and median <= 1.0,
                          "ftsystem_median_below_torchft_1s": below("torchft_1s"),
                          "ftsystem_median_below_torchft_default": below("torchft")}
        return out

    first, *others = layouts
    top = layout(first)
    return {"scenario": "host", "nodes_per_replica": first, "setup": setup,
            "ftsystem": top["ftsystem"], "torchft": torchft.get("torchft"),
            "torchft_1s": torchft.get("torchft_1s"),
            **{k: v for k, v in top.items() if k != "ftsystem"},
            "layouts": {f"nodes_per_replica_{n}": layout(n) for n in others}, "round_log": log,
            "target": "ftsystem median stall <= 1 s at its default timeout, below torchft's at a "
                      "1 s heartbeat timeout and at its defaults, the host dying silently",
            "machine": report.machine()}


def _aggregate(runs: list[dict]) -> dict:
    """One system over its rounds: every counted failure, each round's median, and the spread
    of the rounds' figures (a run that failed counts no failure and is listed under
    ``errors``)."""
    done = [run for run in runs if "error" not in run]
    stalls = [s for run in done for s in run["per_failure_stall_s"]]
    return {**report.over_rounds(runs, FIGURES),
            "failures": len(stalls), "stall_s": stall.distribution(stalls),
            "per_failure_stall_s": stalls,
            "per_round_median_stall_s": [run.get("stall_s", {}).get("median") for run in runs],
            "bitwise_identical": all(run["bitwise_identical"] for run in runs) and bool(runs),
            "settings": next((run["settings"] for run in done if "settings" in run), None),
            "errors": [{"round": run["round"], "error": run["error"]} for run in runs
                       if "error" in run]}


def _ratio_spread(theirs_runs: list[dict], ours_runs: list[dict], theirs: dict,
                  ours: dict) -> dict:
    """torchft's median stall over ftsystem's: overall, and per round (paired by round)."""
    return report.paired_ratio(theirs_runs, ours_runs, "stall_s.median") | {
        "value": _ratio(theirs, ours)}


def print_host_table(data: dict) -> None:
    rows = []
    entries = [(f"ftsystem {data['nodes_per_replica']}n", data["ftsystem"])]
    entries += [(f"ftsystem {v['ftsystem']['nodes_per_replica']}n", v["ftsystem"])
                for v in data["layouts"].values()]
    entries += [(label, data[key]) for key, label in
                (("torchft", "torchft default"), ("torchft_1s", "torchft 1s")) if data.get(key)]
    for name, r in entries:
        rounds = ", ".join("-" if m is None else f"{m:.3g}" for m in r["per_round_median_stall_s"])
        rows.append((name, r["failures"], r["stall_s"]["median"], r["stall_s"]["max"], rounds,
                     r["step_s"]["median"], r["bitwise_identical"]))
    report.print_table("failover --scenario host: survivor stall per host failure "
                       "(Nn: N nodes per replica)",
                       ["system", "failures", "median stall (s)", "max stall (s)",
                        "round medians (s)", "normal step (s)", "bitwise identical"], rows)
    for key in [k for k in data if k.startswith("median_stall_ratio_")]:
        ratio = data[key]
        if ratio["value"] is not None:
            spread = ", ".join("-" if r is None else f"{r:.3g}" for r in ratio["per_round"])
            print(f"{key}: {ratio['value']:.3g} (per round: {spread})")


def _ratio(theirs: dict | None, ours: dict) -> float | None:
    if not theirs or not theirs["stall_s"]["median"] or not ours["stall_s"]["median"]:
        return None
    return theirs["stall_s"]["median"] / ours["stall_s"]["median"]
