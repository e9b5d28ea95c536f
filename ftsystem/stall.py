"""Survivor stall around a failure, from commit timelines (pure; shared by run and benchmarks).

A replica's commit timeline is ``[(step, wall_time), ...]``. Its normal step time is the median
gap between consecutive commits. The stall a failure at time ``t`` caused a survivor is its
longest gap among those ending at its first ``window`` commits after ``t``, minus the normal
step time: the step in flight when the failure hit (and the retry after it) shows as one long
gap. The failure's stall is the worst over the survivors.
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


def survivor_stall(timeline: Timeline, failure_time: float, *, window: int = 3) -> float | None:
    """Stall of one survivor, or None if it committed nothing after the failure."""
    times = [t for _, t in timeline]
    first_after = bisect.bisect_right(times, failure_time)
    if first_after == 0 or first_after >= len(times):
        return None
    ends = range(first_after, min(first_after + window, len(times)))
    longest = max(times[i] - times[i - 1] for i in ends)
    return max(0.0, longest - normal_step_time(timeline))


def window_stall(timeline: Timeline, start: float, end: float) -> float | None:
    """Longest gap overlapping ``[start, end]`` minus the normal step time (None: no gap)."""
    times = [t for _, t in timeline]
    overlapping = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    if not overlapping:
        return None
    return max(0.0, max(overlapping) - normal_step_time(timeline))


def failure_stall(timelines: Mapping[str, Timeline], failure_time: float,
                  failed: Iterable[str], *, window: int = 3) -> float | None:
    """The worst survivor stall for a failure of the replicas in ``failed``."""
    failed = set(failed)
    stalls = [s for rid, tl in timelines.items() if rid not in failed
              if (s := survivor_stall(tl, failure_time, window=window)) is not None]
    return max(stalls) if stalls else None


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "max": None, "mean": None}
    return {"median": statistics.median(values), "max": max(values),
            "mean": statistics.fmean(values)}
