"""The parts of ``commit()`` are timed where they run."""

from __future__ import annotations

import time

from ftsystem.training.commit_times import CommitTimes


def test_parts_sum_over_commits_and_report_per_commit():
    times = CommitTimes()
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
    times = CommitTimes()
    try:
        with times.part("step_fn"):
            raise RuntimeError("the step function failed")
    except RuntimeError:
        pass
    assert times.seconds["step_fn"] > 0 and times.per_commit_ms()["step_fn"] > 0
