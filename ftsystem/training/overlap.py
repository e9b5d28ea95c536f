"""Overlap the cross-replica gradient sum with backward, one bucket at a time.

``FTReplica.commit`` all-reduces one flat buffer of every gradient (``flat.FlatLayout``: in
parameter order, zeros for a parameter without a gradient, then a tail of counts and the
forward's buffers), and the update log stores that buffer. Sent
after backward, the network idles for the whole backward. :class:`OverlappedGradSum` fills the
same buffer from gradient hooks and starts the sum of a bucket (a contiguous slice of it) as soon
as all of the bucket's gradients are in, while backward goes on with the earlier layers.

Every replica issues the buckets in one fixed order (reverse parameter order, the order in which
autograd usually produces gradients): Gloo pairs collectives across processes by their sequence,
so replicas issuing in different orders would add different buckets together. A bucket that is
complete before the ones ahead of it in that order waits for them.

Threads: the hooks, hence ``issue``, run on the thread that runs backward (the caller's for CPU
tensors, an autograd device thread for CUDA ones). They never raise into autograd: a failure is
recorded and :meth:`OverlappedGradSum.finish` reports it as :class:`OverlapInvalid`.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ftsystem.training.flat import FlatLayout

DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20
"""Like DDP's default: big enough that per-collective latency is small next to the transfer."""

Issue = Callable[[torch.Tensor], torch.futures.Future]


class OverlapInvalid(RuntimeError):
    """This step's overlapped sum cannot be trusted. The gradients (``p.grad``) are intact:
    flatten and all-reduce them again, on a new group if some buckets were already issued."""


class GradientProducedTwice(OverlapInvalid):
    """Backward ran several times between ``arm`` and ``finish`` (gradient accumulation):
    a bucket may have left with the first gradient only. The program, not the network, is
    at fault, and it would be again next step."""


def plan_buckets(numels: Sequence[int], element_size: int, cap_bytes: int) -> list[range]:
    """Split parameter indices, in order, into contiguous ranges of at most ``cap_bytes``.

    A parameter larger than the cap gets a range of its own. Contiguous ranges in parameter
    order make every bucket one slice of the flat buffer, so no copy is needed to send it.
    """
    buckets: list[range] = []
    start, size = 0, 0
    for index, numel in enumerate(numels):
        nbytes = numel * element_size
        if index > start and size + nbytes > cap_bytes:
            buckets.append(range(start, index))
            start, size = index, 0
        size += nbytes
    if start < len(numels):
        buckets.append(range(start, len(numels)))
    return buckets


@dataclass
class _Armed:
    """The bookkeeping of one step, from :meth:`OverlappedGradSum.arm` to ``finish``."""

    buffer: torch.Tensor
    issue: Issue
    missing: list[int]
    """Per bucket (in issue order): gradients still to be copied in."""
    copied: list[bool]
    """Per parameter: its gradient is in the buffer."""
    used: list[bool]
    """Per parameter: it had a gradient (the buffer's tail, ``flat.FlatLayout``)."""
    futures: list[torch.futures.Future] = field(default_factory=list)
    """One per issued bucket, in issue order; its length is the next bucket to issue."""
    error: BaseException | None = None


class OverlappedGradSum:
    """Issues the all-reduce of gradient buckets while backward still runs."""

    def __init__(self, layout: FlatLayout,
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> None:
        self._layout = layout
        self._params = layout.params
        numels = [p.numel() for p in self._params]
        self._offsets = list(itertools.accumulate(numels, initial=0))
        element_size = self._params[0].element_size() if self._params else 1
        self._order = plan_buckets(numels, element_size, bucket_cap_bytes)[::-1]
        self._bucket_of = [0] * len(self._params)
        for k, bucket in enumerate(self._order):
            for index in bucket:
                self._bucket_of[index] = k
        # Hooks of several CUDA devices run on several autograd threads.
        self._lock = threading.Lock()
        self._armed: _Armed | None = None
        self._handles = [p.register_post_accumulate_grad_hook(
            lambda _, index=index: self._on_grad(index)) for index, p in enumerate(self._params)]

    @property
    def num_buckets(self) -> int:
        return len(self._order)

    def arm(self, buffer: torch.Tensor, issue: Issue) -> None:
        """Fill ``buffer`` (the layout's) during the next backward and call
        ``issue(bucket_slice)`` for each bucket, in issue order, once it is complete; the
        tail (counts, the forward's buffers) goes last, from :meth:`finish`."""
        size = self._layout.numel
        if buffer.dim() != 1 or not buffer.is_contiguous() or buffer.numel() != size:
            raise ValueError(f"the buffer must be flat and contiguous with {size} "
                             f"elements; got shape {tuple(buffer.shape)}")
        with self._lock:
            self._armed = _Armed(buffer, issue, [len(b) for b in self._order],
                                 [False] * len(self._params), [False] * len(self._params))

    def finish(self, wait: Callable[[torch.futures.Future], None]) -> torch.Tensor:
        """After backward: issue the buckets still missing (parameters that got no gradient
        contribute ``p.grad`` or zeros), ``wait`` for every bucket in issue order, and return
        the buffer holding the sum. Disarms, also when it raises.

        Raises :class:`OverlapInvalid` without waiting when the step cannot be trusted; buckets
        issued before may still be in flight and write into the buffer.
        """
        with self._lock:
            armed, self._armed = self._armed, None
        if armed is None:
            raise OverlapInvalid("finish() without arm(): nothing was collected for this step")
        if isinstance(armed.error, OverlapInvalid):
            raise armed.error
        if armed.error is not None:
            raise OverlapInvalid(f"overlapped gradient sum failed: {armed.error}") from armed.error
        try:
            for index in reversed(range(len(self._params))):  # reversed: issue order
                if not armed.copied[index]:
                    self._accept(armed, index)
            armed.futures.append(armed.issue(self._layout.pack_tail(armed.buffer, armed.used)))
        except Exception as e:
            raise OverlapInvalid(f"issuing the remaining buckets failed: {e}") from e
        for future in armed.futures:
            wait(future)
        return armed.buffer

    def disarm(self) -> None:
        """Drop this step's state; the hooks do nothing until the next :meth:`arm`."""
        with self._lock:
            self._armed = None

    def remove(self) -> None:
        """Remove the hooks from the parameters."""
        self.disarm()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_grad(self, index: int) -> None:
        with self._lock:
            armed = self._armed
            if armed is None or armed.error is not None:
                return
            try:
                if armed.copied[index]:
                    # Its bucket may be on the wire already, holding the first gradient only.
                    raise GradientProducedTwice(
                        f"the gradient of parameter {index} was produced twice in one step "
                        "(several backward calls between arm() and finish()); arm only "
                        "before the last backward of an accumulation")
                self._accept(armed, index)
            except Exception as e:  # autograd must not see it: finish() reports it
                armed.error = e

    def _accept(self, armed: _Armed, index: int) -> None:
        """Copy the gradient of parameter ``index`` in, then issue what became issuable."""
        param = self._params[index]
        target = armed.buffer[self._offsets[index]:self._offsets[index + 1]].view_as(param)
        if param.grad is None:
            target.zero_()
        else:
            target.copy_(param.grad)
        armed.used[index] = param.grad is not None
        armed.copied[index] = True
        armed.missing[self._bucket_of[index]] -= 1
        while len(armed.futures) < len(self._order) and armed.missing[len(armed.futures)] == 0:
            bucket = self._order[len(armed.futures)]
            piece = armed.buffer[self._offsets[bucket.start]:self._offsets[bucket.stop]]
            armed.futures.append(armed.issue(piece))
