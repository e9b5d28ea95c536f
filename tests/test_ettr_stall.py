"""Stall and ETTR arithmetic on hand-made timelines."""

from __future__ import annotations

import pytest

from ftsystem.ettr import LiveEttr, ettr, job_timeline
from ftsystem.stall import failure_stall, normal_step_time, survivor_stall


def steady(start: float, n: int, step: float = 0.1, first_step: int = 1):
    return [(first_step + i, start + i * step) for i in range(n)]


def test_survivor_stall_is_the_longest_gap_after_the_failure_minus_normal():
    # commits every 0.1 s, then a 0.6 s gap right after a failure at t=1.05
    timeline = steady(0.0, 11) + steady(1.6, 10, first_step=12)
    assert normal_step_time(timeline) == pytest.approx(0.1)
    assert survivor_stall(timeline, 1.05) == pytest.approx(0.5)
    assert survivor_stall(timeline, 100.0) is None  # nothing committed after it


def test_failure_stall_ignores_the_failed_replica():
    timelines = {"a": steady(0.0, 30), "b": steady(0.0, 10)}
    assert failure_stall(timelines, 0.95, ["b"]) == pytest.approx(0.0)
    assert failure_stall({"b": steady(0.0, 10)}, 0.5, ["b"]) is None


def test_ettr_without_failures_is_one():
    timelines = {"a": steady(0.0, 50), "b": steady(0.0, 50)}
    result = ettr(timelines, num_replicas=2)
    assert result["ettr_time"] == pytest.approx(1.0)
    assert result["ettr_work"] == pytest.approx(1.0)


def test_ettr_counts_a_stall_and_a_missing_replica():
    # the job stalls 1 s once in 10 s of training; replica b is gone for the second half
    a = steady(0.0, 51) + steady(6.1, 40, first_step=52)
    b = steady(0.0, 51)
    result = ettr({"a": a, "b": b}, num_replicas=2)
    interval = a[-1][1] - a[0][1]
    assert result["ettr_time"] == pytest.approx(1 - 1.0 / interval)
    assert result["ettr_work"] == pytest.approx((90 + 50) / (2 * interval / 0.1))
    assert [s for s, _ in job_timeline({"a": a, "b": b})] == list(range(1, 92))


def _feed(live: LiveEttr, timelines: dict, member: bool = True) -> None:
    for t, replica, step in sorted((t, r, s) for r, tl in timelines.items() for s, t in tl):
        live.observe(replica, step, member, t)


def test_live_ettr_agrees_with_the_offline_one_on_the_same_commits():
    a = steady(0.0, 51) + steady(6.1, 40, first_step=52)
    b = steady(0.0, 51)
    live = LiveEttr(num_replicas=2)
    _feed(live, {"a": a, "b": b})
    offline = ettr({"a": a, "b": b}, num_replicas=2)
    now = a[-1][1]
    assert live.values(now)["ettr_time"] == pytest.approx(offline["ettr_time"], abs=1e-9)
    assert live.values(now)["ettr_work"] == pytest.approx(offline["ettr_work"], abs=1e-9)
    # while the job makes no progress, live ETTR falls
    assert live.values(now + 5)["ettr_time"] < offline["ettr_time"]


def test_live_ettr_credits_coalesced_reports_and_not_a_joiners_jump():
    live = LiveEttr(num_replicas=2)
    # replica a reports every other step (coalesced): still full time-based ETTR
    _feed(live, {"a": [(s, s * 0.1) for s in range(0, 101, 2)]})
    assert live.values(10.0)["ettr_time"] == pytest.approx(1.0)
    # replica b loads a snapshot at step 100: a jump of 100 steps that is not its work
    live.observe("b", 0, False, 10.0)
    live.observe("b", 100, True, 10.0)
    assert live.values(10.0)["ettr_work"] == pytest.approx(0.5)
    assert LiveEttr(num_replicas=1).values(1.0) == {"ettr_time": None, "ettr_work": None}
