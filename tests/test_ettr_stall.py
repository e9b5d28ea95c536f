"""Stall and ETTR arithmetic on hand-made timelines, and runs measured from their faults."""

from __future__ import annotations

import itertools
import json
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftsystem.cli import failure_rows
from ftsystem.measure.ettr import LiveEttr, ettr, job_timeline
from ftsystem.measure.stall import (down_at, failure_stall, fault_stall, faults, normal_step_time,
                                    phase_instant, stall_fields, survivor_stall)


def steady(start: float, n: int, step: float = 0.1, first_step: int = 1):
    return [(first_step + i, start + i * step) for i in range(n)]


def test_the_stall_is_the_excess_of_the_gap_holding_the_fault():
    # commits every 0.1 s, then nothing from 1.0 s to 1.6 s: a fault at 1.05 s
    timeline = steady(0.0, 11) + steady(1.6, 10, first_step=12)
    assert normal_step_time(timeline) == pytest.approx(0.1)
    measured = survivor_stall(timeline, 1.05)
    assert measured.excess_s == pytest.approx(0.6 - 0.1)
    assert measured.normal_step_s == pytest.approx(0.1)
    assert measured.gaps_counted == 1
    assert measured.resolution_s == pytest.approx(0.001)  # gaps all alike: the floor
    # The former measure left out the part of the gap before the fault.
    assert measured.whole_steps_s == pytest.approx(1.6 - 1.05 - 0.1)
    assert survivor_stall(timeline, 100.0) is None  # nothing committed after it
    assert survivor_stall(timeline, -1.0) is None  # nor before it: it was not training


def test_a_stall_under_a_step_is_counted_where_whole_steps_read_zero():
    # The README's kill: one step of 0.134 s among steps of 0.072 s, the fault late in it.
    timeline = steady(0.0, 101, step=0.072) + steady(7.2 + 0.134, 50, step=0.072, first_step=102)
    measured = survivor_stall(timeline, 7.2 + 0.1)
    assert measured.excess_s == pytest.approx(0.134 - 0.072)
    assert measured.whole_steps_s == 0.0


def test_a_step_that_commits_after_the_fault_does_not_hide_the_stall():
    # the step in flight commits on time (1.1 s), then nothing until 2.1 s
    timeline = steady(0.0, 12) + steady(2.1, 10, first_step=13)
    measured = survivor_stall(timeline, 1.05)
    assert measured.excess_s == pytest.approx(2.1 - 1.1 - 0.1)
    assert measured.gaps_counted == 1
    assert measured.whole_steps_s == pytest.approx(2.1 - 1.05 - 2 * 0.1)
    # two steps before the stall, it is not this fault's
    assert survivor_stall(timeline, 0.55).excess_s == pytest.approx(0.0, abs=1e-9)


def test_measuring_from_the_record_instead_of_the_fault_undercounts():
    # A hang at 1.0 s, recorded at 3.2 s, after the survivor resumed at 3.1 s.
    timeline = steady(0.0, 11) + steady(3.1, 10, first_step=12)
    assert survivor_stall(timeline, 1.0).excess_s == pytest.approx(2.0)
    assert survivor_stall(timeline, 3.2).excess_s == pytest.approx(0.0, abs=1e-9)


def test_without_a_lengthened_gap_the_excess_is_not_clipped_at_zero():
    # A fault in a short gap: its (negative) excess is reported, within the resolution.
    times = _jittery(60, 0.1, [-0.01, 0.01, 0.0, -0.01, 0.01, -0.03, 0.0, 0.01, -0.01, 0.0])
    measured = survivor_stall(list(enumerate(times, start=1)), times[15] + 0.05)
    assert measured.excess_s == pytest.approx(0.07 - 0.1)
    assert measured.gaps_counted == 1
    assert abs(measured.excess_s) <= measured.resolution_s
    assert measured.whole_steps_s == 0.0


def test_jittery_steps_set_the_resolution_and_are_not_stalls():
    # Steps alternate 0.08 and 0.12 s; one 0.4 s stall.
    times, t = [], 0.0
    for i in range(60):
        times.append(t)
        t += 0.08 if i % 2 else 0.12
        if i == 30:
            t += 0.4
    timeline = list(enumerate(times, start=1))
    measured = survivor_stall(timeline, times[30] + 0.01)
    assert measured.normal_step_s == pytest.approx(0.1)
    assert measured.resolution_s == pytest.approx(0.02)  # the jitter, not the stall
    assert measured.excess_s == pytest.approx(0.4 + 0.12 - 0.1)
    assert measured.gaps_counted == 1
    quiet = survivor_stall(timeline, times[10] + 0.01)
    assert abs(quiet.excess_s) == pytest.approx(quiet.resolution_s)  # a slow step, no stall


NUM_GAPS = 100
"""Gaps of a made-up timeline: faults lengthen at most 4, too few to move the noise."""


def _jittery(gap_count: int, step: float, jitter: list[float]) -> list[float]:
    """Commit times with steps of ``step`` plus the given jitter (cycled)."""
    times = [0.0]
    for i in range(gap_count):
        times.append(times[-1] + step + jitter[i % len(jitter)])
    return times


fault_cases = st.fixed_dictionaries({
    "step": st.floats(0.02, 2.0),
    "jitter": st.lists(st.floats(-0.1, 0.1), min_size=1, max_size=20),  # of a step
    "extra": st.lists(st.floats(0.6, 20.0), min_size=1, max_size=4),  # of a step, per gap
    "where": st.integers(5, 40),  # the first lengthened gap
    "inside": st.floats(0.0, 0.999),  # where in that gap the fault hits
})


@settings(max_examples=300, deadline=None)
@given(fault_cases)
def test_a_fault_anywhere_in_a_gap_measures_the_time_it_added(case):
    """Stalls added to consecutive gaps of a jittery timeline: the measure sums them, wherever
    in the first gap the fault hits, within the jitter, and never below the former measure."""
    step, jitter = case["step"], [j * case["step"] for j in case["jitter"]]
    extra = [e * step for e in case["extra"]]
    times = _jittery(NUM_GAPS, step, jitter)
    where = case["where"]
    for i, added in enumerate(extra):  # gap k spans times[k]..times[k+1]
        times[where + i + 1:] = [t + added for t in times[where + i + 1:]]
    fault = times[where] + case["inside"] * (times[where + 1] - times[where])
    measured = survivor_stall(list(enumerate(times, start=1)), fault)
    widest = max(jitter) - min(jitter)
    assert measured.resolution_s <= widest + 0.01 * measured.normal_step_s + 1e-9
    # Beside the lengthened gaps, a few normal ones may exceed the noise (one in twenty, of
    # 100): each adds at most the jitter.
    assert len(extra) <= measured.gaps_counted <= len(extra) + 5
    assert measured.excess_s == pytest.approx(sum(extra), abs=(len(extra) + 5) * widest + 1e-9)
    assert measured.whole_steps_s <= measured.excess_s + widest + 1e-9


@settings(max_examples=200, deadline=None)
@given(step=st.floats(0.02, 2.0), jitter=st.lists(st.floats(-0.1, 0.1), min_size=1, max_size=20),
       where=st.integers(0, NUM_GAPS - 2), inside=st.floats(0.0, 0.999))
def test_without_a_stall_the_measure_stays_within_its_resolution(step, jitter, where, inside):
    times = _jittery(NUM_GAPS, step, [j * step for j in jitter])
    fault = times[where] + inside * (times[where + 1] - times[where])
    measured = survivor_stall(list(enumerate(times, start=1)), fault)
    # Only the normal gaps that exceed the noise (one in twenty) count, with their jitter.
    assert measured.gaps_counted <= 1 + 5
    # Below zero by at most the jitter's spread: a gap shorter than normal beside the fault
    # (found: -0.0625 s on a 1 s step whose resolution read 0.01 s).
    assert -measured.resolution_s - (max(jitter) - min(jitter)) * step - 1e-9 \
        <= measured.excess_s
    assert measured.excess_s <= 3 * (max(jitter) - min(jitter)) * step + 1e-9


def test_the_fault_stall_is_the_worst_survivors_with_its_figures():
    timelines = {"a": steady(0.0, 11) + steady(1.6, 10, first_step=12),
                 "b": steady(0.0, 11) + steady(1.3, 10, first_step=12),
                 "victim": steady(0.0, 11)}
    worst = fault_stall(timelines, 1.05, ["victim"])
    assert worst == survivor_stall(timelines["a"], 1.05)
    assert failure_stall(timelines, 1.05, ["victim"]) == pytest.approx(worst.whole_steps_s)
    assert fault_stall(timelines, 1.05, ["a", "b", "victim"]) is None
    assert stall_fields(worst) == {"stall_s": worst.excess_s, "whole_steps_s": worst.whole_steps_s,
                                   "normal_step_s": worst.normal_step_s, "gaps_counted": 1,
                                   "resolution_s": worst.resolution_s}
    assert set(stall_fields(None).values()) == {None}


def test_the_run_report_shows_the_stall_beside_the_former_measure():
    failures = [{"replica": "r1", "step": 100, "reason": "killed by SIGKILL", "stall_s": 0.062,
                 "whole_steps_s": 0.0, "resolution_s": 0.01},
                {"replica": "r2", "step": 7, "reason": "hung"}]  # no survivor measured it
    assert failure_rows(failures) == [("r1", 100, "killed by SIGKILL", 0.062, 0.0, 0.01),
                                      ("r2", 7, "hung", "-", "-", "-")]


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


def test_a_replica_still_down_from_its_own_fault_is_no_survivor_of_the_next():
    # b is cut off at 1.05 s and commits again at 3.0 s; a's fault at 2.0 s hits in between.
    timelines = {"a": steady(0.0, 20) + steady(2.6, 10, first_step=21),
                 "b": steady(0.0, 11) + steady(3.0, 10, first_step=12),
                 "c": steady(0.0, 20) + steady(2.6, 10, first_step=21)}
    events = [{"replica": "b", "time": 1.05}, {"replica": "a", "time": 2.0}]
    assert down_at(timelines, events, 2.0) == ["a", "b"]  # a: its own fault, at that instant
    assert down_at(timelines, events, 0.5) == []
    assert down_at(timelines, events, 3.5) == []  # b committed since
    counted = fault_stall(timelines, 2.0, ["a", *down_at(timelines, events, 2.0)])
    assert counted.excess_s == pytest.approx(2.6 - 1.9 - 0.1)  # c's stall, not b's own gap
    assert fault_stall(timelines, 2.0, ["a"]).excess_s == pytest.approx(3.0 - 1.0 - 0.1)


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


def test_the_rate_history_shows_a_stall_where_it_happened():
    live = LiveEttr(num_replicas=1, rate_window_s=10.0)
    assert live.rate_series(5.0) == []
    for t in range(21):  # 10 steps/s, a report a second, then nothing from t=20 (a stall)
        live.observe("a", 10 * t, True, float(t))
    series = live.rate_series(25.0, num_points=5)  # 2 s intervals over [15, 25]
    assert [t for t, _ in series] == [17.0, 19.0, 21.0, 23.0, 25.0]
    assert [rate for _, rate in series] == pytest.approx([10.0, 10.0, 5.0, 0.0, 0.0])
    young = LiveEttr(num_replicas=1, rate_window_s=10.0)  # nothing before its first report
    young.observe("a", 0, True, 100.0)
    young.observe("a", 8, True, 104.0)
    assert young.rate_series(105.0, num_points=5) == [(103.0, 0.0), (105.0, 4.0)]


def test_the_timeline_draws_members_in_whole_replicas_and_each_survivors_commit_gaps():
    pytest.importorskip("matplotlib")
    from ftsystem.measure.timeline import commit_gaps, figure
    steady = [(step, 100.0 + 0.1 * step) for step in range(30)]
    stalled = steady[:10] + [(step, t + 0.4) for step, t in steady[10:]]  # 0.4 s at step 10
    results = {"r0": {"commits": stalled, "epochs": [{"time": 100.0, "members": ["r0", "r1"]},
                                                     {"time": 101.0, "members": ["r0"]}]},
               "r1": {"commits": steady[:10], "epochs": []}}
    failures = [{"replica": "r1", "step": 9, "time": 100.95}]
    gaps = commit_gaps(results, 100.0, {"r1"})
    assert list(gaps) == ["r0"] and len(gaps["r0"]) == 29  # survivors only, one per commit
    assert max(gaps["r0"], key=lambda g: g[1]) == pytest.approx((1.4, 0.5))
    fig = figure(results, failures)
    _, members_ax, gap_ax = fig.axes
    assert members_ax.get_ylim()[0] == 0
    assert all(float(t).is_integer() for t in members_ax.get_yticks())
    (line,) = [line for line in gap_ax.lines if line.get_label() == "r0"]
    assert max(line.get_ydata()) == pytest.approx(0.5)  # the sub-second stall stands out


def test_a_run_reports_the_stall_of_a_kill_and_a_hang_from_their_instants(tmp_path):
    """End to end: the run's summary measures each fault from the execution of its chaos order,
    so a stall includes the detection in front of it: for the hang, the watchdog (a third of
    the timeout); for the kill, the time until the epoch without the victim was published."""
    import textwrap

    from ftsystem.chaos.spec import parse_specs
    from ftsystem.control.timeouts import Timeouts
    from ftsystem.launch.launcher import RunConfig, run_job
    from ftsystem.training.runtime import HEARTBEAT_S

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


def _gap_excess(timeline, instant: float) -> float:
    """Straight from a commit file: the longer of the gap holding ``instant`` and the next one
    (the step in flight may have committed on time), less the median gap."""
    times = [t for _, t in timeline]
    after = next(i for i, t in enumerate(times) if t > instant)
    step_gaps = [b - a for a, b in itertools.pairwise(times)]
    return max(step_gaps[after - 1:after + 1]) - statistics.median(step_gaps)


@pytest.mark.slow
def test_a_kill_at_point_is_measured_from_the_instant_it_recorded(etcd, job_id, tmp_path):
    """End to end, the README's two kills: each ``--kill-at`` point records its instant; the
    run's summary measures the survivors' stall from it, within a normal step of what their
    commit files show, and not from the failure record that comes after detection."""
    from ftsystem.chaos.faults import RECORD_ACTION, FaultPoint
    from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job
    from ftsystem.measure.stall import read_timeline

    cfg = RunConfig(num_replicas=3, num_steps=100, etcd=etcd.url, job=job_id,
                    out_dir=tmp_path / "run",
                    # The plain loop sends no buckets during backward: the all-reduce that the
                    # second kill interrupts is still in flight on the survivors.
                    train_args=["--sleep-per-step", "0.05", "--loop", "plain"],
                    kills=[ReplicaKill(1, FaultPoint(30, "step")),
                           ReplicaKill(2, FaultPoint(60, "allreduce"))], show_progress=False)
    summary = run_job(cfg)
    assert summary["agents_ok"] and summary["bitwise_identical"], summary
    records = {o["replica"]: o for o in summary["chaos"] if o["action"] == RECORD_ACTION}
    kills = {f["replica"]: f for f in summary["faults"] if f["action"] == RECORD_ACTION}
    assert sorted(kills) == sorted(records) == ["r1", "r2"], summary["faults"]
    timelines = {rid: read_timeline(cfg.out_dir / "results" / f"{rid}.commits")
                 for rid in ("r0", "r1", "r2")}
    for victim, kill in kills.items():
        assert kill["time"] == records[victim]["executed_at"]
        [failure] = [f for f in summary["failures"] if f["replica"] == victim]
        assert failure["fault_time"] == kill["time"] < failure["time"], failure
        survivors = {rid: tl for rid, tl in timelines.items()
                     if rid not in (victim, *down_at(timelines, summary["faults"], kill["time"]))}
        assert survivors, kill
        direct = max(_gap_excess(tl, kill["time"]) for tl in survivors.values())
        measured = fault_stall(survivors, kill["time"], [])
        print(f"{victim} killed at {records[victim]['outcome']}: stall {measured.excess_s:.3f} s"
              f" over {measured.gaps_counted} gap(s), former measure "
              f"{measured.whole_steps_s:.3f} s, summary {kill['stall_s']:.3f} s, commit files "
              f"{direct:.3f} s, normal step {measured.normal_step_s:.3f} s, resolution "
              f"{measured.resolution_s:.3f} s")
        assert abs(kill["stall_s"] - direct) <= measured.normal_step_s, (kill, direct)
        assert abs(measured.excess_s - direct) <= measured.normal_step_s, (measured, direct)
