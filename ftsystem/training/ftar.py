"""Fault-tolerant all-reduce (FTAR): cross-replica collectives over the current epoch's members.

CPU-side control decides who participates (the controller's epochs); torch.distributed moves the
bytes through torchft's reconfigurable process groups: ``ProcessGroupGloo`` for CPU tensors,
``ProcessGroupNCCL`` for CUDA ones (aborted through ``ncclCommAbort`` on a timeout or an epoch
change; ``bench/gpu_check.sh`` runs it on one GPU). One group per epoch and shard index:
rank = the replica's position in ``epoch.members``, rendezvous in the TCPStore named by the epoch,
under a prefix unique to (job, epoch, shard), so groups of different epochs never meet.

Waiting is always interruptible: while a rendezvous or a collective is in flight, a newer epoch
abandons it (:class:`EpochChanged`), a peer failure or the timeout fails it
(:class:`CollectiveFailed`), and a peer that has not arrived at a step's all-reduce within the
straggler bound is named (:class:`Stragglers`): every member of shard 0 marks its arrival at
each step in the epoch's store and beats there all epoch long: one that waits reads the beats
twice, and a member whose count stood still in between is dead, frozen or cut off (a dead host
sends nothing, not even a reset: this is how its death is known in under a second); one that
waited the bound also reads whose mark is missing. Gloo cannot
cancel an operation in flight, so an abandoned group is dropped with its buffers (callers pass
a fresh buffer on every attempt) and a new group is built for the new epoch: in the background,
from the moment the epoch is published, so that the rendezvous overlaps the end of the step in
the old epoch.

A collective is done when its data is in memory. With Gloo that is when its future completes;
with NCCL the future completes when the collective is queued on the GPU, and its errors come
later, from the group (``errored()``). So for CUDA tensors :meth:`FaultTolerantAllReduce.wait`
also waits for the device (:func:`device_arrival`) and then asks the group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torchft.process_group import (ProcessGroupGloo, ProcessGroupNCCL, ProcessGroupWrapper,
                                   create_store_client)

from ftsystem.training.devices import use_device, with_index
from ftsystem.control.membership import Epoch
from ftsystem.training.runtime import ControlPlane

log = logging.getLogger(__name__)
POLL_S = 0.002
ARRIVAL_STORE_TIMEOUT_S = 2.0
"""A check of the arrival marks that the epoch's store does not answer within this means the
store's host (``members[0]``) is frozen or gone: it is the one named late."""
BEAT_S = 0.2
"""How often shard 0 of a member adds one to its beat count in the epoch's store, all epoch
long, on a thread and a connection of its own, whatever its loop is doing. A member whose count
stood still for ``FROZEN_AFTER_BEATS`` beats is dead, frozen (SIGSTOP, a stopped VM) or cut off
from the store's host, not slow: its mark alone could not tell (a member frozen after it
arrived looks like a slow collective)."""
FROZEN_AFTER_BEATS = 3
SILENT_AFTER_S = FROZEN_AFTER_BEATS * BEAT_S
"""Beat counts read this far apart that did not move name a silent member (the default and
least ``StragglerBound.silence_s``, ``FTSYSTEM_STRAGGLER_SILENCE_S``)."""
SILENCE_LEAD_S = 0.1
"""A wait at a step's all-reduce reads the beats once it has lasted this long, and again the
silence later: a wait as short as most all-reduces costs no read at all."""
WATCH_POLL_S = 1.0
"""How often the thread that prepares published epochs looks whether the FTAR was shut down."""
DEVICE_POLL_S = 0.0002
"""A GPU collective of one gradient bucket takes about a millisecond: a poll as coarse as
``POLL_S`` would add a good part of that to every bucket's wait."""

Arrival = Callable[[], Callable[[], bool]]
"""Called right after a collective's future completed: marks where its data will be, and
returns a test of whether the data got there."""


class EpochChanged(Exception):
    """A newer epoch was published while this one was in use: move to it."""


class CollectiveFailed(Exception):
    """A rendezvous or collective failed (a peer died) or exceeded the timeout."""


class Stragglers(CollectiveFailed):
    """Members that had not arrived at a step's all-reduce within the straggler bound."""

    def __init__(self, late: tuple[str, ...], step: int, bound_s: float,
                 why: str = "") -> None:
        super().__init__(why or f"{', '.join(late)} had not arrived at the all-reduce of step "
                         f"{step} within {bound_s:.1f} s (the straggler bound)")
        self.late = late


class SilentMembers(Stragglers):
    """Members whose beats stood still while this one waited at a step's all-reduce: dead,
    frozen or cut off. Reported and handled as stragglers."""

    def __init__(self, silent: tuple[str, ...], step: int, silence_s: float) -> None:
        super().__init__(silent, step, silence_s, why=(
            f"{', '.join(silent)} stopped beating for {silence_s:.1f} s while this member waited "
            f"at the all-reduce of step {step} (dead, frozen or cut off)"))


class DeviceWedged(RuntimeError):
    """The abort of a group whose collective never finished did not return within the
    timeout: the GPU's streams may stay blocked behind that collective, so the next epoch
    cannot use the device. The process must restart (its agent restarts it)."""


class NCCLGroup(ProcessGroupNCCL):
    """torchft's reconfigurable NCCL group, whose error report does not block.

    torchft's ``errored()`` synchronizes the calling thread's current stream before it reads
    the error an abort set. FTAR asks only after its own event on that stream said the
    collective's data arrived, so the synchronize adds nothing there; but it blocks in CUDA,
    where no epoch or timeout can interrupt it (behind a collective that never finishes), and
    on a thread whose current device is not the rank's it waits on (and makes a context on)
    another GPU. The error is the one an abort records, set before the abort unblocks the
    stream; configuring the group clears it, as torchft's does.
    """

    def __init__(self, timeout: timedelta) -> None:
        super().__init__(timeout)
        self.abort_error: Exception | None = None

    def configure(self, *args, **kwargs) -> None:
        super().configure(*args, **kwargs)  # aborts the communicator it replaces first
        self.abort_error = None

    def abort(self, errored: bool = True) -> None:
        self.abort_error = RuntimeError("aborted (a timeout or an epoch change)")
        super().abort(errored=errored)

    def errored(self) -> Exception | None:
        return self.abort_error


def process_group_for(device: torch.device, timeout_s: float,
                      backend: str | None = None) -> ProcessGroupWrapper:
    """A new reconfigurable group for tensors on ``device``: NCCL for CUDA, Gloo for CPU, or
    ``backend`` (``gloo`` moves CUDA tensors too, through host memory: replicas that share
    one GPU cannot form an NCCL group)."""
    timeout = timedelta(seconds=timeout_s)
    if (backend or ("nccl" if device.type == "cuda" else "gloo")) == "nccl":
        return NCCLGroup(timeout)
    return ProcessGroupGloo(timeout)


def device_arrival(device: torch.device) -> Arrival | None:
    """How :meth:`FaultTolerantAllReduce.wait` learns that a collective's data is in memory
    once its future completed; None where the future alone says so (Gloo, on the CPU).

    NCCL completes the future when the collective is queued, and ``future.wait()`` only makes
    the calling thread's current stream wait for NCCL's stream. So the data is there once an
    event recorded on the current stream after that wait has completed. Polling the event,
    rather than synchronizing the stream, keeps the wait interruptible by a newer epoch.
    """
    if device.type != "cuda":
        return None

    def mark() -> Callable[[], bool]:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event.query
    return mark


def _arrived(store, rank: int, step: int) -> bool:
    """Whether ``rank``'s arrival mark in ``store`` is at ``step`` or later."""
    key = str(rank)  # check() first: get() of a key never written waits for it
    return store.check([key]) and int(store.get(key)) >= step


def _beat_key(rank: int) -> str:
    return f"beat{rank}"


class _Beats:
    """This member's beat count in the epoch's store (see ``BEAT_S``), until stopped."""

    def __init__(self, store, rank: int) -> None:
        self._stopped = threading.Event()
        threading.Thread(target=self._run, args=(store, _beat_key(rank)), daemon=True,
                         name="ftar-beats").start()

    def _run(self, store, key: str) -> None:
        while not self._stopped.wait(BEAT_S):
            try:
                store.add(key, 1)
            except (RuntimeError, ValueError):
                pass  # the store's host is gone or frozen: the next beat tries again

    def stop(self) -> None:
        self._stopped.set()


@dataclasses.dataclass(eq=False)
class _Build:
    """The group of one epoch, built on a thread of its own (:meth:`FaultTolerantAllReduce.prepare`)."""
    epoch: Epoch
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    pg: ProcessGroupWrapper | None = None
    arrivals: object = None
    """Shard 0: a client of the epoch's store, where members mark their arrival at steps."""
    beats: object = None
    """Shard 0: another client of it, for this member's beats (``BEAT_S``)."""
    error: BaseException | None = None
    abandoned: bool = False
    """Nobody will use it: its thread aborts the group it finishes building."""


class FaultTolerantAllReduce:
    """The cross-replica group of one shard index, rebuilt for every epoch."""

    def __init__(self, control: ControlPlane, *, shard_index: int = 0, timeout_s: float,
                 device: torch.device = torch.device("cpu"), backend: str | None = None) -> None:
        self.control = control
        self.backend = backend
        """None: NCCL for CUDA tensors, Gloo for CPU ones (:func:`process_group_for`)."""
        self.shard_index = shard_index
        self.timeout_s = timeout_s
        self.device = with_index(device)
        """Where the tensors it moves live (it picks the backend); its helper threads use it."""
        self.data_arrival = device_arrival(self.device)
        """How a wait learns that the data of a completed future is in memory (None: it is)."""
        self.epoch: Epoch | None = None
        self._pg: ProcessGroupWrapper | None = None
        self._arrivals = None
        """Shard 0: a client of the epoch's store, where members mark their arrival at steps."""
        self._arrival: tuple[int, float, float] | None = None
        """(step, bound, silence) while this member waits at that step's all-reduce."""
        self._beats: _Beats | None = None
        self._aborting: list[threading.Thread] = []
        self._wedging: list[threading.Thread] = []
        """Aborts of groups left with a CUDA collective whose data never arrived: the device's
        streams wait behind it until the abort returns (see :meth:`_await_wedging_aborts`)."""
        self._unfinished = False
        """A wait for a CUDA collective's data was interrupted in the current group."""
        self._lock = threading.Lock()
        self._builds: dict[int, _Build] = {}
        """Groups of epochs being built, or built and not yet used, by epoch number."""
        self._retired = 0
        """The newest epoch whose group was used or dropped: none is built again."""
        self._watcher: threading.Thread | None = None
        self._closed = False
        # Where each future waiting for its data was issued: that group reports its errors,
        # also after a newer epoch replaced it.
        self._issued_on: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def rank(self) -> int:
        return self.epoch.rank_of(self.control.ctx.replica_id)

    @property
    def world_size(self) -> int:
        return len(self.epoch.members)

    def configure(self, epoch: Epoch) -> None:
        """Use the group of ``epoch``; returns when every member has joined it.

        The group is built on a thread of its own (:meth:`prepare`), started as soon as the
        epoch is published (:meth:`watch`): while this member still finishes a
        step in the old epoch, the rendezvous of the new one goes on, as torchft's quorum
        runs beside the forward pass. This waits for that build (a newer epoch or the
        timeout interrupts the wait) and adopts it.
        """
        build = self.prepare(epoch)
        try:
            self._wait(lambda: build.done.wait(POLL_S), epoch)
            if isinstance(build.error, (EpochChanged, CollectiveFailed)):
                raise build.error
            if build.error is not None:
                raise CollectiveFailed(f"group of epoch {epoch.number} failed: {build.error}")
        except (EpochChanged, CollectiveFailed):
            self._abandon(build)
            raise
        with self._lock:
            self._builds.pop(epoch.number, None)
            self._retired = max(self._retired, epoch.number)
            older = [b for n, b in self._builds.items() if n < epoch.number]
        for stale in older:
            self._abandon(stale)
        self.abort()
        self._await_wedging_aborts()
        self._pg, self._arrivals, self.epoch = build.pg, build.arrivals, epoch
        if build.beats is not None:
            self._beats = _Beats(build.beats, self.rank)
        self.watch(newer_than=epoch.number)

    def prepare(self, epoch: Epoch) -> "_Build":
        """Start building the group of ``epoch`` on a thread of its own (once per epoch).

        Gloo's own rendezvous cannot be interrupted, and a rendezvous left waiting (its epoch
        superseded) has been seen to abort the process when the store's host died later. So
        the members first meet at an interruptible barrier in the epoch's store, and start
        Gloo's rendezvous only once all have arrived: then it completes at once.
        """
        with self._lock:
            build = self._builds.get(epoch.number)
            if build is None and (self._closed or epoch.number <= self._retired):
                # Used or dropped already: a second rendezvous under its prefix would wait
                # alone (its barrier's keys are all set), past any newer epoch. Shut down:
                # a process exiting during a rendezvous in C++ is aborted.
                build = _Build(epoch, error=EpochChanged(
                    f"epoch {epoch.number} was already used or dropped, or the FTAR is shut down"))
                build.done.set()
            elif build is None:
                build = self._builds[epoch.number] = _Build(epoch)
                threading.Thread(target=self._build, args=(build,), daemon=True,
                                 name="ftar-build").start()
        return build

    def _build(self, build: "_Build") -> None:
        epoch, ctx = build.epoch, self.control.ctx
        rank, world = epoch.rank_of(ctx.replica_id), len(epoch.members)
        addr = f"{epoch.store_addr}/ftsystem/{ctx.job}/epoch/{epoch.number}/shard/{self.shard_index}"
        try:
            self._barrier(addr, rank, world, epoch)
            pg = process_group_for(self.device, self.timeout_s, self.backend)
            use_device(self.device)  # NCCL binds its communicator to the current device
            try:
                pg.configure(addr, ctx.replica_id, rank, world)
            except BaseException as e:  # e.g. a peer that died since the barrier
                raise CollectiveFailed(f"rendezvous of epoch {epoch.number} failed: {e}") from e
            build.pg = pg
            build.arrivals = self._arrival_store(addr, epoch)
            build.beats = self._arrival_store(addr, epoch)
        except BaseException as e:  # reported to the thread that configures the epoch
            build.error = e
        finally:
            with self._lock:
                build.done.set()
                orphan = build.pg if build.abandoned else None
            if orphan is not None:
                self._abort_group(orphan)

    def _arrival_store(self, addr: str, epoch: Epoch):
        if self.shard_index != 0:
            return None
        try:
            return create_store_client(f"{addr}/steps", timedelta(seconds=ARRIVAL_STORE_TIMEOUT_S))
        except (RuntimeError, ValueError) as e:  # its host just went: the collective fails
            log.warning("epoch %d: no arrival marks this epoch (%s)", epoch.number, e)
            return None

    def _abandon(self, build: "_Build") -> None:
        """Drop a build nobody will use: its group is aborted once it exists (tearing down a
        group still connecting aborts the process), by its own thread if it still runs."""
        with self._lock:
            build.abandoned = True
            if self._builds.get(build.epoch.number) is build:
                del self._builds[build.epoch.number]
                self._retired = max(self._retired, build.epoch.number)
            pg = build.pg if build.done.is_set() else None
        if pg is not None:
            self._abort_in_background(pg)

    def watch(self, newer_than: int) -> None:
        """Prepare every epoch numbered above ``newer_than`` published with this replica as a
        trainable member, on a thread that waits for them (started once: by the first
        ``configure``, or earlier by a joiner, so that its group of the join epoch is built
        from the moment the epoch is published, whatever its training thread is doing)."""
        if self._watcher is not None:
            return

        def watch() -> None:
            seen = newer_than
            while not self._closed:
                epoch = self.control.wait_for_epoch(seen, WATCH_POLL_S)
                if epoch is None or self._closed:
                    continue
                seen = epoch.number
                if self.control.ctx.replica_id in epoch.members and not epoch.paused:
                    self.prepare(epoch)

        self._watcher = threading.Thread(target=watch, daemon=True, name="ftar-epochs")
        self._watcher.start()

    def _barrier(self, addr: str, rank: int, world: int, epoch: Epoch) -> None:
        try:
            store = self._connect(f"{addr}/arrived", epoch)
            store.set(str(rank), "1")
            everyone = [str(r) for r in range(world)]
            self._wait(lambda: store.check(everyone) or time.sleep(POLL_S), epoch)
        except (RuntimeError, ValueError) as e:  # the store's host is gone (DistNetworkError)
            raise CollectiveFailed(f"epoch {epoch.number}: rendezvous store unreachable: {e}") \
                from e

    def _connect(self, addr: str, epoch: Epoch):
        """A client of the epoch's store, connected in a thread so that a newer epoch interrupts
        the wait: when the store's host died just before the epoch was published (it named a
        member whose death was not seen yet), its SYNs go unanswered and the connect would hold
        this member for the whole timeout, past the epoch that removes the dead host."""
        done = threading.Event()
        outcome: list = []

        def connect() -> None:
            try:
                outcome.append(create_store_client(addr, timedelta(seconds=self.timeout_s)))
            except BaseException as e:  # reported to the waiting thread
                outcome.append(e)
            finally:
                done.set()

        threading.Thread(target=connect, daemon=True, name="ftar-store-connect").start()
        self._wait(lambda: done.wait(POLL_S), epoch)  # an abandoned connect times out alone
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    @contextlib.contextmanager
    def arrival(self, step: int, bound_s: float,
                silence_s: float = SILENT_AFTER_S) -> Iterator[None]:
        """Around a step's all-reduce: mark this member arrived at ``step``; a wait in it
        raises :class:`SilentMembers` naming the members whose beats stood still for
        ``silence_s``, and once longer than ``bound_s`` reads which members have not arrived,
        and raises :class:`Stragglers` naming them. Shard 0 only (a replica's ranks step
        together: one held back holds back its rank 0, through the replica's own
        collectives)."""
        if self._arrivals is None:
            yield
            return
        try:  # one write per step: the member's key holds the last step it arrived at
            self._arrivals.set(str(self.rank), str(step))
        except (RuntimeError, ValueError):
            pass  # the store's host is gone: the collective fails without help
        self._arrival = (step, bound_s, silence_s)
        try:
            yield
        finally:
            self._arrival = None

    def _late_members(self, epoch: Epoch, step: int, early: "_MarksRead | None" = None,
                      silence_s: float = math.inf) -> tuple[str, ...]:
        """The members whose mark is missing or behind ``step``, and those marked at it in
        both this read and ``early`` whose beats stood still between the two (frozen inside
        the all-reduce: see ``BEAT_S``). The marks are read in a
        thread: a store whose host is frozen (SIGSTOP) or cut off keeps its connection open
        and never answers, and TCPStore's timeout does not bound a ``check``; a store that
        has not answered within ``ARRIVAL_STORE_TIMEOUT_S`` names its host, ``members[0]``,
        and so does one that left ``early``, a read started before, unanswered for
        ``silence_s``. A read left waiting ends with that connection; the epoch that follows
        has its own."""
        if early is not None and not early.done.is_set() and \
                time.monotonic() - early.started >= silence_s:
            return (epoch.members[0],)
        read = self._read_marks(epoch, step)
        read.done.wait(ARRIVAL_STORE_TIMEOUT_S)
        if read.late is None:
            return (epoch.members[0],)
        silent = silent_members(early, read, me=self.control.ctx.replica_id)
        return read.late + tuple(m for m in silent if m not in read.late)

    def _read_marks(self, epoch: Epoch, step: int) -> "_MarksRead":
        """Start reading which members' marks are behind ``step``, on a thread of its own."""
        read = _MarksRead(time.monotonic())
        store = self._arrivals  # this epoch's client: a read left waiting keeps to it

        def run() -> None:
            try:
                late = tuple(m for r, m in enumerate(epoch.members)
                             if not _arrived(store, r, step))
                started = time.monotonic()
                read.beats = {m: store.add(_beat_key(r), 0) for r, m in enumerate(epoch.members)}
                read.beats_read = (started, time.monotonic())
                read.late = late
            except (RuntimeError, ValueError):  # the store's host is gone
                pass
            finally:
                read.done.set()

        threading.Thread(target=run, daemon=True, name="ftar-arrivals").start()
        return read

    def allreduce_sum(self, tensor: torch.Tensor, on_issued: Callable[[], None] | None = None
                      ) -> None:
        future = self.allreduce_sum_async(tensor)
        if on_issued is not None:
            on_issued()
        self.wait(future)

    def allreduce_sum_async(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Issue a sum on the current group and return at once (``wait`` for the result)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self._issue(lambda pg: pg.allreduce([tensor], opts))

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.wait(self._issue(lambda pg: pg.broadcast([tensor], opts)))

    def abort(self) -> None:
        """Drop the current group (its in-flight work is abandoned, see the module doc).

        The abort runs on a thread of its own: a group whose work waits on a silent peer (a
        partition drops packets without a reset) blocks its abort until Gloo's own timeout,
        and the next epoch must not wait for that.
        """
        self._arrivals = None
        if self._beats is not None:
            self._beats.stop()
            self._beats = None
        if self._pg is not None:
            pg, self._pg = self._pg, None
            aborting = self._abort_in_background(pg)
            if self._unfinished:
                self._wedging.append(aborting)
            self._unfinished = False

    def _abort_in_background(self, pg: ProcessGroupWrapper) -> threading.Thread:
        aborting = threading.Thread(target=self._abort_group, args=(pg,), daemon=True,
                                    name="ftar-abort")
        aborting.start()
        self._aborting = [t for t in self._aborting if t.is_alive()] + [aborting]
        return aborting

    def _await_wedging_aborts(self) -> None:
        """Before a new group is used: wait for the aborts of groups left with an unfinished
        CUDA collective. Until such an abort returns, the training stream waits behind that
        collective, and the new epoch's first host copy would block in CUDA, where no epoch
        or timeout can interrupt it. An abort that does not return within the timeout leaves
        the device unusable: :class:`DeviceWedged` (the process restarts)."""
        deadline = time.monotonic() + self.timeout_s
        for thread in self._wedging:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._wedging = [t for t in self._wedging if t.is_alive()]
        if self._wedging:
            raise DeviceWedged(
                f"the abort of a group with an unfinished collective did not return within "
                f"{self.timeout_s:.0f} s (FTSYSTEM_TIMEOUT_S): the device's streams are blocked "
                "behind it; restarting the process")

    def _abort_group(self, pg: ProcessGroupWrapper) -> None:
        use_device(self.device)  # not cuda:0, where it would make a CUDA context of its own
        pg.abort(errored=False)

    def shutdown(self) -> None:
        """Abort the group and wait (up to the timeout) for every abort still running: a
        process that exits while one runs in C++ is terminated with SIGABRT."""
        with self._lock:
            self._closed = True
            builds = list(self._builds.values())
        for build in builds:
            self._abandon(build)
        self.abort()
        deadline = time.monotonic() + self.timeout_s
        for thread in self._aborting:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _issue(self, issue: Callable) -> torch.futures.Future:
        if self._pg is None:
            raise CollectiveFailed("no group: configure an epoch first")
        try:
            future = issue(self._pg).get_future()
        except RuntimeError as e:
            raise CollectiveFailed(str(e)) from e
        if self.data_arrival is not None:
            self._issued_on[future] = self._pg
        return future

    def wait(self, future: torch.futures.Future) -> None:
        """Wait until the data of a collective of the current epoch is in memory; a newer
        epoch or the timeout interrupts the wait (:class:`EpochChanged`,
        :class:`CollectiveFailed`), and so does an error its group reports."""
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        self._wait(lambda: done.wait(POLL_S), self.epoch, self._arrival)
        try:
            future.wait()
        except RuntimeError as e:
            raise CollectiveFailed(f"collective in epoch {self.epoch.number} failed: {e}") from e
        if self.data_arrival is not None:
            self._wait_for_data(future)

    def _wait_for_data(self, future: torch.futures.Future) -> None:
        """After the future: wait for the device to write the data, then ask the group that
        issued it whether it failed meanwhile (NCCL reports errors asynchronously; a timed-out
        collective is aborted, which also lets the stream, and so this wait, go on)."""
        arrived = self.data_arrival()
        self._unfinished = True  # until the data is there: see abort()
        self._wait(lambda: arrived() or time.sleep(DEVICE_POLL_S), self.epoch)
        self._unfinished = False
        group = self._issued_on.get(future)
        error = RuntimeError("issued on no group of this FTAR") if group is None \
            else group.errored()
        if error is not None:
            raise CollectiveFailed(f"collective in epoch {self.epoch.number} failed on the "
                                   f"device: {error}")

    def _wait(self, ready: Callable[[], bool], epoch: Epoch,
              arrival: tuple[int, float, float] | None = None) -> None:
        """Poll ``ready`` (which may block up to ``POLL_S``) until it holds; a newer epoch or
        the timeout interrupts the wait, and so do stragglers at ``arrival`` (step, bound,
        silence)."""
        deadline = time.monotonic() + self.timeout_s
        stragglers = _StragglerCheck(self, epoch, *arrival) if arrival is not None else None
        while not ready():
            latest = self.control.epoch
            if latest is not None and latest.number > epoch.number:
                raise EpochChanged(f"epoch {latest.number} superseded {epoch.number}")
            if stragglers is not None:
                stragglers.poll()
            if time.monotonic() > deadline:
                raise CollectiveFailed(f"not done within {self.timeout_s:.0f} s in epoch "
                                       f"{epoch.number} (FTSYSTEM_TIMEOUT_S)")


@dataclasses.dataclass(eq=False)
class _MarksRead:
    """A read of the arrival marks (:meth:`FaultTolerantAllReduce._read_marks`)."""
    started: float
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    late: tuple[str, ...] | None = None
    """The members behind; None while the store has not answered, or when it failed."""
    beats: dict[str, int] | None = None
    """Every member's beat count, read after the marks."""
    beats_read: tuple[float, float] = (math.inf, -math.inf)
    """When the reading of ``beats`` started and ended."""


def silent_members(early: _MarksRead | None, now: _MarksRead, me: str,
                   after_s: float = SILENT_AFTER_S) -> tuple[str, ...]:
    """The members other than ``me`` whose beat count stood still between two reads: dead,
    frozen (SIGSTOP, a stopped VM) or cut off from the store's host, whatever their mark says
    (a live member beats on a thread of its own, whatever its loop is doing). None unless the
    counts were read ``after_s`` apart (a read that a slow store answered late is nearer the
    next than its start). A member that had not beaten yet at the first read (still
    building its group) is not judged: if it never arrives, the bound's read of the marks
    names it. Nor is anyone while ``me``'s own count moved less than half the beats the span
    holds: its beats, on the same store, are the clock. A machine too loaded to run this
    process's beat thread, or the store's host, for the span may have held the others' beats
    back as well, and their silence says nothing of them (pure)."""
    if early is None or early.beats is None or now.beats is None:
        return ()
    span_s = now.beats_read[0] - early.beats_read[1]
    mine = now.beats.get(me, 0) - early.beats.get(me, 0)
    if span_s < after_s or mine < max(1.0, span_s / BEAT_S / 2):
        return ()
    return tuple(m for m, count in now.beats.items()
                 if m != me and early.beats.get(m, 0) > 0 and early.beats.get(m) == count)


class _StragglerCheck:
    """When a wait at a step's all-reduce reads the arrival marks: at the straggler bound, and
    every bound after. A first read starts half a bound earlier (at most
    ``ARRIVAL_STORE_TIMEOUT_S``): a store silent since then is known silent at the bound, and
    its host named, rather than one store timeout after it (a fault of ``members[0]`` would
    otherwise cost the survivors the bound plus that timeout)."""

    def __init__(self, ftar: FaultTolerantAllReduce, epoch: Epoch, step: int,
                 bound_s: float, silence_s: float = SILENT_AFTER_S) -> None:
        self.ftar, self.epoch, self.step, self.bound_s = ftar, epoch, step, bound_s
        self.lead_s = min(ARRIVAL_STORE_TIMEOUT_S, bound_s / 2)
        now = time.monotonic()
        self._arm(now)
        self.silence = _SilenceCheck(ftar, epoch, step, now + SILENCE_LEAD_S, silence_s)

    def _arm(self, now: float) -> None:
        self.check_at, self.early = now + self.bound_s, None

    def poll(self) -> None:
        """Raise :class:`SilentMembers` as soon as some stopped beating, and
        :class:`Stragglers` once the bound passed with members behind."""
        now = time.monotonic()
        if silent := self.silence.poll(now):
            raise SilentMembers(silent, self.step, self.silence.after_s)
        if self.early is None and now > self.check_at - self.lead_s:
            self.early = self.ftar._read_marks(self.epoch, self.step)
        if now > self.check_at:
            # The early read started at the first poll past its instant, this check runs at
            # the first poll past the bound: the read may have waited a poll less than lead_s.
            # Half of it is silence enough, and no coin toss between the two polls.
            late = self.ftar._late_members(self.epoch, self.step, self.early, self.lead_s / 2)
            if late:
                raise Stragglers(late, self.step, self.bound_s)
            self._arm(now)  # everyone is there: the collective itself is slow


class _SilenceCheck:
    """The beats read while a wait at a step's all-reduce goes on: first at ``first_at``, then
    ``after_s`` after each read answered, each read against the one before. Members whose
    count stood still are named in under a second, where the bound would take seconds: a host
    that died without a word (no reset, no FIN), a frozen process, a cut link. A store that does
    not answer is left to the bound's check, which names its host."""

    def __init__(self, ftar: FaultTolerantAllReduce, epoch: Epoch, step: int,
                 first_at: float, after_s: float) -> None:
        self.ftar, self.epoch, self.step, self.after_s = ftar, epoch, step, after_s
        self.next_at = first_at
        self.before: _MarksRead | None = None
        self.reading: _MarksRead | None = None

    def poll(self, now: float) -> tuple[str, ...]:
        """The silent members, once a read shows some; () until then."""
        if self.reading is None:
            if now >= self.next_at:
                self.reading = self.ftar._read_marks(self.epoch, self.step)
            return ()
        if not self.reading.done.is_set():
            return ()
        read, self.reading = self.reading, None
        if read.beats is None:  # the store failed: nothing to compare, ever
            self.next_at = math.inf
            return ()
        silent = silent_members(self.before, read, me=self.ftar.control.ctx.replica_id,
                                after_s=self.after_s)
        self.before, self.next_at = read, read.beats_read[1] + self.after_s
        return silent
