"""HALoS and its baselines as pure update rules on flat parameter vectors.

A model is one flat tensor (``torch.nn.utils.parameters_to_vector``), so every server-side rule is
tensors in, tensors out: each call returns new tensors and a new state and never changes its
arguments. That makes a snapshot of a model free (keep the reference) and the rules testable by
hand. Only the worker rule touches a ``nn.Module``, because it runs real optimizer steps.

References: HALoS (Kim et al., ICML 2025) and the authors' public simulator; Async-Local-SGD and
its delayed Nesterov momentum (Liu et al., 2024, "Asynchronous Local-SGD Training for Language
Modeling"); DiLoCo (Douillard et al., 2023). The setup YAML quotes the rules it relies on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import clip_grad_norm_, parameters_to_vector

from ftsystem.halos.config import DelayedNesterovConfig


@dataclass(kw_only=True, slots=True)
class NesterovState:
    """Momentum and the pseudo-gradients buffered since the last momentum update."""

    momentum: torch.Tensor
    """m: the momentum, updated every N-th call."""
    pending: torch.Tensor
    """The sum of the pseudo-gradients received since the last momentum update."""
    count: int = 0
    """Pseudo-gradients applied so far."""

    @classmethod
    def zeros_like(cls, theta: torch.Tensor) -> "NesterovState":
        return cls(momentum=torch.zeros_like(theta), pending=torch.zeros_like(theta))


def delayed_nesterov(theta: torch.Tensor, g: torch.Tensor, state: NesterovState,
                     cfg: DelayedNesterovConfig) -> tuple[torch.Tensor, NesterovState]:
    """One update of delayed Nesterov momentum (Liu et al. 2024; the YAML's ``delayed_nesterov``).

    With N = ``buffer`` and step = ``lr * N``: every N-th call ``m = beta*m + buf/N`` and
    ``theta -= step * ((1 - c*N + c)*beta*m + g/N)``; otherwise ``theta -= step*(c*beta*m + g/N)``.
    The factor ``1 - c*N + c`` makes the momentum applied over N calls sum to ``beta*m`` whatever
    ``c`` is; with ``c = 0`` (the paper) it is the YAML's rule. With N = 1 and c = 0 this is
    PyTorch's SGD with Nesterov momentum: ``m = beta*m + g``, ``theta -= lr*(g + beta*m)``.
    """
    n, step = cfg.buffer, cfg.lr * cfg.buffer
    pending, count = state.pending + g, state.count + 1
    if count % n:
        theta = theta - step * (cfg.c * cfg.beta * state.momentum + g / n)
        return theta, NesterovState(momentum=state.momentum, pending=pending, count=count)
    momentum = cfg.beta * state.momentum + pending / n
    theta = theta - step * ((1 - cfg.c * n + cfg.c) * cfg.beta * momentum + g / n)
    return theta, NesterovState(momentum=momentum, pending=torch.zeros_like(g), count=count)


@dataclass(kw_only=True, slots=True)
class ServerState:
    """A parameter server: its model and its momentum."""

    theta: torch.Tensor
    """The server's model."""
    opt: NesterovState
    """Its delayed Nesterov state."""

    @classmethod
    def start(cls, theta: torch.Tensor) -> "ServerState":
        return cls(theta=theta, opt=NesterovState.zeros_like(theta))


def server_apply(state: ServerState, update: torch.Tensor,
                 cfg: DelayedNesterovConfig) -> ServerState:
    """Apply one (pseudo-)gradient with the server's momentum.

    This one rule is the HALoS global server (GPS: global momentum, applies LPS deltas, its model is
    what it returns), the Async-Local-SGD server (applies each worker's pseudo-gradient as it
    arrives) and DiLoCo's outer step (buffer 1, c = 0: SGD with Nesterov momentum on the mean
    pseudo-gradient).
    """
    theta, opt = delayed_nesterov(state.theta, update, state.opt, cfg)
    return ServerState(theta=theta, opt=opt)


@dataclass(kw_only=True, slots=True)
class LpsState:
    """A HALoS local parameter server: local momentum, K-update accumulation, merging."""

    server: ServerState
    """Its model and local momentum."""
    anchor: torch.Tensor
    """Its model right after the last merge: the delta sent to the GPS is measured from here."""
    since_merge: int = 0
    """Worker updates applied since the last merge."""

    @classmethod
    def start(cls, theta: torch.Tensor) -> "LpsState":
        return cls(server=ServerState.start(theta), anchor=theta)


def lps_apply(state: LpsState, pseudo_grad: torch.Tensor, cfg: DelayedNesterovConfig, *,
              accumulation_k: int) -> tuple[LpsState, torch.Tensor | None]:
    """Apply a worker's pseudo-gradient with local momentum; after K updates, the delta to send.

    The delta is ``anchor - theta``: everything the LPS learnt since it last merged the global
    model. It is due exactly when the K-th update since the merge lands; updates that arrive while
    the global model is on its way count towards the next K only after the merge (the authors'
    simulator sends when ``version == merged_version + K``).
    """
    server = server_apply(state.server, pseudo_grad, cfg)
    since = state.since_merge + 1
    delta = state.anchor - server.theta if since == accumulation_k else None
    return LpsState(server=server, anchor=state.anchor, since_merge=since), delta


def merge(local: torch.Tensor, global_: torch.Tensor, alpha: float) -> torch.Tensor:
    """HALoS model merging: ``(1 - alpha) * local + alpha * global``."""
    return (1 - alpha) * local + alpha * global_


def lps_merge(state: LpsState, global_theta: torch.Tensor, alpha: float) -> LpsState:
    """Merge the returned global model into the LPS; the merged model is the new anchor."""
    theta = merge(state.server.theta, global_theta, alpha)
    return LpsState(server=ServerState(theta=theta, opt=state.server.opt), anchor=theta)


def diloco_round(state: ServerState, pseudo_grads: Sequence[torch.Tensor],
                 cfg: DelayedNesterovConfig) -> ServerState:
    """DiLoCo's outer step: Nesterov SGD on the mean of the workers' pseudo-gradients."""
    return server_apply(state, torch.stack(list(pseudo_grads)).mean(dim=0), cfg)


def scaled_local_steps(local_steps: int, speed: float, max_speed: float) -> int:
    """Dynamic local updates: ``ceil(H * speed / max_speed)``, at least one step.

    Rounded to 9 digits first so that a product that is an integer up to float error
    (e.g. 8 * 0.3 / 0.3) does not gain a step.
    """
    return max(1, math.ceil(round(local_steps * speed / max_speed, 9)))


def pseudo_gradient(received: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A worker's pseudo-gradient: the model it received minus its model after H local steps."""
    return received - local


def warmup_cosine_lr(iteration: int, *, max_lr: float, warmup: int, total: int,
                     min_ratio: float = 0.1) -> float:
    """The workers' schedule: linear warmup to ``max_lr``, cosine decay to ``min_ratio*max_lr``."""
    if iteration <= warmup:
        return max_lr * iteration / max(warmup, 1)
    progress = min(1.0, (iteration - warmup) / max(total - warmup, 1))
    return max_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def load_flat(model: nn.Module, theta: torch.Tensor) -> None:
    """Copy a flat vector into the model's parameters.

    Not ``vector_to_parameters``: that makes the parameters views of ``theta``, so the optimizer
    would then write into the caller's (server's) tensor.
    """
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(theta[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def local_sgd(model: nn.Module, optimizer: torch.optim.Optimizer, received: torch.Tensor,
              batches: Sequence[torch.Tensor], lrs: Sequence[float], *,
              grad_clip: float) -> tuple[torch.Tensor, list[float]]:
    """The worker rule: local AdamW steps from the received model, then the pseudo-gradient.

    ``model`` is scratch space that takes the received weights; ``optimizer`` carries this
    worker's AdamW state across rounds, as the authors' workers do. One step per batch, each with
    its learning rate. Returns ``(received - local model after the steps, the step losses)``.
    """
    load_flat(model, received)
    losses = []
    for batch, lr in zip(batches, lrs, strict=True):
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model.loss(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        losses.append(loss.item())
    return pseudo_gradient(received, parameters_to_vector(model.parameters()).detach()), losses
