"""The update log: what produced each recent committed step, for a joiner to replay.

:class:`UpdateLog` keeps the averaged gradient of each committed step (the exact input of the
replica's step function; replaying it on the snapshot reproduces the donor's state bit for
bit), with the commit chain around it and the loop-advanced objects' states after it. It
always keeps the last few steps (for step reconciliation at epoch entry); while a catch-up
session is active it keeps everything within a memory budget, dropping the oldest (a joiner
that needs a dropped step fetches a newer snapshot). The replay is ``LocalState.replay``
(``ftsystem.training.local_state``).
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

KEEP_MIN_ENTRIES = 4
DEFAULT_LOG_BUDGET_BYTES = 1 << 30


MAX_SPARE = 2


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

    def __init__(self, budget_bytes: int = DEFAULT_LOG_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, LoggedUpdate] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.session_active = False
        self._spare: list[torch.Tensor] = []

    def append(self, step: int, update: LoggedUpdate) -> None:
        """Record the update that produced ``step``. Its gradient must not be modified later."""
        with self._lock:
            self._entries[step] = update
            self._bytes += update.nbytes
            self._trim()

    def clear(self) -> None:
        """Forget everything: the state was replaced, older updates no longer lead to it."""
        with self._lock:
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
            self._spare = [dropped.grad, *self._spare[:MAX_SPARE - 1]]

    def recycle(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer the log dropped, for the next step's gradients, if nobody else holds it.

        A fresh large buffer every step is page-faulted in: measured here at 100M parameters,
        222 ms to fill a new one against 37 ms to refill a used one. A dropped buffer may still
        be read (a log being served, a broadcast): it is reused only when neither a Python
        reference nor a view of its storage remains.
        """
        with self._lock:
            for i in range(len(self._spare)):
                if self._spare[i].numel() == numel and self._spare[i].dtype == dtype \
                        and _unshared(self._spare, i):
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
        return self._bytes
