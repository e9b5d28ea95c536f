"""Entering an epoch: wait for one that has this replica as a member, exchange rows, carry out
the plan (``entry_plan``), and apply what was received once the replica's ranks agree.

The rows travel in one all-reduce; every member computes the same plan from them. Then, in the
order every member follows: the joiners of a join step receive a member's loop-advanced states,
and the receivers get the donor's logged updates (by log) or its whole state (by state). What a
rank receives is applied only after every rank of its replica succeeded in the same epoch: all
shards of a replica change together or none does.
"""

from __future__ import annotations

import io
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ftsystem.chaos.faults import FaultSchedule
from ftsystem.control.membership import Epoch
from ftsystem.measure import metrics
from ftsystem.training import carriable
from ftsystem.training.entry_plan import (NO_LOG, ROW_WORDS, EntryPlan, MemberRow,
                                          copy_inherits_lineage, forked, plan_entry,
                                          sync_by_log)
from ftsystem.training.ftar import CollectiveFailed, EpochChanged, FaultTolerantAllReduce
from ftsystem.training.integrity import Integrity
from ftsystem.training.local_state import LocalState
from ftsystem.training.replica_group import ReplicaGroup, Verdict
from ftsystem.training.runtime import ControlPlane, ReplicaContext
from ftsystem.training.update_log import LoggedUpdate

log = logging.getLogger(__name__)
WAIT_POLL_S = 0.05


class ReplicaEvictedError(RuntimeError):
    """The controller removed this replica from the job (its lease expired); restart it."""


@dataclass(frozen=True)
class Entered:
    """The outcome of entering an epoch, for this replica."""

    epoch: Epoch
    plan: EntryPlan
    index: int
    """This replica's index among the epoch's members."""
    replaced: bool
    """Its state was replaced by a peer's: gradients it computed belong to an older step."""
    join_carry: bytes | None
    """In the plan's join step: the loop-advanced states of the step it takes; else None."""

    @property
    def takes_join_step(self) -> bool:
        return self.join_carry is not None


class EpochEntry:
    """Carries out epoch entries for one rank (see the module's doc)."""

    def __init__(self, ctx: ReplicaContext, control: ControlPlane, replica: ReplicaGroup,
                 ftar: FaultTolerantAllReduce, state: LocalState, integrity: Integrity,
                 faults: FaultSchedule, device: torch.device, numel: int, dtype: torch.dtype,
                 vote: Callable[[Exception | None, int, bool], Verdict],
                 after_failed_vote: Callable[[Verdict, Exception | None], None]) -> None:
        self.ctx, self.control, self.replica, self.ftar = ctx, control, replica, ftar
        self.state, self.integrity, self.faults = state, integrity, faults
        self._device, self._numel, self._dtype = device, numel, dtype
        self._vote, self._after_failed_vote = vote, after_failed_vote
        self._labels = (ctx.job, ctx.replica_id)
        self.epochs: list[dict] = []
        """Every epoch this process entered: number, reason, wall time, seconds it took."""

    def enter(self, newer_than: int, at_least: int = 0, *, will_sum: bool = False,
              offers_join_step: bool = False, registered_state: Callable[[], str],
              while_waiting: Callable[[], None] = lambda: None) -> Entered:
        """Join the newest epoch (numbered ``at_least`` or above) that has this replica as a
        trainable member, and sync state. ``will_sum``: an all-reduce of gradients follows at
        once (entered from a commit). ``while_waiting``: called while no such epoch exists
        (a joiner keeps replaying its donor's log)."""
        started = time.monotonic()
        try:
            while True:
                epoch = self._wait_member_epoch(max(newer_than, at_least - 1), while_waiting)
                # What this replica can donate is fixed now: the session expiry may trim the
                # log later. Agreed by its ranks here, where all of them are in every attempt.
                held = self.state.update_log.entries()
                oldest = self._oldest_replayable(held)
                staged, error = None, None
                try:
                    self.ftar.configure(epoch)
                    staged = self._stage(held, oldest, will_sum, offers_join_step)
                except (EpochChanged, CollectiveFailed) as e:
                    error = e
                verdict = self._vote(error, epoch.number, staged is not None and
                                     staged[1] is not None)
                if verdict.ok:
                    break
                self._after_failed_vote(verdict, error)
                newer_than = verdict.highest
            entered, apply = staged
            if apply is not None:
                apply()
            self.state.entered_epoch()
            took = time.monotonic() - started
            self.epochs.append({"number": epoch.number, "reason": epoch.reason,
                                "time": time.time(), "seconds": took,
                                "members": list(epoch.members)})
            metrics.EPOCH_CHANGE.labels(*self._labels, epoch.reason).observe(took)
            # Not waited for: an etcd write (a WAL fsync) would add to every member's stall.
            self.control.register(state=registered_state(), step=self.state.step, wait=False)
            return Entered(epoch, entered.plan, entered.index, verdict.replaced,
                           entered.join_carry)
        finally:
            metrics.STALL.labels(*self._labels).inc(time.monotonic() - started)

    def _wait_member_epoch(self, newer_than: int, while_waiting: Callable[[], None]) -> Epoch:
        me = self.ctx.replica_id
        while True:
            epoch = self.control.wait_for_epoch(newer_than, WAIT_POLL_S)
            if epoch is None:
                while_waiting()
                continue
            if me in epoch.members and not epoch.paused:
                return epoch
            if me not in epoch.members and self.ftar.epoch is not None and \
                    me in self.ftar.epoch.members:
                raise ReplicaEvictedError(f"replica {me} was removed in epoch {epoch.number}")
            newer_than = epoch.number  # paused, or a join that does not include us yet

    def _oldest_replayable(self, held: list[tuple[int, LoggedUpdate]]) -> int:
        """The oldest step this replica's log can replay from, the same on all its ranks
        (NO_LOG: none): every shard of a replica must be synced the same way, by log or by
        state, as replaying runs the step function on all its ranks together."""
        (empty,) = self.replica.any(not held)
        return NO_LOG if empty else self.replica.max(held[0][0])

    def _stage(self, held: list[tuple[int, LoggedUpdate]], oldest: int, will_sum: bool,
               offers_join_step: bool) -> tuple[Entered, Callable[[], None] | None]:
        """Exchange rows, plan, move what the plan says; return the outcome and what applies
        the received state (None: this rank's state stays)."""
        n, rank = self.ftar.world_size, self.ftar.rank
        # A member about to sum its gradients has drawn the batch of the step being committed:
        # a joiner taking that step with no gradient takes these states.
        pending_carry = self.state.objects.carry() if will_sum else b""
        mine = MemberRow(step=self.state.step, chain=self.state.chain, fresh=self.state.fresh,
                         lineage=self.state.lineage, verified=self.state.verified,
                         oldest_logged=oldest,
                         signature=self.integrity.signature_word(), will_sum=will_sum,
                         offers_join_step=offers_join_step, carry_size=len(pending_carry))
        table = torch.zeros(n, ROW_WORDS, dtype=torch.int64, device=self._device)
        table[rank] = torch.tensor(mine.words(), dtype=torch.int64)
        self.ftar.allreduce_sum(table)
        rows = [MemberRow.from_words(words) for words in table.tolist()]
        plan = plan_entry(rows)
        if rank in plan.mismatched:
            self.integrity.signature_mismatch(self.ftar.epoch.members[plan.donor])
        join_carry = None
        if plan.join_step:
            source = plan.carry_source
            carry = self._broadcast_bytes(pending_carry if rank == source else b"", source,
                                          size=rows[source].carry_size)
            if rank in plan.join_step:
                join_carry = carry
        entered = Entered(self.ftar.epoch, plan, rank, False, join_carry)
        if not plan.receivers:
            return entered, None
        self.faults.check(self.state.step, "sync")  # state is about to move between members
        parents: dict[int, bytes] = {}
        meta: list[tuple[int, bytes, bytes, bytes, bytes]] = []
        if plan.log_possible:
            meta = self._broadcast_log_meta(plan, held)
            parents = {step: parent for step, parent, *_ in meta}
        by_log = sync_by_log(plan, rows, parents)
        if forked(plan, rows, parents, rank):
            self.integrity.report_divergence("commit-chain",
                                             [self.ftar.epoch.members[plan.donor]])
        if by_log:
            apply = self._sync_by_log(plan, held, meta)
        else:
            apply = self._sync_by_state(plan, copy_inherits_lineage(rows[plan.donor]))
        return entered, (apply if rank in plan.receivers else None)

    def _broadcast_bytes(self, payload: bytes, root: int, size: int | None = None) -> bytes:
        """``payload`` of member ``root``, on every member (``size``: its length, if every
        member knows it)."""
        if size is None:
            sizes = torch.zeros(1, dtype=torch.int64, device=self._device)
            if self.ftar.rank == root:
                sizes[0] = len(payload)
            self.ftar.allreduce_sum(sizes)
            size = int(sizes.item())
        if not size:  # every member knows it: nothing to send
            return b""
        buf = torch.zeros(size, dtype=torch.uint8, device=self._device)
        if self.ftar.rank == root:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.ftar.broadcast(buf, root)
        return buf.cpu().numpy().tobytes()

    def _broadcast_log_meta(self, plan: EntryPlan, held: list[tuple[int, LoggedUpdate]]
                            ) -> list[tuple[int, bytes, bytes, bytes, bytes]]:
        """The donor's (step, parent chain, chain, carry, carry before) for the steps the
        receivers lack."""
        first, last = plan.log_first, plan.log_last
        payload = b""
        if self.ftar.rank == plan.donor:
            rows = [(step, u.parent, u.chain, u.carry, u.carry_before) for step, u in held
                    if first <= step <= last]
            if [row[0] for row in rows] != list(range(first, last + 1)):
                raise RuntimeError(f"update log does not hold steps {first}..{last}: a bug; "
                                   "dying is better than a silent divergence")
            out = io.BytesIO()
            torch.save(rows, out)
            payload = out.getvalue()
        received = self._broadcast_bytes(payload, plan.donor)
        return [tuple(row) for row in carriable.load(io.BytesIO(received))]

    def _sync_by_log(self, plan: EntryPlan, held: list[tuple[int, LoggedUpdate]],
                     meta: list[tuple[int, bytes, bytes, bytes, bytes]]) -> Callable[[], None]:
        """Broadcast the donor's updates for the steps the receivers lack; replay ours."""
        first, last = plan.log_first, plan.log_last
        updates = torch.zeros(last - first + 1, self._numel, dtype=self._dtype,
                              device=self._device)
        if self.ftar.rank == plan.donor:
            for step, update in held:
                if first <= step <= last:
                    updates[step - first].copy_(update.grad)
        self.ftar.broadcast(updates, plan.donor)

        def replay() -> None:
            for step, parent, chain, carry, carry_before in meta:
                if step > self.state.step:
                    self.state.replay(LoggedUpdate(updates[step - first], parent, chain, carry,
                                                   carry_before))
                    metrics.CATCHUP_STEPS.labels(*self._labels).inc()
        return replay

    def _sync_by_state(self, plan: EntryPlan, inherit_lineage: bool) -> Callable[[], None]:
        donor = plan.donor
        buf = self._broadcast_bytes(self.state.serialize() if self.ftar.rank == donor else b"",
                                    donor)
        source = self.ftar.epoch.members[donor]

        def load() -> None:
            self.state.load_serialized(buf, self._device, inherit_lineage=inherit_lineage)
            log.info("replica %s rank %d loaded state at step %d from %s", self.ctx.replica_id,
                     self.ctx.rank, self.state.step, source)
        return load
