"""Where a replica is in its life, as one value with its allowed moves.

.. code-block:: text

    NEW ─┬─> WARMING ──> CATCHING_UP ──┬─> JOINING ─┬─> JOIN_STEP ──> MEMBER
         ├─────────────> CATCHING_UP ──┘            └─────────────> MEMBER
         └────────────────────────────────> JOINING
    MEMBER ──> REPAIRING ──> MEMBER
    MEMBER ──> FINISHING ──> FINISHED

A joiner (NEW, then WARMING while the loop computes the step it drops) catches up from a donor
while the others train, registers ready (JOINING) and enters its first epoch. If the members
accept its offer there, its first all-reduce carries zeros for the step they are committing
(JOIN_STEP); otherwise it computes its first step as a MEMBER. A member whose state digest
differs from the majority's drops its state and receives the job's (REPAIRING). ``finish()``
keeps a done replica serving late joiners (FINISHING) until everybody is done (FINISHED).

Every move goes through :meth:`Lifecycle.move`, which refuses one the diagram does not have:
a path that forgets a step fails loudly where it happens instead of leaving a flag set.
"""

from __future__ import annotations

import enum
import logging

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    NEW = "new"
    WARMING = "warming"
    CATCHING_UP = "catching-up"
    JOINING = "joining"
    JOIN_STEP = "join-step"
    MEMBER = "member"
    REPAIRING = "repairing"
    FINISHING = "finishing"
    FINISHED = "finished"


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.NEW: frozenset({Phase.WARMING, Phase.CATCHING_UP, Phase.JOINING}),
    Phase.WARMING: frozenset({Phase.CATCHING_UP}),
    Phase.CATCHING_UP: frozenset({Phase.JOINING}),
    Phase.JOINING: frozenset({Phase.JOIN_STEP, Phase.MEMBER}),
    Phase.JOIN_STEP: frozenset({Phase.MEMBER}),
    Phase.MEMBER: frozenset({Phase.REPAIRING, Phase.FINISHING}),
    Phase.REPAIRING: frozenset({Phase.MEMBER}),
    Phase.FINISHING: frozenset({Phase.FINISHED}),
    Phase.FINISHED: frozenset(),
}


class PhaseError(RuntimeError):
    """A move the lifecycle does not allow: a bug of ftsystem, or a call out of order."""


class Lifecycle:
    """The phase of one replica; it alone changes it."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.phase = Phase.NEW

    def move(self, to: Phase) -> None:
        if to not in ALLOWED[self.phase]:
            raise PhaseError(f"replica {self._name}: cannot go from {self.phase.value} to "
                             f"{to.value}")
        log.debug("replica %s: %s -> %s", self._name, self.phase.value, to.value)
        self.phase = to

    def is_(self, *phases: Phase) -> bool:
        return self.phase in phases

    @property
    def done(self) -> bool:
        """Whether the others must see this replica as done (it finished its steps)."""
        return self.phase in (Phase.FINISHING, Phase.FINISHED)
