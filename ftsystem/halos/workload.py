"""The small model and data that the simulator really trains (the paper's method: virtual time
from traces, real optimization on a model that fits here).

The model is ``ftsystem.example.workload.TinyGPT``, made small (one block, width 32) so that the five
methods' tens of thousands of local steps fit a 2-core machine. The data is
``ftsystem.example.workload.MarkovLanguage``: one language for all regions, or with ``non_iid`` one per
region (a different seed, so each region's successor table differs). Sequences are drawn from the
language's transition table by inverse-CDF sampling, which is many times faster than
``MarkovLanguage.batch`` at this volume, and cached per (language, worker, chunk) so that every
method reads the same data.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.utils import parameters_to_vector

from ftsystem.halos.config import WorkerOptimizer
from ftsystem.halos.rules import load_flat, local_sgd
from ftsystem.example.workload import MarkovLanguage, ModelConfig, TinyGPT

CHUNK_SEQUENCES = 512
EVAL_SHARD = 1_000_000  # data streams of workers are shards 0..n-1; held-out data lives far away


def small_model() -> ModelConfig:
    """The default model: 17,888 parameters, 2-3 ms per local step on one CPU core."""
    return ModelConfig(vocab_size=128, seq_len=32, d_model=32, num_layers=1, num_heads=2)


@dataclass(kw_only=True, slots=True)
class WorkloadConfig:
    """The real model and data under the simulated time model."""

    model: ModelConfig = field(default_factory=small_model)
    """The small model that is trained for real."""
    branching: int = 8
    """Likely successors per token in the Markov language (more: harder, slower to learn)."""
    local_batch: int = 8
    """Sequences per local step."""
    non_iid: bool = False
    """One language per region (a distribution shift between regions) instead of one for all."""
    seed: int = 0
    """Seed of the languages, the data and the initial model."""
    eval_sequences: int = 256
    """Held-out sequences per language for the loss curves."""


@functools.lru_cache(maxsize=None)
def _language(vocab_size: int, seed: int, branching: int) -> MarkovLanguage:
    return MarkovLanguage(vocab_size=vocab_size, seed=seed, branching=branching)


def sample(lang: MarkovLanguage, *, seed: int, count: int, seq_len: int) -> torch.Tensor:
    """``count`` sequences of ``seq_len + 1`` tokens of ``lang``, a pure function of ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    cdf = lang.transitions.cumsum(dim=1)
    tokens = torch.empty(count, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(lang.vocab_size, (count,), generator=gen)
    uniform = torch.rand(seq_len, count, 1, generator=gen)
    for i in range(seq_len):
        nxt = torch.searchsorted(cdf[tokens[:, i]], uniform[i]).squeeze(1)
        tokens[:, i + 1] = nxt.clamp_(max=lang.vocab_size - 1)  # guards cdf rounding below 1
    return tokens


@functools.lru_cache(maxsize=None)
def _chunk(vocab_size: int, seed: int, branching: int, seq_len: int, shard: int,
           index: int) -> torch.Tensor:
    lang = _language(vocab_size, seed, branching)
    tokens = sample(lang, seed=hash((seed, shard, index)) & 0x7FFF_FFFF, count=CHUNK_SEQUENCES,
                    seq_len=seq_len)
    return tokens.to(torch.uint8 if vocab_size <= 256 else torch.int32)  # 8x less cache memory


class Workload:
    """Scratch model, each worker's AdamW state and data stream, and the held-out loss."""

    def __init__(self, cfg: WorkloadConfig, worker_regions: Sequence[int],
                 opt: WorkerOptimizer) -> None:
        self.cfg, self.opt_cfg = cfg, opt
        self._seeds = [self._language_seed(r) for r in worker_regions]
        torch.manual_seed(cfg.seed)
        self.model = TinyGPT(cfg.model)
        self.theta0 = parameters_to_vector(self.model.parameters()).detach().clone()
        self._optimizers = [self.adamw() for _ in worker_regions]
        self._cursor = [0] * len(worker_regions)
        self._eval = [sample(_language(cfg.model.vocab_size, s, cfg.branching), seed=EVAL_SHARD + s,
                             count=cfg.eval_sequences, seq_len=cfg.model.seq_len)
                      for s in sorted(set(self._seeds))]

    def _language_seed(self, region: int) -> int:
        return self.cfg.seed + region if self.cfg.non_iid else self.cfg.seed

    def adamw(self) -> torch.optim.AdamW:
        """A fresh AdamW on the scratch model; biases and norms (1-d tensors) are not decayed."""
        params = list(self.model.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2],
                   "weight_decay": self.opt_cfg.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.opt_cfg.lr, betas=self.opt_cfg.betas,
                                 eps=self.opt_cfg.eps, fused=True)

    def batches(self, worker: int, steps: int) -> list[torch.Tensor]:
        """The worker's next ``steps`` local batches of its stream."""
        return [self._next_batch(worker) for _ in range(steps)]

    def _next_batch(self, worker: int) -> torch.Tensor:
        m, b = self.cfg.model, self.cfg.local_batch
        index, offset = divmod(self._cursor[worker], CHUNK_SEQUENCES // b)
        self._cursor[worker] += 1
        chunk = _chunk(m.vocab_size, self._seeds[worker], self.cfg.branching, m.seq_len, worker,
                       index)
        return chunk[offset * b:(offset + 1) * b].long()

    def train(self, worker: int, theta: torch.Tensor,
              lrs: Sequence[float]) -> tuple[torch.Tensor, list[float]]:
        """Worker ``worker`` runs ``len(lrs)`` local steps from ``theta``: its pseudo-gradient."""
        return local_sgd(self.model, self._optimizers[worker], theta,
                         self.batches(worker, len(lrs)), lrs, grad_clip=self.opt_cfg.grad_clip)

    @torch.no_grad()
    def evaluate(self, theta: torch.Tensor) -> float:
        """Held-out loss of ``theta``, averaged over the regions' languages."""
        load_flat(self.model, theta)
        return sum(float(self.model.loss(ev)) for ev in self._eval) / len(self._eval)
