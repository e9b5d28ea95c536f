"""This rank's part of a replica's training state, as plain local tensors.

With FSDP2 (``fully_shard``) inside a replica, parameters, gradients and optimizer state are
DTensors and rank k of the replica holds shard k of each. Everything that crosses replicas
(FTAR, catch-up, the state sync at epoch entry) moves rank k's shard to rank k of the other
replica: the ranks holding one shard index form their own cross-replica group. So those paths
work on the local tensors alone; a replica of one rank is the case where "local" is the whole
tensor, and the same code serves both.

The model's tensors are read as its modules hold them (:func:`model_tensors`); the optimizer's
through ``torch.distributed.checkpoint.state_dict``, which keys its state by parameter name
(stable across processes). A received optimizer state replaces the receiver's slot for slot,
each in the dtype it was sent in; where the receiver has no such slot (a joiner's fresh
optimizer, a head it never used) the received tensor becomes its own.
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
    """Copy a :func:`local_state` of another replica (same shard) into ours, in place; the
    optimizer's state becomes the received one slot for slot (:func:`_load_optimizer_slots`).

    Gradients are dropped: they belonged to the state being replaced. The layouts must match,
    which holds between replicas of one job. A tensor received into its destination
    (``wire.decode_state``) is not copied again: ``copy_`` from itself does nothing.
    """
    register_shards(model)
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for name, tensor in _to_local(model_tensors(model)).items():
            tensor.copy_(state["model"][name])
        for name, tensor in _to_local(non_persistent_buffers(model)).items():
            tensor.copy_(state["buffers"][name])
        _load_optimizer_slots(model, optimizer, state["optim"])
    for group, hyper in zip(optimizer.param_groups, state["hyper"]):
        group.update(hyper)


def _load_optimizer_slots(model: nn.Module, optimizer: torch.optim.Optimizer,
                          received: dict) -> None:
    """Make ``received`` (slots by parameter name, as :func:`local_state` reads them) the
    optimizer's whole state: a parameter it has no state for yet (a head or an expert first
    used after this replica last stepped) takes the received slots, one the sender had no
    state for loses its own, and every slot keeps the dtype it was sent in (fp32 moments of
    bf16 weights stay fp32).

    Not ``optimizer.load_state_dict``, which casts floating slots to their parameter's dtype,
    nor DCP's loader, which would first create a fresh optimizer's state with a step at lr 0
    (3.2 s at 100M parameters with AdamW on an idle core here, 6-7 s beside two training
    replicas, on a joiner's way to its first step). A slot the optimizer holds already in the
    received shape, dtype and device is written in place; any other slot is the received
    tensor itself, moved to where :func:`_slot_device` says."""
    params = _params_by_name(model)
    unknown = sorted(set(received) - set(params))
    if unknown:
        raise ValueError(f"the received optimizer state has slots for parameters this model "
                         f"does not have ({', '.join(unknown[:3])}): every replica must build "
                         "the same model")
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    loaded = {}
    for name, slots in received.items():
        param = params[name]
        own = optimizer.state.get(param, {})
        loaded[param] = {key: _into_slot(own.get(key), param, key, value, group_of[id(param)])
                         for key, value in slots.items()}
    optimizer.state.clear()
    optimizer.state.update(loaded)


def _into_slot(own, param: nn.Parameter, key, value, group: dict):
    """A received slot as the optimizer holds it: written into ``own`` where that fits,
    otherwise ``value`` itself on its device (a plain value as it is)."""
    if not isinstance(value, torch.Tensor):
        return value  # a step count or a running scalar kept as a Python number
    device = _slot_device(own, param, key, value, group)
    if isinstance(own, torch.Tensor):
        shard = local(own)
        if (shard.shape, shard.dtype, shard.device) == (value.shape, value.dtype, device):
            shard.copy_(value)
            return own
    return _shaped_like(param, value.to(device))


def _slot_device(own, param: nn.Parameter, key, value: torch.Tensor, group: dict
                 ) -> torch.device:
    """Where a slot lives: where the optimizer keeps it already; otherwise torch's own rule,
    on the parameter's device, but a step counter of an optimizer neither fused nor
    capturable where it was received (torch's keep it on the host, read without a sync)."""
    if isinstance(own, torch.Tensor):
        return local(own).device
    if key == "step" and not (group.get("fused") or group.get("capturable")):
        return value.device
    return local(param).device


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
