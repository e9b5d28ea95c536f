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
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

from ftsystem.training.runtime import ENV_KILL_AT

PHASES = ("step", "allreduce", "fail-allreduce", "sync", "donate", "corrupt", "corrupt-donate",
          "fail-join-step")
AT_OR_AFTER = ("sync", "donate", "corrupt-donate", "corrupt-next", "fail-join-step")
"""Phases that fire at the first such moment at or after their step (an epoch's state sync, a
catch-up served to a joiner, a join step), which no test could place at an exact step.
(``corrupt-next``: what a ``corrupt-donate`` point leaves for the training thread.)"""
FAILS = ("fail-allreduce", "fail-join-step")
"""Phases that fail the all-reduce on this replica alone instead of killing it."""


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


class FaultSchedule:
    def __init__(self, points: list[FaultPoint]) -> None:
        self.points = set(points)
        self._lock = threading.Lock()  # the state server's thread adds points

    @classmethod
    def from_env(cls) -> "FaultSchedule":
        text = os.environ.get(ENV_KILL_AT, "")
        return cls([parse_fault_point(p) for p in text.split(",") if p.strip()])

    def fires(self, step: int, phase: str) -> bool:
        """Whether a point of ``phase`` is due at ``step`` (spent once it fired)."""
        with self._lock:
            due = {p for p in self.points if p.phase == phase and
                   (p.step == step or (phase in AT_OR_AFTER and p.step <= step))}
            self.points -= due
        return bool(due)

    def add(self, point: FaultPoint) -> None:
        """A point that another one leads to (``corrupt-donate`` to ``corrupt-next``)."""
        with self._lock:
            self.points.add(point)

    def check(self, step: int, phase: str) -> None:
        """Act on the fault point at (``step``, ``phase``), if there is one."""
        if not self.fires(step, phase):
            return
        if phase in FAILS:  # once: the retry of the same step must succeed
            raise InjectedFault(f"injected {phase} failure at step {step}")
        os.kill(os.getpid(), signal.SIGKILL)
