"""Stall and ETTR arithmetic on hand-made timelines, and one run measured from its faults."""

from __future__ import annotations

import json

import pytest

from ftsystem.measure.ettr import LiveEttr, ettr, job_timeline
from ftsystem.measure.stall import (down_at, failure_stall, faults, normal_step_time,
                                    phase_instant, survivor_stall)


def steady(start: float, n: int, step: float = 0.1, first_step: int = 1):
    return [(first_step + i, start + i * step) for i in range(n)]


def test_survivor_stall_runs_from_the_fault_to_the_next_commit_less_a_step():
    # commits every 0.1 s, then nothing from 1.0 s to 1.6 s: a fault at 1.05 s
    timeline = steady(0.0, 11) + steady(1.6, 10, first_step=12)
    assert normal_step_time(timeline) == pytest.approx(0.1)
    assert survivor_stall(timeline, 1.05) == pytest.approx(1.6 - 1.05 - 0.1)
    assert survivor_stall(timeline, 100.0) is None  # nothing committed after it
    assert survivor_stall(timeline, -1.0) is None  # nor before it: it was not training


def test_a_step_that_commits_after_the_fault_does_not_hide_the_stall():
    # the step in flight commits on time (1.1 s), then nothing until 2.1 s
    timeline = steady(0.0, 12) + steady(2.1, 10, first_step=13)
    assert survivor_stall(timeline, 1.05) == pytest.approx(2.1 - 1.05 - 2 * 0.1)
    # beyond the window it is not this fault's
    assert survivor_stall(timeline, 0.55, window=3) == pytest.approx(0.0)


def test_measuring_from_the_record_instead_of_the_fault_undercounts():
    # A hang at 1.0 s, detected and recorded at 3.0 s; the survivor resumes at 3.1 s.
    timeline = steady(0.0, 11) + steady(3.1, 10, first_step=12)
    assert survivor_stall(timeline, 1.0) == pytest.approx(2.0)
    assert survivor_stall(timeline, 3.0) == pytest.approx(0.0)  # what the record would say


def test_faults_are_timed_by_the_order_that_explains_each_failure():
    orders = [{"action": "hang", "replica": "r1", "state": "done", "executed_at": 10.0},
              {"action": "kill", "replica": "r2", "state": "failed", "executed_at": 12.0},
              {"action": "etcd-pause", "replica": "", "state": "done", "executed_at": 30.0},
              {"action": "kill", "replica": "r1", "state": "pending", "executed_at": None}]
    failures = [{"replica": "r1", "time": 13.0, "reason": "hung"},
                {"replica": "r2", "time": 14.0, "reason": "exit -9"},  # no order carried out
                {"replica": "r1", "time": 20.0, "reason": "crash"}]  # after r1's first record
    found = faults(failures, orders)
    assert [(f["time"], f["replica"], f["action"], f["source"], f["explains"])
            for f in found] == [
        (10.0, "r1", "hang", "chaos", [0]),
        (14.0, "r2", "exit -9", "failure record", [1]),
        (20.0, "r1", "crash", "failure record", [2]),
        (30.0, "", "etcd-pause", "chaos", [])]


def test_a_later_order_explains_a_failure_only_once():
    orders = [{"action": "partition", "replica": "r0", "state": "done", "executed_at": t}
              for t in (5.0, 6.0)]
    found = faults([{"replica": "r0", "time": 9.0}], orders)
    assert [(f["time"], f["explains"]) for f in found] == [(5.0, []), (6.0, [0])]


def test_failure_stall_ignores_the_failed_replica():
    timelines = {"a": steady(0.0, 30), "b": steady(0.0, 10)}
    assert failure_stall(timelines, 0.95, ["b"]) == pytest.approx(0.0)
    assert failure_stall({"b": steady(0.0, 10)}, 0.5, ["b"]) is None


def test_a_replica_still_down_from_its_own_fault_is_no_survivor_of_the_next():
    # b is cut off at 1.05 s and commits again at 3.0 s; a's fault at 2.0 s hits in between.
    timelines = {"a": steady(0.0, 20) + steady(2.6, 10, first_step=21),
                 "b": steady(0.0, 11) + steady(3.0, 10, first_step=12),
                 "c": steady(0.0, 20) + steady(2.6, 10, first_step=21)}
    events = [{"replica": "b", "time": 1.05}, {"replica": "a", "time": 2.0}]
    assert down_at(timelines, events, 2.0) == ["a", "b"]  # a: its own fault, at that instant
    assert down_at(timelines, events, 0.5) == []
    assert down_at(timelines, events, 3.5) == []  # b committed since
    counted = failure_stall(timelines, 2.0, ["a", *down_at(timelines, events, 2.0)])
    assert counted == pytest.approx(2.6 - 2.0 - 0.1)  # c's stall, not b's own gap
    assert failure_stall(timelines, 2.0, ["a"]) == pytest.approx(3.0 - 2.0 - 0.1)


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


def test_live_step_rate_covers_the_recent_window_and_falls_during_a_stall():
    live = LiveEttr(num_replicas=1, rate_window_s=10.0)
    assert live.step_rate(0.0) is None
    # 10 steps/s for 30 s, reported once a second; then nothing (a stall)
    for t in range(31):
        live.observe("a", 10 * t, True, float(t))
    assert live.step_rate(30.0) == pytest.approx(10.0)
    assert live.step_rate(35.0) == pytest.approx(5.0)  # half of the last 10 s stalled
    assert live.step_rate(45.0) == pytest.approx(0.0)
    assert live.measured_s == 30.0
    # a younger tracker measures since its first report
    young = LiveEttr(num_replicas=1, rate_window_s=10.0)
    young.observe("a", 0, True, 100.0)
    young.observe("a", 6, True, 102.0)
    assert young.step_rate(103.0) == pytest.approx(2.0)


def test_a_run_reports_the_stall_of_a_kill_and_a_hang_from_their_instants(tmp_path):
    """End to end: the run's summary measures each fault from the execution of its chaos order,
    so a stall includes the detection in front of it: for the hang, the watchdog (a third of
    the timeout); for the kill, the time until the epoch without the victim was published."""
    import textwrap

    from ftsystem.chaos.spec import parse_specs
    from ftsystem.launch.launcher import RunConfig, run_job
    from ftsystem.training.runtime import HEARTBEAT_S
    from ftsystem.control.timeouts import Timeouts

    timeout_s = 6.0
    cfg = RunConfig(num_replicas=3, num_steps=140, out_dir=tmp_path / "run",
                    train_args=["--sleep-per-step", "0.05", "--loop", "plain"],
                    timeout_s=timeout_s, show_progress=False, chaos=parse_specs(textwrap.dedent("""
                        action: kill
                        selector: {replicas: [r1]}
                        after_step: 20
                        ---
                        action: hang
                        selector: {replicas: [r2]}
                        duration: 4s
                        after_step: 80
                    """)))
    summary = run_job(cfg)
    assert summary["agents_ok"] and summary["bitwise_identical"], summary
    faults_by_action = {f["action"]: f for f in summary["faults"] if f["source"] == "chaos"}
    kill, hang = faults_by_action["kill"], faults_by_action["hang"]
    orders = {o["action"]: o for o in summary["chaos"]}
    assert kill["time"] == orders["kill"]["executed_at"]
    assert hang["time"] == orders["hang"]["executed_at"]
    step = summary["step_time_s"]["median"]
    # The survivors' next commits (at most the step in flight, then one after recovery) come
    # only once the hung rank's heartbeat (last written up to HEARTBEAT_S before the hang) is
    # older than the watchdog allows.
    assert hang["stall_s"] >= Timeouts(timeout_s).watchdog_s - HEARTBEAT_S - 2 * step, hang
    # ... and after the kill, once r0 has entered an epoch without r1.
    result = json.loads((cfg.out_dir / "results" / "r0.json").read_text())
    dropped = min(e["time"] for e in result["epochs"]
                  if e["time"] > kill["time"] and "r1" not in e["members"])
    assert kill["stall_s"] >= dropped - kill["time"] - 2 * step, (kill, dropped)
    # Each failure carries the stall of the fault behind it.
    by_replica = {f["replica"]: f for f in summary["failures"]}
    assert by_replica["r1"]["fault_time"] == kill["time"]
    assert by_replica["r2"]["fault_time"] == hang["time"]
    assert by_replica["r2"]["stall_s"] == hang["stall_s"]


def test_paced_ettr_evens_out_jitter_that_the_median_counts_as_lost() -> None:
    from ftsystem.measure.ettr import (ettr, fault_free_pace, gaps, net_ettr, paced_ettr,
                                       spread_bound)
    # Steps alternate 0.08 and 0.12 s, no fault: the median-held figure loses 0.02 s a step
    # pair, the paced one (against the same run's mean pace) loses nothing.
    t, timeline = 0.0, []
    for step in range(201):
        timeline.append((step, t))
        t += 0.08 if step % 2 else 0.12
    jittery = {"r0": timeline}
    pace = fault_free_pace(jittery)
    assert pace == pytest.approx(0.1)
    assert ettr(jittery, 1)["ettr_time"] < 0.91
    assert paced_ettr(200, timeline[-1][1] - timeline[0][1], pace) == pytest.approx(1.0)
    # A 5 s stall in a 25 s window of 200 steps at 0.1 s: 20 s of progress, 0.8.
    assert paced_ettr(200, 25.0, pace) == pytest.approx(0.8)
    assert paced_ettr(200, 25.0, None) is None
    # Net: the jitter stays under the fault-free run's slowest steps; a 5 s stall is lost.
    bound = spread_bound(jittery)
    assert bound == pytest.approx(0.12)
    step_gaps = gaps(timeline)
    assert net_ettr(step_gaps, timeline[-1][1], 0.1, bound) == pytest.approx(1.0)
    assert net_ettr([*step_gaps, 5.1], timeline[-1][1] + 5.1, 0.1, bound) == pytest.approx(
        1 - 5.0 / (timeline[-1][1] + 5.1))
    assert net_ettr(step_gaps, 20.0, 0.1, None) is None


def test_phase_instant_is_a_fraction_of_a_normal_step_after_the_last_commit() -> None:
    timeline = [(1, 10.0), (2, 11.0), (3, 12.0), (4, 15.0)]  # normal step: the median gap, 1 s
    assert phase_instant(timeline, 0.25) == 15.25
    assert phase_instant(timeline, 0.0) == 15.0
    assert phase_instant(timeline[:1], 0.5) is None  # no step time yet
