"""The training-side API: wrap a model and optimizer, call :meth:`FTReplica.commit` every step.

.. code-block:: python

    with FTReplica(model, optimizer) as ft:          # registers, joins an epoch, syncs state
        while ft.step < num_steps:
            optimizer.zero_grad()
            model.loss(batch_for(ft.step)).backward()
            ft.commit()                              # FTAR, then optimizer.step()

Step protocol (docs/step_protocol.md): the gradients are averaged over the members of the current
epoch; on a peer failure the group is rebuilt for the next epoch and the same local gradients are
all-reduced again (no recomputation). At the start of every epoch the members compare committed
steps; members a few steps behind replay the most advanced member's logged updates, new ones
load its whole state. ``commit`` returns False when that changed this replica's state: its
gradients belonged to an older step and are dropped. A restarted replica first catches up from
a donor while the others train (``ftsystem.training.catchup``), so that it joins only a step or two behind,
and takes the step the members are committing with no gradient of its own (its join step).

The average is over the members that took part: when a replica is missing, its data shard for
that step is skipped, not redistributed, so the effective batch of that step is smaller.

A replica may have several ranks (``--nodes N --nproc-per-node M``): the model is sharded in the
replica with FSDP2, rank k all-reduces shard k with rank k of the other replicas, and the
replica's ranks vote before anything changes their state (``ftsystem.training.replica_group``), so the
replica commits all its shards of a step or none. Only rank 0 registers with the controller.
Catch-up and state sync move shard k from rank k of the donor to rank k of the receiver.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ftsystem.control import keys

from ftsystem.measure import metrics
from ftsystem.training.catchup import (DEFAULT_LOG_BUDGET_BYTES, DonorUnavailableError, LoggedUpdate,
                              Snapshot, Snapshotter, StateServer, UpdateLog, fetch_head,
                              fetch_log, fetch_snapshot, receiving_buffers, tensor_places)
from ftsystem.training.checkpoint import Checkpointer, TrainingState
from ftsystem.chaos.faults import FaultSchedule, InjectedFault
from ftsystem.training.fingerprint import (GENESIS, WORDS, chain_next, from_words, judge, state_digest,
                                  to_words)
from ftsystem.training.ftar import (CollectiveFailed, EpochChanged, FaultTolerantAllReduce, Stragglers,
                           plan_state_sync)
from ftsystem.control.membership import Epoch, Registration, ReplicaState
from ftsystem.training.overlap import (DEFAULT_BUCKET_CAP_BYTES, GradientProducedTwice, OverlapInvalid,
                              OverlappedGradSum)
from ftsystem.training.replica_group import ReplicaGroup, Verdict
from ftsystem.training.replicated import (AdvancedBy, Batches, RegistrationMismatch, ReplicatedObjects,
                                 Stateful)
from ftsystem.training.runtime import (ENV_CHECKPOINT_DIR, ENV_CHECKPOINT_EVERY, ENV_CHECKPOINT_KEEP,
                                       ControlPlane, Heartbeat, ReplicaContext)
from ftsystem.training.state_access import replica_access
from ftsystem.training.shards import (flat_grads, grads_as_views, load_local_state, local, local_numel,
                             local_state, release_grads)
from ftsystem.control.timeouts import StragglerBound, Timeouts

log = logging.getLogger(__name__)
WAIT_POLL_S = 0.05
STEP_TIMES_KEPT = 20
"""Recent step times the straggler bound is taken from (their median)."""
READY_LAG = 2
"""A joiner asks to join once it is this many steps (or fewer) behind its donor."""
SNAPSHOT_LEAD = 2
"""The ranks of a joiner ask for snapshots of a step this far ahead of the donor's head."""
CATCHUP_REPORT_S = 0.5
"""A joiner shows its progress (its registration's ``catchup``) at most this often; its
registration writes are rate-limited again by ``runtime.PROGRESS_INTERVAL_S``."""
ENV_LOG_BUDGET = "FTSYSTEM_CATCHUP_LOG_BYTES"
ENV_CATCHUP_MODE = "FTSYSTEM_CATCHUP"
"""``nonblocking`` (default): catch up from a donor while the others train; ``blocking``:
join at once and receive the whole state in the epoch's sync (the members wait for it)."""
ENV_OVERLAP = "FTSYSTEM_OVERLAP"
"""``1``: send gradient buckets during backward; ``0``: one buffer after it; unset: buckets for
gradients on a GPU or of several buckets (see :func:`overlap_by_default`)."""
ENV_BUCKET_BYTES = "FTSYSTEM_BUCKET_BYTES"
"""Largest gradient bucket of the overlap (default 25 MiB, like DDP's ``bucket_cap_mb``)."""
ENV_WARM_UP = "FTSYSTEM_WARM_UP"
"""``1`` (default): a joiner computes one step of the loop, thrown away, before it catches up
and joins (see :meth:`FTReplica._join_after_warm_up`); ``0``: it catches up at once."""
ENV_CATCHUP_PAUSE = "FTSYSTEM_CATCHUP_PAUSE_S"
"""Fault injection: a joiner waits this long after loading a snapshot (a slow link)."""
ENV_FINGERPRINT_EVERY = "FTSYSTEM_FINGERPRINT_EVERY"
"""Committed steps between comparisons of the members' state digests (default 100; every
replica of a job must use the same value). Measured by ``ftsystem bench fingerprint``."""
DEFAULT_FINGERPRINT_EVERY = 100


def _env_int(name: str, default: int) -> int:
    """A positive integer from the environment, or an error that names the variable."""
    text = os.environ.get(name, str(default))
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"{name}={text!r}: expected a positive integer (default {default})")
    return int(text)


def _checkpointer_from_env() -> Checkpointer | None:
    directory = os.environ.get(ENV_CHECKPOINT_DIR)
    if not directory:
        return None
    return Checkpointer(directory, _env_int(ENV_CHECKPOINT_EVERY, 100),
                        keep=_env_int(ENV_CHECKPOINT_KEEP, 3))


MIN_CPU_OVERLAP_BUCKETS = 4
"""On CPU, gradients of fewer buckets than this go out in one buffer after backward."""


def overlap_by_default(params: list[nn.Parameter], bucket_cap_bytes: int) -> bool:
    """``FTSYSTEM_OVERLAP`` if set; otherwise overlap gradients that live on a GPU, and CPU
    gradients of at least :data:`MIN_CPU_OVERLAP_BUCKETS` buckets.

    On a GPU, Gloo's or NCCL's work runs beside a backward that leaves the CPU idle. On CPU
    the all-reduce competes with backward for the same cores, and only pays when several
    buckets can go out while backward still has layers to compute: with one or two buckets
    the last is sent when backward ends anyway. Measured by ``ftsystem bench gradsum`` (2
    cores, one per replica; ``bench/results/gradsum.json``), speed relative to DDP: at 100M
    parameters (21 buckets) 0.955 overlapped against 0.942 flat; at 10M (2 buckets) 0.943
    against 0.952. A first run had 1.026 against 0.956, and 1.0 against 1.025: the overlap won
    at 100M and lost at 10M both times, by less than the spread between the two runs.
    """
    setting = os.environ.get(ENV_OVERLAP)
    if setting is not None:
        return setting != "0"
    if not params:
        return False
    if local(params[0]).is_cuda:
        return True
    grad_bytes = sum(local(p).numel() * local(p).element_size() for p in params)
    return grad_bytes >= MIN_CPU_OVERLAP_BUCKETS * bucket_cap_bytes


class ReplicaEvictedError(RuntimeError):
    """The controller removed this replica from the job (its lease expired); restart it."""


class DivergenceError(RuntimeError):
    """The members' states differ and no majority says which is right: the job must stop."""


class ForkedHistory(RuntimeError):
    """A logged update does not continue this replica's commit chain (another history)."""


def _new_catchup_stats() -> dict:
    """A joiner's catch-up so far (its registration's ``catchup``, its result's)."""
    return {"bytes": 0, "steps_replayed": 0, "donors": []}


class FTReplica:
    """One replica's side of FT-HSDP: membership, FTAR of gradients, commits, state sync."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 step_fn: Callable[[], None] | None = None,
                 ctx: ReplicaContext | None = None, overlap: bool | None = None,
                 warm_up: bool | None = None) -> None:
        """``step_fn``: what :meth:`commit` runs once the parameters' ``.grad`` hold the
        gradients averaged over the members (default: ``optimizer.step()``). Put everything
        the step does after averaging there: clipping, unscaling, the optimizer, the
        scheduler, an EMA. Catch-up replays committed steps by running it on the logged
        averages, so it must depend only on the gradients, on what ``model`` and
        ``optimizer`` hold, and on registered objects (:meth:`register`); anything else
        shows up as a divergence. It may modify ``.grad`` in place (clipping): it runs on a
        copy of the average (one gradient-sized copy per step), the log keeps the average.

        ``overlap``: send the all-reduce of gradient buckets while backward runs (default:
        ``FTSYSTEM_OVERLAP``, else :func:`overlap_by_default`). It needs one backward per
        commit: a program accumulating gradients over several must pass False. Replicas of
        several ranks never overlap (their FSDP reduce-scatter does, inside the replica).

        ``warm_up``: a replica that joins a running job first computes one step of the loop
        and drops it (its :meth:`commit` returns False, having caught up and
        joined), so that the members do not wait for its cold first forward and backward
        (default: ``FTSYSTEM_WARM_UP``, else True)."""
        self.ctx = ctx or ReplicaContext.from_env()
        self.replica = ReplicaGroup(self.ctx.world_size)
        self.model, self.optimizer = model, optimizer
        self._step_fn = step_fn or optimizer.step
        self.objects = ReplicatedObjects()
        self.chain = GENESIS
        """The commit chain after ``self.step`` (``ftsystem.training.fingerprint``)."""
        self._carry = b""  # the loop-advanced objects' states after self.step
        # A step function of the user's may write into .grad (clipping, unscaling), and not
        # every in-place kernel bumps the version counter (GradScaler.unscale_ does not): it
        # runs on a copy, so the log keeps the average it ran on.
        self._copy_grads = step_fn is not None
        self._scratch: torch.Tensor | None = None
        self._fingerprint_every = _env_int(ENV_FINGERPRINT_EVERY, DEFAULT_FINGERPRINT_EVERY)
        self.divergences: list[dict] = []
        """Divergences this replica took part in: step, how found, who differed."""
        self.started = time.time()
        self.step = 0
        self.commits: list[tuple[int, float]] = []
        """(step, wall time) of every commit of this process, for stall reports."""
        self.epochs: list[dict] = []
        """Every epoch this process entered: number, reason, wall time, seconds it took."""
        self._fresh = True  # never synced: its state may differ from the job's
        self._member_state = ReplicaState.MEMBER  # DONE once finished: others must see it
        self._finished = False  # finish() returned: the work is done
        self.heartbeat = Heartbeat(self.ctx.heartbeat_path)
        self.control = ControlPlane(self.ctx)
        # Closed by default: no token (and no --insecure) stops the rank before it serves.
        access, self._credentials = replica_access(self.ctx, self.control)
        # Injected faults hit one rank (the last): its death takes the whole replica down.
        last_rank = self.ctx.rank == self.ctx.world_size - 1
        self.faults = FaultSchedule.from_env() if last_rank else FaultSchedule([])
        # The rendezvous store for the epochs this replica leads (it is members[0]), hosted by
        # its rank 0 for every shard's group.
        self._rendezvous = dist.TCPStore(self.ctx.host, 0, is_master=True,
                                         wait_for_workers=False) if self.ctx.rank == 0 \
            else None
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._numel = local_numel(self._params)
        self._dtype, self._device = local(self._params[0]).dtype, local(self._params[0]).device
        self.ftar = FaultTolerantAllReduce(self.control, shard_index=self.ctx.rank,
                                           timeout_s=self.ctx.timeout_s, device=self._device)
        bucket_cap = _env_int(ENV_BUCKET_BYTES, DEFAULT_BUCKET_CAP_BYTES)
        if overlap is None:
            overlap = overlap_by_default(self._params, bucket_cap)
        self._overlap = OverlappedGradSum(self._params, bucket_cap) \
            if overlap and self.ctx.world_size == 1 else None
        self._overlap_armed = False
        self.overlapped_commits = 0
        """Commits whose gradients went out in buckets during backward."""
        # Catch-up material this replica can donate, and what it learnt catching up itself.
        self.update_log = UpdateLog(_env_int(ENV_LOG_BUDGET, DEFAULT_LOG_BUDGET_BYTES))
        self.snapshotter = Snapshotter(self._state)
        self.state_server = StateServer(
            self.ctx.host, self.snapshotter, self.update_log, lambda: self.step,
            self.ctx.timeout_s, access=access,
            before_serving=lambda: self.faults.check(self.step, "donate"))
        self.catchup_stats: dict = {}
        self._donor_addr: str | None = None
        self._catchup_reported = 0.0
        # The join step (see _take_join_step): this replica offers to take part in its epoch's
        # first all-reduce with no gradient; the members agree on it at the epoch's entry.
        self._offers_join_step = False
        if warm_up is None:
            warm_up = os.environ.get(ENV_WARM_UP, "1") != "0"
        self._warm_up = warm_up
        self._warming_since: float | None = None  # start() returned to compute the warm-up
        self._prefetched: Future | None = None  # the donor's snapshot, during the warm-up
        self._registered_addresses: dict[str, str] = {}  # by start()
        self._absent = 0  # members taking part in the next all-reduce with no gradient
        self._join_carry = b""  # the loop-advanced objects' states of the join step
        self._spare_buffer: torch.Tensor | None = None  # for the next gradients' sum
        self.checkpointer = _checkpointer_from_env()
        self._disk_state = {"train": TrainingState(model, optimizer),
                            f"replicated_rank{self.ctx.rank}": _DiskExtras(self)}
        self.resumed_from: int | None = None
        """The disk checkpoint's step this replica started from (a cold start), if any."""
        self._labels = (self.ctx.job, self.ctx.replica_id)
        self._last_commit = time.monotonic()
        self._step_times: collections.deque[float] = collections.deque(maxlen=STEP_TIMES_KEPT)
        self._stragglers = StragglerBound.from_env(os.environ, Timeouts(self.ctx.timeout_s))

    # --- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> "FTReplica":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, name: str, obj: Stateful, *, advanced_by: AdvancedBy = "step") -> None:
        """Make ``obj`` (anything with ``state_dict()``/``load_state_dict()``) part of the
        replicated state under ``name``; before :meth:`start`. ``advanced_by``: "step" when
        the step function advances it (a scheduler, a ``GradScaler``, an EMA), "loop" when
        the loop does, outside the step (see ``ftsystem.training.replicated``)."""
        self.objects.register(name, obj, advanced_by)

    def register_data(self, name: str, loader: Stateful) -> Batches:
        """Register a stateful data loader (e.g. torchdata's ``StatefulDataLoader``) and
        return the iterator to take batches from: ``batch = next(batches)`` once per step.
        It follows the loader's position whenever this replica receives the job's state."""
        batches = Batches(loader)
        self.register(name, batches, advanced_by="loop")
        return batches

    def start(self) -> None:
        """Join the job: catch up from a donor while the others train, then enter an epoch.

        With no running epoch to catch up with (the job is starting, or every replica died),
        the replica registers ready at once and the epoch's state sync aligns everybody.
        """
        self.objects.freeze()
        self._carry = self.objects.carry()
        # Once: it gathers over the replica's ranks and starts the metrics endpoint.
        addresses = self._registered_addresses = self._addresses()
        epoch = self.control.epoch
        running = epoch is not None and epoch.members and not epoch.paused
        # The ranks read the epoch at slightly different times: they decide together.
        (stopped,) = self.replica.any(not running)
        if not stopped and os.environ.get(ENV_CATCHUP_MODE, "nonblocking") != "blocking":
            self.control.register(state=ReplicaState.CATCHING_UP, step=self.step, **addresses)
            self._offers_join_step = self.replica.size == 1
            if self._warm_up:
                self._warming_since = time.monotonic()
                if self.replica.size == 1:  # several ranks agree on a step by collectives
                    self._prefetched = self._prefetch_snapshot()
                return  # the next commit() (or finish()) catches up and joins
            self._catch_up_replica()
        elif stopped and self.checkpointer is not None:
            self._resume_from_disk()
        self._join(watch=not stopped)

    def _join(self, watch: bool) -> None:
        """Register ready and enter the first epoch; a joiner takes its join step there."""
        self.replica.barrier()  # the replica is ready when every rank is
        if watch:  # the join epoch's group is built as soon as it is published
            self.ftar.watch(newer_than=self.control.epoch.number)
        self.control.register(state=ReplicaState.READY, step=self.step, catchup={},
                              **self._registered_addresses)
        if self._offers_join_step:  # its zeros, ready before the members come to sum them
            self._spare_buffer = torch.zeros(self._numel, dtype=self._dtype,
                                             device=self._device)
        self._enter_epoch(newer_than=0, will_sum=self._offers_join_step)
        if self._offers_join_step:
            self._take_join_step()

    def _join_after_warm_up(self, warm_up_s: float | None) -> None:
        """Catch up and join, after the loop computed one step and this replica dropped it.

        A fresh process's first forward and backward are slow: every allocation is
        page-faulted in, every kernel runs for the first time (on a GPU: the CUDA context,
        autotuning, compilation). Measured at 10M parameters on 2 cores: a first forward of
        0.42-0.46 s against 0.09-0.19 s, which the members waited for in the joiner's first
        all-reduce. torchft's healing replica computes that step while its state arrives and
        zeroes its gradient; this replica computes it on the state it started with, while a
        thread of its own receives the donor's snapshot (:meth:`_prefetch_snapshot`).
        """
        self._warming_since = None
        release_grads(self._params)
        self.objects.load_carry(self._carry)  # the batch it drew is not this replica's
        prefetched, self._prefetched = self._prefetched, None
        self._catch_up_replica(prefetched)
        if warm_up_s is not None:
            self.catchup_stats["warm_up_s"] = warm_up_s
        self._join(watch=True)

    def _take_join_step(self) -> None:
        """Commit the step the members were committing when this replica joined, taking part
        in its all-reduce with no gradient (and not counted in the average), as torchft's
        healing replica does: the members do not wait for this replica's forward and backward
        of a step they have computed already. This replica's data shard of that step is
        skipped, as for a missing replica. Its loop-advanced objects take the members' states
        of that step (the batch the members drew), received at the epoch's entry.

        The members agree on it when the epoch is entered (``_stage_sync``): all of them must
        be about to all-reduce their gradients. Otherwise this replica computes its first step
        as usual.
        """
        self.objects.load_carry(self._join_carry)
        self._carry = self._join_carry
        if self.commit():
            self.catchup_stats["join_step"] = self.step
        self._offers_join_step = False

    def _addresses(self) -> dict[str, str]:
        """What rank 0 registers: its rendezvous store, every rank's state server (one
        ``host:port`` per rank, comma-separated, in rank order), its metrics endpoint."""
        store = f"{self.ctx.host}:{self._rendezvous.port}" if self._rendezvous else ""
        return dict(store_addr=store, state_addr=",".join(self.replica.gather(
                        self.state_server.address)),
                    metrics_addr=metrics.serve(self.ctx.host))

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()  # the last save in flight completes (or is logged)
        if self._finished:
            self.heartbeat.done()  # from here on only teardown: see Heartbeat.done
        if self._overlap is not None:
            self._overlap.remove()
        self.ftar.shutdown()
        self.state_server.shutdown()
        self.snapshotter.shutdown()
        self.control.close()

    def _state(self) -> dict:
        """Everything replicated, at ``self.step``: tensors by reference (see Snapshotter)."""
        return {**local_state(self.model, self.optimizer), "step": self.step,
                "objects": self.objects.step_state(), "carry": self._carry, "chain": self.chain}

    def _fingerprinted(self) -> dict:
        """What the state digest covers: everything replicated but the chain (compared on
        its own at every epoch entry), the loop-advanced objects decoded."""
        state = self._state()
        del state["chain"]
        state["carry"] = self.objects.decode(self._carry)
        return state

    # --- the step --------------------------------------------------------------------------

    def commit(self, *, loss: float | None = None, samples: int = 0) -> bool:
        """Average the gradients over the epoch's members and run the step function on them.

        Returns False when the gradients were dropped because this replica's state was replaced
        by a more advanced member's at an epoch change, or because the step was a joining
        replica's warm-up (see ``warm_up``: it caught up and joined since); the caller simply
        goes on with ``self.step`` (a registered data loader is then at the replaced state's
        position).
        ``loss`` and ``samples`` of the step only feed the metrics. Either way the gradients
        are None afterwards, as after ``optimizer.zero_grad()``.
        """
        if self._warming_since is not None:  # this step was the warm-up
            self._join_after_warm_up(time.monotonic() - self._warming_since)
            return False
        self.faults.check(self.step, "step")
        overlapped, self._overlap_armed = self._overlap_armed, False
        buf = self._sum_gradients(overlapped)
        if buf is None:
            return False
        buf /= self.ftar.world_size - self._absent  # those who took part
        self._absent = 0
        chain = chain_next(self.chain, self.step + 1, self.ftar.epoch.number)
        parent, intact = self.chain, self._apply_update(buf, chain)
        self._carry = self.objects.carry()
        self._committed()
        self._log(LoggedUpdate(buf, parent, chain, self._carry), intact)
        metrics.SAMPLES.labels(*self._labels).inc(samples)
        if loss is not None:
            metrics.LOSS.labels(*self._labels).set(loss)
        if self.faults.fires(self.step, "corrupt"):
            self._corrupt()
        if self.step % self._fingerprint_every == 0:
            self._compare_digests()
        self.snapshotter.after_commit(self.step)
        self._maybe_checkpoint()
        # Here too, not only on entry: once armed, the next backward sends buckets, and a
        # "step" fault must strike before anything of the next step is on the wire.
        self.faults.check(self.step, "step")
        self._arm_overlap()
        return True

    def _sum_gradients(self, overlapped: bool) -> torch.Tensor | None:
        """The gradients summed over the epoch's members, retried in newer epochs until the
        replica's ranks agree; None when entering an epoch replaced this replica's state."""
        while True:
            newest = self.replica.max(self.control.epoch.number)
            if newest > self.ftar.epoch.number:
                if overlapped:  # its buckets went to the old epoch's group
                    self._overlap.disarm()
                overlapped = False
                offered = self._offers_join_step
                if self._enter_epoch(newer_than=self.ftar.epoch.number, at_least=newest,
                                     will_sum=True) or offered != self._offers_join_step:
                    return None  # replaced, or the members no longer take a join step
            started, error, buf, sent_early = time.monotonic(), None, None, overlapped
            try:
                with self.ftar.arrival(self.step, self._stragglers.bound_s(self._step_times)):
                    buf = self._sum_overlapped() if overlapped else self._sum_flat()
                self.faults.check(self.step, "fail-allreduce")
            except Stragglers as e:
                error = e
                # Reported before the vote: this replica's other ranks may be waiting on the
                # same stragglers in their shards' all-reduces until the epoch without them.
                self.control.register(resync_after=self.ftar.epoch.number, late=e.late)
            except (EpochChanged, CollectiveFailed, InjectedFault) as e:
                error = e
            # A retry runs in a new group (see _after_failed_vote), where every member sends
            # one buffer after backward: nobody's buckets are on that group's wire.
            overlapped = False
            verdict = self._vote(error, self.ftar.epoch.number)
            if verdict.ok:
                metrics.FTAR_DURATION.labels(*self._labels).observe(time.monotonic() - started)
                if sent_early:
                    self.overlapped_commits += 1
                    metrics.FTAR_OVERLAPPED.labels(*self._labels).inc()
                return buf
            self._after_failed_vote(verdict, error)

    def _sum_flat(self) -> torch.Tensor:
        # A fresh buffer per attempt (an abandoned one may still be written into); the
        # gradients themselves stay untouched until the commit, so a retry reuses them.
        buf = self._flat_grads()
        self.ftar.allreduce_sum(buf, on_issued=lambda: self.faults.check(self.step, "allreduce"))
        return buf

    def _sum_overlapped(self) -> torch.Tensor:
        """Wait for the buckets that backward sent (and send those it could not)."""
        self.faults.check(self.step, "allreduce")  # the buckets are on the wire
        try:
            return self._overlap.finish(self.ftar.wait)
        except GradientProducedTwice as e:
            raise RuntimeError(f"{e}: construct FTReplica(..., overlap=False) or set "
                               f"{ENV_OVERLAP}=0 for this program") from e
        except OverlapInvalid as e:
            raise CollectiveFailed(str(e)) from e

    def _arm_overlap(self) -> None:
        """Let the next backward send its gradient buckets on the current epoch's group.

        A member arms only after an all-reduce of its gradients succeeded on that group. So
        on every member the first all-reduce on a newly configured group is one flat buffer
        (a joiner's first step, a retry, a step recomputed after a state replacement), and
        the later ones are bucketed: the members' collectives on one group always pair up.
        """
        if self._overlap is None or self._finished:
            return
        buf = self.update_log.recycle(self._numel, self._dtype)
        self._overlap.arm(buf if buf is not None else torch.empty(
                              self._numel, dtype=self._dtype, device=self._device),
                          self.ftar.allreduce_sum_async)
        self._overlap_armed = True

    def _compare_digests(self) -> None:
        """Compare state digests with the members (every ``FTSYSTEM_FINGERPRINT_EVERY`` steps).

        A replica whose digest differs from the majority's is reported and receives the
        majority's state in a new epoch; with no majority the job stops. A comparison that a
        failure interrupts is skipped: the next epoch's entry compares commit chains, the
        next comparison the states. The ranks of a replica decide together.
        """
        n, rank = self.ftar.world_size, self.ftar.rank
        if n == 1:
            return
        started, verdict = time.monotonic(), None
        words = torch.zeros(n, WORDS, dtype=torch.int64, device=self._device)
        words[rank] = torch.tensor(to_words(state_digest(self._fingerprinted())))
        try:
            self.ftar.allreduce_sum(words)
            verdict = judge([from_words(w) for w in words.tolist()])
        except (EpochChanged, CollectiveFailed) as e:
            log.info("replica %s step %d: state digests not compared (%s)",
                     self.ctx.replica_id, self.step, e)
        diverged, unrepairable = self.replica.any(
            verdict is not None and rank in verdict.divergent,
            verdict is not None and not verdict.repairable)
        metrics.FINGERPRINT_DURATION.labels(*self._labels).observe(time.monotonic() - started)
        members = self.ftar.epoch.members
        if verdict is not None and not verdict.agreed:
            log.error("replica %s step %d: state digests differ; diverged: %s, majority: %s",
                      self.ctx.replica_id, self.step, [members[i] for i in verdict.divergent],
                      [members[i] for i in verdict.majority] or "none")
        if unrepairable:
            self._report_divergence("state-digest", [m for m in members
                                                     if m != self.ctx.replica_id])
            self._halt(DivergenceError(
                f"step {self.step}: the state digests of {', '.join(members)} differ and no "
                "majority agrees on one: nobody can tell which state is right, so the job "
                "stops. Restart it from the last disk checkpoint; see docs/divergence.md"))
        if diverged:
            self._report_divergence("state-digest", [members[i] for i in verdict.majority]
                                    if verdict is not None else [])
            self._resync()

    def _report_divergence(self, found_by: str, differs_from: list[str]) -> None:
        """Name this replica as diverged: a log line, a metric, an event in etcd (REST)."""
        epoch = self.ftar.epoch.number
        event = {"kind": "divergence", "replica": self.ctx.replica_id, "step": self.step,
                 "epoch": epoch, "found_by": found_by, "differs_from": differs_from,
                 "time": time.time()}
        self.divergences.append(event)
        log.error("replica %s diverged at step %d (epoch %d, found by %s): its state differs "
                  "from %s's", self.ctx.replica_id, self.step, epoch, found_by,
                  ", ".join(differs_from) or "the others")
        metrics.DIVERGENCE.labels(*self._labels, found_by).inc()
        try:
            self.control.put_json(keys.divergence(self.ctx.job, self.step,
                                                  self.ctx.replica_id), event)
        except Exception as e:  # the report must not stop the repair
            log.warning("replica %s: divergence event not written: %s", self.ctx.replica_id, e)

    def _resync(self) -> None:
        """Drop this replica's state: ask for a new epoch, in which it receives the job's."""
        self._fresh = True
        failed = self.ftar.epoch.number
        self.control.register(resync_after=failed, late=())
        self._enter_epoch(newer_than=failed)

    def _corrupt(self) -> None:
        """Fault injection (``STEP:corrupt``): change one parameter value in memory, as a bad
        memory cell or a faulty kernel would."""
        self.snapshotter.before_mutation()
        with torch.no_grad():
            local(self._params[0]).view(-1)[0] += 1.0
        log.warning("replica %s: corrupted a parameter at step %d (fault injection)",
                    self.ctx.replica_id, self.step)

    def _maybe_checkpoint(self) -> None:
        """Rank 0 of the epoch writes the disk checkpoints (all members hold the same state)."""
        if self.checkpointer is not None and self.ftar.rank == 0:
            self.checkpointer.maybe_save(self.step, self._disk_state)

    def _resume_from_disk(self) -> None:
        """A cold start (no member to catch up from): load the newest complete checkpoint.

        Every replica of a cold start loads the same one, so the first epoch's state sync
        finds them equal; one that finds none joins fresh and receives the state.
        """
        step = self.checkpointer.load(self._disk_state)
        if step is None:
            return
        self.step, self._fresh, self.resumed_from = step, False, step
        self.update_log.clear()
        self.heartbeat.beat(step)
        log.info("replica %s resumed from disk checkpoint step %d in %s", self.ctx.replica_id,
                 step, self.checkpointer.directory)

    def _flat_grads(self) -> torch.Tensor:
        """This rank's gradient shards in one buffer (the layout the update log replays)."""
        out, self._spare_buffer = self._spare_buffer, None
        return flat_grads(self._params, out if out is not None else
                          self.update_log.recycle(self._numel, self._dtype))

    def _apply_update(self, update: torch.Tensor, chain: bytes) -> bool:
        """Run the step function on the averaged gradient: committed step ``step + 1``,
        whose commit chain is ``chain``. Returns whether ``update`` is still what it ran on.

        With the default step (``optimizer.step()``) the gradients are views of ``update``,
        not copies of it, and are dropped after the step: ``update`` goes to the update log.
        Should the optimizer write into ``.grad`` anyway (seen from the version counter),
        this entry cannot be replayed, and from then on the step runs on a copy.
        """
        self.snapshotter.before_mutation()
        version = update._version
        grads_as_views(self._params, self._grad_copy(update) if self._copy_grads else update)
        try:
            self._step_fn()
        finally:
            release_grads(self._params)
        self.chain = chain
        if update._version == version:
            return True
        log.info("replica %s: the step function modifies .grad in place; the update log keeps "
                 "a copy of each averaged gradient from now on", self.ctx.replica_id)
        self._copy_grads = True
        return False

    def _grad_copy(self, update: torch.Tensor) -> torch.Tensor:
        """``update`` copied into a buffer kept across steps (a new one per step would be
        page-faulted in: see UpdateLog.recycle)."""
        if self._scratch is None or self._scratch.shape != update.shape:
            self._scratch = torch.empty_like(update)
        return self._scratch.copy_(update)

    def _log(self, update: LoggedUpdate, intact: bool) -> None:
        """Keep ``update`` for replicas catching up; an entry whose gradient the step function
        modified cannot reproduce its step, and no older entry leads past it."""
        if intact:
            self.update_log.append(self.step, update)
        else:
            self.update_log.clear()

    def _committed(self) -> None:
        """Count a committed step: ``self.step`` is the number of committed steps."""
        self.step += 1
        now = time.monotonic()
        metrics.STEPS.labels(*self._labels).inc()
        metrics.STEP_DURATION.labels(*self._labels).observe(now - self._last_commit)
        self._step_times.append(now - self._last_commit)
        self._last_commit = now
        self.commits.append((self.step, time.time()))
        self.heartbeat.beat(self.step)
        self.control.report(step=self.step)

    def _vote(self, error: Exception | None, epoch: int, replaced: bool = False) -> Verdict:
        return self.replica.vote(
            failed=isinstance(error, (CollectiveFailed, InjectedFault)),
            superseded=isinstance(error, EpochChanged), epoch=epoch, replaced=replaced)

    def _after_failed_vote(self, verdict: Verdict, error: Exception | None) -> None:
        """A newer epoch already exists (the next attempt enters it), or the attempt failed
        on some rank, or the ranks used different epochs: then a new epoch must come."""
        if verdict.failed or verdict.split:
            self._await_repair(verdict.highest, error or CollectiveFailed(
                f"ranks of the replica failed or used different epochs "
                f"({verdict.lowest}..{verdict.highest})"))
        else:
            self.ftar.abort()

    def _await_repair(self, failed: int, error: Exception) -> None:
        """After a failure in epoch ``failed``: a peer died (its removal epoch is coming) or
        nobody did (then ask the leader for a new epoch); give up after the timeout."""
        metrics.FTAR_FAILURES.labels(*self._labels).inc()
        log.warning("replica %s rank %d step %d: %s", self.ctx.replica_id, self.ctx.rank,
                    self.step, error)
        self.ftar.abort()
        # If nobody died, no epoch would come: ask the leader for one (it reconfigures all).
        self.control.register(resync_after=failed, late=getattr(error, "late", ()))
        if self.control.wait_for_epoch(failed, self.ctx.timeout_s) is None:
            raise CollectiveFailed(
                f"{error}; and no new epoch came within {self.ctx.timeout_s:.0f} s: giving up "
                "so that the agent restarts this replica") from error

    # --- epochs ----------------------------------------------------------------------------

    def _enter_epoch(self, newer_than: int, at_least: int = 0, *, will_sum: bool = False) -> bool:
        """Join the newest epoch (numbered ``at_least`` or above) that has this replica as a
        trainable member; sync state. Returns True when the state was replaced by a peer's.
        ``will_sum``: an all-reduce of gradients follows at once (entered from ``commit``, or
        a joiner's join step).
        """
        started = time.monotonic()
        try:
            while True:
                epoch = self._wait_member_epoch(max(newer_than, at_least - 1))
                # What this replica can donate is fixed now: the session expiry may trim the
                # log later. Agreed by its ranks here, where all of them are in every attempt.
                held = self.update_log.entries()
                oldest = self._oldest_replayable(held)
                staged, error = None, None
                try:
                    self.ftar.configure(epoch)
                    staged = self._stage_sync(held, oldest, will_sum)
                except (EpochChanged, CollectiveFailed) as e:
                    error = e
                verdict = self._vote(error, epoch.number, replaced=staged is not None)
                if verdict.ok:
                    break
                self._after_failed_vote(verdict, error)
                newer_than = verdict.highest
            if staged is not None:
                staged()
            self._fresh = False
            took = time.monotonic() - started
            self.epochs.append({"number": epoch.number, "reason": epoch.reason,
                                "time": time.time(), "seconds": took,
                                "members": list(epoch.members)})
            metrics.EPOCH_CHANGE.labels(*self._labels, epoch.reason).observe(took)
            # Not waited for: an etcd write (a WAL fsync) would add to every member's stall.
            self.control.register(state=self._member_state, step=self.step, wait=False)
            return verdict.replaced
        finally:
            metrics.STALL.labels(*self._labels).inc(time.monotonic() - started)

    def _wait_member_epoch(self, newer_than: int) -> Epoch:
        me = self.ctx.replica_id
        while True:
            epoch = self.control.wait_for_epoch(newer_than, WAIT_POLL_S)
            if epoch is None:
                self._replay_from_donor()  # a joiner stays current while it waits
                continue
            if me in epoch.members and not epoch.paused:
                return epoch
            if me not in epoch.members and self.ftar.epoch is not None and \
                    me in self.ftar.epoch.members:
                raise ReplicaEvictedError(f"replica {me} was removed in epoch {epoch.number}")
            newer_than = epoch.number  # paused, or a join that does not include us yet

    def _stage_sync(self, held: list[tuple[int, LoggedUpdate]], oldest_held: int,
                    will_sum: bool) -> Callable[[], None] | None:
        """Compare committed steps and commit chains with the other members; bring the ones
        behind (or on another history) up to date.

        Members behind by a few steps on the donor's history (an uncommitted step, a joiner
        that caught up) receive the donor's logged updates to replay; fresh members, forked
        ones (same step, another chain: a step they received from a replica that died, which
        the others redid) and ones behind what the donor's log holds receive its whole state.
        What was received is returned as a function that applies it (None: this rank's state
        stays), to be called once the replica's ranks agreed: all shards of a replica change
        together or none does.
        """
        n, rank = self.ftar.world_size, self.ftar.rank
        # A member about to sum its gradients has drawn the batch of the step being committed:
        # a joiner taking that step with no gradient takes these states (see _take_join_step).
        pending_carry = self.objects.carry() if will_sum else b""
        row = [self.step, int(self._fresh), oldest_held, self._signature_word(), int(will_sum),
               int(self._offers_join_step), len(pending_carry), *to_words(self.chain)]
        info = torch.zeros(n, len(row), dtype=torch.int64, device=self._device)
        info[rank] = torch.tensor(row, dtype=torch.int64)
        self.ftar.allreduce_sum(info)
        steps, fresh, oldest, signatures, summing, offers, carry_sizes, *chain_words = \
            zip(*info.tolist())
        chains = [from_words(words) for words in zip(*chain_words)]
        donor, receivers = plan_state_sync(list(steps), [bool(f) for f in fresh], chains)
        self._check_signature(signatures, donor)
        self._agree_join_step(rank, receivers, [bool(s) for s in summing],
                              [bool(o) for o in offers], pending_carry, carry_sizes)
        if not receivers:
            return None
        self.faults.check(self.step, "sync")  # state is about to move between members
        last, first_needed = steps[donor], min(steps[r] for r in receivers) + 1
        by_log = not any(fresh[r] or steps[r] == last for r in receivers) and \
            0 <= oldest[donor] <= first_needed
        parents = {}
        if by_log:
            meta = self._broadcast_log_meta(rank, donor, first_needed, last, held)
            parents = {step: parent for step, parent, _, _ in meta}
            by_log = all(parents[steps[r] + 1] == chains[r] for r in receivers)
        forked = steps[rank] == last or parents.get(steps[rank] + 1, chains[rank]) != chains[rank]
        if rank in receivers and not fresh[rank] and forked:
            self._report_divergence("commit-chain", [self.ftar.epoch.members[donor]])
        if by_log:
            apply = self._sync_by_log(rank, donor, first_needed, last, held, meta)
        else:
            apply = self._sync_by_state(rank, donor)
        return apply if rank in receivers else None

    def _oldest_replayable(self, held: list[tuple[int, LoggedUpdate]]) -> int:
        """The oldest step this replica's log can replay from, the same on all its ranks (-1:
        none): every shard of a replica must be synced the same way, by log or by state, as
        replaying runs the step function on all its ranks together."""
        (empty,) = self.replica.any(not held)
        return -1 if empty else self.replica.max(held[0][0])

    def _agree_join_step(self, rank: int, receivers: list[int], summing: list[bool],
                         offers: list[bool], pending_carry: bytes, carry_sizes: tuple[int, ...]
                         ) -> None:
        """Who takes part in this epoch's first all-reduce with no gradient (see
        :meth:`_take_join_step`), the same on every member; those joiners receive a member's
        ``pending_carry``: its loop-advanced objects' states of the step being committed."""
        absent, source = join_step_absentees(summing, offers, receivers)
        self._absent = len(absent)
        if self._offers_join_step and rank not in absent:
            self._offers_join_step = False
        if absent:
            carry = self._broadcast_bytes(pending_carry if rank == source else b"", source,
                                          size=carry_sizes[source])
            if rank in absent:
                self._join_carry = carry

    def _signature_word(self) -> int:
        """What every replica must agree on, hashed: the registered objects, the interval of
        digest comparisons (their collectives must pair up)."""
        text = f"{self.objects.signature()}|{self._fingerprint_every}"
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                              signed=True)

    def _check_signature(self, signatures: tuple[int, ...], donor: int) -> None:
        if signatures[self.ftar.rank] == signatures[donor]:
            return
        self._halt(RegistrationMismatch(
            f"replica {self.ctx.replica_id} registered [{self.objects.signature()}] with "
            f"{ENV_FINGERPRINT_EVERY}={self._fingerprint_every}, and replica "
            f"{self.ftar.epoch.members[donor]} something else: every replica of a job must "
            "register the same objects (names and advanced_by) and use the same settings"))

    def _halt(self, error: Exception) -> None:
        """Raise ``error``, which no restart can fix: its agent stops restarting this replica."""
        log.error("replica %s: %s", self.ctx.replica_id, error)
        self.control.put_json(keys.halted(self.ctx.job, self.ctx.replica_id),
                              {"time": time.time(), "step": self.step, "reason": str(error)})
        raise error

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

    def _broadcast_log_meta(self, rank: int, donor: int, first: int, last: int,
                            held: list[tuple[int, LoggedUpdate]]
                            ) -> list[tuple[int, bytes, bytes, bytes]]:
        """The donor's (step, parent chain, chain, carry) for steps ``first..last``."""
        payload = b""
        if rank == donor:
            rows = [(step, u.parent, u.chain, u.carry) for step, u in held
                    if first <= step <= last]
            if [row[0] for row in rows] != list(range(first, last + 1)):
                raise RuntimeError(f"update log does not hold steps {first}..{last}: a bug; "
                                   "dying is better than a silent divergence")
            out = io.BytesIO()
            torch.save(rows, out)
            payload = out.getvalue()
        received = self._broadcast_bytes(payload, donor)
        return [tuple(row) for row in torch.load(io.BytesIO(received), weights_only=True)]

    def _sync_by_log(self, rank: int, donor: int, first: int, last: int,
                     held: list[tuple[int, LoggedUpdate]],
                     meta: list[tuple[int, bytes, bytes, bytes]]) -> Callable[[], None]:
        """Broadcast the donor's updates for steps ``first..last``; replay the missing ones."""
        updates = torch.zeros(last - first + 1, self._numel, dtype=self._dtype,
                              device=self._device)
        if rank == donor:
            for step, update in held:
                if first <= step <= last:
                    updates[step - first].copy_(update.grad)
        self.ftar.broadcast(updates, donor)

        def replay() -> None:
            for step, parent, chain, carry in meta:
                if step > self.step:
                    self._replay(LoggedUpdate(updates[step - first], parent, chain, carry))
        return replay

    def _sync_by_state(self, rank: int, donor: int) -> Callable[[], None]:
        buf = self._broadcast_bytes(self._serialize() if rank == donor else b"", donor)
        source = self.ftar.epoch.members[donor]

        def load() -> None:
            self._load(torch.load(io.BytesIO(buf), weights_only=True,
                                  map_location=self._device))
            self._fresh = False
            log.info("replica %s rank %d loaded state at step %d from %s", self.ctx.replica_id,
                     self.ctx.rank, self.step, source)
        return load

    def _replay(self, logged: LoggedUpdate) -> None:
        """Run the step function on a peer's logged update: this replica commits the same
        step bit for bit, and takes the loop-advanced objects' states of that step."""
        if logged.parent != self.chain:
            raise ForkedHistory(
                f"replica {self.ctx.replica_id} at step {self.step}: the logged update for step "
                f"{self.step + 1} continues another history (commit chain "
                f"{logged.parent.hex()[:12]}, ours {self.chain.hex()[:12]})")
        grad = logged.grad.to(self._device, copy=True)  # the log keeps it; the source is reused
        try:
            intact = self._apply_update(grad, logged.chain)
        except Exception as e:
            raise RuntimeError(
                f"the step function failed replaying step {self.step + 1}: it runs without "
                "the forward and backward of that step, so it may use only the gradients, "
                "the model, the optimizer and registered objects (a GradScaler needs "
                "scale() called first: see docs/adopting.md)") from e
        self.objects.load_carry(logged.carry)
        self._carry = logged.carry
        self.step += 1
        self.heartbeat.beat(self.step)
        self._log(LoggedUpdate(grad, logged.parent, logged.chain, logged.carry), intact)
        metrics.CATCHUP_STEPS.labels(*self._labels).inc()

    def _serialize(self) -> bytes:
        out = io.BytesIO()
        torch.save(self._state(), out)
        return out.getvalue()

    def _load(self, state: dict) -> None:
        self.snapshotter.before_mutation()
        self.update_log.clear()
        load_local_state(self.model, self.optimizer, state)
        self.objects.load_step_state(state["objects"])
        self.objects.load_carry(state["carry"])
        self.step, self.chain, self._carry = state["step"], state["chain"], state["carry"]
        self.heartbeat.beat(self.step)

    # --- catch-up (joiner side) -------------------------------------------------------------

    def _catch_up_replica(self, prefetched: Future | None = None) -> None:
        if self.replica.size == 1:
            self._catch_up(prefetched)
        else:
            self._catch_up_ranks()

    def _catch_up(self, prefetched: Future | None = None) -> None:
        """Load a donor's snapshot and replay its log until within ``READY_LAG`` steps.

        Runs while the members train. A donor that fails mid-transfer is replaced by the one
        the leader assigns next; with no donor at all the replica joins with a full sync.
        ``prefetched``: (donor, its address, its snapshot or None) from
        :meth:`_prefetch_snapshot`, used first.
        """
        started, failed = time.monotonic(), set()
        stats = self.catchup_stats = _new_catchup_stats()
        while True:
            if prefetched is not None:
                (donor, addr, snapshot), prefetched = prefetched.result(), None
            else:
                (donor, addr), snapshot = self._assigned_donor(avoid=failed), None
            if donor is None:
                return
            stats["donors"].append(donor)
            try:
                head = self._replay_from(addr)
                if head is None:  # no snapshot yet, or the log moved past us
                    if snapshot is None:
                        snapshot = fetch_snapshot(
                            addr, self.ctx.timeout_s, credentials=self._credentials,
                            into=self._receiving_tensors, on_progress=self._report_catchup)
                    else:
                        stats["prefetched"] = True
                    self._load(snapshot.state)
                    self._fresh = False
                    stats.update(snapshot.stats(), bytes=stats["bytes"] + snapshot.nbytes)
                    metrics.CATCHUP_BYTES.labels(*self._labels).inc(snapshot.nbytes)
                    time.sleep(float(os.environ.get(ENV_CATCHUP_PAUSE, "0")))
                    head = self._replay_from(addr)
            except DonorUnavailableError as e:
                log.warning("replica %s: donor %s failed (%s); asking for another",
                            self.ctx.replica_id, donor, e)
                failed.add(donor)
                continue
            if head is not None and head - self.step <= READY_LAG:
                break
        self._donor_addr = addr
        stats["duration_s"] = time.monotonic() - started
        metrics.CATCHUP_DURATION.labels(*self._labels).observe(stats["duration_s"])
        log.info("replica %s caught up to step %d from %s: %s", self.ctx.replica_id,
                 self.step, donor, stats)

    def _prefetch_snapshot(self) -> Future:
        """Ask the assigned donor for its snapshot now, and receive it in a thread of its own
        while the loop computes the warm-up step: the wait for the donor's next commit and the
        transfer then overlap that step instead of following it. It lands in tensors of its
        own, not in the model's (the warm-up reads the parameters), and is loaded once the
        step is done (:meth:`_catch_up`): the optimizer adopts its slots, the parameters are
        copied. The future holds (donor, address, snapshot); None for a snapshot that failed,
        asked for again after the warm-up."""
        self.catchup_stats = _new_catchup_stats()  # what _report_catchup shows meanwhile
        future: Future = Future()

        def fetch() -> None:
            try:
                future.set_result(self._fetch_first_snapshot())
            except BaseException as e:  # noqa: BLE001 (raised again in the training thread)
                future.set_exception(e)
        threading.Thread(target=fetch, daemon=True, name="ftsystem-prefetch").start()
        return future

    def _fetch_first_snapshot(self) -> tuple[str | None, str, Snapshot | None]:
        donor, addr = self._assigned_donor(avoid=set())
        if donor is None:
            return None, "", None
        try:
            return donor, addr, fetch_snapshot(
                addr, self.ctx.timeout_s, credentials=self._credentials,
                into=lambda layout: receiving_buffers({}, layout),
                on_progress=self._report_catchup)
        except DonorUnavailableError as e:
            log.warning("replica %s: no snapshot from donor %s during the warm-up (%s); "
                        "asking again after it", self.ctx.replica_id, donor, e)
            return donor, addr, None

    def _catch_up_ranks(self) -> None:
        """Catch-up of a replica of several ranks: each rank fetches a snapshot of its shard
        from the same rank of the donor, all of one step the ranks agree on (a little ahead of
        the donor's head: each donor rank copies its shard right after committing it). They
        load them only if every rank got its own; otherwise none does, and the replica joins
        fresh (the epoch's state sync then sends it the whole state, while the members wait).

        The ranks never replay on their own: replaying runs the step function, whose
        collectives inside the replica (the norm of a clipped FSDP gradient) need every rank at
        the same step. The epoch's state sync replays the rest on all ranks together.
        """
        started = time.monotonic()
        stats = self.catchup_stats = _new_catchup_stats()
        step, state, head = -1, None, -1
        donor, addr = self._assigned_donor(avoid=set())
        try:
            if donor is not None:
                stats["donors"].append(donor)
                head = fetch_head(addr, self.ctx.timeout_s, credentials=self._credentials)
        except DonorUnavailableError as e:
            log.warning("replica %s rank %d: donor %s failed (%s)", self.ctx.replica_id,
                        self.ctx.rank, donor, e)
        target = self.replica.max(head) + SNAPSHOT_LEAD  # every rank, whatever happened
        try:
            if head >= 0:
                snapshot = fetch_snapshot(addr, self.ctx.timeout_s, at_step=target,
                                          credentials=self._credentials,
                                          into=self._receiving_tensors,
                                          on_progress=self._report_catchup)
                step, state, stats["bytes"] = snapshot.step, snapshot.state, snapshot.nbytes
                stats.update(snapshot.stats())
        except DonorUnavailableError as e:
            log.warning("replica %s rank %d: no snapshot of step %d from %s (%s)",
                        self.ctx.replica_id, self.ctx.rank, target, donor, e)
        (missing,) = self.replica.any(state is None)
        if missing or self.replica.max(step) != -self.replica.max(-step):
            log.info("replica %s: its ranks got no snapshots of one step (rank %d: %d); "
                     "joining with a full state sync", self.ctx.replica_id,
                     self.ctx.rank, step)
            return
        self._load(state)
        self._fresh = False
        stats.update(snapshot_step=step, duration_s=time.monotonic() - started)
        metrics.CATCHUP_BYTES.labels(*self._labels).inc(stats["bytes"])
        metrics.CATCHUP_DURATION.labels(*self._labels).observe(stats["duration_s"])
        log.info("replica %s rank %d loaded %s's snapshot of step %d", self.ctx.replica_id,
                 self.ctx.rank, donor, step)

    def _receiving_tensors(self, layout: dict[tuple, torch.Tensor]) -> dict[tuple, torch.Tensor]:
        """Where a snapshot's tensors land: this rank's own state tensors, so that nothing is
        allocated or copied as they arrive, and new ones for what it lacks of the donor's
        ``layout`` (a fresh optimizer's slots, which it then adopts:
        ``shards.load_local_state``). They are overwritten from here on: until a whole
        snapshot is loaded, this replica holds no state of the job (it is fresh)."""
        self.snapshotter.before_mutation()
        self.update_log.clear()
        self._fresh = True
        return receiving_buffers(tensor_places(local_state(self.model, self.optimizer)), layout)

    def _report_catchup(self, received: int = 0, total: int = 0) -> None:
        """Show how far catching up is (the status page reads it from the registration):
        the bytes of the snapshot in flight, the steps replayed; at most every
        ``CATCHUP_REPORT_S``."""
        now = time.monotonic()
        if now - self._catchup_reported < CATCHUP_REPORT_S and received < total:
            return
        self._catchup_reported = now
        stats = self.catchup_stats
        self.control.report(step=self.step, catchup={
            "bytes": stats["bytes"] + received, "snapshot_received": received,
            "snapshot_bytes": total or stats.get("snapshot_bytes", 0),
            "steps_replayed": stats["steps_replayed"]})

    def _assigned_donor(self, avoid: set[str]) -> tuple[str | None, str]:
        """Wait for the leader to name a donor (not one in ``avoid``); None: there is none.

        A failed donor that stays a member keeps its assignment; after the timeout the replica
        stops waiting for another and joins with a full state sync instead.
        """
        key = keys.catchup(self.ctx.job, self.ctx.replica_id)
        deadline = time.monotonic() + self.ctx.timeout_s
        while not avoid or time.monotonic() < deadline:
            assignment = self.control.get_json(key)
            if assignment is not None and assignment["donor"] not in avoid:
                donor = assignment["donor"]
                return donor, self._shard_server(assignment) if donor else ""
            time.sleep(WAIT_POLL_S)
        return None, ""

    def _shard_server(self, assignment: dict) -> str:
        """The donor's state server for this rank's shard (rank k serves shard k)."""
        addrs = assignment["state_addr"].split(",")
        if len(addrs) != self.ctx.world_size:
            raise RuntimeError(
                f"donor {assignment['donor']} has {len(addrs)} ranks, this replica "
                f"{self.ctx.world_size}: every replica of a job needs the same "
                "--nodes and --nproc-per-node")
        return addrs[self.ctx.rank]

    def _replay_from(self, addr: str) -> int | None:
        """Replay the donor's logged updates after our step; the donor's head, or None if
        they do not reach back to our step (or we have no state from this job yet)."""
        if self._fresh:
            return None
        fetched = fetch_log(addr, self.step, self.ctx.timeout_s, credentials=self._credentials)
        if fetched is None:
            return None
        updates, head, nbytes = fetched
        for step, update in updates:
            if step == self.step + 1:
                if update.parent != self.chain:  # the donor's history is not ours
                    log.warning("replica %s: donor's log does not continue our commit chain at "
                                "step %d: fetching its full state", self.ctx.replica_id,
                                self.step)
                    self._fresh = True
                    return None
                self._replay(update)
                self.catchup_stats["steps_replayed"] += 1
                self._report_catchup()
        self.catchup_stats["bytes"] += nbytes
        metrics.CATCHUP_BYTES.labels(*self._labels).inc(nbytes)
        return head

    def _replay_from_donor(self) -> None:
        """While waiting to be let in, keep up with the donor (best effort)."""
        if self._donor_addr is None:
            return
        try:
            self._replay_from(self._donor_addr)
        except DonorUnavailableError:
            self._donor_addr = None  # the epoch's state sync will bring us up to date

    # --- the end of the job ----------------------------------------------------------------

    def finish(self, linger_s: float = 120.0) -> None:
        """Mark this replica done, then stay (up to ``linger_s``) to serve late joiners.

        A replica still restarting when the others reach the last step needs a peer to load
        the final state from; the done replicas keep entering epochs that contain it.
        """
        if self._warming_since is not None:  # the loop computed no step: none was left
            self._join_after_warm_up(None)
        self._member_state = ReplicaState.DONE
        if self.control.speaks_for_replica and \
                self.control.get_json(keys.finished(self.ctx.job)) is None:
            self.control.put_json(keys.finished(self.ctx.job), {
                "step": self.step, "replica": self.ctx.replica_id, "time": time.time()})
        self.control.register(state=ReplicaState.DONE, step=self.step)
        deadline = time.monotonic() + linger_s
        while True:
            items = self.control.job_items(keys.job(self.ctx.job) + "/")
            registrations = _registrations(self.ctx.job, items)
            latest = self.control.epoch
            # Every rank of the replica takes the same branch: each one's collectives pair up.
            enter, everyone_done, timed_out = self.replica.any(
                latest.number > self.ftar.epoch.number and self._needs_donor(latest,
                                                                              registrations),
                not replicas_to_serve(self.ctx.job, items),
                time.monotonic() > deadline)
            if timed_out:
                log.warning("replica %s: stragglers still not done after %.0f s",
                            self.ctx.replica_id, linger_s)
                break
            if enter:
                self._enter_epoch(newer_than=self.ftar.epoch.number)
            elif everyone_done:
                break
            time.sleep(WAIT_POLL_S)
        self._finished = True

    def _needs_donor(self, epoch: Epoch, registrations: dict[str, Registration]) -> bool:
        return self.ctx.replica_id in epoch.members and any(
            registrations.get(m) is not None and registrations[m].state != ReplicaState.DONE
            for m in epoch.members)


    def state_hash(self) -> str:
        """The digest of this rank's replicated state (its shard of parameters and optimizer
        state, the registered objects, the step): equal across replicas at equal steps, rank
        by rank."""
        return state_digest(self._fingerprinted()).hex()


class _DiskExtras:
    """The replicated state beyond model and optimizer, as a DCP ``Stateful``: registered
    objects, the commit chain. One blob per rank (each rank's objects hold its shard)."""

    def __init__(self, replica: FTReplica) -> None:
        self._replica = replica

    def state_dict(self) -> dict:
        r = self._replica
        out = io.BytesIO()
        torch.save({"objects": r.objects.step_state(), "carry": r._carry, "chain": r.chain},
                   out)
        return {"blob": out.getvalue()}

    def load_state_dict(self, state: dict) -> None:
        r = self._replica
        extras = torch.load(io.BytesIO(state["blob"]), weights_only=True,
                            map_location=r._device)
        r.objects.load_step_state(extras["objects"])
        r.objects.load_carry(extras["carry"])
        r._carry, r.chain = extras["carry"], extras["chain"]


# --- pure logic -----------------------------------------------------------------------------------

def join_step_absentees(summing: list[bool], offers: list[bool], receivers: list[int]
                        ) -> tuple[list[int], int]:
    """Pure: the members that take part in an epoch's first all-reduce with no gradient, and
    the member whose loop-advanced objects' states they take.

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


# --- the end of the job: pure logic -------------------------------------------------------------

NOT_RESTARTED = ("", "stopped")
"""How a generation ends when its agents do not start another: it still runs (or finished), or
its agents were told to stop."""


def _registrations(job: str, items: dict[str, bytes]) -> dict[str, Registration]:
    return {keys.last_segment(k): Registration.from_json(v) for k, v in items.items()
            if k.startswith(keys.replicas(job))}


def replicas_to_serve(job: str, items: dict[str, bytes]) -> set[str]:
    """Pure: the replicas a finished replica stays for (from the job's keys ``items``): each
    one not done that may still come to load the final state from it.

    That is a replica with a node agent, or one whose last generation ended in a failure and
    that did not halt: its agents are restarting it. The second matters for a replica of
    several nodes cut apart: its agents free each other's node ranks, and take their own back
    only at their next node-lease renewal (up to ``NODE_LEASE_RENEW_S`` later), so meanwhile the
    replica has no agent record at all; a finished replica that left then would take the job's
    state with it, and the restarted one would train the job again from step 0."""
    registrations = _registrations(job, items)
    with_agent = {keys.agent_replica(job, k) for k in items if k.startswith(keys.agents(job))}
    halted = {keys.last_segment(k) for k in items if k.startswith(keys.halts(job))}
    restarting = {keys.last_segment(k) for k, v in items.items()
                  if k.startswith(keys.generations(job))
                  and json.loads(v).get("ended", "") not in NOT_RESTARTED}
    return {rid for rid in with_agent | (restarting - halted)
            if rid not in registrations or registrations[rid].state != ReplicaState.DONE}
