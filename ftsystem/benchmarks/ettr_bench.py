"""``ftsystem bench ettr``: effective training time under one chaos schedule, two designs.

One seeded spec (Poisson arrivals, each firing a kill, a hang or a partition of one replica)
drives, in the same invocation, ftsystem (``run_job``, replicas in network namespaces) and the
synchronous restart-all baseline (``baselines.restart_all``: torchrun elastic, DDP, checkpoint
reload): the same model, data, batch, optimizer, number of replicas and emulated step time.
Each system expands the spec from its own launch, so both see the same faults at the same
offsets on the same replicas.

Both ETTRs come from ``ftsystem.ettr`` over the same window: from the system's first commit to
its launch plus ``--duration`` (the schedule's horizon); commits after it, free of faults, are
not counted. The baseline's commits count once, in the lineage that survived (steps rolled back
by a restart are lost work).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer

from ftsystem import ettr, report
from ftsystem.chaos import ChaosSpec, expand, parse_duration, spec_from_mapping
from ftsystem.cli import bench_app
from ftsystem.launcher import replica_id
from ftsystem.stall import Timeline, normal_step_time, read_timeline

QUICK_DURATION_S = 60.0
BOTH_DO = ("kill", "hang", "partition")
"""The actions both systems carry out (the baseline has no slow, no controller or etcd)."""
# ftsystem trains a step count, not a duration: this many times the steps that fit in the
# window at the baseline's step time (the same model and emulated compute), so that it is
# still training when the window closes, even with no fault at all.
STEP_MARGIN = 1.1
TARGET = "ftsystem ettr_time >= 0.90"
# ftsystem's window starting this much later than the baseline's means lost history.
WINDOW_WARNING_S = 30.0
NOTES = [
    "each window runs from the system's first commit to its launch plus duration_s",
    "restart_all counts a step once, in the lineage that survived its restarts",
    ("with ftsystem history 'last generation only' (no results/<replica>.commits progress "
     "files), a replica's commits before its last restart are missing: ettr_work is a lower "
     "bound, and the window starts only where every replica's last generation is under way"),
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
        return whole | {"tail_s": 0.0}
    job = ettr.job_timeline(clipped)
    tail = max(0.0, end - job[-1][1])
    interval = whole["interval_s"] + tail
    lost = (1 - whole["ettr_time"]) * whole["interval_s"] + max(0.0, tail - normal_step_time(job))
    return {"ettr_time": 1 - lost / interval,
            "ettr_work": whole["ettr_work"] * whole["interval_s"] / interval,
            "interval_s": interval, "tail_s": tail}


def measure(timelines: Mapping[str, Timeline], *, num_replicas: int, launched: float,
            end: float, injected: list[dict]) -> dict:
    """ETTR over the window ending at ``end`` and the faults carried out in it (pure)."""
    clipped = clip(timelines, end)
    start = _first_commit(clipped)
    done = [o for o in injected
            if o.get("state") == "done" and start <= o["executed_at"] <= end]
    return {**window_ettr(timelines, num_replicas=num_replicas, end=end),
            "window_start_s": start - launched,
            "failures": len(done),
            "failures_by_action": {a: sum(o["action"] == a for o in done)
                                   for a in sorted({o["action"] for o in done})},
            "steps_in_window": max((s for tl in clipped.values() for s, _ in tl), default=0)}


def ratios(ours: dict, theirs: dict) -> dict[str, float | None]:
    return {k: ours[k] / theirs[k] if ours.get(k) and theirs.get(k) else None
            for k in ("ettr_time", "ettr_work")}


def run_baseline(*, spec: ChaosSpec, num_replicas: int, duration_s: float, timeout_s: float,
                 checkpoint_every: int, netns: bool, train_args: list[str],
                 workdir: Path) -> dict:
    """The restart-all baseline for ``duration_s`` under ``spec``; measured over its window."""
    from ftsystem.baselines.restart_all import (
        RestartAllConfig,
        final_lineage,
        run_restart_all,
    )
    cfg = RestartAllConfig(out_dir=workdir, num_nodes=num_replicas, num_steps=10**9,
                           duration_s=duration_s, checkpoint_every=checkpoint_every,
                           timeout_s=timeout_s, deadline_s=duration_s + 600, netns=netns,
                           train_args=train_args)
    summary = run_restart_all(cfg, spec)
    timelines = {replica_id(i): final_lineage(read_timeline(workdir / f"{replica_id(i)}.commits"))
                 for i in range(num_replicas)}
    measured = measure(timelines, num_replicas=num_replicas, launched=summary["launched"],
                       end=summary["launched"] + duration_s, injected=summary["failures"])
    return measured | {"outcome": summary["outcome"], "restarts": summary["restarts"],
                       "recomputed_steps": summary["recomputed_steps"],
                       "step_s": _step_time(timelines), "checkpoint_every": checkpoint_every,
                       "eval_loss": summary["eval_loss"], "injected": summary["failures"]}


def run_ftsystem(*, spec: ChaosSpec, first_offset_s: float, num_replicas: int,
                 duration_s: float, timeout_s: float, num_steps: int, netns: bool,
                 train_args: list[str], workdir: Path) -> dict:
    """ftsystem under ``spec`` for ``num_steps``; measured over the window of ``duration_s``."""
    from ftsystem.launcher import RunConfig, run_job
    cfg = RunConfig(num_replicas=num_replicas, num_steps=num_steps, chaos=spec, netns=netns,
                    timeout_s=timeout_s, out_dir=workdir, train_args=train_args,
                    show_progress=False, job="ettr")
    summary = run_job(cfg)
    timelines, history = ftsystem_timelines(workdir / "results")
    orders = summary.get("chaos", [])
    # The spec was expanded when the agents were up: its first order came that long after.
    launched = min((o["at"] for o in orders), default=None)
    launched = launched - first_offset_s if launched else _first_commit(timelines)
    end = launched + duration_s
    if summary["steps"] >= num_steps:  # done early: what follows is not a stall
        end = min(end, max(t for tl in timelines.values() for _, t in tl))
    measured = measure(timelines, num_replicas=num_replicas, launched=launched, end=end,
                       injected=orders)
    return measured | {"history": history, "replica_failures": len(summary["failures"]),
                       "stall_s": summary["stall_s"], "step_s": _step_time(timelines),
                       "bitwise_identical": summary["bitwise_identical"],
                       "eval_loss": summary["eval_loss"], "injected": orders}


def ftsystem_timelines(results: Path) -> tuple[dict[str, Timeline], str]:
    """Each ftsystem replica's commits, and whether they span all its generations.

    A replica's result JSON holds the commits of its last generation only: once every replica
    has been restarted, the job timeline built from them starts at the latest first restart,
    and the window shrinks to what follows. A progress file ``<replica>.commits`` (``step
    unix_time`` per commit, appended over all generations, as the baseline's worker writes
    one), when the replica program writes one, has the whole history and is used instead.
    """
    timelines, complete = {}, True
    for path in sorted(results.glob("*.json")):
        result = json.loads(path.read_text())
        progress = path.with_suffix(".commits")
        complete &= progress.exists()
        timelines[result["replica"]] = (read_timeline(progress) if progress.exists()
                                        else result["commits"])
    return timelines, "all generations" if complete else "last generation only"


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
    from ftsystem.chaos import ChaosSpecError
    from ftsystem.timeouts import TimeoutConfigError, Timeouts
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
        quick: Annotated[bool, typer.Option(help=f"{QUICK_DURATION_S:.0f} s per system")
                         ] = False,
        actions: Annotated[str, typer.Option(help="actions to mix, comma-separated")
                           ] = "kill,hang,partition",
        fault_duration: Annotated[str, typer.Option(help="how long a hang or partition lasts")
                                  ] = "10s",
        timeout: Annotated[float, typer.Option(help="ftsystem's one timeout, and the "
                                               "baseline's Gloo collective timeout (s)")
                           ] = 10.0,
        checkpoint_every: Annotated[int, typer.Option(min=1, help="baseline: steps per "
                                                      "checkpoint")] = 10,
        sleep_per_step: Annotated[float, typer.Option(help="emulated compute per step (s)")
                                  ] = 0.1,
        workdir: Annotated[Path | None, typer.Option(help="keep runs and logs here (default: "
                                                     "a temporary directory)")] = None,
) -> None:
    """ETTR under one seeded chaos schedule: ftsystem vs synchronous restart-all (torchrun)."""
    duration = QUICK_DURATION_S if quick else duration
    # A SIGTERM unwinds like Ctrl-C, so that namespaces and processes are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    spec = _checked_spec(actions, duration, mtbf, fault_duration, seed, timeout)
    netns = "partition" in spec.actions
    if netns and (reason := _netns_problem()):
        raise _fail(f"partition needs network namespaces, and here {reason}: run as root, "
                    "or leave partition out of --actions")
    plan = schedule(spec, replicas)
    from ftsystem.etcd_server import EtcdNotInstalledError, EtcdStartError
    from ftsystem.netns import NetnsError
    from ftsystem.store import StoreError
    try:
        ours, theirs = _run_both(spec, plan, replicas=replicas, duration_s=duration,
                                 timeout_s=timeout, checkpoint_every=checkpoint_every,
                                 netns=netns, sleep_per_step=sleep_per_step, workdir=workdir)
    except (NetnsError, StoreError, EtcdNotInstalledError, EtcdStartError) as e:
        raise _fail(str(e))
    data = {"ftsystem": ours, "restart_all": theirs, "ratio": ratios(ours, theirs),
            "warning": window_warning(ours, theirs),
            "target": TARGET, "notes": NOTES, "machine": report.machine(), "schedule": plan,
            "settings": {"duration_s": duration, "mtbf": mtbf, "seed": seed,
                         "replicas": replicas, "actions": list(spec.actions),
                         "fault_duration": fault_duration, "timeout_s": timeout,
                         "checkpoint_every": checkpoint_every,
                         "sleep_per_step": sleep_per_step, "netns": netns}}
    _print(data)
    report.write_json(json_path, data)


def _run_both(spec: ChaosSpec, plan: list[dict], *, replicas: int, duration_s: float,
              timeout_s: float, checkpoint_every: int, netns: bool, sleep_per_step: float,
              workdir: Path | None) -> tuple[dict, dict]:
    """The baseline, then ftsystem for about as long (its step count from the baseline's pace)."""
    train_args = ["--sleep-per-step", str(sleep_per_step)]
    with tempfile.TemporaryDirectory(prefix="ftsystem-bench-ettr-") as tmp:
        root = workdir or Path(tmp)
        typer.echo(f"restart-all: {duration_s:.0f} s under {len(plan)} faults ...", err=True)
        theirs = run_baseline(spec=spec, num_replicas=replicas, duration_s=duration_s,
                              timeout_s=timeout_s, checkpoint_every=checkpoint_every,
                              netns=netns, train_args=train_args, workdir=root / "restart_all")
        steps = math.ceil(STEP_MARGIN * duration_s / (theirs["step_s"] or sleep_per_step))
        typer.echo(f"ftsystem: {steps} steps under the same {len(plan)} faults ...", err=True)
        ours = run_ftsystem(spec=spec, first_offset_s=plan[0]["at_s"] if plan else 0.0,
                            num_replicas=replicas, duration_s=duration_s, timeout_s=timeout_s,
                            num_steps=steps, netns=netns,
                            train_args=[*train_args, "--loop", "plain"],
                            workdir=root / "ftsystem")
    return ours, theirs


def _netns_problem() -> str | None:
    from ftsystem.netns import netns_supported
    return netns_supported()


def _print(data: dict) -> None:
    def row(name: str, r: dict) -> tuple:
        faults = ", ".join(f"{a} {n}" for a, n in r.get("failures_by_action", {}).items())
        start = r["window_start_s"]
        return (name, r["ettr_time"], r["ettr_work"], f"{r['failures']} ({faults or '-'})",
                r.get("restarts", r.get("replica_failures")),
                f"+{start:.0f} to +{start + r['interval_s']:.0f}", r["steps_in_window"],
                r["step_s"])
    ours, ratio = data["ftsystem"], data["ratio"]
    report.print_table(
        f"ETTR over {data['settings']['duration_s']:.0f} s, mtbf {data['settings']['mtbf']}, "
        f"seed {data['settings']['seed']}",
        ["system", "ETTR time", "ETTR work", "faults injected", "restarts / replica failures",
         "window (s after launch)", "steps in window", "normal step (s)"],
        [row("ftsystem", ours), row("restart-all", data["restart_all"]),
         ("ratio", ratio["ettr_time"], ratio["ettr_work"], "", "", "", "", "")])
    if shrunk := window_warning(ours, data["restart_all"]):
        typer.secho(shrunk, err=True, fg=typer.colors.YELLOW)
    typer.echo(data["machine"])


def window_warning(ours: dict, theirs: dict) -> str | None:
    """Why ftsystem's figures may cover less than the window (None: they do not)."""
    late = ours["window_start_s"] - theirs["window_start_s"]
    if ours["history"] == "all generations" or late < WINDOW_WARNING_S:
        return None
    return (f"warning: ftsystem's window starts {late:.0f} s later than the baseline's: every "
            "replica was restarted, and their results keep only the commits of their last "
            "generation, so its figures cover only the end of the run")
