"""A joining replica's way in: the warm-up step, then catch-up from a donor while the others
train, through a ``ftsystem.training.transport.StateTransport``.

The joiner loads a donor's snapshot and replays the donor's logged updates until it is within
:data:`READY_LAG` steps of the donor's head; the epoch it then enters sends it the rest. A
replica of several ranks loads a snapshot of one step on every rank, or none. Catch-up always
ends: a donor that fails is replaced by the next one the leader assigns, and after
``FTSYSTEM_CATCHUP_TRIES`` snapshots that the donor's log could not continue (a link too slow
for the log's window) the joiner joins as it is and the epoch's state sync brings it up to
date, while the members wait.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from ftsystem.control import keys
from ftsystem.measure import metrics
from ftsystem.training.local_state import LocalState
from ftsystem.training.replica_group import ReplicaGroup
from ftsystem.training.runtime import ControlPlane, ReplicaContext
from ftsystem.training.settings import ReplicaSettings
from ftsystem.training.shards import local_state
from ftsystem.training.transport import DonorUnavailableError, Snapshot, StateTransport
from ftsystem.training.wire import receiving_buffers, tensor_places

log = logging.getLogger(__name__)
WAIT_POLL_S = 0.05
READY_LAG = 2
"""A joiner asks to join once it is this many steps (or fewer) behind its donor."""
SNAPSHOT_LEAD = 2
"""The ranks of a joiner ask for snapshots of a step this far ahead of the donor's head."""
CATCHUP_REPORT_S = 0.5
"""A joiner shows its progress (its registration's ``catchup``) at most this often; its
registration writes are rate-limited again by ``runtime.PROGRESS_INTERVAL_S``."""


def new_catchup_stats() -> dict:
    """A joiner's catch-up so far (its registration's ``catchup``, its result's)."""
    return {"bytes": 0, "steps_replayed": 0, "donors": []}


class Joiner:
    """Catch-up for one rank of a joining replica, from its donors through ``transport``."""

    def __init__(self, ctx: ReplicaContext, control: ControlPlane, replica: ReplicaGroup,
                 state: LocalState, transport: StateTransport,
                 settings: ReplicaSettings) -> None:
        self.ctx, self.control, self.replica, self.state = ctx, control, replica, state
        self._transport, self._settings = transport, settings
        self.stats: dict = {}
        self._labels = (ctx.job, ctx.replica_id)
        self._reported = 0.0
        self._donor_addr: str | None = None  # the donor it caught up from, while it joins
        self._prefetched: Future | None = None
        self.warming_since: float | None = None

    # --- the warm-up -----------------------------------------------------------------------

    def start_warm_up(self) -> None:
        """The loop computes one step that is dropped; a replica of one rank receives the
        donor's snapshot meanwhile (several ranks agree on a step by collectives, which must
        not run beside FSDP's)."""
        self.warming_since = time.monotonic()
        if self.replica.size == 1:
            self._prefetched = self._prefetch_snapshot()

    def end_warm_up(self) -> float:
        """The warm-up step is done: its seconds."""
        took, self.warming_since = time.monotonic() - self.warming_since, None
        return took

    def _prefetch_snapshot(self) -> Future:
        """Ask the assigned donor for its snapshot now, and receive it in a thread of its own
        while the loop computes the warm-up step: the wait for the donor's next commit and the
        transfer then overlap that step instead of following it. It lands in tensors of its
        own, not in the model's (the warm-up reads the parameters), and is loaded once the
        step is done (:meth:`catch_up`). The future holds (donor, address, snapshot); None for
        a snapshot that failed, asked for again after the warm-up."""
        self.stats = new_catchup_stats()  # what report() shows meanwhile
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
            return donor, addr, self._transport.fetch_snapshot(
                addr, into=lambda layout: receiving_buffers({}, layout),
                on_progress=self.report)
        except DonorUnavailableError as e:
            log.warning("replica %s: no snapshot from donor %s during the warm-up (%s); "
                        "asking again after it", self.ctx.replica_id, donor, e)
            return donor, addr, None

    # --- catch-up --------------------------------------------------------------------------

    def catch_up(self) -> None:
        prefetched, self._prefetched = self._prefetched, None
        if self.replica.size == 1:
            self._catch_up(prefetched)
        else:
            self._catch_up_ranks()

    def _catch_up(self, prefetched: Future | None) -> None:
        """Load a donor's snapshot and replay its log until within ``READY_LAG`` steps.

        Runs while the members train. A donor that fails mid-transfer is replaced by the one
        the leader assigns next; with no donor at all the replica joins with a full sync.
        """
        started, failed, snapshots = time.monotonic(), set(), 0
        stats = self.stats = new_catchup_stats()
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
                    if snapshots == self._settings.catchup_tries:
                        log.warning(
                            "replica %s: %d snapshots from %s, and each time the donor's log "
                            "had moved past it by the time it was loaded (a link too slow "
                            "for the log's window, or a long warm-up); joining now, the "
                            "epoch's state sync brings this replica up to date while the "
                            "members wait", self.ctx.replica_id, snapshots, donor)
                        stats["gave_up_after_snapshots"] = snapshots
                        break
                    snapshots += 1
                    if snapshot is None:
                        snapshot = self._transport.fetch_snapshot(
                            addr, into=self._receiving_tensors, on_progress=self.report)
                    else:
                        stats["prefetched"] = True
                    self.state.load(snapshot.state)
                    stats.update(snapshot.stats(), bytes=stats["bytes"] + snapshot.nbytes)
                    metrics.CATCHUP_BYTES.labels(*self._labels).inc(snapshot.nbytes)
                    time.sleep(self._settings.catchup_pause_s)
                    head = self._replay_from(addr)
            except DonorUnavailableError as e:
                log.warning("replica %s: donor %s failed (%s); asking for another",
                            self.ctx.replica_id, donor, e)
                failed.add(donor)
                continue
            if head is not None and head - self.state.step <= READY_LAG:
                break
        self._donor_addr = addr
        stats["duration_s"] = time.monotonic() - started
        metrics.CATCHUP_DURATION.labels(*self._labels).observe(stats["duration_s"])
        log.info("replica %s caught up to step %d from %s: %s", self.ctx.replica_id,
                 self.state.step, donor, stats)

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
        stats = self.stats = new_catchup_stats()
        step, state, head = -1, None, -1
        donor, addr = self._assigned_donor(avoid=set())
        try:
            if donor is not None:
                stats["donors"].append(donor)
                head = self._transport.fetch_head(addr)
        except DonorUnavailableError as e:
            log.warning("replica %s rank %d: donor %s failed (%s)", self.ctx.replica_id,
                        self.ctx.rank, donor, e)
        target = self.replica.max(head) + SNAPSHOT_LEAD  # every rank, whatever happened
        try:
            if head >= 0:
                snapshot = self._transport.fetch_snapshot(addr, at_step=target,
                                                          into=self._receiving_tensors,
                                                          on_progress=self.report)
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
        self.state.load(state)
        stats.update(snapshot_step=step, duration_s=time.monotonic() - started)
        metrics.CATCHUP_BYTES.labels(*self._labels).inc(stats["bytes"])
        metrics.CATCHUP_DURATION.labels(*self._labels).observe(stats["duration_s"])
        log.info("replica %s rank %d loaded %s's snapshot of step %d", self.ctx.replica_id,
                 self.ctx.rank, donor, step)

    def _receiving_tensors(self, layout: dict) -> dict:
        """Where a snapshot's tensors land: this rank's own state tensors, so that nothing is
        allocated or copied as they arrive, and new ones for what it lacks of the donor's
        ``layout`` (a fresh optimizer's slots, which it then adopts:
        ``shards.load_local_state``). They are overwritten from here on: until a whole
        snapshot is loaded, this replica holds no state of the job (it is fresh)."""
        self.state.receiving()
        return receiving_buffers(
            tensor_places(local_state(self.state.model, self.state.optimizer)), layout)

    def report(self, received: int = 0, total: int = 0) -> None:
        """Show how far catching up is (the status page reads it from the registration):
        the bytes of the snapshot in flight, the steps replayed; at most every
        ``CATCHUP_REPORT_S``."""
        now = time.monotonic()
        if now - self._reported < CATCHUP_REPORT_S and received < total:
            return
        self._reported = now
        stats = self.stats
        self.control.report(step=self.state.step, catchup={
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
        if self.state.fresh:
            return None
        fetched = self._transport.fetch_log(addr, self.state.step)
        if fetched is None:
            return None
        updates, head, nbytes = fetched
        for step, update in updates:
            if step == self.state.step + 1:
                if update.parent != self.state.chain:  # the donor's history is not ours
                    log.warning("replica %s: donor's log does not continue our commit chain at "
                                "step %d: fetching its full state", self.ctx.replica_id,
                                self.state.step)
                    self.state.drop()
                    return None
                self.state.replay(update)
                metrics.CATCHUP_STEPS.labels(*self._labels).inc()
                self.stats["steps_replayed"] += 1
                self.report()
        self.stats["bytes"] += nbytes
        metrics.CATCHUP_BYTES.labels(*self._labels).inc(nbytes)
        return head

    def keep_up(self) -> None:
        """While waiting to be let in, keep up with the donor (best effort)."""
        if self._donor_addr is None:
            return
        try:
            self._replay_from(self._donor_addr)
        except DonorUnavailableError:
            self._donor_addr = None  # the epoch's state sync will bring us up to date

    def joined(self) -> None:
        """It is a member now: its donor's log is nothing to it any more (a member replays
        only what the epoch's entry sends it)."""
        self._donor_addr = None
