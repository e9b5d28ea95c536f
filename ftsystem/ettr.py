"""Effective training time ratio (ETTR) of a run, from its replicas' commit timelines (pure).

- Time-based: the fraction of the training interval (first to last commit of the job) in which
  committed steps advance at the normal pace. Each gap of the job's commit timeline (the
  union over replicas: the job advances when any member commits) counts as productive up to
  the normal step time; the excess is lost time.
- Work-based: samples committed, summed over replicas, divided by what all ``num_replicas``
  replicas would have committed in the same interval at the normal step time. A replica that
  is down, catching up or paused costs work even while the others keep time-based ETTR high.

Not counted: start-up before the first commit (both) — the baseline pays its own start-up.
"""

from __future__ import annotations

from typing import Mapping

from ftsystem.stall import Timeline, gaps, normal_step_time


def job_timeline(timelines: Mapping[str, Timeline]) -> list[tuple[int, float]]:
    """The first commit time of every step, over all replicas."""
    first: dict[int, float] = {}
    for timeline in timelines.values():
        for step, t in timeline:
            first[int(step)] = min(t, first.get(int(step), t))
    return sorted(first.items())


def ettr(timelines: Mapping[str, Timeline], num_replicas: int) -> dict[str, float | None]:
    job = job_timeline(timelines)
    if len(job) < 3:
        return {"ettr_time": None, "ettr_work": None, "interval_s": 0.0}
    step_s = normal_step_time(job)
    interval = job[-1][1] - job[0][1]
    lost = sum(max(0.0, g - step_s) for g in gaps(job))
    commits = sum(len(t) for t in timelines.values()) - len(timelines)  # after the first
    capacity = num_replicas * interval / step_s
    return {"ettr_time": 1.0 - lost / interval, "ettr_work": min(1.0, commits / capacity),
            "interval_s": interval}
