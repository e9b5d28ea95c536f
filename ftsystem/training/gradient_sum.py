"""The gradients of one step summed over the epoch's members, retried until the replica's ranks
agree (docs/step_protocol.md).

An attempt all-reduces this rank's gradient shards on the current epoch's group, either as one
flat buffer after backward or as the buckets backward sent (the overlap), inside the straggler
bound. Then the replica's ranks vote. A failed or superseded attempt is retried in the next
epoch with the same gradients (no recomputation); entering that epoch may replace this
replica's state, and then the gradients are dropped.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch
from torch import nn

from ftsystem.chaos.faults import FaultSchedule, InjectedFault
from ftsystem.control.timeouts import StragglerBound
from ftsystem.measure import metrics
from ftsystem.training.ftar import (CollectiveFailed, EpochChanged, FaultTolerantAllReduce,
                                    Stragglers)
from ftsystem.training.overlap import GradientProducedTwice, OverlapInvalid, OverlappedGradSum
from ftsystem.training.replica_group import ReplicaGroup, Verdict
from ftsystem.training.runtime import ControlPlane, ReplicaContext
from ftsystem.training.settings import ENV_OVERLAP
from ftsystem.training.flat import FlatLayout
from ftsystem.training.shards import local
from ftsystem.training.commit_times import CommitTimes
from ftsystem.training.update_log import UpdateLog

log = logging.getLogger(__name__)

MIN_CPU_OVERLAP_BUCKETS = 4
"""On CPU, gradients of fewer buckets than this go out in one buffer after backward."""


def overlap_by_default(params: list[nn.Parameter], bucket_cap_bytes: int,
                       setting: bool | None = None) -> bool:
    """``setting`` (``FTSYSTEM_OVERLAP``) if given; otherwise overlap gradients that live on a
    GPU, and CPU gradients of at least :data:`MIN_CPU_OVERLAP_BUCKETS` buckets.

    On a GPU, Gloo's or NCCL's work runs beside a backward that leaves the CPU idle. On CPU
    the all-reduce competes with backward for the same cores, and only pays when several
    buckets can go out while backward still has layers to compute: with one or two buckets
    the last is sent when backward ends anyway. Measured by ``ftsystem bench gradsum`` (2
    cores, one per replica; ``bench/results/gradsum.json``), speed relative to DDP: at 100M
    parameters (21 buckets) 0.955 overlapped against 0.942 flat; at 10M (2 buckets) 0.943
    against 0.952. A first run had 1.026 against 0.956, and 1.0 against 1.025: the overlap won
    at 100M and lost at 10M both times, by less than the spread between the two runs.
    """
    if setting is not None:
        return setting
    if not params:
        return False
    if local(params[0]).is_cuda:
        return True
    grad_bytes = sum(local(p).numel() * local(p).element_size() for p in params)
    return grad_bytes >= MIN_CPU_OVERLAP_BUCKETS * bucket_cap_bytes


def vote(replica: ReplicaGroup, error: Exception | None, epoch: int,
         replaced: bool = False) -> Verdict:
    return replica.vote(failed=isinstance(error, (CollectiveFailed, InjectedFault)),
                        superseded=isinstance(error, EpochChanged), epoch=epoch,
                        replaced=replaced)


class GradientSum:
    """Sums this rank's gradients over the members (see the module's doc)."""

    def __init__(self, ctx: ReplicaContext, control: ControlPlane, replica: ReplicaGroup,
                 ftar: FaultTolerantAllReduce, faults: FaultSchedule,
                 layout: FlatLayout, update_log: UpdateLog, overlap: bool,
                 bucket_bytes: int, stragglers: StragglerBound,
                 step_times: Sequence[float], times: CommitTimes) -> None:
        """``step_times``: the recent steps' durations, which the straggler bound follows;
        ``times``: where the parts of the sum are timed."""
        self.ctx, self.control, self.replica, self.ftar = ctx, control, replica, ftar
        self._times = times
        self.faults, self._layout, self._update_log = faults, layout, update_log
        self._overlap = OverlappedGradSum(layout, bucket_bytes) \
            if overlap and ctx.world_size == 1 else None
        self._armed = False
        self._summed_in: int | None = None  # the epoch of the last successful sum
        self._spare: torch.Tensor | None = None
        self._stragglers, self._step_times = stragglers, step_times
        self._labels = (ctx.job, ctx.replica_id)
        self.overlapped_commits = 0
        """Commits whose gradients went out in buckets during backward."""

    def reserve_buffers(self) -> None:
        """The buffers of the first steps' averages, touched before this replica sums any."""
        self._update_log.reserve(self._layout.numel, self._layout.dtype, self._layout.device)

    def zeros_ready(self) -> None:
        """A joiner's zeros, allocated before the members come to sum them."""
        self._spare = self._layout.empty().zero_()

    def sum(self, step: int, enter_newer: Callable[[int], bool],
            join_step: Callable[[], bool] = lambda: False) -> torch.Tensor | None:
        """The gradients summed over the epoch's members; None when they were dropped.

        ``enter_newer(at_least)`` enters a newer epoch and says whether the gradients still
        belong to the step being committed; ``join_step()``: whether this sum is a join step
        (its zeros include the statistics; and for fault injection)."""
        overlapped, self._armed = self._armed, False
        while True:
            newest = self.replica.max(self.control.epoch.number)
            if newest > self.ftar.epoch.number:
                if overlapped:  # its buckets went to the old epoch's group
                    self._overlap.disarm()
                overlapped = False
                if not enter_newer(newest):
                    return None
            started, error, buf, sent_early = time.monotonic(), None, None, overlapped
            try:
                with self.ftar.arrival(step, self._stragglers.bound_s(self._step_times),
                                       self._stragglers.silence_s):
                    buf = self._sum_overlapped(step) if overlapped \
                        else self._sum_flat(step, joining=join_step())
                self.faults.check(step, "fail-allreduce")
                if join_step():
                    self.faults.check(step, "fail-join-step")
            except Stragglers as e:
                error = e
                # Reported before the vote: this replica's other ranks may be waiting on the
                # same stragglers in their shards' all-reduces until the epoch without them.
                self.control.register(resync_after=self.ftar.epoch.number, late=e.late)
            except (EpochChanged, CollectiveFailed, InjectedFault) as e:
                error = e
            # A retry runs in a new group (see after_failed_vote), where every member sends
            # one buffer after backward: nobody's buckets are on that group's wire.
            overlapped = False
            with self._times.part("vote"):
                verdict = vote(self.replica, error, self.ftar.epoch.number)
            if verdict.ok:
                metrics.FTAR_DURATION.labels(*self._labels).observe(time.monotonic() - started)
                if sent_early:
                    self.overlapped_commits += 1
                    metrics.FTAR_OVERLAPPED.labels(*self._labels).inc()
                self._summed_in = self.ftar.epoch.number
                return buf
            self.after_failed_vote(verdict, error, step)

    def _sum_flat(self, step: int, joining: bool) -> torch.Tensor:
        # A fresh buffer per attempt (an abandoned one may still be written into); the
        # gradients themselves stay untouched until the commit, so a retry reuses them.
        # A join step's zeros include the statistics: the sum is not divided by the joiner.
        out, self._spare = self._spare, None
        with self._times.part("pack"):
            buf = self._layout.pack(out if out is not None else self._recycled(),
                                    statistics=not joining)
        with self._times.part("allreduce"):
            self.ftar.allreduce_sum(buf, on_issued=lambda: self.faults.check(step, "allreduce"))
        return buf

    def _recycled(self) -> torch.Tensor | None:
        """A buffer for a step's average that the update log dropped, if one is free."""
        return self._update_log.recycle(self._layout.numel, self._layout.dtype,
                                        self._layout.device)

    def _sum_overlapped(self, step: int) -> torch.Tensor:
        """Wait for the buckets that backward sent (and send those it could not)."""
        self.faults.check(step, "allreduce")  # the buckets are on the wire
        try:
            with self._times.part("allreduce"):
                return self._overlap.finish(self.ftar.wait)
        except GradientProducedTwice as e:
            raise RuntimeError(f"{e}: construct FTReplica(..., overlap=False) or set "
                               f"{ENV_OVERLAP}=0 for this program") from e
        except OverlapInvalid as e:
            raise CollectiveFailed(str(e)) from e

    def arm(self) -> None:
        """Let the next backward send its gradient buckets on the current epoch's group.

        Only after an all-reduce of gradients succeeded on that very group. So on every
        member the first all-reduce on a newly configured group is one flat buffer (a
        joiner's first step, a retry, a step recomputed after a state replacement or a
        repair), and the later ones are bucketed: the members' collectives on one group
        always pair up.
        """
        if self._overlap is None or self._summed_in != self.ftar.epoch.number:
            return
        buf = self._recycled()
        self._overlap.arm(buf if buf is not None else self._layout.empty(),
                          self.ftar.allreduce_sum_async)
        self._armed = True

    def disarm(self) -> None:
        """The replica stops summing (it finished): the next backward sends nothing."""
        if self._armed:
            self._overlap.disarm()
            self._armed = False

    def after_failed_vote(self, verdict: Verdict, error: Exception | None, step: int) -> None:
        """A newer epoch already exists (the next attempt enters it), or the attempt failed
        on some rank, or the ranks used different epochs: then a new epoch must come."""
        if verdict.failed or verdict.split:
            self._await_repair(verdict.highest, error or CollectiveFailed(
                f"ranks of the replica failed or used different epochs "
                f"({verdict.lowest}..{verdict.highest})"), step)
        else:
            self.ftar.abort()

    def _await_repair(self, failed: int, error: Exception, step: int) -> None:
        """After a failure in epoch ``failed``: a peer died (its removal epoch is coming) or
        nobody did (then ask the leader for a new epoch); give up after the timeout."""
        metrics.FTAR_FAILURES.labels(*self._labels).inc()
        log.warning("replica %s rank %d step %d: %s", self.ctx.replica_id, self.ctx.rank,
                    step, error)
        self.ftar.abort()
        # If nobody died, no epoch would come: ask the leader for one (it reconfigures all).
        self.control.register(resync_after=failed, late=getattr(error, "late", ()))
        if self.control.wait_for_epoch(failed, self.ctx.timeout_s) is None:
            raise CollectiveFailed(
                f"{error}; and no new epoch came within {self.ctx.timeout_s:.0f} s: giving up "
                "so that the agent restarts this replica") from error

    def remove(self) -> None:
        if self._overlap is not None:
            self._overlap.remove()
