"""Survivor stall around a fault, from commit timelines (pure; one measure for every system).

A replica's commit timeline is ``[(step, wall_time), ...]``; a gap is the time between two
consecutive commits. :func:`survivor_stall` measures what a fault at instant ``t`` cost one
survivor: the excess over its normal step of its gap holding ``t``, summed over the consecutive
gaps the fault lengthened. Its figures say how fine the measure is (:class:`Stall`): a stall
under their ``resolution_s`` cannot be told from a survivor's own jitter. The fault's stall is
the worst over the survivors (:func:`fault_stall`).

``t`` is the fault's instant (the kill, or the execution of a chaos order), never the moment
some agent recorded the failure: that record comes after detection, and for a partition only
after the link is back, so measuring from it leaves out most of what the survivors waited.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

Timeline = Sequence[Sequence[float]]  # [(step, wall_time), ...] in commit order

NOISE_QUANTILE = 0.95
"""The noise of a normal gap: this quantile of the gaps' distance from the normal step. The few
gaps that faults lengthen (under one in twenty) do not move it; a slow step that recurs (a state
digest every few steps) does, as it should: it is no stall."""
RESOLUTION_FLOOR = 0.01
"""The finest resolution claimed, as a fraction of the normal step: gaps that are all alike
(timelines made by hand) would otherwise count float rounding as a lengthened gap."""
WHOLE_STEPS_WINDOW = 3
"""Commits after the fault that the former, whole-step measure looked at."""


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


@dataclass(frozen=True, slots=True)
class Stall:
    """What a fault cost one survivor, in seconds, and how finely that is known."""

    excess_s: float
    """The stall: the counted gaps' excess over the normal step. Not clipped at 0: where no
    gap was lengthened it is the excess of the gap holding the fault, within the noise."""
    whole_steps_s: float
    """The former measure, for comparison with earlier reports during one release: the worst
    over the next three commits of ``commit_k - t - k * median gap``, clipped at 0. Whole
    steps subtracted, it reads 0 for most stalls shorter than a step."""
    normal_step_s: float
    """The median gap of the stretches no fault lengthened."""
    gaps_counted: int
    """The lengthened gaps summed; 1 (the gap holding the fault) where none was."""
    resolution_s: float
    """The noise of a normal gap: a stall, or a ratio's denominator, under it is jitter."""


def step_statistics(step_gaps: Sequence[float]) -> tuple[float, float]:
    """``(normal step, noise)`` of a timeline's gaps (at least one).

    The normal step is the median of the gaps that no fault lengthened: a first pass drops
    those longer than the median of all by more than their noise. The noise is the
    ``NOISE_QUANTILE`` of the gaps' distance from the normal step (at least
    ``RESOLUTION_FLOOR`` of a step): faults lengthen too few gaps to move it.
    """
    normal = statistics.median(step_gaps)
    fault_free = [g for g in step_gaps if g - normal <= _noise(step_gaps, normal)]
    normal = statistics.median(fault_free)
    return normal, _noise(step_gaps, normal)


def _noise(step_gaps: Sequence[float], normal: float) -> float:
    distances = sorted(abs(g - normal) for g in step_gaps)
    # The rank, not an interpolation: a short timeline's one stall would leak into it.
    return max(distances[int(NOISE_QUANTILE * (len(distances) - 1))], RESOLUTION_FLOOR * normal)


def survivor_stall(commits: Timeline, fault_time: float) -> Stall | None:
    """What a fault at ``fault_time`` cost the survivor with these commits; None if it
    committed nothing before or after the fault (it was not training then, or never resumed).

    The rule: the gaps counted are the consecutive lengthened gaps (longer than the normal
    step by more than the noise: :func:`step_statistics`) from the one holding the fault's
    instant, or from the next one where the step in flight still committed on time (its
    all-reduce was over); the stall is their summed excess over the normal step. Where
    neither gap is lengthened, the stall is the holding gap's excess, near 0 either way.
    """
    times = sorted(t for _, t in commits)
    first_after = bisect.bisect_right(times, fault_time)
    if first_after == 0 or first_after >= len(times):
        return None
    step_gaps = [b - a for a, b in itertools.pairwise(times)]
    normal, noise = step_statistics(step_gaps)
    counted = _lengthened_run(step_gaps, first_after - 1, normal + noise) or \
        [step_gaps[first_after - 1]]
    whole_steps = _whole_steps(times[first_after:], fault_time, statistics.median(step_gaps))
    return Stall(excess_s=sum(g - normal for g in counted), whole_steps_s=whole_steps,
                 normal_step_s=normal, gaps_counted=len(counted), resolution_s=noise)


def _lengthened_run(step_gaps: Sequence[float], holding: int, bound: float) -> list[float]:
    """The consecutive gaps above ``bound`` from gap ``holding``, or from the next one."""
    start = holding if step_gaps[holding] > bound else holding + 1
    return list(itertools.takewhile(lambda g: g > bound, step_gaps[start:]))


def _whole_steps(after: Sequence[float], fault_time: float, median_gap: float) -> float:
    """The former measure, from the commits ``after`` the fault (``Stall.whole_steps_s``)."""
    return max(0.0, max(c - fault_time - k * median_gap
                        for k, c in enumerate(after[:WHOLE_STEPS_WINDOW], start=1)))


def window_stall(timeline: Timeline, start: float, end: float) -> float | None:
    """Longest gap overlapping ``[start, end]`` minus the normal step time (None: no gap)."""
    times = [t for _, t in timeline]
    overlapping = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    if not overlapping:
        return None
    return max(0.0, max(overlapping) - normal_step_time(timeline))


def fault_stall(timelines: Mapping[str, Timeline], fault_time: float,
                failed: Iterable[str]) -> Stall | None:
    """The stall of a fault at ``fault_time``: the worst of its survivors' (every replica
    not in ``failed``); None if none committed both before and after it."""
    return max(_survivor_stalls(timelines, fault_time, failed), key=lambda s: s.excess_s,
               default=None)


def failure_stall(timelines: Mapping[str, Timeline], fault_time: float,
                  failed: Iterable[str]) -> float | None:
    """The former, whole-step measure of a fault's stall (``Stall.whole_steps_s``, the worst
    over the survivors), for the callers that still report it beside :func:`fault_stall`."""
    return max((s.whole_steps_s for s in _survivor_stalls(timelines, fault_time, failed)),
               default=None)


def _survivor_stalls(timelines: Mapping[str, Timeline], fault_time: float,
                     failed: Iterable[str]) -> list[Stall]:
    failed = set(failed)
    return [s for rid, tl in timelines.items() if rid not in failed
            if (s := survivor_stall(tl, fault_time)) is not None]


STALL_FIELDS = ("stall_s", "whole_steps_s", "normal_step_s", "gaps_counted", "resolution_s")
"""A fault's stall in a run summary (:func:`stall_fields`)."""


def stall_fields(measured: Stall | None) -> dict[str, float | int | None]:
    """A fault's stall as a run summary's fields: ``stall_s`` (the excess), ``whole_steps_s``
    (the former measure), ``normal_step_s``, ``gaps_counted`` and ``resolution_s``; all None
    where no survivor measured it."""
    if measured is None:
        return dict.fromkeys(STALL_FIELDS)
    return {"stall_s": measured.excess_s, "whole_steps_s": measured.whole_steps_s,
            "normal_step_s": measured.normal_step_s, "gaps_counted": measured.gaps_counted,
            "resolution_s": measured.resolution_s}


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

    A fault is a chaos order carried out (``state`` done), timed by its ``executed_at`` (a
    ``--kill-at`` point records its kill as one, ``ftsystem.chaos.faults``); or a recorded
    failure (``{"replica", "time"}``) that no such order on its replica explains (a crash of
    its own), timed by its record, as nothing earlier is known.
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
