"""Kill points inside a replica process, for ``--kill-at`` and the fault tests.

The agent passes the points still to come in ``FTSYSTEM_KILL_AT`` (``"STEP[:PHASE],..."``);
the replica sends itself SIGKILL when it reaches one: a real, uncatchable death at an exact
place, which a signal from outside could only hit by chance. Phases: ``step`` (between steps,
before the all-reduce is issued) and ``allreduce`` (the all-reduce is in flight on the peers).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from ftsystem.runtime import ENV_KILL_AT

PHASES = ("step", "allreduce")


@dataclass(frozen=True, slots=True)
class KillPoint:
    step: int
    phase: str = "step"

    def __str__(self) -> str:
        return f"{self.step}:{self.phase}"


def parse_kill_point(text: str) -> KillPoint:
    step, _, phase = text.strip().partition(":")
    if not step.isdigit() or (phase and phase not in PHASES):
        raise ValueError(f"malformed kill point {text!r}: expected STEP or STEP:PHASE with "
                         f"PHASE in {', '.join(PHASES)}, e.g. 120:allreduce")
    return KillPoint(int(step), phase or "step")


def format_kill_points(points: list[KillPoint]) -> str:
    return ",".join(map(str, points))


class KillSchedule:
    def __init__(self, points: list[KillPoint]) -> None:
        self.points = set(points)

    @classmethod
    def from_env(cls) -> "KillSchedule":
        text = os.environ.get(ENV_KILL_AT, "")
        return cls([parse_kill_point(p) for p in text.split(",") if p.strip()])

    def check(self, step: int, phase: str) -> None:
        if KillPoint(step, phase) in self.points:
            os.kill(os.getpid(), signal.SIGKILL)
