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
steps; members behind (or new) load the state of the most advanced one. ``commit`` returns False
when that replaced this replica's state: its gradients belonged to an older step and are dropped.

The average is over the members that took part: when a replica is missing, its data shard for
that step is skipped, not redistributed, so the effective batch of that step is smaller.
"""

from __future__ import annotations

import hashlib
import io
import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from ftsystem import keys, metrics
from ftsystem.faults import KillSchedule
from ftsystem.ftar import CollectiveFailed, EpochChanged, FaultTolerantAllReduce, plan_state_sync
from ftsystem.membership import Epoch, Registration, ReplicaState
from ftsystem.runtime import ControlPlane, Heartbeat, ReplicaContext

log = logging.getLogger(__name__)
WAIT_POLL_S = 0.05


class ReplicaEvictedError(RuntimeError):
    """The controller removed this replica from the job (its lease expired); restart it."""


class FTReplica:
    """One replica's side of FT-HSDP: membership, FTAR of gradients, commits, state sync."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 ctx: ReplicaContext | None = None) -> None:
        self.ctx = ctx or ReplicaContext.from_env()
        if self.ctx.local_world_size != 1:
            raise NotImplementedError(
                "replicas of several ranks (FSDP inside a replica) are not built yet; "
                "run with --nproc-per-replica 1")
        self.model, self.optimizer = model, optimizer
        self.step = 0
        self.commits: list[tuple[int, float]] = []
        """(step, wall time) of every commit of this process, for stall reports."""
        self.epochs: list[tuple[int, float, tuple[str, ...]]] = []
        """(epoch number, wall time entered, members) of every epoch this process trained in."""
        self._fresh = True  # never synced: its state may differ from the job's
        self.heartbeat = Heartbeat(self.ctx.heartbeat_path)
        self.control = ControlPlane(self.ctx)
        self.kill_schedule = KillSchedule.from_env()
        # The rendezvous store for the epochs this replica leads (it is members[0]).
        self._rendezvous = dist.TCPStore(self.ctx.host, 0, is_master=True,
                                         wait_for_workers=False)
        self.ftar = FaultTolerantAllReduce(self.control, self.heartbeat,
                                           timeout_s=self.ctx.timeout_s)
        self._labels = (self.ctx.job, self.ctx.replica_id)
        self._last_commit = time.monotonic()

    # --- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> "FTReplica":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Register as ready and wait until an epoch takes this replica in."""
        self.control.register(state=ReplicaState.READY, step=self.step,
                              store_addr=f"{self.ctx.host}:{self._rendezvous.port}")
        self._enter_epoch(newer_than=0)

    def close(self) -> None:
        self.ftar.abort()
        self.control.close()

    # --- the step --------------------------------------------------------------------------

    def commit(self) -> bool:
        """Average the gradients over the epoch's members and step the optimizer.

        Returns False when the gradients were dropped because this replica's state was replaced
        by a more advanced member's at an epoch change; the caller simply goes on with
        ``self.step``.
        """
        self.kill_schedule.check(self.step, "step")
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        while True:
            latest = self.control.epoch
            if latest.number > self.ftar.epoch.number and self._enter_epoch(
                    newer_than=self.ftar.epoch.number):
                return False
            buf = flat.clone()  # an abandoned attempt may still write into its buffer
            started = time.monotonic()
            try:
                self.ftar.allreduce_sum(
                    buf, on_issued=lambda: self.kill_schedule.check(self.step, "allreduce"))
                break
            except EpochChanged:
                continue
            except CollectiveFailed as e:
                self._on_failure(e)
        metrics.FTAR_DURATION.labels(*self._labels).observe(time.monotonic() - started)
        buf /= self.ftar.world_size
        for grad, avg in zip(grads, buf.split([g.numel() for g in grads])):
            grad.copy_(avg.view_as(grad))
        self.optimizer.step()
        self._committed()
        return True

    def _committed(self) -> None:
        self.step += 1
        self.ftar.step = self.step
        now = time.monotonic()
        metrics.STEPS.labels(*self._labels).inc()
        metrics.STEP_DURATION.labels(*self._labels).observe(now - self._last_commit)
        self._last_commit = now
        self.commits.append((self.step, time.time()))
        self.heartbeat.beat(self.step)
        self.control.report(step=self.step)

    def _on_failure(self, error: Exception) -> None:
        """A peer failed mid-collective: wait (bounded) for the epoch that removes it."""
        metrics.FTAR_FAILURES.labels(*self._labels).inc()
        failed = self.ftar.epoch.number
        log.warning("replica %s step %d: %s", self.ctx.replica_id, self.step, error)
        self.ftar.abort()
        if self.control.wait_for_epoch(failed, self.ctx.timeout_s) is None:
            raise CollectiveFailed(
                f"{error}; and no new epoch came within {self.ctx.timeout_s:.0f} s: giving up "
                "so that the agent restarts this replica") from error

    # --- epochs ----------------------------------------------------------------------------

    def _enter_epoch(self, newer_than: int) -> bool:
        """Join the newest epoch that has this replica as a trainable member; sync state.

        Returns True when this replica's state was replaced by a peer's.
        """
        started = time.monotonic()
        try:
            while True:
                epoch = self._wait_member_epoch(newer_than)
                try:
                    self.ftar.configure(epoch)
                    replaced = self._sync_state()
                except (EpochChanged, CollectiveFailed) as e:
                    log.info("replica %s: epoch %d not entered: %s", self.ctx.replica_id,
                             epoch.number, e)
                    self.ftar.abort()
                    newer_than = epoch.number
                    continue
                self.epochs.append((epoch.number, time.time(), epoch.members))
                self.control.register(state=ReplicaState.MEMBER, step=self.step)
                return replaced
        finally:
            metrics.STALL.labels(*self._labels).inc(time.monotonic() - started)

    def _wait_member_epoch(self, newer_than: int) -> Epoch:
        me = self.ctx.replica_id
        while True:
            epoch = self.control.wait_for_epoch(newer_than, WAIT_POLL_S)
            self.heartbeat.beat(self.step)
            if epoch is None:
                continue
            if me in epoch.members and not epoch.paused:
                return epoch
            if me not in epoch.members and self.ftar.epoch is not None and \
                    me in self.ftar.epoch.members:
                raise ReplicaEvictedError(f"replica {me} was removed in epoch {epoch.number}")
            newer_than = epoch.number  # paused, or a join that does not include us yet

    def _sync_state(self) -> bool:
        """Compare committed steps with the other members; load the donor's state if behind."""
        n, rank = self.ftar.world_size, self.ftar.rank
        info = torch.zeros(2 * n, dtype=torch.float64)
        info[2 * rank], info[2 * rank + 1] = self.step, float(self._fresh)
        self.ftar.allreduce_sum(info)
        steps = [int(s) for s in info[0::2].tolist()]
        donor, receivers = plan_state_sync(steps, [bool(f) for f in info[1::2].tolist()])
        self._fresh = False
        if not receivers:
            return False
        payload = self._serialize() if rank == donor else b""
        size = torch.tensor([float(len(payload))], dtype=torch.float64)
        self.ftar.allreduce_sum(size)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if rank == donor:
            buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self.ftar.broadcast(buf, donor)
        if rank not in receivers:
            return False
        self._load(buf.numpy().tobytes())
        log.info("replica %s loaded state at step %d from %s", self.ctx.replica_id, self.step,
                 self.ftar.epoch.members[donor])
        return True

    def _serialize(self) -> bytes:
        out = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                    "step": self.step}, out)
        return out.getvalue()

    def _load(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.step = self.ftar.step = state["step"]
        self.heartbeat.beat(self.step)

    # --- the end of the job ----------------------------------------------------------------

    def finish(self, linger_s: float = 120.0) -> None:
        """Mark this replica done, then stay (up to ``linger_s``) to serve late joiners.

        A replica still restarting when the others reach the last step needs a peer to load
        the final state from; the done replicas keep entering epochs that contain it.
        """
        self.control.register(state=ReplicaState.DONE, step=self.step)
        deadline = time.monotonic() + linger_s
        while time.monotonic() < deadline:
            registrations, agents = self._job_replicas()
            latest = self.control.epoch
            if latest.number > self.ftar.epoch.number and self._needs_donor(latest, registrations):
                self._enter_epoch(newer_than=self.ftar.epoch.number)
                self.control.register(state=ReplicaState.DONE, step=self.step)
            elif not any(registrations.get(rid) is None or
                         registrations[rid].state != ReplicaState.DONE for rid in agents):
                return
            self.heartbeat.beat(self.step)
            time.sleep(WAIT_POLL_S)
        log.warning("replica %s: stragglers still not done after %.0f s", self.ctx.replica_id,
                    linger_s)

    def _needs_donor(self, epoch: Epoch, registrations: dict[str, Registration]) -> bool:
        return self.ctx.replica_id in epoch.members and any(
            registrations.get(m) is not None and registrations[m].state != ReplicaState.DONE
            for m in epoch.members)

    def _job_replicas(self) -> tuple[dict[str, Registration], set[str]]:
        job = self.ctx.job
        items = self.control.job_items(keys.job(job) + "/")
        regs = {keys.last_segment(k): Registration.from_json(v) for k, v in items.items()
                if k.startswith(keys.replicas(job))}
        agents = {keys.last_segment(k) for k in items if k.startswith(keys.agents(job))}
        return regs, agents

    def state_hash(self) -> str:
        """SHA-256 of the parameters and optimizer state: equal across replicas at equal steps."""
        digest = hashlib.sha256()
        for tensor in _state_tensors(self.model.state_dict(), self.optimizer.state_dict()):
            digest.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def _state_tensors(*trees: object):
    for tree in trees:
        if isinstance(tree, torch.Tensor):
            yield tree
        elif isinstance(tree, dict):
            for key in sorted(tree, key=str):
                yield from _state_tensors(tree[key])
        elif isinstance(tree, (list, tuple)):
            for item in tree:
                yield from _state_tensors(item)
