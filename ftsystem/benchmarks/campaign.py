"""``ftsystem bench campaign``: seeded random fault schedules, and what must hold after each.

Each schedule (``campaign_schedule(seed)``, pure) runs a real job of 3-5 replicas of the example
loop (EMA, several shuffled passes of a ``StatefulDataLoader``, bf16 autocast) and places 1-3
faults on the replicas other than one, the protected replica, which is never faulted:

| kind | how | phases |
|---|---|---|
| kill | SIGKILL at a fault point | between steps, state transfer (donating, or an epoch's state sync), digest comparison (right after the step compared), first interval |
| allreduce-kill | SIGKILL inside the all-reduce, or the all-reduce failing on it alone | all-reduce, first interval, join step |
| corrupt | one parameter changed in memory | between steps, first interval, state transfer (a donor gone bad just before its snapshot) |
| hang, partition, host-kill, etcd-pause | a chaos order, once the job reached the step | between steps, first interval |

After each schedule the checker (``violations``, pure) requires: every finished replica holds the
same state bit for bit at the job's last step; the protected replica finished, was never
restarted, never reported as diverged, and never loaded another replica's state after the
start; every replica whose corruption struck was reported; nothing halted; the run ended within
its bound. The JSON lists every schedule (seed, faults, outcome, violations) and counts the
faults by kind and phase.

A fault point that never comes (a donor that is never asked, a step a replica skipped while it
caught up) strikes nothing; the checker asks a report only of corruptions that struck (their
log line).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import typer

from ftsystem.cli import bench_app
from ftsystem.measure import report

FINGERPRINT_EVERY = 20
"""Digests are compared every this many steps: four comparisons in a schedule."""
NUM_STEPS = 80
SLEEP_PER_STEP_S = 0.02
LINGER_S = 20.0
"""How long a finished replica serves replicas still restarting."""
LOOP_ARGS = ("--ema", "0.99", "--passes", "3", "--amp", "bf16")
"""The loop's hard parts the example carries today: an EMA, a loader making several shuffled
passes, bf16 autocast."""
BOUND_S = 150.0
"""A schedule's run must end within this, plus ``BOUND_PER_FAULT_S`` per fault (2 busy cores:
a restart and catch-up takes 10-30 s)."""
BOUND_PER_FAULT_S = 60.0

CHAOS_KINDS = ("hang", "partition", "host-kill", "etcd-pause")
KIND_PHASES = {
    "kill": ("between-steps", "state-transfer", "digest", "first-interval"),
    "allreduce-kill": ("all-reduce", "first-interval", "join-step"),
    "corrupt": ("between-steps", "first-interval", "state-transfer"),
    **{kind: ("between-steps", "first-interval") for kind in CHAOS_KINDS},
}
DURATION_S = {"hang": (1.0, 3.0), "partition": (2.0, 5.0), "host-kill": (2.0, 4.0),
              "etcd-pause": (1.0, 4.0)}
CORRUPTED_LOG = "corrupted a parameter at step"
"""What a replica logs when its corruption strikes (``FTReplica``)."""
LOADED_LOG = "rank 0 loaded state at step"
"""What a replica logs when it loads another's whole state at an epoch entry."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    phase: str
    step: int
    target: int
    """Replica index; -1 for etcd-pause, which hits no replica."""
    point: str = ""
    """The fault point (``ftsystem.chaos.faults.PHASES``) of an in-process fault."""
    duration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Schedule:
    seed: int
    num_replicas: int
    protected: int
    faults: tuple[Fault, ...]
    num_steps: int = NUM_STEPS
    fingerprint_every: int = FINGERPRINT_EVERY

    @property
    def needs_netns(self) -> bool:
        return any(f.kind in ("partition", "host-kill") for f in self.faults)

    @property
    def bound_s(self) -> float:
        return BOUND_S + BOUND_PER_FAULT_S * len(self.faults)

    @property
    def min_replicas(self) -> int:
        """Every replica when a corruption is scheduled: they all start from the job's initial
        state, so each is its own witness at the first comparison (a replica that joined late
        copied a peer, and the two would be one vote)."""
        return self.num_replicas if any(f.kind == "corrupt" for f in self.faults) else 1

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> Schedule:
        return cls(**{**raw, "faults": tuple(Fault(**f) for f in raw["faults"])})


def campaign_schedule(seed: int) -> Schedule:
    """The schedule of ``seed`` (pure): 3-5 replicas, one protected, 1-3 faults on the others.

    A corruption comes first, on a replica no other fault touches, and every other fault
    strikes after the comparison that must find it: a peer restarted before that comparison
    could copy the bad state, and two copies of one history are one vote, so the job would
    rightly halt (no majority) instead of repairing it.
    """
    rng = random.Random(seed)
    n = rng.randint(3, 5)
    protected = rng.randrange(n)
    others = [i for i in range(n) if i != protected]
    kinds = [rng.choice(list(KIND_PHASES)) for _ in range(rng.randint(1, 3))]
    if "corrupt" in kinds:  # one corruption, first
        kinds = ["corrupt"] + [k for k in kinds if k != "corrupt"]
    faults: list[Fault] = []
    earliest = 1
    for kind in kinds:
        phase = rng.choice(KIND_PHASES[kind])
        free = [i for i in others if not any(f.target == i and f.kind == "corrupt"
                                             for f in faults)]
        if kind != "etcd-pause" and not free:
            continue
        target = -1 if kind == "etcd-pause" else rng.choice(free)
        if phase == "first-interval" and earliest >= FINGERPRINT_EVERY:
            phase = KIND_PHASES[kind][0]  # the first interval is over
        fault = _place(rng, kind, phase, target, earliest)
        faults.append(fault)
        if kind == "corrupt":
            earliest = detection_step(fault.step) + 5
    return Schedule(seed=seed, num_replicas=n, protected=protected, faults=tuple(faults))


def detection_step(step: int, every: int = FINGERPRINT_EVERY) -> int:
    """The comparison that sees a corruption of ``step`` (it strikes before that step's)."""
    return -(-step // every) * every


def _place(rng: random.Random, kind: str, phase: str, target: int, earliest: int) -> Fault:
    last = NUM_STEPS - FINGERPRINT_EVERY - 1  # the last comparison still comes after
    if kind == "corrupt":  # found and repaired with room for the other faults after it
        last = 2 * FINGERPRINT_EVERY - 1
    digests = [s for s in range(FINGERPRINT_EVERY, last + 1, FINGERPRINT_EVERY) if s >= earliest]
    if phase == "digest" and not digests:
        phase = "between-steps"
    if phase == "first-interval":
        step = rng.randint(max(2, earliest), FINGERPRINT_EVERY - 1)
    elif phase == "digest":
        step = rng.choice(digests)
    else:
        step = rng.randint(max(FINGERPRINT_EVERY + 1, earliest), last)
    if kind == "corrupt" and step % FINGERPRINT_EVERY == 0:
        step += 1  # strictly inside an interval
    point = {("kill", "between-steps"): "step", ("kill", "first-interval"): "step",
             ("kill", "digest"): "step",
             ("kill", "state-transfer"): rng.choice(("donate", "sync")),
             ("allreduce-kill", "all-reduce"): rng.choice(("allreduce", "fail-allreduce")),
             ("allreduce-kill", "first-interval"): "allreduce",
             ("allreduce-kill", "join-step"): "fail-join-step",
             ("corrupt", "between-steps"): "corrupt", ("corrupt", "first-interval"): "corrupt",
             ("corrupt", "state-transfer"): "corrupt-donate"}.get((kind, phase), "")
    low, high = DURATION_S.get(kind, (0.0, 0.0))
    return Fault(kind=kind, phase=phase, step=step, target=target, point=point,
                 duration_s=round(rng.uniform(low, high), 1) if high else 0.0)


@dataclass(slots=True)
class Outcome:
    """What a schedule's run left: the input of the checker."""

    results: dict[str, dict]
    """Each replica's result JSON, by replica id."""
    events: list[dict]
    """Divergence and halt events."""
    failures: list[dict]
    """The job's failure records (``replica``, ``reason``)."""
    corrupted: set[str]
    """Replicas whose corruption struck."""
    loaded: dict[str, list[int]]
    """The steps at which each replica loaded another's whole state."""
    wall_s: float
    timed_out: bool = False
    error: str = ""
    fired: list[dict] = field(default_factory=list)


def violations(schedule: Schedule, outcome: Outcome) -> list[str]:
    """What went wrong in a schedule's run (pure); empty when everything held."""
    found = []
    protected = f"r{schedule.protected}"
    if outcome.timed_out or outcome.wall_s > schedule.bound_s:
        found.append(f"bound: the run took {outcome.wall_s:.0f} s, over {schedule.bound_s:.0f} s")
    if outcome.error:
        found.append(f"error: {outcome.error}")
    finished = {rid: r for rid, r in outcome.results.items()}
    if len({(r["state_hash"], r["step"]) for r in finished.values()}) > 1:
        found.append("identical: the finished replicas' states differ: " + ", ".join(
            f"{rid} step {r['step']} {r['state_hash'][:12]}" for rid, r in sorted(finished.items())))
    if any(r["step"] != schedule.num_steps for r in finished.values()):
        found.append("identical: a replica finished short of the last step")
    if protected not in finished:
        found.append(f"protected: {protected} wrote no result")
    if reported := [e for e in outcome.events if e.get("replica") == protected]:
        found.append(f"protected: {protected} was reported: {_brief(reported)}")
    if protected in finished and finished[protected].get("divergences"):
        found.append(f"protected: {protected} reported itself diverged")
    if any(f["replica"] == protected for f in outcome.failures):
        found.append(f"protected: {protected} was restarted: "
                     f"{[f.get('reason') for f in outcome.failures if f['replica'] == protected]}")
    if overwritten := [s for s in outcome.loaded.get(protected, []) if s > 0]:
        found.append(f"protected: {protected} loaded another replica's state at steps "
                     f"{overwritten}")
    reported_ids = {e["replica"] for e in outcome.events if e.get("kind") == "divergence"}
    if missed := sorted(outcome.corrupted - reported_ids):
        found.append(f"corrupted: {', '.join(missed)} corrupted and never reported")
    if halts := [e for e in outcome.events if e.get("kind") == "halt"]:
        found.append(f"halt: {_brief(halts)}")
    return found


def _brief(events: list[dict]) -> str:
    return "; ".join(f"{e.get('kind')} {e.get('replica')} at step {e.get('step')}"
                     + (f" ({e['reason'][:80]})" if e.get("reason") else "") for e in events)


# --- running one schedule ------------------------------------------------------------------

def run_config(schedule: Schedule, out_dir: Path, loop_args: tuple[str, ...]):
    from ftsystem.chaos.faults import FaultPoint
    from ftsystem.chaos.spec import ChaosSpec
    from ftsystem.launch.launcher import ReplicaKill, RunConfig, replica_id
    kills = [ReplicaKill(f.target, FaultPoint(f.step, f.point)) for f in schedule.faults
             if f.point]
    chaos = [ChaosSpec(actions=(f.kind,), replicas=() if f.target < 0 else
                       (replica_id(f.target),), duration_s=f.duration_s, after_step=f.step,
                       seed=schedule.seed) for f in schedule.faults if f.kind in CHAOS_KINDS]
    return RunConfig(num_replicas=schedule.num_replicas, num_steps=schedule.num_steps,
                     min_replicas=schedule.min_replicas, job=f"campaign{schedule.seed}",
                     kills=kills, chaos=chaos or None, out_dir=out_dir, show_progress=False,
                     netns=schedule.needs_netns,
                     train_args=["--sleep-per-step", str(SLEEP_PER_STEP_S),
                                 "--linger", str(LINGER_S), *loop_args])


def run_schedule(schedule: Schedule, out_dir: Path, loop_args: tuple[str, ...]) -> Outcome:
    """Run ``schedule`` in a process of its own (``ftsystem run``'s way: SIGTERM unwinds and
    cleans up), stopped at its bound, and read what it left."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / "schedule.json"
    spec.write_text(json.dumps({"schedule": schedule.to_json(), "loop_args": list(loop_args)}))
    env = os.environ | {"FTSYSTEM_FINGERPRINT_EVERY": str(schedule.fingerprint_every)}
    started = time.monotonic()
    with open(out_dir / "campaign.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", __name__, str(spec), str(out_dir)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        timed_out = False
        try:
            proc.wait(schedule.bound_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall = time.monotonic() - started
    return read_outcome(out_dir, wall_s=wall, timed_out=timed_out,
                        error="" if proc.returncode == 0 or timed_out else
                        f"the run exited with {proc.returncode}; see {out_dir}/campaign.log")


def read_outcome(out_dir: Path, *, wall_s: float, timed_out: bool, error: str) -> Outcome:
    left = json.loads(p.read_text()) if (p := out_dir / "left.json").exists() else {}
    results = {p.stem: json.loads(p.read_text()) for p in (out_dir / "results").glob("*.json")}
    corrupted, loaded = set(), collections.defaultdict(list)
    for path in out_dir.glob("agent-*.log"):
        rid = path.stem.removeprefix("agent-").split("-")[0]
        for line in path.read_text(errors="replace").splitlines():
            if CORRUPTED_LOG in line and f"replica {rid}:" in line:
                corrupted.add(rid)
            if f"replica {rid} {LOADED_LOG}" in line:
                loaded[rid].append(int(line.split(LOADED_LOG)[1].split()[0]))
    return Outcome(results=results, events=left.get("events", []),
                   failures=left.get("failures", []), corrupted=corrupted, loaded=dict(loaded),
                   wall_s=wall_s, timed_out=timed_out, error=error or left.get("error", ""),
                   fired=left.get("fired", []))


def _run_in_this_process(spec_path: Path, out_dir: Path) -> None:
    """The schedule's process: the job, then its events read back from its etcd's data."""
    from ftsystem.launch.launcher import run_job
    spec = json.loads(spec_path.read_text())
    schedule = Schedule.from_json(spec["schedule"])
    cfg = run_config(schedule, out_dir, tuple(spec["loop_args"]))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    left: dict = {}
    try:
        summary = run_job(cfg)
        left |= {"failures": [{"replica": f["replica"], "reason": f.get("reason"),
                               "step": f.get("step")} for f in summary["failures"]],
                 "fired": [{"action": o.get("action"), "replica": o.get("replica"),
                            "state": o.get("state"), "outcome": o.get("outcome")}
                           for o in summary["chaos"]]}
    except Exception as e:  # recorded as the schedule's violation, with its seed
        left["error"] = f"{type(e).__name__}: {e}"
    finally:
        left["events"] = asyncio.run(_events(out_dir / "etcd" / "m0", cfg.job))
        (out_dir / "left.json").write_text(json.dumps(left))


async def _events(data_dir: Path, job: str) -> list[dict]:
    """Divergence and halt events, from the stopped embedded etcd's data (started again)."""
    from ftsystem.control import keys
    from ftsystem.control.etcd_server import EmbeddedEtcd
    from ftsystem.control.store import Store
    with EmbeddedEtcd(data_dir=data_dir, name="m0") as etcd:
        async with Store(etcd.url) as store:
            divergences, _ = await store.get_prefix(keys.divergences(job))
            halts, _ = await store.get_prefix(keys.halts(job))
    events = [json.loads(v) for v in divergences.values()]
    events += [{"kind": "halt", "replica": keys.last_segment(k), **json.loads(v)}
               for k, v in halts.items()]
    return sorted(events, key=lambda e: e.get("time", 0))


# --- the campaign --------------------------------------------------------------------------

def run_campaign(seeds: list[int], workdir: Path, loop_args: tuple[str, ...],
                 keep: bool = False) -> Iterator[dict]:
    """Each schedule's row, as it ends."""
    for seed in seeds:
        schedule = campaign_schedule(seed)
        out_dir = workdir / f"s{seed}"
        outcome = run_schedule(schedule, out_dir, loop_args)
        found = violations(schedule, outcome)
        row = {"seed": seed, "replicas": schedule.num_replicas,
               "protected": f"r{schedule.protected}",
               "faults": [asdict(f) for f in schedule.faults],
               "wall_s": round(outcome.wall_s, 1), "bound_s": schedule.bound_s,
               "corrupted": sorted(outcome.corrupted),
               "reported": sorted({e["replica"] for e in outcome.events
                                   if e.get("kind") == "divergence"}),
               "restarts": len(outcome.failures), "chaos_done": outcome.fired,
               "violations": found,
               "out_dir": str(out_dir) if found or keep else None}
        print(f"seed {seed}: {len(schedule.faults)} faults "
              f"{[(f.kind, f.phase, f.step) for f in schedule.faults]} -> "
              f"{'ok' if not found else found}", flush=True)
        yield row


def summarize(rows: list[dict], loop_args: tuple[str, ...]) -> dict:
    """The campaign's JSON from its schedules (pure)."""
    by_kind_phase = collections.Counter(f"{f['kind']}/{f['phase']}" for r in rows
                                        for f in r["faults"])
    return {"schedules": len(rows), "violations": sum(1 for r in rows if r["violations"]),
            "violating_seeds": [r["seed"] for r in rows if r["violations"]],
            "faults": sum(len(r["faults"]) for r in rows),
            "faults_by_kind_phase": dict(sorted(by_kind_phase.items())),
            "loop_args": list(loop_args), "num_steps": NUM_STEPS,
            "fingerprint_every": FINGERPRINT_EVERY, "per_schedule": rows}


def merge(previous: dict | None, rows: list[dict]) -> list[dict]:
    """Earlier batches' schedules and this one's, a seed run again replacing its row."""
    seeds = {r["seed"] for r in rows}
    return [r for r in (previous or {}).get("per_schedule", []) if r["seed"] not in seeds] + rows


@bench_app.command("campaign")
def campaign(
        schedules: int = typer.Option(200, min=1, help="schedules to run"),
        seed: int = typer.Option(0, help="the first schedule's seed; the others follow"),
        quick: bool = typer.Option(False, help="3 schedules"),
        append: bool = typer.Option(False, help="add these schedules to --json's (batches)"),
        loop_args: str = typer.Option(" ".join(LOOP_ARGS),
                                      help="the example loop's arguments for every replica"),
        workdir: Path | None = typer.Option(None, help="keep every run here (default: a "
                                                          "temp dir; violating runs are kept)"),
        json_path: Path | None = typer.Option(None, "--json", help="write the results here"),
) -> None:
    """Seeded random fault schedules; every finished replica must be bitwise identical, the
    protected replica untouched, every corruption reported."""
    count = 3 if quick else schedules
    args = tuple(loop_args.split())
    base = workdir or Path(tempfile.mkdtemp(prefix="ftsystem-campaign-"))
    previous = json.loads(json_path.read_text()) if append and json_path and \
        json_path.exists() else None
    rows: list[dict] = []
    for row in run_campaign(list(range(seed, seed + count)), base, args,
                            keep=workdir is not None):
        rows.append(row)  # written after every schedule: a campaign stopped early keeps its rows
        result = summarize(merge(previous, rows), args) | {"machine": report.machine()}
        report.write_json(json_path, result)
    report.print_table(f"campaign: {result['schedules']} schedules",
                       ["faults", "violations", "violating seeds"],
                       [(result["faults"], result["violations"],
                         ", ".join(map(str, result["violating_seeds"])) or "-")])
    report.print_table("faults by kind and phase", ["kind/phase", "count"],
                       list(result["faults_by_kind_phase"].items()))
    if any(r["violations"] for r in rows):
        raise typer.Exit(1)


if __name__ == "__main__":
    _run_in_this_process(Path(sys.argv[1]), Path(sys.argv[2]))
