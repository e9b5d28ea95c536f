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
a donor while the others train (``joiner``), so that it joins only a step or two behind, and
takes the step the members are committing with no gradient of its own (its join step).

The average is over the members that took part: when a replica is missing, its data shard for
that step is skipped, not redistributed, so the effective batch of that step is smaller.

A replica may have several ranks (``--nodes N --nproc-per-node M``): the model is sharded in the
replica with FSDP2, or split with tensor parallelism over a mesh of its ranks (``mesh=``), rank
k all-reduces its part with rank k of the other replicas, and the
replica's ranks vote before anything changes their state (``replica_group``), so the replica
commits all its shards of a step or none. Only rank 0 registers with the controller.

The units (docs/architecture.md): :class:`~ftsystem.training.local_state.LocalState` is the one
writer of the replicated state; ``gradient_sum`` sums gradients with retries and votes;
``epoch_entry`` carries out the pure ``entry_plan``; ``joiner`` catches up; ``integrity``
compares digests; ``phase`` holds where the replica is. This class wires them and owns the
lifecycle and the telemetry.
"""

from __future__ import annotations

import collections
import io
import logging
import os
import time
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ftsystem.chaos.faults import FaultPoint, FaultSchedule
from ftsystem.control import keys
from ftsystem.control.membership import ReplicaState
from ftsystem.control.timeouts import StragglerBound, Timeouts
from ftsystem.control.tokens import checkpoint_key
from ftsystem.measure import metrics
from ftsystem.training import carriable
from ftsystem.training.checkpoint import Checkpointer, TrainingState, check_checkpointable
from ftsystem.training.commit_times import CommitTimes
from ftsystem.training.end_of_job import needs_donor, registrations_of, replicas_to_serve
from ftsystem.training.epoch_entry import Entered, EpochEntry, ReplicaEvictedError
from ftsystem.training.ftar import FaultTolerantAllReduce
from ftsystem.training.gradient_sum import GradientSum, overlap_by_default, vote
from ftsystem.training.http_transport import HTTPTransport, StateServer
from ftsystem.training.integrity import DivergenceError, Integrity
from ftsystem.training.joiner import Joiner
from ftsystem.training.local_state import LocalState
from ftsystem.training.parameters import ParameterSet, ParameterSetChanged
from ftsystem.training.phase import Lifecycle, Phase
from ftsystem.training.replica_group import ReplicaGroup, check_mesh
from ftsystem.training.replicated import AdvancedBy, Batches, ReplicatedObjects, Stateful
from ftsystem.training.runtime import ControlPlane, Heartbeat, ReplicaContext
from ftsystem.training.settings import ENV_LOG_BUDGET, ENV_LOG_PLACE, ReplicaSettings
from ftsystem.training.devices import free_memory
from ftsystem.training.flat import FlatLayout, forward_buffers, release_grads
from ftsystem.training.shards import align_grads
from ftsystem.training.state_access import replica_access
from ftsystem.training.stores import listening_store
from ftsystem.training.update_log import UpdateLog, log_on_host

__all__ = ["FTReplica", "ReplicaEvictedError", "DivergenceError"]
log = logging.getLogger(__name__)
WAIT_POLL_S = 0.05
STEP_TIMES_KEPT = 20
"""Recent step times the straggler bound is taken from (their median)."""


class FTReplica:
    """One replica's side of FT-HSDP: membership, FTAR of gradients, commits, state sync."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 step_fn: Callable[[], None] | None = None,
                 ctx: ReplicaContext | None = None, overlap: bool | None = None,
                 warm_up: bool | None = None, settings: ReplicaSettings | None = None,
                 mesh: DeviceMesh | None = None) -> None:
        """``step_fn``: what :meth:`commit` runs once the parameters' ``.grad`` hold the
        gradients averaged over the members (default: ``optimizer.step()``). Put everything
        the step does after averaging there: clipping, unscaling, the optimizer, the
        scheduler, an EMA. Catch-up replays committed steps by running it on the logged
        averages, so it must depend only on the gradients, on what ``model`` and
        ``optimizer`` hold, and on registered objects (:meth:`register`); anything else
        shows up as a divergence. It may modify ``.grad`` in place (clipping): it runs on a
        copy of the average (one gradient-sized copy per step), the log keeps the average.

        ``overlap``: send the all-reduce of gradient buckets while backward runs (default:
        ``FTSYSTEM_OVERLAP``, else ``gradient_sum.overlap_by_default``). It needs one
        backward per commit: a program accumulating gradients over several must pass False.
        Replicas of several ranks never overlap (their FSDP reduce-scatter does, inside the
        replica).

        ``warm_up``: a replica that joins a running job first computes one step of the loop
        and drops it (its :meth:`commit` returns False, having caught up and joined), so that
        the members do not wait for its cold first forward and backward (default:
        ``FTSYSTEM_WARM_UP``, else on where the model is on a GPU). A GPU's first step is
        what is slow (its context, compilation, autotuning), and it runs there while the
        host receives the snapshot; on a CPU the warm-up step competes with the snapshot's
        transfer for the same cores (at 100M parameters here, 0.22 GB/s beside it against
        3.4 GB/s without) and delays the join by a step, while the cold step's own extra cost
        is small (``bench rejoin``'s ``ftsystem`` against ``cold-join``).

        ``settings``: default ``ReplicaSettings.from_env()``.

        ``mesh``: the replica's device mesh when it combines parallelisms inside (FSDP2 beside
        tensor or pipeline parallelism): all of its ranks, in rank order, laid out alike in
        every replica. The replicas are the data-parallel dimension across meshes: rank k
        of every replica sums its part of the gradients with rank k of the others, so each
        part (a shard of the ``dp_shard`` dimension, a slice of the ``tp`` one, a pipeline
        stage) is averaged over the replicas on its own. It is checked at construction; a
        mesh that spans replicas, or lists the ranks in another order, is refused. Without
        it, the replica's ranks are its process group's (``WORLD_SIZE``)."""
        # First what can be refused without side effects: a bad setting or model loses nothing.
        self.settings = settings or ReplicaSettings.from_env()
        self.trainable = ParameterSet(model, optimizer)
        params = self._params = self.trainable.params
        self.ctx = ctx or ReplicaContext.from_env()
        if mesh is not None:
            check_mesh(mesh, self.ctx.world_size)
        if self.settings.checkpoint is not None:
            check_checkpointable(model)
        self.mesh = mesh
        self.replica = ReplicaGroup(self.ctx.world_size)
        self.model, self.optimizer = model, optimizer
        self.lifecycle = Lifecycle(self.ctx.replica_id)
        self.started = time.time()
        self.commits: list[tuple[int, float]] = []
        """(step, wall time) of every commit of this process, for stall reports."""
        self.partial_sums: list[tuple[int, int, int]] = []
        """(step, members that sent gradients, members) of each step whose average left some
        members out (a join step's joiners send zeros): at most one per epoch."""
        self.heartbeat = Heartbeat(self.ctx.heartbeat_path)
        self.control = ControlPlane(self.ctx)
        # Closed by default: no token (and no --insecure) stops the rank before it serves.
        access, credentials = replica_access(self.ctx, self.control)
        # Injected faults hit one rank (the last): its death takes the whole replica down.
        last_rank = self.ctx.rank == self.ctx.world_size - 1
        self.faults = FaultSchedule.from_env() if last_rank else FaultSchedule([])
        # The rendezvous store for the epochs this replica leads (it is members[0]), hosted by
        # its rank 0 for every shard's group.
        self._rendezvous = listening_store(self.ctx.host) if self.ctx.rank == 0 else None
        layout = FlatLayout(params, forward_buffers(model))
        device = layout.device
        self.objects = ReplicatedObjects()
        self.update_log = UpdateLog(self.settings.log_budget_bytes, on_host=log_on_host(
            self.settings.log_place, self.settings.log_budget_bytes, free_memory(device)))
        self.commit_times = CommitTimes()
        """Where the time of :meth:`commit` goes (``ftsystem bench overhead``)."""
        self.state = LocalState(self.ctx.replica_id, model, optimizer, layout, self.objects,
                                step_fn, self.update_log, self.heartbeat.beat,
                                self.commit_times)
        self.snapshotter = self.state.snapshotter
        self.ftar = FaultTolerantAllReduce(self.control, shard_index=self.ctx.rank,
                                           timeout_s=self.ctx.timeout_s, device=device,
                                           backend=self.settings.backend)
        self._step_times: collections.deque[float] = collections.deque(maxlen=STEP_TIMES_KEPT)
        if overlap is None:
            overlap = overlap_by_default(params, self.settings.bucket_bytes,
                                         self.settings.overlap)
        self.gradients = GradientSum(
            self.ctx, self.control, self.replica, self.ftar, self.faults, layout,
            self.update_log, overlap, self.settings.bucket_bytes,
            StragglerBound.from_env(os.environ, Timeouts(self.ctx.timeout_s)),
            self._step_times, self.commit_times)
        entry_bytes = layout.nbytes
        if entry_bytes > self.settings.log_budget_bytes:
            log.warning(
                "replica %s: one averaged gradient is %.2f GB, over the update log's budget "
                "(%s=%d): no step is logged, so a joiner cannot replay and every member behind "
                "receives the whole state at the epoch's entry while the others wait. Raise "
                "the budget to keep a window of steps", self.ctx.replica_id, entry_bytes / 1e9,
                ENV_LOG_BUDGET, self.settings.log_budget_bytes)
        if self.update_log.on_host:
            log.info("replica %s: the update log keeps host copies of its GPU's averaged "
                     "gradients (budget %.2f GB, %s)", self.ctx.replica_id,
                     self.settings.log_budget_bytes / 1e9, ENV_LOG_PLACE)
        self.integrity = Integrity(self.ctx, self.control, self.replica, self.ftar, self.state,
                                   self.settings.fingerprint_every, device)
        self.entry = EpochEntry(
            self.ctx, self.control, self.replica, self.ftar, self.state, self.integrity,
            self.faults, device, layout.numel, layout.dtype,
            vote=lambda error, epoch, replaced: vote(self.replica, error, epoch, replaced),
            after_failed_vote=lambda verdict, error: self.gradients.after_failed_vote(
                verdict, error, self.state.step))
        self.joiner = Joiner(self.ctx, self.control, self.replica, self.state,
                             HTTPTransport(self.ctx.timeout_s, credentials), self.settings)
        self.state_server = StateServer(
            self.ctx.host, self.snapshotter, self.update_log, lambda: self.state.step,
            self.ctx.timeout_s, access=access,
            before_serving=self._before_serving)
        if warm_up is None:
            warm_up = self.settings.warm_up
        self._warm_up = device.type == "cuda" if warm_up is None else warm_up
        self._registered_addresses: dict[str, str] = {}  # by start()
        self._entered: Entered | None = None  # the last epoch entry, until its first sum
        c = self.settings.checkpoint
        self.checkpointer = Checkpointer(
            c.directory, c.every, keep=c.keep,
            key=checkpoint_key(self.ctx.state_key) if self.ctx.state_key else None) if c else None
        self._disk_state = {"train": TrainingState(model, optimizer),
                            f"replicated_rank{self.ctx.rank}": _DiskExtras(self.state)}
        self.resumed_from: int | None = None
        """The disk checkpoint's step this replica started from (a cold start), if any."""
        self._labels = (self.ctx.job, self.ctx.replica_id)
        self._last_commit = time.monotonic()

    def _before_serving(self) -> None:
        """Fault injection, in the state server's thread before it serves a joiner."""
        step = self.state.step
        self.faults.check(step, "donate")
        if self.faults.fires(step, "corrupt-donate"):
            self.faults.add(FaultPoint(step, "corrupt-next"))  # at the next commit

    # --- what the loop and the tools read ---------------------------------------------------

    @property
    def step(self) -> int:
        """Committed steps."""
        return self.state.step

    @property
    def chain(self) -> bytes:
        return self.state.chain

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    @property
    def epochs(self) -> list[dict]:
        """Every epoch this process entered: number, reason, wall time, seconds it took."""
        return self.entry.epochs

    @property
    def divergences(self) -> list[dict]:
        """Divergences this replica took part in: step, how found, who differed."""
        return self.integrity.divergences

    @property
    def catchup_stats(self) -> dict:
        return self.joiner.stats

    @property
    def overlapped_commits(self) -> int:
        """Commits whose gradients went out in buckets during backward."""
        return self.gradients.overlapped_commits

    def state_hash(self) -> str:
        """The digest of this rank's replicated state (its shard of parameters and optimizer
        state, the registered objects, the step): equal across replicas at equal steps, rank
        by rank."""
        return self.state.digest().hex()

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
        # Before anything is registered: a leaf the others could not load fails here, with
        # its name, and not in a joiner's crash loop.
        self.objects.check_carriable()
        carriable.check([{k: v for k, v in group.items() if k != "params"}
                         for group in self.optimizer.param_groups],
                        "the optimizer's param_groups")
        self.state.start()
        # Before the first step: a joiner touches them while it catches up, not while the
        # members wait for its first sums.
        self.gradients.reserve_buffers()
        # Once: it gathers over the replica's ranks and starts the metrics endpoint.
        addresses = self._registered_addresses = self._addresses()
        epoch = self.control.epoch
        running = epoch is not None and epoch.members and not epoch.paused
        # The ranks read the epoch at slightly different times: they decide together.
        (stopped,) = self.replica.any(not running)
        if not stopped and not self.settings.blocking_catchup:
            self.control.register(state=ReplicaState.CATCHING_UP, step=self.step, **addresses)
            if self._warm_up:
                self.lifecycle.move(Phase.WARMING)
                self.joiner.start_warm_up()
                return  # the next commit() (or finish()) catches up and joins
            self.lifecycle.move(Phase.CATCHING_UP)
            self.joiner.catch_up()
            self._join(watch=True, offers=self.replica.size == 1)
            return
        if stopped and self.checkpointer is not None:
            self._resume_from_disk()
        self._join(watch=not stopped, offers=False)

    def _join(self, watch: bool, offers: bool) -> None:
        """Register ready and enter the first epoch. ``offers``: to take the members' current
        step with no gradient (a joiner that caught up, of one rank: several ranks would each
        need the step function's collectives inside the replica)."""
        self.lifecycle.move(Phase.JOINING)
        self.replica.barrier()  # the replica is ready when every rank is
        if watch:  # the join epoch's group is built as soon as it is published
            self.ftar.watch(newer_than=self.control.epoch.number)
        self.control.register(state=ReplicaState.READY, step=self.step, catchup={},
                              **self._registered_addresses)
        if offers:  # its zeros, ready before the members come to sum them
            self.gradients.zeros_ready()
        self._after_entry(self._enter(newer_than=0, will_sum=offers, offers=offers))
        if self.lifecycle.is_(Phase.JOIN_STEP) and self.commit():
            self.joiner.stats["join_step"] = self.step

    def _after_warm_up(self, took_a_step: bool) -> None:
        """Catch up and join, after the loop computed one step and this replica dropped it.

        A fresh process's first forward and backward are slow: every allocation is
        page-faulted in, every kernel runs for the first time (on a GPU: the CUDA context,
        autotuning, compilation). Measured at 10M parameters on 2 cores: a first forward of
        0.42-0.46 s against 0.09-0.19 s, which the members waited for in the joiner's first
        all-reduce. torchft's healing replica computes that step while its state arrives and
        zeroes its gradient; this replica computes it on the state it started with, while a
        thread of its own receives the donor's snapshot.
        """
        took = self.joiner.end_warm_up()
        release_grads(self._params)
        self.state.rewind_loop()  # the batch it drew is not this replica's
        self.lifecycle.move(Phase.CATCHING_UP)
        self.joiner.catch_up()
        if took_a_step:
            self.joiner.stats["warm_up_s"] = took
        self._join(watch=True, offers=self.replica.size == 1)

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
        if self.lifecycle.is_(Phase.FINISHED):
            self.heartbeat.done()  # from here on only teardown: see Heartbeat.done
        self.gradients.remove()
        self.ftar.shutdown()
        self.state_server.shutdown()
        self.snapshotter.shutdown()
        self.control.close()

    # --- epochs ----------------------------------------------------------------------------

    def _enter(self, newer_than: int, at_least: int = 0, *, will_sum: bool = False,
               offers: bool = False) -> Entered:
        joining = self.lifecycle.is_(Phase.JOINING, Phase.JOIN_STEP)
        return self.entry.enter(
            newer_than, at_least, will_sum=will_sum, offers_join_step=offers,
            registered_state=lambda: ReplicaState.DONE if self.lifecycle.done
            else ReplicaState.MEMBER,
            while_waiting=self.joiner.keep_up if joining else lambda: None)

    def _after_entry(self, entered: Entered) -> None:
        """The phase that an entry leaves this replica in; the entry is kept until the first
        sum of its epoch, which it decides the divisor of."""
        self._entered = entered
        if self.lifecycle.is_(Phase.JOINING):
            self.joiner.joined()
            self.lifecycle.move(Phase.JOIN_STEP if entered.takes_join_step else Phase.MEMBER)
        elif self.lifecycle.is_(Phase.JOIN_STEP) and not entered.takes_join_step:
            self.lifecycle.move(Phase.MEMBER)  # the members no longer take a join step
        elif self.lifecycle.is_(Phase.REPAIRING):
            self.lifecycle.move(Phase.MEMBER)

    def _enter_for_sum(self, at_least: int) -> bool:
        """Enter a newer epoch from a commit; whether the gradients still count. A joiner the
        members accept for a join step sends zeros whatever it received (it computed nothing
        of this step); others drop gradients computed on a state that was replaced."""
        joining = self.lifecycle.is_(Phase.JOIN_STEP)
        entered = self._enter(self.ftar.epoch.number, at_least, will_sum=True, offers=joining)
        self._after_entry(entered)
        if joining:
            return entered.takes_join_step
        return not entered.replaced

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
        if self.lifecycle.is_(Phase.WARMING):  # this step was the warm-up
            self._after_warm_up(took_a_step=True)
            return False
        if not self.lifecycle.is_(Phase.MEMBER, Phase.JOIN_STEP):
            raise RuntimeError(f"commit() in phase {self.phase.value}: call start() first "
                               "(or use `with FTReplica(...)`), and no commit after finish()")
        try:
            self.trainable.check_unchanged()
        except ParameterSetChanged as e:  # every replica's loop changes it at one step
            self.integrity.halt(e)
        self.faults.check(self.step, "step")
        align_grads(self._params)  # tensor parallelism leaves partial sums: see align_grads
        buf = self.gradients.sum(self.step, self._enter_for_sum,
                                 join_step=lambda: self.lifecycle.is_(Phase.JOIN_STEP))
        if buf is None:
            release_grads(self._params)
            return False
        entered, self._entered = self._entered, None
        first_of_epoch = entered is not None and entered.epoch.number == self.ftar.epoch.number
        divisor = entered.plan.divisor if first_of_epoch else self.ftar.world_size
        with self.commit_times.part("divide"):
            buf /= divisor  # those who sent gradients
        if divisor != self.ftar.world_size:
            self.partial_sums.append((self.step + 1, divisor, self.ftar.world_size))
        join_step = self.lifecycle.is_(Phase.JOIN_STEP)
        if join_step and not first_of_epoch:
            raise RuntimeError("a join step summed outside the epoch that accepted it: a bug")
        self.state.commit(buf, self.ftar.epoch.number,
                          carry_before=entered.join_carry if join_step else None)
        if join_step:
            self.lifecycle.move(Phase.MEMBER)
        with self.commit_times.part("telemetry"):
            self._committed(loss, samples)
        if self.faults.fires(self.step, "corrupt") or self.faults.fires(self.step, "corrupt-next"):
            self.state.corrupt()
            log.warning("replica %s: corrupted a parameter at step %d (fault injection)",
                        self.ctx.replica_id, self.step)
        with self.commit_times.part("digests"):
            repair = self.integrity.due(self.step) and self.integrity.compare_digests()
        if repair:
            self._repair()
        with self.commit_times.part("snapshot_checkpoint"):
            self.snapshotter.after_commit(self.step)
            self._maybe_checkpoint()
        # Here too, not only on entry: once armed, the next backward sends buckets, and a
        # "step" fault must strike before anything of the next step is on the wire.
        self.faults.check(self.step, "step")
        with self.commit_times.part("arm"):
            self.gradients.arm()
        self.commit_times.committed()
        return True

    def _committed(self, loss: float | None, samples: int) -> None:
        """Telemetry of a committed step."""
        now = time.monotonic()
        metrics.STEPS.labels(*self._labels).inc()
        metrics.STEP_DURATION.labels(*self._labels).observe(now - self._last_commit)
        self._step_times.append(now - self._last_commit)
        self._last_commit = now
        self.commits.append((self.step, time.time()))
        self.control.report(step=self.step)
        metrics.SAMPLES.labels(*self._labels).inc(samples)
        if loss is not None:
            metrics.LOSS.labels(*self._labels).set(loss)

    def _repair(self) -> None:
        """Drop this replica's state: ask for a new epoch, in which it receives the job's."""
        self.lifecycle.move(Phase.REPAIRING)
        self.state.drop()
        failed = self.ftar.epoch.number
        self.control.register(resync_after=failed, late=())
        self._after_entry(self._enter(newer_than=failed))

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
        self.state.resumed(step)
        self.resumed_from = step
        log.info("replica %s resumed from disk checkpoint step %d in %s", self.ctx.replica_id,
                 step, self.checkpointer.directory)

    # --- the end of the job ----------------------------------------------------------------

    def finish(self, linger_s: float = 120.0) -> None:
        """Mark this replica done, then stay (up to ``linger_s``) to serve late joiners.

        A replica still restarting when the others reach the last step needs a peer to load
        the final state from; the done replicas keep entering epochs that contain it.
        """
        if self.lifecycle.is_(Phase.WARMING):  # the loop computed no step: none was left
            self._after_warm_up(took_a_step=False)
        self.lifecycle.move(Phase.FINISHING)
        self.gradients.disarm()
        if self.control.speaks_for_replica and \
                self.control.get_json(keys.finished(self.ctx.job)) is None:
            self.control.put_json(keys.finished(self.ctx.job), {
                "step": self.step, "replica": self.ctx.replica_id, "time": time.time()})
        self.control.register(state=ReplicaState.DONE, step=self.step)
        deadline = time.monotonic() + linger_s
        while True:
            items = self.control.job_items(keys.job(self.ctx.job) + "/")
            latest = self.control.epoch
            # Every rank of the replica takes the same branch: each one's collectives pair up.
            enter, everyone_done, timed_out = self.replica.any(
                latest.number > self.ftar.epoch.number and needs_donor(
                    self.ctx.replica_id, latest, registrations_of(self.ctx.job, items)),
                not replicas_to_serve(self.ctx.job, items),
                time.monotonic() > deadline)
            if timed_out:
                log.warning("replica %s: stragglers still not done after %.0f s",
                            self.ctx.replica_id, linger_s)
                break
            if enter:
                self._after_entry(self._enter(newer_than=self.ftar.epoch.number))
            elif everyone_done:
                break
            time.sleep(WAIT_POLL_S)
        self.lifecycle.move(Phase.FINISHED)


class _DiskExtras:
    """The replicated state beyond model and optimizer, as a DCP ``Stateful``: registered
    objects, the commit chain. One blob per rank (each rank's objects hold its shard)."""

    def __init__(self, state: LocalState) -> None:
        self._state = state

    def state_dict(self) -> dict:
        out = io.BytesIO()
        torch.save(self._state.extras(), out)
        return {"blob": out.getvalue()}

    def load_state_dict(self, state: dict) -> None:
        self._state.load_extras(carriable.load(io.BytesIO(state["blob"]),
                                               map_location=self._state._device))
