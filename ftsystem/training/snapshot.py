"""A donor's snapshots of its (model, optimizer) state, taken without pausing training.

:class:`Snapshotter` takes a snapshot of the model and optimizer state at a step boundary
without pausing training. On CPU it copies nothing: between a commit and the next
``optimizer.step()`` (the only thing that mutates that state) the live tensors *are* the
snapshot, and they go on the wire straight from the model's memory; if the training thread
reaches that ``optimizer.step()`` before the transfer is done, it first copies the tensors
still to be sent (:meth:`~ftsystem.training.wire.EncodedState.freeze`). CUDA state is copied
into pinned host memory on a side stream and thread (the analogue of that window), which the
training thread waits for only if it reaches the next ``optimizer.step()`` first
(:func:`host_copy`).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from ftsystem.training.devices import cuda_device_of, use_device
from ftsystem.training.wire import (EncodedState, Transfer, cpu_copy, encode_state, map_tensors,
                                    state_layout, tree_tensors)


class Snapshotter:
    """Snapshots of (model, optimizer) state taken between commits, served raw."""

    def __init__(self, state_fn: Callable[[], dict]) -> None:
        self._state_fn = state_fn
        self._requested = threading.Event()
        self._at_step: int | None = None
        self._ready = threading.Condition()
        self._copying: threading.Thread | None = None
        self._encoded: EncodedState | None = None
        self._live: EncodedState | None = None  # served from the state's own memory
        self._copied_to_host = False  # a snapshot was copied into pinned memory
        self.step = -1  # step of the snapshot being served, -1: none
        self.layout: bytes | None = None  # state_layout() as of the first commit

    def request(self, at_step: int | None = None) -> None:
        """Take a snapshot after the next commit, or after committing ``at_step`` exactly
        (the ranks of a joining replica need their shards of one step)."""
        self._at_step = at_step
        self._requested.set()

    def after_commit(self, step: int) -> None:
        """Called by the training thread after each commit: take a requested snapshot."""
        if self.layout is None:  # once, here: the training thread is between its steps
            self.layout = state_layout(self._state_fn())
        if not self._requested.is_set() or self._copying is not None:
            return
        if self._at_step is not None and step < self._at_step:
            return
        self._requested.clear()
        state = self._state_fn()  # references
        if any(t.is_cuda for t in tree_tensors(state)):
            self._copying = threading.Thread(target=self._copy, args=(step, state),
                                             daemon=True, name="ftsystem-snapshot")
            self._copying.start()
            return
        encoded = encode_state(step, state, live=True)
        with self._ready:
            self.step, self._encoded, self._live = step, encoded, encoded
            self._ready.notify_all()

    def before_mutation(self) -> None:
        """Called by the training thread before ``optimizer.step()`` or a state load: a copy
        in flight completes; a snapshot served from the live state is no longer offered, and
        its transfers in flight go on from copies of what they have still to send."""
        if self._copying is not None:
            self._copying.join()
            self._copying = None
        with self._ready:
            live, self._live = self._live, None
            if live is not None and self._encoded is live:
                self.step, self._encoded = -1, None
        if live is not None:
            live.freeze()

    def _copy(self, step: int, state: dict) -> None:
        # This thread starts on cuda:0: the copy's streams belong on the state's GPU.
        use_device(cuda_device_of(tree_tensors(state)))
        self._copied_to_host = True
        encoded = encode_state(step, host_copy(state))
        with self._ready:
            self.step, self._encoded = step, encoded
            self._ready.notify_all()

    def wait_newer(self, than: int, timeout_s: float) -> int:
        with self._ready:
            self._ready.wait_for(lambda: self.step > than, timeout_s)
            return self.step

    def taken(self, step: int) -> Transfer | None:
        """A transfer of the snapshot of ``step`` if it is still offered (the transfer keeps
        what it sends: neither freeing the snapshot nor the next mutation cuts it short)."""
        with self._ready:
            return self._encoded.open() if self.step == step else None

    def free(self) -> None:
        """Stop serving the snapshot and release it (a transfer in flight keeps its copy)."""
        with self._ready:
            self.step, self._encoded = -1, None
        if self._copied_to_host:
            release_pinned_memory()

    def shutdown(self) -> None:
        self.free()


def host_copy(tree: Any) -> Any:
    """A host-memory copy of every tensor in ``tree``, taken without stalling the GPU.

    CUDA tensors are copied asynchronously into pinned memory on a side stream that first waits
    for the work already queued on the training stream; the training stream is not blocked,
    and this (side) thread waits for the copies alone. CPU tensors are cloned.
    """
    if not any(t.is_cuda for t in tree_tensors(tree)):
        return map_tensors(tree, cpu_copy)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        copy = map_tensors(tree, _pinned_copy)
    side.synchronize()
    return copy


def release_pinned_memory() -> None:
    """Give back the pinned host memory no tensor holds any more. CUDA's host allocator keeps
    every pinned block it made for reuse, so without this a donor keeps a whole copy of its
    state pinned for the rest of the job after one catch-up. Blocks a transfer still sends
    from stay (the session's end frees the snapshot again once they are done)."""
    empty = getattr(torch.accelerator, "empty_host_cache", None)
    if empty is None:  # an older torch
        empty = torch._C._host_emptyCache
    empty()


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_cuda:
        return cpu_copy(tensor)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    return host.copy_(tensor.detach(), non_blocking=True)
