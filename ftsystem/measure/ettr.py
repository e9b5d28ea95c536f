"""Effective training time ratio (ETTR) of a run, from its replicas' commit timelines (pure).

- Time-based: the fraction of the training interval (first to last commit of the job) in which
  committed steps advance at the normal pace. Each gap of the job's commit timeline (the
  union over replicas: the job advances when any member commits) counts as productive up to
  the normal step time; the excess is lost time.
- Work-based: samples committed, summed over replicas, divided by what all ``num_replicas``
  replicas would have committed in the same interval at the normal step time. A replica that
  is down, catching up or paused costs work even while the others keep time-based ETTR high.

Not counted: start-up before the first commit (both) — the baseline pays its own start-up.

Both measure loss against the run's own median gap, so on a machine whose step time spreads
(2 busy cores) every gap above the median counts as lost, and a run free of faults scores
below 1. Where a run of the same system free of faults is at hand, two figures leave that
spread out:
- :func:`net_ettr` loses only the gaps longer than the fault-free run's slowest steps
  (:func:`spread_bound`), each by its excess over the median step: what stalls cost;
- :func:`paced_ettr`: the steps committed at the fault-free run's mean pace, over the wall
  time. Where replicas share cores, one that is down speeds the others up, and this figure
  then credits the faults with that speed (it can pass 1).
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ftsystem.measure.stall import Timeline, gaps, normal_step_time


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


def fault_free_pace(timelines: Mapping[str, Timeline], *, warmup: float = 0.1) -> float | None:
    """Mean seconds per step of a run free of faults, over its job timeline after the first
    ``warmup`` fraction of its steps (the first steps pay for caches and lazy set-up)."""
    job = _settled(timelines, warmup)
    if len(job) < 3:
        return None
    return (job[-1][1] - job[0][1]) / (job[-1][0] - job[0][0])


def spread_bound(timelines: Mapping[str, Timeline], *, quantile: float = 0.99,
                 warmup: float = 0.1) -> float | None:
    """The ``quantile`` of a run's per-step gaps (its job timeline after the first ``warmup``
    fraction of its steps): in a run free of faults, how slow a normal step gets."""
    steps = gaps(_settled(timelines, warmup))
    if len(steps) < 2:
        return None
    return statistics.quantiles(steps, n=100, method="inclusive")[round(quantile * 100) - 1]


def _settled(timelines: Mapping[str, Timeline], warmup: float) -> list[tuple[int, float]]:
    """The job timeline without its first ``warmup`` fraction of steps."""
    job = job_timeline(timelines)
    return job[int(len(job) * warmup):]


def net_ettr(step_gaps: Sequence[float], interval_s: float, step_s: float,
             bound_s: float | None) -> float | None:
    """Time-based ETTR that loses only the gaps longer than ``bound_s`` (a normal step's
    spread, :func:`spread_bound`), each by its excess over the normal step ``step_s``."""
    if bound_s is None or interval_s <= 0:
        return None
    # A gap within a normal step is never lost, even where this run's steps are slower than
    # the fault-free run's slowest.
    bound_s = max(bound_s, step_s)
    return 1.0 - sum(g - step_s for g in step_gaps if g > bound_s) / interval_s


def paced_ettr(steps: int, interval_s: float, pace_s: float | None) -> float | None:
    """The fraction of ``interval_s`` that ``steps`` committed steps fill at the fault-free
    pace ``pace_s``. Jitter evens out (a fast step offsets a slow one), so only the time
    that faults take is lost; above 1 means the run outpaced its fault-free reference."""
    if not pace_s or interval_s <= 0:
        return None
    return steps * pace_s / interval_s


@dataclass
class LiveEttr:
    """ETTR of a running job, updated from the replicas' step reports as they arrive (pure).

    The controller sees each replica's committed step in its registration. Reports may be
    coalesced (a replica skips one while the previous write is in flight), so progress is
    credited per step advanced: a gap covering ``n`` steps is productive up to ``n`` normal
    step times. The normal step time is the median per-step gap of the recent past.
    Work counts steps that a replica advanced while it stayed a member: a joiner's jump to the
    job's step (loading a snapshot) is not work it did.
    """

    num_replicas: int
    window: int = 200
    """Per-step gaps kept for the normal step time."""
    rate_window_s: float = 120.0
    """The recent past over which :meth:`step_rate` is measured."""
    _job_step: int = -1
    _job_time: float = 0.0
    _first_time: float | None = None
    _productive_s: float = 0.0
    _per_step: deque = field(init=False)
    _replica_steps: dict = field(default_factory=dict)
    _work_steps: int = 0
    _recent: deque = field(default_factory=deque)
    """(time, job step) of each advance over the last ``rate_window_s``, and the one before."""

    def __post_init__(self) -> None:
        self._per_step = deque(maxlen=self.window)

    def observe(self, replica: str, step: int, is_member: bool, now: float) -> None:
        previous = self._replica_steps.get(replica)
        self._replica_steps[replica] = (step, is_member)
        if previous is not None and previous[1] and is_member and step > previous[0]:
            self._work_steps += step - previous[0]
        if step <= self._job_step:
            return
        if self._first_time is None:
            self._first_time = now
        elif self._job_step >= 0:
            advanced = step - self._job_step
            self._per_step.append((now - self._job_time) / advanced)
            self._productive_s += min(now - self._job_time, advanced * self.step_s)
        self._job_step, self._job_time = step, now
        self._recent.append((now, step))
        while len(self._recent) > 2 and self._recent[1][0] <= now - self.rate_window_s:
            self._recent.popleft()

    def forget(self, replica: str) -> None:
        """The replica's registration is gone (failed, or finished): its next one starts over."""
        self._replica_steps.pop(replica, None)

    @property
    def step_s(self) -> float:
        return statistics.median(self._per_step) if self._per_step else 0.0

    def step_rate(self, now: float) -> float | None:
        """Steps per second the job advanced over the last ``rate_window_s`` (since the first
        report if that is more recent), up to ``now``: a stall lowers it while it lasts."""
        if len(self._recent) < 2:
            return None
        start = max(self._recent[0][0], now - self.rate_window_s)
        if now <= start:
            return None
        base = next(step for t, step in reversed(self._recent) if t <= start)
        return (self._job_step - base) / (now - start)

    def rate_series(self, now: float, num_points: int = 40) -> list[tuple[float, float]]:
        """The step rate over the last ``rate_window_s`` in ``num_points`` equal intervals:
        (end of the interval, steps per second), oldest first. Intervals that start before
        the first report are left out, so a young term shows only what it measured."""
        if not self._recent:
            return []
        times = [t for t, _ in self._recent]
        steps = [step for _, step in self._recent]

        def step_at(t: float) -> int:  # the job's step at t: its last advance at or before t
            return steps[max(0, bisect.bisect_right(times, t) - 1)]

        width = self.rate_window_s / num_points
        starts = (now - self.rate_window_s + i * width for i in range(num_points))
        return [(start + width, (step_at(start + width) - step_at(start)) / width)
                for start in starts if start >= times[0]]

    @property
    def measured_s(self) -> float | None:
        """Seconds from the first report this tracker saw to the last."""
        return None if self._first_time is None else self._job_time - self._first_time

    def values(self, now: float) -> dict[str, float | None]:
        """Time- and work-based ETTR from the first commit seen until ``now``."""
        if self._first_time is None or len(self._per_step) < 2 or now <= self._first_time:
            return {"ettr_time": None, "ettr_work": None}
        elapsed = now - self._first_time
        capacity = self.num_replicas * elapsed / self.step_s
        return {"ettr_time": min(1.0, self._productive_s / elapsed),
                "ettr_work": min(1.0, self._work_steps / capacity)}
