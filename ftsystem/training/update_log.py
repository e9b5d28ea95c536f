"""The update log: what produced each recent committed step, for a joiner to replay.

:class:`UpdateLog` keeps the averaged gradient of each committed step (the exact input of the
replica's step function; replaying it on the snapshot reproduces the donor's state bit for
bit), with the commit chain around it and the loop-advanced objects' states after it. It
always keeps the last few steps (for step reconciliation at epoch entry); while a catch-up
session is active it keeps everything within a memory budget, dropping the oldest (a joiner
that needs a dropped step fetches a newer snapshot). The replay is ``LocalState.replay``
(``ftsystem.training.local_state``).

Memory: the entries, and the buffers it keeps for reuse beyond the one the next step needs
anyway, stay within the budget. Where the device is short (:func:`log_on_host`), the entries
are pinned host copies, made on a thread and a side stream of their own while training goes
on: an entry holds its device average until its copy is complete, then the copy.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ftsystem.training.devices import use_device

KEEP_MIN_ENTRIES = 4
DEFAULT_LOG_BUDGET_BYTES = 1 << 30
MAX_SPARE = 2
DEVICE_SHARE = 0.25
"""The log goes to the host (``FTSYSTEM_CATCHUP_LOG_PLACE=auto``) when its budget is over
this share of the device memory free at start: the first steps still allocate optimizer
state, activations and the step's own buffers there."""
PLACES = ("auto", "device", "host")


def log_on_host(place: str, budget_bytes: int, device_free_bytes: int | None) -> bool:
    """Whether the update log keeps its entries in host memory: ``place`` is the setting
    (one of ``PLACES``), ``device_free_bytes`` the gradients' device's free memory (None: the
    gradients are on the host already)."""
    if place not in PLACES:
        raise ValueError(f"the update log's place {place!r}: expected one of {', '.join(PLACES)}")
    if device_free_bytes is None:
        return False
    return place == "host" or (place == "auto" and budget_bytes > DEVICE_SHARE * device_free_bytes)


def _unshared(tensors: list[torch.Tensor], i: int) -> bool:
    """Whether ``tensors[i]`` is referenced by that list alone (no other name, no view)."""
    # getrefcount counts the list's reference and its own argument; a storage referenced by
    # this tensor alone has a use count of 2 while ``untyped_storage()`` holds it too.
    return sys.getrefcount(tensors[i]) == 2 and torch._C._storage_Use_Count(
        tensors[i].untyped_storage()._cdata) == 2


@dataclass(frozen=True, slots=True)
class LoggedUpdate:
    """What produced one committed step: the averaged gradient the step function ran on, the
    commit chain before and after it (``ftsystem.training.fingerprint``), and the loop-advanced
    objects' states (``ReplicatedObjects.carry``) after the step and when the step function
    ran (the loop had drawn the step's batch; the step function may draw too)."""

    grad: torch.Tensor
    parent: bytes
    chain: bytes
    carry: bytes = b""
    carry_before: bytes = b""

    @property
    def nbytes(self) -> int:
        return self.grad.numel() * self.grad.element_size() + len(self.carry) + \
            len(self.carry_before)


class UpdateLog:
    """What produced each recent committed step: ``step -> LoggedUpdate``."""

    def __init__(self, budget_bytes: int = DEFAULT_LOG_BUDGET_BYTES, *,
                 on_host: bool = False) -> None:
        self.budget_bytes = budget_bytes
        self.on_host = on_host
        """Device gradients are logged as host copies (:func:`log_on_host`)."""
        self._entries: OrderedDict[int, LoggedUpdate] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.session_active = False
        self._spare: list[torch.Tensor] = []
        self._copies = _HostCopies(self) if on_host else None

    def append(self, step: int, update: LoggedUpdate) -> None:
        """Record the update that produced ``step``. Its gradient must not be modified later."""
        if update.nbytes > self.budget_bytes:
            # Not even alone: the log keeps nothing (it never has a gap), and the buffer is the
            # next step's (on the host, the allocator's).
            with self._lock:
                self._forget()
                if not (update.grad.is_cuda and self.on_host):
                    self._keep_spare(update.grad, locked=True)
            return
        with self._lock:
            self._entries[step] = update
            self._bytes += update.nbytes
            self._trim()
        if self._copies is not None and update.grad.is_cuda:
            self._copies.start(step, update)

    def _copied(self, step: int, update: LoggedUpdate, host: torch.Tensor) -> None:
        """The host copy of ``update`` (logged for ``step``) is complete: the entry holds it
        from now on, and its device average goes back to the allocator."""
        with self._lock:
            if self._entries.get(step) is update:
                self._entries[step] = dataclasses.replace(update, grad=host)
            else:  # dropped meanwhile
                self._keep_spare(host, locked=True)

    def _host_buffer(self, grad: torch.Tensor) -> torch.Tensor | None:
        """A pinned buffer the log dropped, for ``grad``'s host copy (pinning is slow)."""
        with self._lock:
            return self._take_spare(grad.numel(), grad.dtype, torch.device("cpu"))

    def wait_for_copies(self) -> None:
        """Until every host copy started so far is complete (the entries hold host memory)."""
        if self._copies is not None:
            self._copies.wait()

    def clear(self) -> None:
        """Forget everything: the state was replaced, older updates no longer lead to it."""
        with self._lock:
            self._forget()

    def _forget(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def end_session(self) -> None:
        """No joiner is reading any more: keep only the last few updates."""
        with self._lock:
            self.session_active = False
            self._trim()

    def _trim(self) -> None:
        """Within the budget, always; beyond the last few steps (for step reconciliation) only
        while a joiner is reading. Entries larger than the budget are not kept at all: the
        members behind then receive the whole state at the epoch's entry."""
        while self._entries and (self._bytes > self.budget_bytes or (
                not self.session_active and len(self._entries) > KEEP_MIN_ENTRIES)):
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.nbytes
            self._keep_spare(dropped.grad, locked=True)

    def _keep_spare(self, grad: torch.Tensor, locked: bool = False) -> None:
        """Keep a dropped buffer for reuse: one always (the next step needs one anyway), more
        only within what the entries leave of the budget."""
        with contextlib.nullcontext() if locked else self._lock:
            kept = [grad, *self._spare][:MAX_SPARE]
            while len(kept) > 1 and self._bytes + sum(_size(t) for t in kept[1:]) > \
                    self.budget_bytes:
                kept.pop()
            self._spare = kept

    def reserve(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate and touch, now, the host buffers that the first steps' averages of
        ``numel`` elements take (as many as the log keeps in steady state, and the next
        step's). Until the log holds its last few steps, each step would page-fault a new one
        in: 30-300 ms at 10M parameters on a loaded 2-core machine, 1.1 s over a joiner's
        first steps, which the members spent waiting for it at the all-reduce. A GPU's
        caching allocator has no such cost: device buffers are left to it."""
        if device.type != "cpu":
            return
        entry = numel * dtype.itemsize
        count = min(KEEP_MIN_ENTRIES, self.budget_bytes // entry) + 1
        buffers = [torch.zeros(numel, dtype=dtype, device=device) for _ in range(count)]
        with self._lock:
            self._spare = buffers

    def recycle(self, numel: int, dtype: torch.dtype,
                device: torch.device = torch.device("cpu")) -> torch.Tensor | None:
        """A buffer the log dropped, for the next step's gradients, if nobody else holds it.

        A fresh large buffer every step is page-faulted in: measured here at 100M parameters,
        222 ms to fill a new one against 37 ms to refill a used one. A dropped buffer may still
        be read (a log being served, a broadcast): it is reused only when neither a Python
        reference nor a view of its storage remains.
        """
        with self._lock:
            return self._take_spare(numel, dtype, device)

    def _take_spare(self, numel: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor | None:
        for i in range(len(self._spare)):  # no local name for a spare: it would count
            if _fits(self._spare[i], numel, dtype, device) and _unshared(self._spare, i):
                return self._spare.pop(i)
        return None

    def oldest(self) -> int | None:
        """The oldest step that can be produced from the log, or None when it is empty."""
        with self._lock:
            return next(iter(self._entries), None)

    def entries(self) -> list[tuple[int, LoggedUpdate]]:
        """All entries, oldest first: a consistent view that later trimming cannot change."""
        with self._lock:
            return list(self._entries.items())

    def since(self, after: int) -> list[tuple[int, LoggedUpdate]] | None:
        """Updates for steps ``after+1 ..``, or None when some of them were dropped."""
        with self._lock:
            steps = list(self._entries)
            if steps and after + 1 < steps[0]:
                return None
            return [(s, self._entries[s]) for s in steps if s > after]

    @property
    def nbytes(self) -> int:
        """The entries' bytes."""
        return self._bytes

    @property
    def held_bytes(self) -> int:
        """Everything the log holds: its entries and the buffers it keeps for reuse."""
        with self._lock:
            return self._bytes + sum(_size(t) for t in self._spare)


def _fits(tensor: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
    return tensor.numel() == numel and tensor.dtype == dtype and tensor.device.type == device.type


def _size(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _HostCopies:
    """Host copies of a log's device averages, made in order on a thread and a side stream of
    their own: the training thread neither allocates pinned memory (about 0.45 ms per MB,
    measured on an H200 host) nor waits for the copy. At most ``MAX_PENDING`` copies are in
    flight (each holds its device average); a step beyond that waits for the oldest."""

    MAX_PENDING = 2

    def __init__(self, log: UpdateLog) -> None:
        self._log = log
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ftsystem-log-copy")
        self._pending: collections.deque[Future] = collections.deque()
        self._stream = None

    def start(self, step: int, update: LoggedUpdate) -> None:
        while self._pending and (self._pending[0].done() or
                                 len(self._pending) >= self.MAX_PENDING):
            self._pending.popleft().result()
        written = torch.cuda.Event()  # the average is complete once the queued work ran
        written.record(torch.cuda.current_stream(update.grad.device))
        self._pending.append(self._pool.submit(self._copy, step, update, written))

    def _copy(self, step: int, update: LoggedUpdate, written) -> None:
        grad = update.grad
        use_device(grad.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(grad.device)
        host = self._log._host_buffer(grad)
        if host is None:
            host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
        self._stream.wait_event(written)
        with torch.cuda.stream(self._stream):
            host.copy_(grad, non_blocking=True)
        self._stream.synchronize()
        self._log._copied(step, update, host)

    def wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()
