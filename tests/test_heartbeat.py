"""The heartbeat file and the agent's watchdog: a crash with a slow teardown is a crash.

Seen under load: a rank raised, then spent seconds destroying its process groups with no
thread left to beat, and its agent reported "hung" instead of the exception's exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from agent.supervisor import TEARDOWN_S, hang_reason
from conftest import wait_for
from ftsystem.training.runtime import DONE_MARK, EXITING_MARK

WATCHDOG_S = 5.0


def test_a_silent_rank_is_hung_after_the_watchdog_and_an_exiting_one_only_after_teardown():
    assert hang_reason(0, WATCHDOG_S - 1, None, WATCHDOG_S) is None
    assert hang_reason(1, WATCHDOG_S + 1, None, WATCHDOG_S) == \
        "local rank 1 hung: no heartbeat for 6s"
    for mark in (DONE_MARK, EXITING_MARK):
        assert hang_reason(0, WATCHDOG_S + 1, mark, WATCHDOG_S) is None
        assert "hung while exiting" in hang_reason(0, TEARDOWN_S + 1, mark, WATCHDOG_S)


SLOW_TEARDOWN = textwrap.dedent("""
    import sys, time
    from ftsystem.training.runtime import Heartbeat

    class SlowToDestroy:  # like a process group whose destructor takes seconds
        def __del__(self):
            time.sleep(30)

    beat = Heartbeat(sys.argv[1])
    beat.beat(7)
    keep = SlowToDestroy()
    raise RuntimeError("replica r0 was removed in epoch 6")
""")


def test_an_uncaught_exception_marks_the_heartbeat_before_a_slow_teardown(tmp_path):
    path = tmp_path / "heartbeat"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_TEARDOWN, str(path)],
                            stderr=subprocess.PIPE, text=True)
    try:
        # Still alive (tearing down) and already marked: the watchdog leaves it to its exit code.
        line = wait_for(lambda: EXITING_MARK in _read(path) and _read(path), 60,
                        "the exiting mark")
        assert line.split() == ["7", EXITING_MARK]
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def _read(path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
