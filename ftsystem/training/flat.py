"""The one buffer a step's all-reduce moves, and what it holds, in this order:

1. every trainable parameter's gradient shard, flattened (a parameter without a gradient
   contributes zeros: every member must all-reduce the same layout);
2. one element per parameter: 1 where it had a gradient. After the sum, a parameter that no
   member used keeps no gradient, as under DDP, so weight decay and momentum leave it alone;
3. the buffers the forward updates (batch-norm running statistics and their counters): they
   are averaged with the gradients, so every member holds the same statistics, and the update
   log carries them, so a replay or a join step (which run no forward) sets them too.

The buffer's dtype is the widest of the parameters' (bf16 weights beside fp32 ones are summed
in fp32, each gradient then cast back to its own dtype). The update log keeps the averaged
buffer of each step: :meth:`FlatLayout.unpack` of it reproduces the step's inputs bit for bit.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ftsystem.training.shards import local, local_numel, sharded_like


def forward_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The buffers a forward pass updates in place: batch norms' running statistics and
    counters. (Other counters a forward keeps belong in a registered object.)"""
    return [buffer for module in model.modules()
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
            for buffer in (module.running_mean, module.running_var, module.num_batches_tracked)
            if buffer is not None]


class FlatLayout:
    """Where each part of a step's inputs lies in the flat buffer (see the module's doc)."""

    def __init__(self, params: list[nn.Parameter], buffers: list[torch.Tensor] = ()) -> None:
        self.params, self.buffers = list(params), [local(b) for b in buffers]
        self.grad_numel = local_numel(self.params)
        self.numel = self.grad_numel + len(self.params) + sum(b.numel() for b in self.buffers)
        self.dtype = functools.reduce(torch.promote_types, (local(p).dtype for p in params))
        self.device = local(self.params[0]).device

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def empty(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def pack(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's gradients, their counts and the forward's buffers, in ``out`` (or a
        new buffer). With no gradient at all (a joiner's join step): zeros, in one pass."""
        out = self.empty() if out is None else out
        if all(p.grad is None for p in self.params):
            return out.zero_()
        grads = [(local(p.grad) if p.grad is not None else torch.zeros_like(local(p))).reshape(-1)
                 for p in self.params]
        torch.cat(grads, out=out[:self.grad_numel])
        self.pack_tail(out, [p.grad is not None for p in self.params])
        return out

    def pack_tail(self, out: torch.Tensor, used: list[bool]) -> torch.Tensor:
        """Write the counts and the buffers behind the gradients; returns that tail."""
        tail = out[self.grad_numel:]
        counts, rest = tail[:len(used)], tail[len(used):]
        counts.copy_(torch.tensor(used, dtype=out.dtype))
        if self.buffers:
            torch.cat([b.reshape(-1).to(out.dtype) for b in self.buffers], out=rest)
        return tail

    def unpack(self, flat: torch.Tensor) -> None:
        """Make slices of ``flat`` (an averaged buffer) the parameters' gradients (views, no
        copy; a copy in the parameter's dtype where it differs), and copy the averaged
        buffers in. A parameter no member had a gradient for keeps none."""
        sizes = [local(p).numel() for p in self.params]
        counts = flat[self.grad_numel:self.grad_numel + len(self.params)]
        for param, grad, used in zip(self.params, flat[:self.grad_numel].split(sizes),
                                     (counts != 0).tolist()):
            if not used:
                param.grad = None
                continue
            shard = local(param)
            if grad.dtype != shard.dtype:
                grad = grad.to(shard.dtype)
            param.grad = sharded_like(param, grad.view_as(shard)) \
                if isinstance(param, DTensor) else grad.view_as(param)
        if self.buffers:
            averaged = flat[self.grad_numel + len(self.params):]
            with torch.no_grad():
                for buffer, value in zip(self.buffers, averaged.split(
                        [b.numel() for b in self.buffers])):
                    buffer.copy_(value.view_as(buffer))  # an integer counter is truncated


def release_grads(params: list[nn.Parameter]) -> None:
    """Drop the gradients (as ``zero_grad(set_to_none=True)``)."""
    for param in params:
        param.grad = None
