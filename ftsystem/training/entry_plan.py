"""Pure: what happens when the members enter an epoch, computed from what each one brings.

Every member sends its :class:`MemberRow` in one all-reduce; every member then computes the
same :class:`EntryPlan` from the same rows, and ``epoch_entry`` carries it out. Nothing here
does I/O, so the rules are property-tested (``tests/test_entry_plan.py``):

- **Who donates.** Among the members that hold the job's state (not fresh), the most advanced;
  at that step, the commit chain with the most votes, one per copy lineage that holds it
  (:attr:`MemberRow.lineage`, ``fingerprint.lineage_votes``); the lowest index among equals. With nobody holding state
  (the job's start) member 0.
- **Who receives.** Every member that is fresh, behind the donor, or at its step on another
  chain. Members at the donor's step on its chain hold identical state already.
- **By log or by state.** Receivers behind by steps the donor's log still holds, all on its
  history, replay those steps (:func:`sync_by_log`); otherwise the donor's whole state moves.
- **The join step.** Joiners that offer to take the members' current step with no gradient do
  so when every other member is about to all-reduce its gradients; the others then divide the
  sum by the number of members that sent gradients (:attr:`EntryPlan.divisor`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ftsystem.training.fingerprint import WORDS, from_words, lineage_votes, to_words

NO_LOG = -1
""":attr:`MemberRow.oldest_logged` of a member whose log holds nothing."""


@dataclass(frozen=True)
class MemberRow:
    """What one member brings to an epoch's entry."""

    step: int
    """Committed steps."""
    chain: bytes
    """Its commit chain (``fingerprint.chain_next``)."""
    fresh: bool = False
    """It holds no state of the job yet (a new process, or one that dropped its state)."""
    lineage: int = 0
    """Its copy lineage (``LocalState.lineage``): members of one lineage hold states descended
    from one whole-state copy, and vote once."""
    verified: bool = False
    """Its state is the one its last digest comparison found agreeing with the majority (it
    has not stepped since): a copy of it starts a lineage of its own."""
    oldest_logged: int = NO_LOG
    """The oldest step its update log can replay from."""
    signature: int = 0
    """A hash of what every replica must agree on (registered objects, settings)."""
    will_sum: bool = False
    """It entered the epoch to all-reduce the gradients it has computed."""
    offers_join_step: bool = False
    """A joiner that would take the members' current step with no gradient."""
    carry_size: int = 0
    """The length of its loop-advanced objects' states (sent to joiners taking a join step)."""

    def words(self) -> list[int]:
        """As int64 words (what travels in the all-reduce)."""
        return [self.step, int(self.fresh), self.lineage, int(self.verified), self.oldest_logged,
                self.signature, int(self.will_sum), int(self.offers_join_step),
                self.carry_size, *to_words(self.chain)]

    @classmethod
    def from_words(cls, words: list[int]) -> "MemberRow":
        (step, fresh, lineage, verified, oldest, signature, will_sum, offers, carry_size), chain \
            = words[:9], words[9:]
        return cls(step=step, chain=from_words(chain), fresh=bool(fresh), lineage=lineage,
                   verified=bool(verified), oldest_logged=oldest, signature=signature,
                   will_sum=bool(will_sum), offers_join_step=bool(offers),
                   carry_size=carry_size)


ROW_WORDS = len(fields(MemberRow)) - 1 + WORDS


@dataclass(frozen=True)
class EntryPlan:
    """What every member does at an epoch's entry (indices into the epoch's members)."""

    donor: int
    receivers: tuple[int, ...]
    mismatched: tuple[int, ...]
    """Members whose signature differs from the donor's: they cannot take part."""
    log_first: int
    """The first step a receiver lacks (the donor's log must start there to sync by log)."""
    log_last: int
    """The donor's step."""
    log_possible: bool
    """Whether the receivers can replay the donor's log, before checking that each one is on
    the donor's history (:func:`sync_by_log`)."""
    join_step: tuple[int, ...]
    """Joiners whose first all-reduce of this epoch carries zeros (they take no part in the
    average)."""
    carry_source: int
    """The member whose loop-advanced objects' states the joiners of ``join_step`` take; -1."""
    size: int

    @property
    def divisor(self) -> int:
        """What the first all-reduce of the epoch is divided by: the members that sent
        gradients."""
        return self.size - len(self.join_step)


def choose_donor(rows: list[MemberRow]) -> int:
    holders = [i for i, r in enumerate(rows) if not r.fresh] or list(range(len(rows)))
    top = max(rows[i].step for i in holders)
    at_top = [i for i in holders if rows[i].step == top]
    votes = lineage_votes([rows[i].chain for i in at_top], [rows[i].lineage for i in at_top])
    best = max(votes.values())
    return next(i for i in at_top if votes[rows[i].chain] == best)


def copy_inherits_lineage(donor: MemberRow) -> bool:
    """Whether a receiver of ``donor``'s whole state joins its lineage. Not at the job's start
    (the donor is fresh: the initial state, which every replica would compute alike), nor from
    a state the last comparison verified (a repair receives the majority's state at the step
    it was compared): a corruption there was ruled out, so the copy is a witness of its own."""
    return not (donor.fresh or donor.verified)


def join_step_absentees(summing: list[bool], offers: list[bool], receivers: list[int]
                        ) -> tuple[list[int], int]:
    """The members that take part in an epoch's first all-reduce with no gradient, and the
    member whose loop-advanced objects' states they take.

    Those are the joiners that offer to (``offers``), provided every other member is about to
    all-reduce the gradients it has computed (``summing``: it entered the epoch from a
    commit). The states come from the first other member that loads nothing at the epoch's
    entry (a receiver's belong to an older step). Otherwise nobody, ``([], -1)``: the joiners
    compute their first step.
    """
    joiners = [i for i, offer in enumerate(offers) if offer]
    others = [i for i, offer in enumerate(offers) if not offer]
    sources = [i for i in others if i not in receivers]
    if not joiners or not sources or not all(summing[i] for i in others):
        return [], -1
    return joiners, sources[0]


def plan_entry(rows: list[MemberRow]) -> EntryPlan:
    donor = choose_donor(rows)
    d = rows[donor]
    receivers = tuple(i for i, r in enumerate(rows) if i != donor and
                      (r.fresh or r.step != d.step or r.chain != d.chain))
    first = min((rows[r].step for r in receivers), default=d.step) + 1
    log_possible = bool(receivers) and \
        not any(rows[r].fresh or rows[r].step == d.step for r in receivers) and \
        0 <= d.oldest_logged <= first
    absent, source = join_step_absentees([r.will_sum for r in rows],
                                         [r.offers_join_step for r in rows], list(receivers))
    return EntryPlan(donor=donor, receivers=receivers,
                     mismatched=tuple(i for i, r in enumerate(rows)
                                      if r.signature != d.signature),
                     log_first=first, log_last=d.step, log_possible=log_possible,
                     join_step=tuple(absent), carry_source=source, size=len(rows))


def sync_by_log(plan: EntryPlan, rows: list[MemberRow], parents: dict[int, bytes]) -> bool:
    """Whether the receivers replay the donor's log: possible, and each receiver's chain is
    the parent of the first step it lacks (it is on the donor's history). ``parents``: step ->
    the chain that step continues, from the donor's log."""
    return plan.log_possible and all(parents.get(rows[r].step + 1) == rows[r].chain
                                     for r in plan.receivers)


def forked(plan: EntryPlan, rows: list[MemberRow], parents: dict[int, bytes], member: int
           ) -> bool:
    """Whether ``member``, a receiver that held state, is on another history than the donor
    (a divergence to report): at the donor's step on another chain, or its chain is not the
    parent of the donor's next logged step."""
    row = rows[member]
    if member not in plan.receivers or row.fresh:
        return False
    return row.step == plan.log_last or parents.get(row.step + 1, row.chain) != row.chain
