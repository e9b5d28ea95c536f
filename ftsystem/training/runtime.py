"""What a replica process gets from its agent: the environment contract and the control plane.

The agent launches each rank with torchrun-style variables for the replica's own group
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus ``FTSYSTEM_*``
variables naming the job, the replica, its generation and lease, etcd, and a heartbeat file.
:class:`ControlPlane` gives the synchronous training loop what it needs from etcd (the latest
epoch, its own registration) through an asyncio loop running in a background thread.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Coroutine, TypeVar

from ftsystem.control import keys

from ftsystem.measure import metrics
from ftsystem.control.membership import Epoch, Registration, ReplicaState
from ftsystem.control.records import RecordError, report_malformed
from ftsystem.control.store import Store, StoreError

T = TypeVar("T")

ENV_ETCD = "FTSYSTEM_ETCD"
ENV_JOB = "FTSYSTEM_JOB"
ENV_REPLICA = "FTSYSTEM_REPLICA_ID"
ENV_GENERATION = "FTSYSTEM_GENERATION"
ENV_LEASE = "FTSYSTEM_LEASE_ID"
ENV_LEASE_FILE = "FTSYSTEM_LEASE_FILE"
ENV_HEARTBEAT = "FTSYSTEM_HEARTBEAT"
ENV_HOST = "FTSYSTEM_HOST"
ENV_NODE_ID = "FTSYSTEM_NODE_ID"
"""The machine the rank runs on (its agent's ``--node-id``): the ``host`` label of its metrics."""
ENV_TIMEOUT = "FTSYSTEM_TIMEOUT_S"
ENV_KILL_AT = "FTSYSTEM_KILL_AT"
ENV_CHECKPOINT_DIR = "FTSYSTEM_CHECKPOINT_DIR"
"""Disk checkpoints for cold starts go here (a filesystem every replica shares); unset: none.
The agent sets it (and the two below) from the job spec's checkpoint policy."""
ENV_CHECKPOINT_EVERY = "FTSYSTEM_CHECKPOINT_EVERY"
"""Committed steps between disk checkpoints (default 100), written by the epoch's rank 0."""
ENV_CHECKPOINT_KEEP = "FTSYSTEM_CHECKPOINT_KEEP"
"""Complete checkpoints kept (default 3); older ones are removed."""
ENV_STATE_KEY = "FTSYSTEM_STATE_KEY"
"""The state servers' key, which the agent derives from the job's token (its
``FTSYSTEM_API_TOKEN`` or ``..._FILE``, which the ranks never get): the rank's state server
accepts a fetch only with the token this key makes for the replica the fetch names, and the
rank's own fetches send its replica's token (``ftsystem.control.tokens``)."""
ENV_INSECURE = "FTSYSTEM_INSECURE"
"""``1`` when the agent was started with ``--insecure`` and no token: the rank's state server
then serves without one. Without either, the rank refuses to start its state server."""
DEFAULT_TIMEOUT_S = 30.0
HEARTBEAT_S = 0.5
PROGRESS_INTERVAL_S = 1.0
"""Step progress reaches etcd at most this often per replica (only its rank 0 writes it), so
etcd's write rate grows with the replicas, not with the step rate, the nodes or the ranks."""
LEASE_WAIT_S = 0.2


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaContext:
    etcd: str
    job: str
    replica_id: str
    generation: int
    lease_id: int
    lease_file: str = ""
    """Where the agent writes the replica lease when an etcd outage outlived the first one."""
    heartbeat_path: str
    host: str
    node_id: str = ""
    """The machine (``FTSYSTEM_NODE_ID``; outside an agent, the hostname)."""
    rank: int
    """This process's rank among its replica's ranks (``RANK``; node rank × ranks per node +
    ``LOCAL_RANK``): the shard it holds and all-reduces with rank ``rank`` of the others."""
    world_size: int
    """The replica's ranks on all its nodes (``WORLD_SIZE``)."""
    timeout_s: float
    """The one timeout users set: collectives and rendezvous give up after it."""
    state_key: str = field(default="", repr=False)
    """The state servers' key (``FTSYSTEM_STATE_KEY``); empty: none was handed down."""
    insecure: bool = False
    """The agent was started with ``--insecure`` (``FTSYSTEM_INSECURE=1``)."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "ReplicaContext":
        env = dict(os.environ if env is None else env)
        missing = [v for v in (ENV_ETCD, ENV_JOB, ENV_REPLICA, ENV_LEASE) if v not in env]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not set: run this script under "
                               "`ftsystem agent` (or `ftsystem run`), which sets them")
        return cls(etcd=env[ENV_ETCD], job=keys.check_id("job", env[ENV_JOB]),
                   replica_id=keys.check_id("replica", env[ENV_REPLICA]),
                   generation=int(env.get(ENV_GENERATION, "0")), lease_id=int(env[ENV_LEASE]),
                   lease_file=env.get(ENV_LEASE_FILE, ""),
                   heartbeat_path=env.get(ENV_HEARTBEAT, ""),
                   host=env.get(ENV_HOST, "127.0.0.1"),
                   node_id=env.get(ENV_NODE_ID) or socket.gethostname(),
                   rank=int(env.get("RANK", "0")),
                   world_size=int(env.get("WORLD_SIZE", "1")),
                   timeout_s=float(env.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S)),
                   state_key=env.get(ENV_STATE_KEY, ""),
                   insecure=env.get(ENV_INSECURE, "") == "1")


class BackgroundLoop:
    """An asyncio loop in a daemon thread, for synchronous callers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="ftsystem-control")
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


DONE_MARK = "done"
"""Written after the step in the heartbeat file once the rank only tears down."""

EXITING_MARK = "exiting"
"""Written when the interpreter starts to exit for any other reason (an exception, sys.exit):
the exit code, not the silence of a slow teardown, then says what happened."""


class Heartbeat:
    """The file the agent's watchdog reads: its mtime is liveness, its content the last step.

    A daemon thread writes it every ``HEARTBEAT_S``, so a long forward/backward pass of a big
    model is not mistaken for a hang, while a stopped or frozen process (SIGSTOP, a stuck
    host) stops writing it. A main thread stuck in a collective is bounded by FTAR's own
    timeout instead.
    """

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644) if path else None
        self._step = 0
        self._mark: str | None = None  # sticky: the beating thread must not overwrite it
        # The agent sends SIGUSR1 before it kills a hung rank: its log then shows where it hung
        # (dumped from the signal handler, so also while a C call holds the GIL).
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        if self._fd is not None:
            threading.Thread(target=self._write_forever, daemon=True,
                             name="ftsystem-heartbeat").start()
            # Interpreter shutdown stops this thread, and destroying process groups can then
            # take seconds: without the mark the agent would report a crash as a hang. The
            # hook marks an uncaught exception at once; atexit covers sys.exit.
            atexit.register(self._exiting)
            previous_hook = sys.excepthook

            def mark_then_report(*exc_info) -> None:
                self._exiting()
                previous_hook(*exc_info)

            sys.excepthook = mark_then_report

    def beat(self, step: int) -> None:
        """Record progress at once: the agent reads the step of a replica that just died."""
        self._step = step
        self._write()

    def done(self) -> None:
        """The rank's work is over and recorded; what follows is teardown, which the agent
        neither watches nor counts as a failure if it crashes.

        Interpreter shutdown after a job (destructors of process groups and stores, in C++,
        with no Python thread left to beat) has been measured here to take several seconds.
        """
        self._mark = DONE_MARK
        self._write()

    def _exiting(self) -> None:
        self._mark = self._mark or EXITING_MARK
        self._write()

    def _write(self) -> None:
        if self._fd is not None:  # fixed width: no truncate needed
            line = f"{self._step} {self._mark}" if self._mark else str(self._step)
            os.pwrite(self._fd, f"{line}\n".encode().ljust(24), 0)

    def _write_forever(self) -> None:
        while True:
            self._write()
            time.sleep(HEARTBEAT_S)


class ControlPlane:
    """The replica's view of its job in etcd: follows the epoch key, owns its registration."""

    def __init__(self, ctx: ReplicaContext) -> None:
        self.ctx = ctx
        self._bg = BackgroundLoop()
        # Waits ride out an etcd outage as long as the job's timeout: training goes on meanwhile.
        self._store = Store(ctx.etcd, retry_deadline_s=ctx.timeout_s)
        self._epoch: Epoch | None = None
        self._changed = threading.Condition()
        self._registration: Registration | None = None
        self._pending_report: Future | None = None
        self._last_report = 0.0
        self._lease_used = ctx.lease_id
        self._write_lock: asyncio.Lock | None = None  # created on the background loop
        self._bg.run(self._store.connect())
        metrics.init_replica(ctx.job, ctx.replica_id,
                             speaks_for_replica=self.speaks_for_replica)
        # The first read of the epoch happens before the constructor returns: callers decide
        # on it (catch up, or join a starting job).
        items, revision = self._bg.run(self._store.get_prefix(keys.epoch(ctx.job)))
        if keys.epoch(ctx.job) in items:
            self._set_epoch_record(keys.epoch(ctx.job), items[keys.epoch(ctx.job)])
        self._watcher = self._bg.submit(self._follow_epochs(revision + 1))

    async def _follow_epochs(self, start_revision: int) -> None:
        key = keys.epoch(self.ctx.job)
        async for event in self._store.watch_prefix(key, start_revision=start_revision):
            if event.key == key and event.kind == "PUT":
                self._set_epoch_record(key, event.value)

    def _set_epoch_record(self, key: str, raw: bytes) -> None:
        try:
            self._set_epoch(Epoch.from_json(raw))
        except RecordError as e:  # not the leader's: the replica waits for one that is
            report_malformed(key, e)

    def _set_epoch(self, epoch: Epoch) -> None:
        with self._changed:
            if self._epoch is None or epoch.number > self._epoch.number:
                self._epoch = epoch
                self._changed.notify_all()

    @property
    def epoch(self) -> Epoch | None:
        """The newest epoch seen (it may be newer than the one the data plane uses)."""
        return self._epoch

    def wait_for_epoch(self, newer_than: int, timeout_s: float) -> Epoch | None:
        """Block until an epoch numbered above ``newer_than`` is seen, or None on timeout."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._epoch is not None and self._epoch.number > newer_than, timeout_s)
            epoch = self._epoch
        return epoch if epoch is not None and epoch.number > newer_than else None

    @property
    def speaks_for_replica(self) -> bool:
        """Rank 0 alone publishes the replica's registration and exports its replica-level
        metrics; the other ranks only follow."""
        return self.ctx.rank == 0

    def register(self, *, wait: bool = True, **changes: Any) -> None:
        """Publish this replica's registration (bound to the agent's lease), waiting for it
        unless ``wait`` is False (then a failure is logged, and writes keep their order);
        every rank publishes its own metrics endpoint."""
        if addr := changes.get("metrics_addr"):
            self._bg.run(self._put_metrics_addr(addr), timeout=self.ctx.timeout_s)
        if not self.speaks_for_replica:
            return
        if wait:
            self._bg.run(self._put_registration(changes), timeout=self.ctx.timeout_s)
        else:
            self._bg.submit(self._put_registration(changes)).add_done_callback(_log_failure)

    def report(self, **changes: Any) -> None:
        """Publish without waiting (step progress), at most every ``PROGRESS_INTERVAL_S`` unless
        the replica lease changed; skipped while the previous one is in flight."""
        if not self.speaks_for_replica:
            return
        now = time.monotonic()
        if now - self._last_report < PROGRESS_INTERVAL_S and self._lease() == self._lease_used:
            return
        if self._pending_report is None or self._pending_report.done():
            self._last_report = now
            self._pending_report = self._bg.submit(self._put_registration(changes))

    def _lease(self) -> int:
        """The replica lease now: the agent replaces it when an etcd outage outlived it."""
        if self.ctx.lease_file:
            try:
                return int(Path(self.ctx.lease_file).read_text())
            except (OSError, ValueError):
                pass  # not written (yet): the first one holds
        return self.ctx.lease_id

    async def _put_metrics_addr(self, addr: str) -> None:
        key = keys.metrics_endpoint(self.ctx.job, self.ctx.replica_id, self.ctx.rank)
        try:
            await self._store.put_json(key, {"addr": addr, "node_id": self.ctx.node_id},
                                       lease=self._lease() or None)
        except StoreError as e:  # discovery only: not worth failing the replica for
            logging.getLogger(__name__).warning("metrics endpoint not published: %s", e)

    async def _put_registration(self, changes: dict[str, Any]) -> None:
        # Concurrent puts may reach etcd in any order: a late step report could overwrite
        # "done". The lock (FIFO) keeps the writes in the order they were asked for.
        self._write_lock = self._write_lock or asyncio.Lock()
        async with self._write_lock:
            base = self._registration or Registration(
                replica_id=self.ctx.replica_id, state=ReplicaState.STARTING,
                generation=self.ctx.generation, host=self.ctx.host, pid=os.getpid())
            self._registration = dataclasses.replace(base, **changes)
            await self._put_on_lease(self._registration)

    async def _put_on_lease(self, registration: Registration) -> None:
        """Put the registration on the replica lease; if an outage outlived the lease, wait
        (up to the timeout) for the agent's replacement and put it on that."""
        deadline = time.monotonic() + self.ctx.timeout_s
        while True:
            lease = self._lease()
            value = dataclasses.replace(registration, lease=lease).to_json()
            try:
                await self._store.put(keys.replica(self.ctx.job, self.ctx.replica_id), value,
                                      lease=lease)
                self._lease_used = lease
                return
            except StoreError as e:
                if "lease not found" not in str(e) or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(LEASE_WAIT_S)

    def get_json(self, key: str) -> Any:
        return self._bg.run(self._store.get_json(key), timeout=self.ctx.timeout_s)

    def put_json(self, key: str, value: Any) -> None:
        """Write a record that outlives this process (no lease), if this rank speaks."""
        if self.speaks_for_replica:
            self._bg.run(self._store.put_json(key, value), timeout=self.ctx.timeout_s)

    def job_items(self, prefix: str) -> dict[str, bytes]:
        return self._bg.run(self._store.get_prefix(prefix), timeout=self.ctx.timeout_s)[0]

    def close(self) -> None:
        self._watcher.cancel()
        try:
            self._bg.run(self._store.close(), timeout=5)
        finally:
            self._bg.stop()


def _log_failure(future: Future) -> None:
    if not future.cancelled() and (error := future.exception()) is not None:
        logging.getLogger(__name__).warning("registration not published: %s", error)
