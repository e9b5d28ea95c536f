"""Which GPU a rank uses, and making the threads that work for it use that GPU too.

The rule is torchrun's: rank ``LOCAL_RANK`` of a replica uses ``cuda:(LOCAL_RANK mod the
number of GPUs it sees)``. By default every rank sees all of the node's GPUs, so rank k uses
GPU k. An agent started with ``--gpus 4,5`` lets rank k see only the k-th listed GPU
(``CUDA_VISIBLE_DEVICES``, see ``agent.supervisor.visible_gpu_per_rank``); it sees one GPU,
so the same rule gives it ``cuda:0``, which is that GPU.

The current CUDA device belongs to a thread, and a new thread starts on ``cuda:0``. A thread
that makes streams, events or NCCL communicators for a rank on another GPU (a rendezvous, an
abort, a snapshot copy) must first call :func:`use_device`, or it works on (and allocates a
context on) the wrong GPU.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

ENV_LOCAL_RANK = "LOCAL_RANK"


def device_index(local_rank: int, num_visible: int) -> int:
    """The index, among the ``num_visible`` GPUs a rank sees, of the one rank ``local_rank``
    uses."""
    return local_rank % num_visible


def local_device() -> torch.device:
    """This rank's device: its GPU by the rule above, or the CPU on a machine without CUDA."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get(ENV_LOCAL_RANK, "0"))
    return torch.device("cuda", device_index(local_rank, torch.cuda.device_count()))


def with_index(device: torch.device) -> torch.device:
    """``device`` with its index spelt out: a bare ``cuda`` means the calling thread's current
    GPU, which another thread cannot know."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def use_device(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device; nothing for a CPU (or None).

    ``device`` must have an index (:func:`with_index`): in a new thread a bare ``cuda`` would
    mean ``cuda:0``.
    """
    if device is not None and device.type == "cuda":
        if device.index is None:
            raise ValueError(f"{device} has no index: pass with_index(device) from the rank's "
                             "own thread")
        torch.cuda.set_device(device)


def cuda_device_of(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    """The GPU of the first CUDA tensor among ``tensors``; None when there is none."""
    return next((t.device for t in tensors if t.is_cuda), None)


def free_memory(device: torch.device) -> int | None:
    """Free bytes on ``device`` if it is a GPU; None for the host."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free
