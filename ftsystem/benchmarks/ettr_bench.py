"""``ftsystem bench ettr``: effective training time under one chaos schedule, two designs.

One seeded chaos spec (Poisson arrivals, each firing a kill, a hang or a partition of one
replica) drives, in the same invocation, ftsystem (``run_job``, replicas in network namespaces)
and the synchronous restart-all baseline (``baselines.restart_all``: torchrun elastic, DDP,
checkpoint reload), both training one run spec (``harness.RunSpec``: the same model, data,
batch, learning rate, optimizer, number of replicas, emulated step time, duration and timeout;
each run records it). Each system expands the chaos spec from its own launch, so both see the
same faults at the same offsets on the same replicas.

Both ETTRs come from ``ftsystem.measure.ettr`` over the same window: from the system's first commit to
its launch plus ``--duration`` (the schedule's horizon); commits after it, free of faults, are
not counted. The baseline's commits count once, in the lineage that survived (steps rolled back
by a restart are lost work). Both systems' stalls come from ``ftsystem.measure.stall``, from each
fault's instant (the execution of its order) to the survivors' next commit, less a normal step.

The headline and the target's figure is ``ettr_work``, work-based: samples committed over
what every replica would have committed at the normal step (a replica down or catching up
costs work while the others keep time). Beside it, time-based: ``ettr_time`` holds each gap of
the job's timeline to the run's median step, so it counts the step time's own spread as loss
too (a fault-free run scores below 1). Each system's chaos run follows, in the same round, a
run of it free of faults (``--fault-free`` seconds): ``ettr_net`` loses only the gaps longer
than that run's 99th-percentile step; ``ettr_paced`` is the steps committed at its mean pace,
over the window.

Both run at the same one timeout (``--timeout``, ftsystem's default 30 s), with the same
meaning: ftsystem's watchdog and lease detect a hang or a partition in a third of it, and the
baseline's only detector, its Gloo collective timeout, gets that same third
(``RestartAllConfig.collective_timeout_s``). ``--rounds N`` runs both N times, the order
alternated per round; the JSON gives each figure's median and min/max over the rounds.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer

from ftsystem.benchmarks import harness
from ftsystem.benchmarks.harness import RunSpec, ftsystem_timelines
from ftsystem.measure import ettr, report, stall
from ftsystem.chaos.spec import ChaosSpec, expand, parse_duration, spec_from_mapping
from ftsystem.cli import bench_app
from ftsystem.launch.launcher import replica_id
from ftsystem.measure.stall import Timeline, normal_step_time

QUICK_DURATION_S = 60.0
BOTH_DO = ("kill", "hang", "partition", "host-kill")
"""The actions both systems carry out (the baseline has no slow, no controller or etcd)."""
TARGET = "ftsystem ettr_work >= 0.95"
"""Work-based, the headline: what the job trained against what all its replicas would have
trained at their normal step. The FT-HSDP paper's 44% and 80% are work-based figures
(``docs/ettr_simulation.md``: its time-based FT-HSDP figure is 4-5 points higher)."""
ETTR_FIGURES = ("ettr_work", "ettr_time", "ettr_net", "ettr_paced")
QUICK_FAULT_FREE_S = 15.0
SYSTEMS = ("restart_all", "ftsystem")
DEFAULT_TIMEOUT_S = 30.0  # ftsystem's default (RunConfig.timeout_s)
# ftsystem's window starting this much later than the baseline's means lost history.
WINDOW_WARNING_S = 30.0
NOTES = [
    "each window runs from the system's first commit to its launch plus duration_s",
    "restart_all counts a step once, in the lineage that survived its restarts",
    ("with ftsystem history 'last generation only' (no results/<replica>.commits progress "
     "files), a replica's commits before its last restart are missing: ettr_work is a lower "
     "bound, and the window starts only where every replica's last generation is under way"),
    ("ettr_time counts every gap above the run's median step as lost, the step time's own "
     "spread too (fault_free.ettr_time: what a run with no fault scores). ettr_net loses only "
     "the gaps longer than the 99th-percentile step of the same system's run free of faults in "
     "the same round, each by its excess over the median step. ettr_paced holds the steps "
     "committed to that run's mean pace; with replicas sharing cores, a replica down speeds "
     "the others up, and ettr_paced credits that to the faults (it can pass 1)"),
]


def chaos_spec(*, actions: list[str], duration_s: float, mtbf_s: float, fault_s: float,
               seed: int) -> ChaosSpec:
    """The one spec both systems run: one replica per firing, the action picked per firing."""
    return spec_from_mapping({"action": actions, "schedule": {"mtbf": f"{mtbf_s}s"},
                              "duration": f"{fault_s}s", "horizon": f"{duration_s}s",
                              "seed": seed})


def schedule(spec: ChaosSpec, num_replicas: int) -> list[dict]:
    """The expanded schedule, in seconds after launch (what each system is given)."""
    replicas = [replica_id(i) for i in range(num_replicas)]
    return [{"at_s": round(o.at, 3), "action": o.action, "replica": o.replica,
             "duration_s": o.duration_s} for o in expand(spec, replicas, now=0.0, name="ettr")]


def clip(timelines: Mapping[str, Timeline], end: float) -> dict[str, list]:
    """Each timeline's commits up to ``end`` (pure)."""
    return {name: [(s, t) for s, t in tl if t <= end] for name, tl in timelines.items()}


def window_ettr(timelines: Mapping[str, Timeline], *, num_replicas: int,
                end: float) -> dict:
    """``ettr.ettr`` over the window from the first commit to ``end`` (pure).

    ``ettr.ettr`` spans first to last commit; a job that stopped committing before ``end``
    (stuck in a restart when the window closed) would be scored on its productive part
    alone. The time from its last commit to ``end``, beyond one normal step, is lost too.
    """
    clipped = clip(timelines, end)
    whole = ettr.ettr(clipped, num_replicas)
    if whole["ettr_time"] is None:
        return whole | {"tail_s": 0.0, "steps_advanced": 0}
    job = ettr.job_timeline(clipped)
    tail = max(0.0, end - job[-1][1])
    interval = whole["interval_s"] + tail
    step_s = normal_step_time(job)
    lost = (1 - whole["ettr_time"]) * whole["interval_s"] + max(0.0, tail - step_s)
    return {"ettr_time": 1 - lost / interval,
            "ettr_work": whole["ettr_work"] * whole["interval_s"] / interval,
            "interval_s": interval, "tail_s": tail, "steps_advanced": job[-1][0] - job[0][0],
            # What the figures free of the step time's spread need (``with_fault_free``); the
            # gaps stay out of the JSON.
            "_gaps_s": [*stall.gaps(job), tail], "_step_s": step_s}


def measure(timelines: Mapping[str, Timeline], *, num_replicas: int, launched: float,
            end: float, injected: list[dict]) -> dict:
    """ETTR over the window ending at ``end`` and the faults carried out in it (pure)."""
    clipped = clip(timelines, end)
    start = _first_commit(clipped)
    done = [o for o in injected
            if o.get("state") == "done" and start <= o["executed_at"] <= end]
    return {**window_ettr(timelines, num_replicas=num_replicas, end=end),
            "window_start_s": start - launched, "window_end": end,
            "failures": len(done),
            "failures_by_action": {a: sum(o["action"] == a for o in done)
                                   for a in sorted({o["action"] for o in done})},
            "steps_in_window": max((s for tl in clipped.values() for s, _ in tl), default=0),
            # Of a run free of faults, what its chaos run is held to (``with_fault_free``);
            # meaningless for a chaos run, so kept out of its JSON.
            "_mean_step_s": ettr.fault_free_pace(clipped),
            "_spread_bound_s": ettr.spread_bound(clipped)}


def run_baseline(spec: RunSpec, *, chaos: ChaosSpec | None, checkpoint_every: int,
                 netns: bool, workdir: Path) -> dict:
    """The restart-all baseline for the spec's duration under ``chaos``; measured over its
    window."""
    from ftsystem.baselines.restart_all import run_restart_all
    cfg = harness.restart_all_config(spec, out_dir=workdir, checkpoint_every=checkpoint_every,
                                     deadline_s=spec.duration_s + 600, netns=netns)
    summary = run_restart_all(cfg, chaos)
    timelines = harness.read_timelines("restart_all", workdir)
    measured = measure(timelines, num_replicas=spec.num_replicas, launched=summary["launched"],
                       end=summary["launched"] + spec.duration_s, injected=summary["failures"])
    stalls = stall_summary(summary["faults"], start=summary["launched"],
                           end=measured["window_end"])
    return measured | stalls | {
        "outcome": summary["outcome"], "restarts": summary["restarts"],
        "recomputed_steps": summary["recomputed_steps"], "step_s": _step_time(timelines),
        "checkpoint_every": checkpoint_every, "collective_timeout_s": cfg.collective_timeout_s(),
        "eval_loss": summary["eval_loss"], "injected": summary["failures"]}


def stall_summary(faults: list[dict], *, start: float, end: float) -> dict:
    """The stalls of the faults between ``start`` and ``end`` (pure): their distribution, and
    per action how many, their median and their total (which faults cost the most)."""
    inside = [f for f in faults if start <= f["time"] <= end and f.get("stall_s") is not None]
    return {"stall_s": stall.distribution([f["stall_s"] for f in inside]),
            "stall_total_s": sum(f["stall_s"] for f in inside),
            "stall_by_action": stalls_by_action(inside),
            "faults": [{k: f.get(k) for k in ("time", "action", "replica", *stall.STALL_FIELDS)}
                       for f in inside]}


def stalls_by_action(faults: list[dict]) -> dict[str, dict]:
    """Per action, how many ``faults`` (each with its ``stall_s``), their stalls' spread and
    total (pure)."""
    by_action = {}
    for action in sorted({f["action"] for f in faults}):
        values = [f["stall_s"] for f in faults if f["action"] == action]
        by_action[action] = {"n": len(values), **report.spread(values), "total_s": sum(values)}
    return by_action


def run_ftsystem(spec: RunSpec, *, chaos: ChaosSpec | None, first_offset_s: float,
                 step_s: float, netns: bool, workdir: Path) -> dict:
    """ftsystem under ``chaos``, measured over the window of the spec's duration: it trains
    the steps that fit in it at ``step_s`` a step, with margin (``harness.ftsystem_steps``)."""
    from ftsystem.launch.launcher import run_job
    cfg = harness.ftsystem_config(spec, step_s=step_s, chaos=chaos, netns=netns,
                                  out_dir=workdir, job="ettr")
    summary = run_job(cfg)
    timelines, history = ftsystem_timelines(workdir / "results")
    orders = summary.get("chaos", [])
    # The chaos spec was expanded when the agents were up: its first order came that long after.
    launched = min((o["at"] for o in orders), default=None)
    launched = launched - first_offset_s if launched else _first_commit(timelines)
    end = launched + spec.duration_s
    if summary["steps"] >= cfg.num_steps:  # done early: what follows is not a stall
        end = min(end, max(t for tl in timelines.values() for _, t in tl))
    measured = measure(timelines, num_replicas=spec.num_replicas, launched=launched, end=end,
                       injected=orders)
    return measured | stall_summary(summary["faults"], start=launched, end=end) | {
        "history": history, "replica_failures": len(summary["failures"]),
        "step_s": _step_time(timelines), "num_steps": cfg.num_steps,
        "bitwise_identical": summary["bitwise_identical"],
        "eval_loss": summary["eval_loss"], "injected": orders}


def _first_commit(timelines: Mapping[str, Timeline]) -> float:
    return min((t for tl in timelines.values() for _, t in tl[:1]), default=0.0)


def _step_time(timelines: Mapping[str, Timeline]) -> float | None:
    job = ettr.job_timeline(timelines)
    return normal_step_time(job) if len(job) > 1 else None


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(2)


def _checked_spec(actions: str, duration_s: float, mtbf: str, fault: str, seed: int,
                  timeout_s: float) -> ChaosSpec:
    from ftsystem.chaos.spec import ChaosSpecError
    from ftsystem.control.timeouts import TimeoutConfigError, Timeouts
    chosen = [a.strip() for a in actions.split(",") if a.strip()]
    if unsupported := sorted(set(chosen) - set(BOTH_DO)):
        raise typer.BadParameter(f"{', '.join(unsupported)}: the bench mixes only what both "
                                 f"systems do ({', '.join(BOTH_DO)})", param_hint="--actions")
    try:
        Timeouts(timeout_s)
        return chaos_spec(actions=chosen,
                          duration_s=duration_s, mtbf_s=parse_duration(mtbf, "--mtbf"),
                          fault_s=parse_duration(fault, "--fault-duration"), seed=seed)
    except (ChaosSpecError, TimeoutConfigError) as e:
        raise typer.BadParameter(str(e)) from e


@bench_app.command("ettr")
def ettr_bench(
        json_path: Annotated[Path | None, typer.Option("--json", help="write results here")
                             ] = None,
        duration: Annotated[float, typer.Option(min=10, help="seconds each system trains")
                            ] = 300.0,
        mtbf: Annotated[str, typer.Option(help="mean time between failures (Poisson)")] = "30s",
        seed: Annotated[int, typer.Option(help="seeds the schedule and its choices")] = 0,
        replicas: Annotated[int, typer.Option(min=2, help="replicas (baseline: torchrun nodes)")
                            ] = 4,
        quick: Annotated[bool, typer.Option(help=f"{QUICK_DURATION_S:.0f} s per system, "
                                                 "one round")] = False,
        rounds: Annotated[int, typer.Option(min=1, help="runs of each system, the order "
                                                        "alternated per round")] = 1,
        actions: Annotated[str, typer.Option(help="actions to mix, comma-separated")
                           ] = "kill,hang,partition,host-kill",
        fault_duration: Annotated[str, typer.Option(help="how long a hang or partition lasts")
                                  ] = "10s",
        timeout: Annotated[float, typer.Option(help="the one timeout of both systems (s): "
                                               "ftsystem's --timeout; the baseline's Gloo "
                                               "collective timeout gets a third of it, as "
                                               "ftsystem's detectors do")
                           ] = DEFAULT_TIMEOUT_S,
        checkpoint_every: Annotated[int, typer.Option(min=1, help="baseline: steps per "
                                                      "checkpoint")] = 10,
        sleep_per_step: Annotated[float, typer.Option(help="emulated compute per step (s)")
                                  ] = 0.1,
        fault_free: Annotated[float, typer.Option(min=0, help="seconds each system trains "
                                                  "free of faults before its chaos run, each "
                                                  "round: the spread and pace that ettr_net and "
                                                  "ettr_paced hold it to (0: none)")
                              ] = 60.0,
        workdir: Annotated[Path | None, typer.Option(help="keep runs and logs here (default: "
                                                     "a temporary directory)")] = None,
) -> None:
    """ETTR under one seeded chaos schedule: ftsystem vs synchronous restart-all (torchrun)."""
    duration = QUICK_DURATION_S if quick else duration
    rounds = 1 if quick else rounds
    fault_free = min(fault_free, QUICK_FAULT_FREE_S) if quick else fault_free
    # A SIGTERM unwinds like Ctrl-C, so that namespaces and processes are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    chaos = _checked_spec(actions, duration, mtbf, fault_duration, seed, timeout)
    spec = RunSpec(num_replicas=replicas, duration_s=duration, sleep_per_step=sleep_per_step,
                   timeout_s=timeout)
    # ftsystem's host actions hit a node's emulated host: every process in its namespace.
    netns = bool({"partition", "host-kill"} & set(chaos.actions))
    if netns and (reason := _netns_problem()):
        raise _fail(f"partition and host-kill need network namespaces, and here {reason}: run "
                    "as root, or leave them out of --actions")
    plan = schedule(chaos, replicas)
    from ftsystem.control.etcd_server import EtcdNotInstalledError, EtcdStartError
    from ftsystem.launch.netns import NetnsError
    from ftsystem.control.store import StoreError
    try:
        runs, log = _run_rounds(spec, chaos, plan, rounds=rounds,
                                checkpoint_every=checkpoint_every, netns=netns,
                                fault_free_s=fault_free, workdir=workdir)
    except (NetnsError, StoreError, EtcdNotInstalledError, EtcdStartError) as e:
        raise _fail(str(e))
    data = {**summarized({}, runs), "round_log": log, "spec": dataclasses.asdict(spec),
            "warnings": [w for o, t in zip(runs["ftsystem"], runs["restart_all"])
                         if (w := window_warning(o, t))],
            "target": TARGET, "notes": NOTES, "machine": report.machine(), "schedule": plan,
            "settings": {"duration_s": duration, "mtbf": mtbf, "seed": seed,
                         "replicas": replicas, "rounds": rounds, "actions": list(chaos.actions),
                         "fault_duration": fault_duration, "timeout_s": timeout,
                         "checkpoint_every": checkpoint_every,
                         "sleep_per_step": sleep_per_step, "fault_free_s": fault_free,
                         "netns": netns}}
    _print(data)
    report.write_json(json_path, data)


def summarized(data: dict, runs: dict[str, list[dict]]) -> dict:
    """``data`` with each system's figures and the ratios taken again from ``runs`` (pure)."""
    return data | {name: aggregate(runs[name]) for name in SYSTEMS} | {
        "ratio": round_ratios(runs["ftsystem"], runs["restart_all"])}


def kept_timelines(name: str, where: Path) -> dict[str, Timeline]:
    """The commits a system's run left in its directory (the baseline's surviving lineage)."""
    return harness.read_timelines(name, where)


def remeasured(run: dict, where: Path, name: str) -> dict:
    """One round's figures that need its fault-free run, taken again from the commit files
    both runs left under ``where`` (a bench's ``--workdir``)."""
    if not where.is_dir():
        raise FileNotFoundError(f"no {where}")
    chaos = window_ettr(kept_timelines(name, where), num_replicas=1, end=run["window_end"])
    calm = kept_timelines(name, where / "fault_free")
    fault_free = (run.get("fault_free") or {}) | {
        "_mean_step_s": ettr.fault_free_pace(calm), "_spread_bound_s": ettr.spread_bound(calm)}
    return run | with_fault_free(run | chaos, fault_free if calm else None)


@bench_app.command("ettr-remeasure")
def ettr_remeasure(
        json_path: Annotated[Path, typer.Argument(help="a bench ettr JSON, rewritten")],
        workdir: Annotated[Path, typer.Argument(help="the --workdir it ran with")],
) -> None:
    """Take a kept bench ettr run's figures again from its commit files (after a change to how
    they are measured), without running it again."""
    try:
        data = json.loads(json_path.read_text())
        runs = {name: [remeasured(run, workdir / f"round{run['round']}" / name, name)
                       for run in data[name]["rounds"]] for name in SYSTEMS}
    except (OSError, KeyError, ValueError) as e:
        raise _fail(f"{json_path} and {workdir} are not a bench ettr JSON and its --workdir "
                    f"({e})")
    data = summarized(data, runs)
    _print(data)
    report.write_json(json_path, data)


def _run_rounds(spec: RunSpec, chaos: ChaosSpec, plan: list[dict], *, rounds: int,
                checkpoint_every: int, netns: bool, fault_free_s: float,
                workdir: Path | None) -> tuple[dict[str, list[dict]], list[dict]]:
    """Both systems ``rounds`` times, the order alternated per round, and the round log. Each
    system's chaos run follows a run of it free of faults (``fault_free_s``, 0: none): the step
    time's spread and pace that its ``ettr_net`` and ``ettr_paced`` are held to. ftsystem
    trains a step count: from the baseline's pace when one is known (the same spec)."""
    pace: list[float] = []

    def run_one(name: str, run_spec: RunSpec, faults: ChaosSpec | None, where: Path) -> dict:
        if name == "restart_all":
            out = run_baseline(run_spec, chaos=faults, checkpoint_every=checkpoint_every,
                               netns=netns, workdir=where)
            pace.extend([out["step_s"]] if out["step_s"] else [])
        else:
            out = run_ftsystem(run_spec, chaos=faults, step_s=pace[-1] if pace else 0.0,
                               first_offset_s=plan[0]["at_s"] if plan and faults else 0.0,
                               netns=netns, workdir=where)
        return out | harness.ran_with(name, run_spec)

    def run(name: str, r: int, root: Path) -> dict:
        where = root / f"round{r}" / name
        calm = None
        if fault_free_s > 0:
            typer.echo(f"round {r + 1}/{rounds}: {name}, {fault_free_s:.0f} s free of faults "
                       "...", err=True)
            calm = run_one(name, dataclasses.replace(spec, duration_s=fault_free_s), None,
                           where / "fault_free")
        typer.echo(f"round {r + 1}/{rounds}: {name}, {spec.duration_s:.0f} s under "
                   f"{len(plan)} faults ...", err=True)
        out = run_one(name, spec, chaos, where) | {"round": r}
        out |= with_fault_free(out, calm)
        out = {k: v for k, v in out.items() if not k.startswith("_")}
        # Each round's figures as soon as it ends: a long run interrupted keeps what it measured.
        report.write_json(where / "round.json", out)
        return out

    with tempfile.TemporaryDirectory(prefix="ftsystem-bench-ettr-") as tmp:
        root = workdir or Path(tmp)
        return report.in_rounds(SYSTEMS, rounds, lambda name, r: run(name, r, root))


def with_fault_free(chaos_run: dict, fault_free: dict | None) -> dict:
    """The chaos run's ETTR free of the step time's spread, from its system's run free of
    faults (pure): ``ettr_net`` past that run's slowest steps, ``ettr_paced`` at its pace."""
    if fault_free is None:
        return {"ettr_net": None, "ettr_paced": None, "fault_free": None}
    summary = {k: fault_free.get(k) for k in ("step_s", "ettr_time", "interval_s",
                                             "steps_advanced", "window_start_s", "spec")} | {
        "mean_step_s": fault_free.get("_mean_step_s"),
        "spread_bound_s": fault_free.get("_spread_bound_s")}
    return {"ettr_net": ettr.net_ettr(chaos_run.get("_gaps_s", []), chaos_run["interval_s"],
                                      chaos_run.get("_step_s", 0.0), summary["spread_bound_s"]),
            "ettr_paced": ettr.paced_ettr(chaos_run["steps_advanced"], chaos_run["interval_s"],
                                          summary["mean_step_s"]),
            "fault_free": summary}


FIGURES = {"ettr_net": "ettr_net", "ettr_time": "ettr_time", "ettr_paced": "ettr_paced",
           "ettr_work": "ettr_work",
           "median_stall_s": "stall_s.median", "stall_total_s": "stall_total_s",
           "failures": "failures", "step_s": "step_s",
           "fault_free_step_s": "fault_free.mean_step_s",
           "fault_free_spread_bound_s": "fault_free.spread_bound_s",
           "fault_free_ettr_time": "fault_free.ettr_time"}
"""The figures each round gives (a dotted path into its result), reported over the rounds."""


def aggregate(runs: list[dict]) -> dict:
    """One system over its rounds (pure): each figure's median and min/max over the rounds,
    the stalls of every fault of every round, per action too, and every round in full."""
    faults = [f for run in runs for f in run["faults"]]
    return {**report.over_rounds(runs, FIGURES),
            "stall_per_fault_s": stall.distribution([f["stall_s"] for f in faults]),
            "stall_by_action": stalls_by_action(faults)}


def round_ratios(ours: list[dict], theirs: list[dict]) -> dict:
    """ftsystem's ETTR over the baseline's, per round (paired within a round) and their spread."""
    return {k: report.paired_ratio(ours, theirs, k) for k in ETTR_FIGURES}


def _netns_problem() -> str | None:
    from ftsystem.launch.netns import netns_supported
    return netns_supported()


def _print(data: dict) -> None:
    def fmt(figure: dict) -> str:
        if figure["median"] is None:
            return "-"
        return f"{figure['median']:.3g} [{figure['min']:.3g}, {figure['max']:.3g}]"

    def row(name: str, r: dict) -> tuple:
        costs = ", ".join(f"{a} {c['n']}: {c['total_s']:.0f} s"
                          for a, c in r["stall_by_action"].items())
        return (name, fmt(r["ettr_work"]), fmt(r["ettr_time"]), fmt(r["ettr_net"]),
                fmt(r["ettr_paced"]),
                fmt(r["median_stall_s"]), costs or "-", fmt(r["step_s"]),
                fmt(r["fault_free_step_s"]))
    settings, ratio = data["settings"], data["ratio"]
    report.print_table(
        f"ETTR over {settings['duration_s']:.0f} s, mtbf {settings['mtbf']}, seed "
        f"{settings['seed']}, timeout {settings['timeout_s']:g} s, {settings['rounds']} "
        "round(s): median [min, max]",
        ["system", "ETTR work", "ETTR time", "ETTR net", "ETTR paced", "median stall (s)",
         "faults: total stall", "median step (s)", "fault-free pace (s)"],
        [row("ftsystem", data["ftsystem"]), row("restart-all", data["restart_all"]),
         ("ratio", fmt(ratio["ettr_work"]), fmt(ratio["ettr_time"]), fmt(ratio["ettr_net"]),
          fmt(ratio["ettr_paced"]), "", "", "", "")])
    for warning in data["warnings"]:
        typer.secho(warning, err=True, fg=typer.colors.YELLOW)
    typer.echo(data["machine"])


def window_warning(ours: dict, theirs: dict) -> str | None:
    """Why ftsystem's figures may cover less than the window (None: they do not)."""
    late = ours["window_start_s"] - theirs["window_start_s"]
    if ours["history"] == "all generations" or late < WINDOW_WARNING_S:
        return None
    return (f"warning: ftsystem's window starts {late:.0f} s later than the baseline's: every "
            "replica was restarted, and their results keep only the commits of their last "
            "generation, so its figures cover only the end of the run")
