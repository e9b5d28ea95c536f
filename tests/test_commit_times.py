"""The parts of ``commit()`` are timed where they run."""

from __future__ import annotations

import time

from ftsystem.training.commit_times import CommitTimes


def test_parts_sum_over_commits_and_report_per_commit():
    times = CommitTimes(start_up_commits=0)
    for _ in range(4):
        with times.part("allreduce"):
            time.sleep(0.01)
        with times.part("vote"):
            pass
        times.committed()
    per_commit = times.per_commit_ms()
    assert list(per_commit) == ["allreduce", "vote"]
    assert per_commit["allreduce"] >= 10.0 > per_commit["vote"]


def test_a_part_that_raises_is_timed_too():
    times = CommitTimes(start_up_commits=0)
    try:
        with times.part("step_fn"):
            raise RuntimeError("the step function failed")
    except RuntimeError:
        pass
    assert times.seconds["step_fn"] > 0 and times.per_commit_ms()["step_fn"] > 0


def test_the_start_up_commits_are_summed_apart():
    """A first pack faults in fresh buffers: averaged with the rest, it would stand for the
    steady state of a short run."""
    times = CommitTimes(start_up_commits=2)
    for slow in (True, True, False, False):
        with times.part("pack"):
            time.sleep(0.05 if slow else 0.0)
        times.committed()
    assert times.start_up_ms()["pack"] >= 100.0
    assert times.per_commit_ms()["pack"] < 25.0
