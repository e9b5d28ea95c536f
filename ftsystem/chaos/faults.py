"""Fault points inside a replica process, for ``--kill-at`` and the fault tests.

The agent passes the points still to come in ``FTSYSTEM_KILL_AT`` (``"STEP[:PHASE],..."``);
the replica acts when it reaches one. Kills are real SIGKILLs the process sends itself: an
uncatchable death at an exact place, which a signal from outside could only hit by chance.

Phases:
- ``step``: SIGKILL between steps, before the all-reduce is issued;
- ``allreduce``: SIGKILL while the all-reduce is in flight on the peers;
- ``fail-allreduce``: the all-reduce completes on the peers but this replica treats it as
  failed (a link that dropped after the data arrived): the peers commit the step, this one
  does not, and step reconciliation at the next epoch must repair it;
- ``sync``: SIGKILL in the first epoch state sync at or after the step that moves state
  between members, before its broadcast;
- ``donate``: SIGKILL when this replica, at or after the step, serves a joiner's catch-up
  (a donor dying mid-transfer);
- ``corrupt``: no kill: one parameter value changes in memory after the step (a bad memory
  cell); the periodic state digest must find and repair it;
- ``fail-join-step``: no kill: the all-reduce of this replica's first join step at or after the
  step fails on it alone while the members commit (it must enter the next epoch and still send
  zeros there, not gradients divided as if it sent none);
- ``corrupt-donate``: no kill: when this replica, at or after the step, serves a joiner's
  catch-up, it corrupts a parameter at its next commit, before the snapshot is taken (a donor
  gone bad just before the transfer: the joiner copies the bad state).

Before a kill strikes, it records its wall-clock instant, which reaches etcd as a chaos order
carried out (action ``kill-at``, the record the chaos executor writes): the survivors' stall is
measured from it (``ftsystem.measure.stall.faults``), not from the failure record that the
agent writes after detecting the death.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ftsystem.chaos.spec import Order
from ftsystem.control import keys
from ftsystem.control.store import Store, StoreError
from ftsystem.training.runtime import ENV_ETCD, ENV_GENERATION, ENV_JOB, ENV_KILL_AT, ENV_REPLICA

log = logging.getLogger(__name__)

PHASES = ("step", "allreduce", "fail-allreduce", "sync", "donate", "corrupt", "corrupt-donate",
          "fail-join-step")
AT_OR_AFTER = ("sync", "donate", "corrupt-donate", "corrupt-next", "fail-join-step")
"""Phases that fire at the first such moment at or after their step (an epoch's state sync, a
catch-up served to a joiner, a join step), which no test could place at an exact step.
(``corrupt-next``: what a ``corrupt-donate`` point leaves for the training thread.)"""
FAILS = ("fail-allreduce", "fail-join-step")
"""Phases that fail the all-reduce on this replica alone instead of killing it."""
KILLS = ("step", "allreduce", "sync", "donate")
"""Phases that SIGKILL the process, each after recording its instant (:class:`KillRecorder`)."""
RECORD_ACTION = "kill-at"
"""The action of a kill's record among the chaos orders."""
RECORD_TIMEOUT_S = 1.0
"""How long the recorder tries to store a kill's instant; past it the stall is measured from
the agent's failure record (etcd unreachable, or stopped by a chaos order)."""
PARENT_POLL_S = 1.0
"""How often the recorder checks that its replica process is still there."""


class InjectedFault(Exception):
    """A collective failure injected by a ``fail-allreduce`` fault point."""


@dataclass(frozen=True, slots=True)
class FaultPoint:
    step: int
    phase: str = "step"

    def __str__(self) -> str:
        return f"{self.step}:{self.phase}"


def parse_fault_point(text: str) -> FaultPoint:
    step, _, phase = text.strip().partition(":")
    if not step.isdigit() or (phase and phase not in PHASES):
        raise ValueError(f"malformed fault point {text!r}: expected STEP or STEP:PHASE with "
                         f"PHASE in {', '.join(PHASES)}, e.g. 120:allreduce")
    return FaultPoint(int(step), phase or "step")


def format_fault_points(points: list[FaultPoint]) -> str:
    return ",".join(map(str, points))


class KillRecorder:
    """Stores the instant of this process's kills in etcd, as chaos orders carried out.

    A kill cannot wait for etcd: a write takes a millisecond or more, time enough for an
    all-reduce that the kill should interrupt to complete on the peers. The kill writes its
    record on a pipe instead (microseconds; the pipe keeps it once the process is dead), to a
    recorder process started with the schedule, in a session of its own so that the teardown
    of the replica spares it. The recorder stores each record and ends with the pipe.
    """

    def __init__(self, etcd: str, job: str, replica: str, generation: str) -> None:
        self.replica, self.generation = replica, generation
        read, self._pipe = os.pipe()
        try:
            self._recorder = subprocess.Popen(
                [sys.executable, "-m", __name__, etcd, job, str(os.getpid())], stdin=read,
                start_new_session=True)
        finally:
            os.close(read)

    @classmethod
    def from_env(cls) -> "KillRecorder | None":
        """The recorder of this replica process's kills; None outside a job (no etcd)."""
        etcd = os.environ.get(ENV_ETCD)
        if not etcd:
            return None
        return cls(etcd, os.environ.get(ENV_JOB, ""), os.environ.get(ENV_REPLICA, ""),
                   os.environ.get(ENV_GENERATION, "0"))

    def record(self, point: FaultPoint) -> None:
        """Record that ``point`` strikes now (the clock of the commit files: ``time.time()``)."""
        now = time.time()
        order = Order(id=f"{RECORD_ACTION}-{self.replica}-g{self.generation}-{point.step}-"
                         f"{point.phase}", action=RECORD_ACTION, replica=self.replica, at=now,
                      state="done", outcome=f"SIGKILL at {point}", executed_at=now)
        try:  # one write under PIPE_BUF: the recorder reads all of it or nothing
            os.write(self._pipe, order.to_json().encode() + b"\n")
        except OSError as e:  # the recorder is gone; the fault must strike all the same
            log.warning("replica %s: the instant of the kill at %s was not recorded (%s)",
                        self.replica, point, e)


def store_records(etcd: str, job: str, parent: int) -> None:
    """The recorder process: stores each order that comes on stdin, until stdin ends or the
    process ``parent`` is gone with nothing left to read."""
    asyncio.run(_store_records(etcd, job, parent))


async def _store_records(etcd: str, job: str, parent: int) -> None:
    store = Store(etcd, retry_deadline_s=RECORD_TIMEOUT_S)
    loop = asyncio.get_running_loop()
    with contextlib.suppress(StoreError):  # connected before a kill comes, where etcd answers
        await store.connect()
    try:
        while records := await loop.run_in_executor(None, _read, parent):
            for line in records.splitlines():
                await _store(store, job, Order.from_json(line))
    finally:
        await store.close()


async def _store(store: Store, job: str, order: Order) -> None:
    try:
        await asyncio.wait_for(store.put(keys.chaos(job, order.id), order.to_json()),
                               RECORD_TIMEOUT_S)
    except (StoreError, TimeoutError) as e:
        log.warning("replica %s: the instant of the %s was not recorded (%s); its stall will be "
                    "measured from the failure record", order.replica, order.outcome, e)


def _read(parent: int) -> bytes:
    """What came on stdin; empty at its end, or once ``parent`` is gone and nothing came (a
    process it forked may hold the pipe open)."""
    while not select.select([sys.stdin], [], [], PARENT_POLL_S)[0]:
        if os.getppid() != parent:
            return b""
    return os.read(sys.stdin.fileno(), 1 << 16)


class FaultSchedule:
    def __init__(self, points: list[FaultPoint], recorder: KillRecorder | None = None) -> None:
        self.points = set(points)
        self.recorder = recorder
        self._lock = threading.Lock()  # the state server's thread adds points

    @classmethod
    def from_env(cls) -> "FaultSchedule":
        text = os.environ.get(ENV_KILL_AT, "")
        points = [parse_fault_point(p) for p in text.split(",") if p.strip()]
        kills = any(p.phase in KILLS for p in points)
        return cls(points, KillRecorder.from_env() if kills else None)

    def fires(self, step: int, phase: str) -> bool:
        """Whether a point of ``phase`` is due at ``step`` (spent once it fired)."""
        return bool(self._take_due(step, phase))

    def _take_due(self, step: int, phase: str) -> set[FaultPoint]:
        with self._lock:
            due = {p for p in self.points if p.phase == phase and
                   (p.step == step or (phase in AT_OR_AFTER and p.step <= step))}
            self.points -= due
        return due

    def add(self, point: FaultPoint) -> None:
        """A point that another one leads to (``corrupt-donate`` to ``corrupt-next``)."""
        with self._lock:
            self.points.add(point)

    def check(self, step: int, phase: str) -> None:
        """Act on the fault point at (``step``, ``phase``), if there is one."""
        due = self._take_due(step, phase)
        if not due:
            return
        if phase in FAILS:  # once: the retry of the same step must succeed
            raise InjectedFault(f"injected {phase} failure at step {step}")
        if self.recorder is not None:
            self.recorder.record(min(due, key=lambda p: p.step))
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    store_records(sys.argv[1], sys.argv[2], int(sys.argv[3]))
