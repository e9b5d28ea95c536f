"""This rank's part of a replica's training state, as plain local tensors.

With FSDP2 (``fully_shard``) inside a replica, parameters, gradients and optimizer state are
DTensors and rank k of the replica holds shard k of each. Everything that crosses replicas
(FTAR, catch-up, the state sync at epoch entry) moves rank k's shard to rank k of the other
replica: the ranks holding one shard index form their own cross-replica group. So those paths
work on the local tensors alone; a replica of one rank is the case where "local" is the whole
tensor, and the same code serves both.

The model's tensors are read as its modules hold them (:func:`model_tensors`); the optimizer's
through ``torch.distributed.checkpoint.state_dict``, which keys its state by parameter name
(stable across processes). An optimizer that has not stepped yet (a joiner's) adopts the
received state's tensors as its own.
"""

from __future__ import annotations


import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ftsystem.training.wire import map_tensors


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds (the tensor itself when it is not sharded)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def align_grads(params: list[nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements, in place of ``.grad``.

    What crosses replicas is this rank's part of each gradient, laid out as its parameter's
    part. FSDP2 leaves gradients that way; tensor parallelism does not always: a replicated
    parameter applied to sequence-sharded activations (a norm under sequence parallelism) gets
    a ``Partial`` gradient, each rank holding a different addend, and a row-wise sharded
    embedding a replicated one. The partial sums are reduced over the mesh here (a collective
    inside the replica: every rank calls this at the same point of the step, parameters in one
    order), as the optimizer would have done implicitly.
    """
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def _to_local(tree):
    return map_tensors(tree, lambda t: local(t).detach())


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's live tensors (references: copy them before the next ``optimizer.step()``
    if the values must stay, as the snapshotter does) and the optimizer's hyperparameters."""
    register_shards(model)
    return {"model": _to_local(model_tensors(model)),
            "buffers": _to_local(non_persistent_buffers(model)),
            "optim": _optimizer_slots(model, optimizer),
            "hyper": [{k: v for k, v in g.items() if k != "params"}
                      for g in optimizer.param_groups]}


def register_shards(model: nn.Module) -> None:
    """Make every FSDP2 module hold its sharded parameters, the ones the optimizer steps.

    FSDP2 keeps the root module's parameters unsharded after a forward without backward (an
    evaluation): the module then holds whole tensors the optimizer does not know, and DCP,
    which finds the optimizer's parameters by ``model.named_parameters()``, cannot name them.
    ``state_dict()`` reshards through FSDP2's pre-hook; :func:`model_tensors` reads the modules
    without it, so the state's readers and writers reshard here (local: no collective)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers as the modules hold them, by canonical name, each
    tensor once. Not ``state_dict()``, whose hooks may rename and reshape what a checkpoint
    holds (torchtitan's fused QKV projection saves its one weight as three, under names no
    module has): the replicas exchange the live tensors themselves. FSDP2's modules must hold
    their shards (:func:`register_shards`)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        persistent = [(name, buffer) for name, buffer in module._buffers.items()
                      if name not in module._non_persistent_buffers_set]
        for name, tensor in [*module._parameters.items(), *persistent]:
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                tensors[canonical_name(f"{prefix}.{name}" if prefix else name)] = tensor
    return tensors


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``state_dict()`` leaves out (``register_buffer(..., persistent=False)``:
    a rotary table, a mask, a counter). They are replicated state all the same: a forward may
    update them, and a joiner must hold what the members hold."""
    return {canonical_name(f"{prefix}.{name}" if prefix else name): buffer
            for prefix, module in model.named_modules()
            for name in sorted(module._non_persistent_buffers_set)
            if (buffer := module._buffers.get(name)) is not None}


WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Name segments that wrappers add (torch.compile, activation checkpointing, FSDP1): the
names DCP gives the state drop them, and so do these."""


def canonical_name(name: str) -> str:
    """``name`` without the segments wrappers add (:data:`WRAPPER_SEGMENTS`), as DCP names it."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def _optimizer_slots(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    # An optimizer that has not stepped has no state, and reading it through DCP would create
    # one (a step with lr 0): reading must not change what is read.
    if not optimizer.state:
        return {}
    return _to_local(get_optimizer_state_dict(model, optimizer)["state"])


def load_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Copy a :func:`local_state` of another replica (same shard) into ours, in place; a
    fresh optimizer adopts the received slots instead (:func:`_adopt_optimizer_state`).

    Gradients are dropped: they belonged to the state being replaced. The layouts must match,
    which holds between replicas of one job. A tensor received into its destination
    (``wire.decode_state``) is not copied again: ``copy_`` from itself does nothing.
    """
    register_shards(model)
    optimizer.zero_grad(set_to_none=True)  # also lets DCP initialize a fresh optimizer below
    if not state["optim"]:
        optimizer.state.clear()
    with torch.no_grad():
        for name, tensor in _to_local(model_tensors(model)).items():
            tensor.copy_(state["model"][name])
        for name, tensor in _to_local(non_persistent_buffers(model)).items():
            tensor.copy_(state["buffers"][name])
        if state["optim"] and (optimizer.state or
                               not _adopt_optimizer_state(model, optimizer, state["optim"])):
            ours = _to_local(get_optimizer_state_dict(model, optimizer)["state"])
            params = _params_by_name(model)
            for name, slots in ours.items():
                for slot, value in slots.items():
                    received = state["optim"][name][slot]
                    if isinstance(value, torch.Tensor):
                        value.copy_(received)
                    else:  # a step count or a running scalar kept as a Python number
                        optimizer.state[params[name]][slot] = received
    for group, hyper in zip(optimizer.param_groups, state["hyper"]):
        group.update(hyper)


def _adopt_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                           slots: dict) -> bool:
    """Make received slots (by parameter name) the state of an optimizer that has none, by
    reference, through ``optimizer.load_state_dict`` (which moves them to the parameters'
    devices). DCP would first create that state with a step at lr 0 and the copy over it: a
    whole optimizer step and its allocations, 3.2 s at 100M parameters with AdamW on an idle
    core here, 6-7 s beside two training replicas, on a joiner's way to its first step.

    False, with nothing changed, when a slot's name is not one of ``model.named_parameters()``
    (a wrapper that renames them): the caller then goes through DCP.
    """
    params = dict(model.named_parameters())
    order = [p for group in optimizer.param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(order)}
    if not all(name in params and id(params[name]) in index for name in slots):
        return False
    optimizer.load_state_dict({
        "state": {index[id(params[name])]: {slot: _shaped_like(params[name], tensor)
                                            for slot, tensor in param_slots.items()}
                  for name, param_slots in slots.items()},
        "param_groups": [{**group, "params": [index[id(p)] for p in group["params"]]}
                         for group in optimizer.param_groups]})
    return True


def _params_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters by the names DCP gives them (wrapper segments dropped)."""
    return {canonical_name(name): param for name, param in model.named_parameters()}


def _shaped_like(param: torch.Tensor, tensor):
    """A slot as its optimizer holds it: a DTensor sharded as its parameter where it has the
    shape of the parameter's shard (a moment), the local tensor otherwise (a step count), a
    plain value as it is."""
    if isinstance(param, DTensor) and isinstance(tensor, torch.Tensor) and tensor.dim() \
            and tensor.shape == param.to_local().shape:
        return sharded_like(param, tensor)
    return tensor


def sharded_like(param: DTensor, shard: torch.Tensor) -> DTensor:
    """``shard``, this rank's part of a tensor sharded as ``param`` is, as that DTensor."""
    return DTensor.from_local(shard, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride(), run_check=False)


def local_numel(params: list[nn.Parameter]) -> int:
    return sum(local(p).numel() for p in params)
