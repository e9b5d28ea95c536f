"""The one buffer a step's all-reduce moves, and what it holds, in this order:

1. every trainable parameter's gradient shard, flattened (a parameter without a gradient
   contributes zeros: every member must all-reduce the same layout);
2. one element per parameter: 1 where it had a gradient. After the sum, a parameter that no
   member used keeps no gradient, as under DDP, so weight decay and momentum leave it alone;
3. the buffers the forward updates (batch-norm running statistics and their counters): they
   are averaged with the gradients, so every member holds the same statistics, and the update
   log carries them, so a replay or a join step (which run no forward) sets them too. Every
   member sends the statistics it holds, with a gradient or without one (a member that
   skipped its batch's backward); only a joiner's join step, which the sum is not divided
   by, sends zeros.

The buffer's dtype is the widest of the parameters' and the statistics' (bf16 weights beside
fp32 ones are summed in fp32, each gradient then cast back to its own dtype; fp32 statistics
beside bf16 weights make it fp32), and at least fp32 where there are integer counters: bf16
holds integers exactly only up to 256, fp32 up to 2**24, a bound on the members' summed
counts (16 members to a million batches each). The update log keeps the averaged buffer of
each step: :meth:`FlatLayout.unpack` of it reproduces the step's inputs bit for bit.
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
        self.dtype = functools.reduce(torch.promote_types, [
            *(local(p).dtype for p in params), *(_carried_as(b) for b in self.buffers)])
        self.device = local(self.params[0]).device

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def empty(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def pack(self, out: torch.Tensor | None = None, statistics: bool = True) -> torch.Tensor:
        """This rank's gradients, their counts and the forward's buffers, in ``out`` (or a
        new buffer). ``statistics``: False for a joiner's join step, which sends zeros for
        everything (in one pass)."""
        out = self.empty() if out is None else out
        used = [p.grad is not None for p in self.params]
        if not any(used) and not (statistics and self.buffers):
            return out.zero_()
        if any(used):
            grads = [(local(p.grad) if p.grad is not None else torch.zeros_like(local(p)))
                     .reshape(-1) for p in self.params]
            torch.cat(grads, out=out[:self.grad_numel])
        else:
            out[:self.grad_numel].zero_()
        self.pack_tail(out, used, statistics)
        return out

    def pack_tail(self, out: torch.Tensor, used: list[bool], statistics: bool = True
                  ) -> torch.Tensor:
        """Write the counts and the buffers (zeros without ``statistics``) behind the
        gradients; returns that tail."""
        tail = out[self.grad_numel:]
        counts, rest = tail[:len(used)], tail[len(used):]
        counts.copy_(torch.tensor(used, dtype=out.dtype))
        if self.buffers and statistics:
            torch.cat([b.reshape(-1).to(out.dtype) for b in self.buffers], out=rest)
        elif self.buffers:
            rest.zero_()
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


def _carried_as(buffer: torch.Tensor) -> torch.dtype:
    """The dtype a buffer's sum must have at least to hold it exactly (see the module's doc)."""
    return buffer.dtype if buffer.is_floating_point() else torch.float32


def release_grads(params: list[nn.Parameter]) -> None:
    """Drop the gradients (as ``zero_grad(set_to_none=True)``)."""
    for param in params:
        param.grad = None
