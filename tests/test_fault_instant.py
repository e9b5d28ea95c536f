"""A ``--kill-at`` point records the instant of its kill in etcd before it strikes: real
processes that SIGKILL themselves, against a real etcd."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

from ftsystem.chaos.faults import RECORD_ACTION, RECORD_TIMEOUT_S, FaultSchedule
from ftsystem.control import keys
from ftsystem.control.etcd_server import free_port
from ftsystem.control.store import Store
from ftsystem.training import runtime

# A replica process in miniature: its schedule from the environment, then the step's check.
REPLICA = ("import sys, time\n"
           "from ftsystem.chaos.faults import FaultSchedule\n"
           "schedule = FaultSchedule.from_env()\n"
           "print(time.time(), flush=True)\n"
           "schedule.check(int(sys.argv[1]), 'step')\n")


def _env(etcd_url: str, job: str, kill_at: str) -> dict[str, str]:
    return os.environ | {runtime.ENV_ETCD: etcd_url, runtime.ENV_JOB: job,
                         runtime.ENV_REPLICA: "r1", runtime.ENV_GENERATION: "2",
                         runtime.ENV_KILL_AT: kill_at}


def _replica(etcd_url: str, job: str, kill_at: str, step: int) -> tuple[float, float, str]:
    """Run the replica to its check at ``step``: (instant before the check, instant its exit
    was seen, stderr once its recorder is done too); it must have died of SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-c", REPLICA, str(step)],
                            env=_env(etcd_url, job, kill_at), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    before = float(proc.stdout.readline())
    proc.wait(timeout=60)
    seen = time.time()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
    # The recorder holds the replica's stderr until it has stored what it was given.
    return before, seen, proc.stderr.read()


def _orders(etcd_url: str, job: str) -> list[dict]:
    async def read() -> list[dict]:
        async with Store(etcd_url) as store:
            items, _ = await store.get_prefix(keys.chaos_orders(job))
        return [json.loads(v) for v in items.values()]
    return asyncio.run(read())


def test_a_kill_records_its_instant_as_a_chaos_order_carried_out(etcd, job_id):
    before, seen, _ = _replica(etcd.url, job_id, "5:step", 5)
    [order] = _orders(etcd.url, job_id)
    assert (order["action"], order["replica"], order["state"]) == (RECORD_ACTION, "r1", "done")
    assert order["id"] == f"{RECORD_ACTION}-r1-g2-5-step"
    assert "SIGKILL at 5:step" in order["outcome"]
    # Taken on the commit files' clock, between the check and the death.
    assert before <= order["executed_at"] == order["at"] <= seen


def test_a_kill_waits_for_no_etcd_and_strikes_when_it_is_unreachable(job_id):
    # The kill hands its record over in microseconds: it must strike while an all-reduce it
    # interrupts is in flight, not a millisecond later, let alone after a timeout.
    probe = ("import time\n"
             "from ftsystem.chaos.faults import FaultPoint, FaultSchedule\n"
             "recorder = FaultSchedule.from_env().recorder\n"
             "start = time.perf_counter()\n"
             "recorder.record(FaultPoint(5))\n"
             "print(time.perf_counter() - start)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=_env(f"http://127.0.0.1:{free_port()}", job_id, "5:step"),
                          timeout=60, check=True)
    assert float(done.stdout) < RECORD_TIMEOUT_S / 20, done.stdout
    assert "was not recorded" in done.stderr  # by the recorder, after its attempt
    before, seen, stderr = _replica(f"http://127.0.0.1:{free_port()}", job_id, "5:step", 5)
    assert seen - before < RECORD_TIMEOUT_S, (seen - before, stderr)


def test_a_process_whose_kill_never_came_exits_and_so_does_its_recorder(etcd, job_id):
    done = subprocess.run([sys.executable, "-c", REPLICA, "5"], capture_output=True, text=True,
                          env=_env(etcd.url, job_id, "500:step"), timeout=60, check=False)
    assert done.returncode == 0, done.stderr  # and the pipes closed: no recorder is left
    assert _orders(etcd.url, job_id) == []


def test_only_a_schedule_that_kills_connects_to_etcd(monkeypatch):
    monkeypatch.setenv(runtime.ENV_ETCD, f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv(runtime.ENV_KILL_AT, "3:fail-allreduce,4:corrupt")
    assert FaultSchedule.from_env().recorder is None
    monkeypatch.delenv(runtime.ENV_ETCD)
    monkeypatch.setenv(runtime.ENV_KILL_AT, "3:step")
    assert FaultSchedule.from_env().recorder is None  # outside a job
