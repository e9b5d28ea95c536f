"""This rank's part of a replica's training state, as plain local tensors.

With FSDP2 (``fully_shard``) inside a replica, parameters, gradients and optimizer state are
DTensors and rank k of the replica holds shard k of each. Everything that crosses replicas
(FTAR, catch-up, the state sync at epoch entry) moves rank k's shard to rank k of the other
replica: the ranks holding one shard index form their own cross-replica group. So those paths
work on the local tensors alone; a replica of one rank is the case where "local" is the whole
tensor, and the same code serves both.

State is read and written through ``torch.distributed.checkpoint.state_dict``: its sharded
state dict keys optimizer state by parameter name (stable across processes) and initializes an
optimizer that has not stepped yet (a joiner's), so a received state can be copied in place.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from ftsystem.training.catchup import map_tensors


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds (the tensor itself when it is not sharded)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _to_local(tree):
    return map_tensors(tree, lambda t: local(t).detach())


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                create: bool = False) -> dict:
    """This rank's live tensors (references: copy them before the next ``optimizer.step()``
    if the values must stay, as the snapshotter does) and the optimizer's hyperparameters.
    ``create``: an optimizer that has not stepped gets its state first (for receiving one)."""
    return {"model": _to_local(get_model_state_dict(model)),
            "optim": _optimizer_slots(model, optimizer, create),
            "hyper": [{k: v for k, v in g.items() if k != "params"}
                      for g in optimizer.param_groups]}


def _optimizer_slots(model: nn.Module, optimizer: torch.optim.Optimizer, create: bool) -> dict:
    # An optimizer that has not stepped has no state, and reading it through DCP would create
    # one (a step with lr 0): reading must not change what is read, unless asked to.
    if not optimizer.state and not create:
        return {}
    return _to_local(get_optimizer_state_dict(model, optimizer)["state"])


def load_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Copy a :func:`local_state` of another replica (same shard) into ours, in place.

    Gradients are dropped: they belonged to the state being replaced. The layouts must match,
    which holds between replicas of one job.
    """
    optimizer.zero_grad(set_to_none=True)  # also lets DCP initialize a fresh optimizer below
    if not state["optim"]:
        optimizer.state.clear()
    with torch.no_grad():
        for name, tensor in _to_local(get_model_state_dict(model)).items():
            tensor.copy_(state["model"][name])
        if state["optim"]:
            ours = _to_local(get_optimizer_state_dict(model, optimizer)["state"])
            for name, slots in ours.items():
                for slot, tensor in slots.items():
                    tensor.copy_(state["optim"][name][slot])
    for group, hyper in zip(optimizer.param_groups, state["hyper"]):
        group.update(hyper)


def flat_grads(params: list[nn.Parameter], out: torch.Tensor | None) -> torch.Tensor:
    """This rank's gradient shards in one buffer (``out`` if given); parameters without a
    gradient take part with zeros: every replica must all-reduce the same layout."""
    if all(p.grad is None for p in params):  # a joiner's join step: zeros, in one pass
        return (out if out is not None else torch.empty(
            local_numel(params), dtype=local(params[0]).dtype, device=local(params[0]).device
        )).zero_()
    grads = [(local(p.grad) if p.grad is not None else torch.zeros_like(local(p))).reshape(-1)
             for p in params]
    return torch.cat(grads) if out is None else torch.cat(grads, out=out)


def grads_as_views(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Make slices of ``flat`` (the layout of :func:`flat_grads`, on the parameters' device)
    the gradients of ``params``: views, so no gradient is copied."""
    sizes = [local(p).numel() for p in params]
    for param, grad in zip(params, flat.split(sizes)):
        shard = local(param)
        if isinstance(param, DTensor):
            param.grad = DTensor.from_local(grad.view_as(shard), param.device_mesh,
                                            param.placements, shape=param.shape,
                                            stride=param.stride(), run_check=False)
        else:
            param.grad = grad.view_as(param)


def release_grads(params: list[nn.Parameter]) -> None:
    """Drop the gradients (as ``zero_grad(set_to_none=True)``)."""
    for param in params:
        param.grad = None


def local_numel(params: list[nn.Parameter]) -> int:
    return sum(local(p).numel() for p in params)
