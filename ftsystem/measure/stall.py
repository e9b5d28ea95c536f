"""Survivor stall around a fault, from commit timelines (pure; one measure for every system).

A replica's commit timeline is ``[(step, wall_time), ...]``. Its normal step time is the median
gap between consecutive commits. The stall a fault at instant ``t`` caused a survivor is the time
from ``t`` to its next commit, minus a normal step; where the step in flight when the fault hit
still committed (its all-reduce was over), the stall shows at a later commit, so the measure is
the worst over the first ``window`` commits after ``t`` of ``commit_k - t - k * normal``. The
fault's stall is the worst over the survivors.

``t`` is the fault's instant (the kill, or the execution of a chaos order), never the moment
some agent recorded the failure: that record comes after detection, and for a partition only
after the link is back, so measuring from it leaves out most of what the survivors waited.
As the fault hits somewhere inside a step, the measure can undercount by at most one step.
"""

from __future__ import annotations

import bisect
import statistics
from pathlib import Path
from typing import Iterable, Mapping, Sequence

Timeline = Sequence[Sequence[float]]  # [(step, wall_time), ...] in commit order


def read_timeline(path: Path) -> list[tuple[int, float]]:
    """A progress file's ``step unix_time`` lines (one per commit); empty if there is none."""
    if not path.exists():
        return []
    return [(int(step), float(t)) for step, t in
            (line.split() for line in path.read_text().splitlines() if line)]


def gaps(timeline: Timeline) -> list[float]:
    times = [t for _, t in timeline]
    return [b - a for a, b in zip(times, times[1:])]


def normal_step_time(timeline: Timeline) -> float:
    g = gaps(timeline)
    return statistics.median(g) if g else 0.0


def phase_instant(timeline: Timeline, phase: float) -> float | None:
    """The instant ``phase`` (0 to 1) of a normal step after the timeline's last commit; None
    before it has two commits. A bench launching a joiner then lands at a chosen point of the
    members' step, not wherever its own polling happens to put it."""
    if len(timeline) < 2:
        return None
    return timeline[-1][1] + phase * normal_step_time(timeline)


def survivor_stall(timeline: Timeline, fault_time: float, *, window: int = 3) -> float | None:
    """Stall of one survivor, or None if it committed nothing before or after the fault (it
    was not training then, or never resumed)."""
    times = [t for _, t in timeline]
    first_after = bisect.bisect_right(times, fault_time)
    if first_after == 0 or first_after >= len(times):
        return None
    normal = normal_step_time(timeline)
    after = times[first_after:first_after + window]
    return max(0.0, max(c - fault_time - k * normal for k, c in enumerate(after, start=1)))


def window_stall(timeline: Timeline, start: float, end: float) -> float | None:
    """Longest gap overlapping ``[start, end]`` minus the normal step time (None: no gap)."""
    times = [t for _, t in timeline]
    overlapping = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    if not overlapping:
        return None
    return max(0.0, max(overlapping) - normal_step_time(timeline))


def failure_stall(timelines: Mapping[str, Timeline], fault_time: float,
                  failed: Iterable[str], *, window: int = 3) -> float | None:
    """The worst survivor stall for a fault at ``fault_time`` of the replicas in ``failed``."""
    failed = set(failed)
    stalls = [s for rid, tl in timelines.items() if rid not in failed
              if (s := survivor_stall(tl, fault_time, window=window)) is not None]
    return max(stalls) if stalls else None


def down_at(timelines: Mapping[str, Timeline], events: Iterable[Mapping], t: float) -> list[str]:
    """The replicas still down at ``t`` from a fault of their own: one of ``events`` (faults or
    failure records, ``{"replica", "time"}``) hit them after their last commit before ``t``.
    They are no survivors of a fault at ``t``: a replica cut off at 10 s and back at 33 s
    would otherwise count its own 23 s as the stall of every fault in between."""
    events = list(events)

    def down(rid: str) -> bool:
        last = max((c[1] for c in timelines[rid] if c[1] <= t), default=float("-inf"))
        return any(e.get("replica") == rid and last <= e["time"] <= t for e in events)
    return [rid for rid in timelines if down(rid)]


def faults(failures: Sequence[Mapping], orders: Sequence[Mapping]) -> list[dict]:
    """Every fault of a run, each with its instant ``time``, oldest first.

    A fault is a chaos order carried out (``state`` done), timed by its ``executed_at``; or a
    recorded failure (``{"replica", "time"}``) that no such order on its replica explains (a
    crash of its own, a ``--kill-at`` point), timed by its record, as nothing earlier is known.
    The last order on a failure's replica carried out after the replica's previous failure
    record explains it. A service order (no replica) is a fault of every replica. Each fault
    lists in ``explains`` the indices in ``failures`` of the failures it caused.
    """
    done = [o for o in orders if o.get("state") == "done" and o.get("executed_at") is not None]
    found = [{"time": o["executed_at"], "replica": o.get("replica", ""), "action": o["action"],
              "source": "chaos", "explains": []} for o in done]
    previous: dict[str, float] = {}
    for i in sorted(range(len(failures)), key=lambda i: failures[i]["time"]):
        f = failures[i]
        since = previous.get(f["replica"], float("-inf"))
        previous[f["replica"]] = f["time"]
        causes = [j for j, o in enumerate(done)
                  if o.get("replica") == f["replica"] and since < o["executed_at"] <= f["time"]]
        if causes:
            found[max(causes, key=lambda j: done[j]["executed_at"])]["explains"].append(i)
        else:
            found.append({"time": f["time"], "replica": f["replica"],
                          "action": f.get("reason", "failure"), "source": "failure record",
                          "explains": [i]})
    return sorted(found, key=lambda f: f["time"])


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "min": None, "max": None, "mean": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "mean": statistics.fmean(values)}
