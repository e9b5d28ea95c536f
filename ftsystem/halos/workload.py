"""The model and data that the simulator really trains (the paper's method: virtual time from
traces, real optimization on a model that fits here).

The model is ``ftsystem.example.workload.TinyGPT``. Two kinds of data (``WorkloadConfig.data``):

- ``text``: English, the King James Bible of ``corpus`` at the character level. Each worker reads
  its own seeded stream of windows drawn uniformly from the training text (with ``non_iid``, from
  its region's contiguous share of the book); the held-out loss is measured on fixed, evenly
  spaced windows of the held-out text, the same for every seed. ``text_model`` gives the models.
- ``markov``: ``ftsystem.example.workload.MarkovLanguage``, one language for all regions, or with
  ``non_iid`` one per region (a different seed, so each region's successor table differs).
  Sequences are drawn from the transition table by inverse-CDF sampling, many times faster than
  ``MarkovLanguage.batch`` at this volume. Real mode (``ftsystem halos run``) trains this one.

Batches are cached per (data, worker, chunk) so that every method reads the same data.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.utils import parameters_to_vector

from ftsystem.halos import corpus
from ftsystem.halos.config import WorkerOptimizer
from ftsystem.halos.rules import load_flat, local_sgd
from ftsystem.example.workload import MarkovLanguage, ModelConfig, TinyGPT

CHUNK_SEQUENCES = 512
EVAL_SHARD = 1_000_000  # data streams of workers are shards 0..n-1; held-out data lives far away
EVAL_SPLITS = ("held_out", "validation", "test")


def small_model() -> ModelConfig:
    """The default model: 17,888 parameters, 2-3 ms per local step on one CPU core."""
    return ModelConfig(vocab_size=128, seq_len=32, d_model=32, num_layers=1, num_heads=2)


TEXT_MODELS = {
    # name: (d_model, layers, heads), heads of width 64 (tiny: one of 16). Parameters with the 65-character
    # alphabet and a context of 64 (embeddings tied): tiny 5,376 (tests), small 108,352,
    # base 1,206,400.
    "tiny": (16, 1, 1),
    "small": (64, 2, 1),
    "base": (128, 6, 2),
}


def text_model(name: str = "base", *, seq_len: int = 64) -> ModelConfig:
    """A character-level model of ``TEXT_MODELS`` for the corpus's alphabet."""
    if name not in TEXT_MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(TEXT_MODELS)}")
    d_model, layers, heads = TEXT_MODELS[name]
    return ModelConfig(vocab_size=len(corpus.load().alphabet), seq_len=seq_len, d_model=d_model,
                       num_layers=layers, num_heads=heads)


@dataclass(kw_only=True, slots=True)
class WorkloadConfig:
    """The real model and data under the simulated time model."""

    model: ModelConfig = field(default_factory=small_model)
    """The small model that is trained for real (for ``text``: from ``text_model``)."""
    data: str = "markov"
    """``text`` (the King James Bible, ``corpus``) or ``markov`` (a synthetic language)."""
    branching: int = 8
    """Likely successors per token in the Markov language (more: harder, slower to learn)."""
    local_batch: int = 8
    """Sequences per local step."""
    non_iid: bool = False
    """One language per region (a distribution shift between regions) instead of one for all."""
    seed: int = 0
    """Seed of the languages, the data and the initial model."""
    eval_sequences: int = 256
    """Held-out sequences (per language for ``markov``) for the loss curves."""
    eval_split: str = "held_out"
    """For ``text``, the held-out text the loss curves measure: ``held_out`` (all of it),
    ``validation`` (the half hyperparameters are chosen on) or ``test`` (the other half)."""

    def __post_init__(self) -> None:
        if self.data not in ("text", "markov"):
            raise ValueError(f"unknown data {self.data!r}; choose text or markov")
        if self.eval_split not in EVAL_SPLITS:
            raise ValueError(f"unknown eval_split {self.eval_split!r}; choose from "
                             f"{', '.join(EVAL_SPLITS)}")


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


@functools.lru_cache(maxsize=None)
def _text_chunk(seed: int, shard: int, index: int, length: int, lo: int, hi: int) -> torch.Tensor:
    """Chunk ``index`` of worker ``shard``'s stream: windows of ``length`` from ``train[lo:hi]``."""
    gen = torch.Generator().manual_seed(hash((seed, shard, index)) & 0x7FFF_FFFF)
    starts = torch.randint(lo, hi - length + 1, (CHUNK_SEQUENCES,), generator=gen)
    return corpus.windows(corpus.load().train, starts, length)


class Workload:
    """Scratch model, each worker's AdamW state and data stream, and the held-out loss."""

    def __init__(self, cfg: WorkloadConfig, worker_regions: Sequence[int],
                 opt: WorkerOptimizer) -> None:
        self.cfg, self.opt_cfg = cfg, opt
        self._regions = list(worker_regions)
        self._seeds = [self._language_seed(r) for r in worker_regions]
        torch.manual_seed(cfg.seed)
        self.model = TinyGPT(cfg.model)
        self.theta0 = parameters_to_vector(self.model.parameters()).detach().clone()
        self._optimizers = [self.adamw() for _ in worker_regions]
        self._cursor = [0] * len(worker_regions)
        self._eval = self._text_eval() if cfg.data == "text" else [
            sample(_language(cfg.model.vocab_size, s, cfg.branching), seed=EVAL_SHARD + s,
                   count=cfg.eval_sequences, seq_len=cfg.model.seq_len)
            for s in sorted(set(self._seeds))]

    @property
    def num_params(self) -> int:
        return self.theta0.numel()

    def _language_seed(self, region: int) -> int:
        return self.cfg.seed + region if self.cfg.non_iid else self.cfg.seed

    def _text_eval(self) -> list[torch.Tensor]:
        text = corpus.load()
        if self.cfg.model.vocab_size != text.vocab_size:
            raise ValueError(f"the model's vocabulary ({self.cfg.model.vocab_size}) is not the "
                             f"corpus's alphabet ({text.vocab_size}): build it with text_model()")
        held, length = getattr(text, self.cfg.eval_split), self.cfg.model.seq_len + 1
        starts = torch.linspace(0, len(held) - length, self.cfg.eval_sequences).long()
        return [corpus.windows(held, starts, length).long()]

    def _text_range(self, worker: int) -> tuple[int, int]:
        """The share of the training text worker ``worker`` reads: all of it, or its region's."""
        n = len(corpus.load().train)
        if not self.cfg.non_iid:
            return 0, n
        regions = max(self._regions) + 1
        r = self._regions[worker]
        return r * n // regions, (r + 1) * n // regions

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
        if self.cfg.data == "text":
            chunk = _text_chunk(self.cfg.seed, worker, index, m.seq_len + 1,
                                *self._text_range(worker))
        else:
            chunk = _chunk(m.vocab_size, self._seeds[worker], self.cfg.branching, m.seq_len,
                           worker, index)
        return chunk[offset * b:(offset + 1) * b].long()

    def train(self, worker: int, theta: torch.Tensor,
              lrs: Sequence[float]) -> tuple[torch.Tensor, list[float]]:
        """Worker ``worker`` runs ``len(lrs)`` local steps from ``theta``: its pseudo-gradient."""
        return local_sgd(self.model, self._optimizers[worker], theta,
                         self.batches(worker, len(lrs)), lrs, grad_clip=self.opt_cfg.grad_clip)

    def gradient_norms(self, theta: torch.Tensor,
                       batches: Sequence[torch.Tensor]) -> tuple[float, float]:
        """At ``theta``, the mean squared norm of each batch's gradient and the squared norm of
        their mean (the gradient of all of them together when they are of one size): the two
        measurements of the gradient noise scale (McCandlish et al. 2018, appendix A.1)."""
        load_flat(self.model, theta)
        grads = []
        for batch in batches:
            self.model.zero_grad(set_to_none=True)
            self.model.loss(batch).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in self.model.parameters()]))
        g = torch.stack(grads)
        return float(g.square().sum(1).mean()), float(g.mean(0).square().sum())

    @torch.no_grad()
    def evaluate(self, theta: torch.Tensor) -> float:
        """Held-out loss of ``theta`` (for ``markov``: averaged over the regions' languages)."""
        load_flat(self.model, theta)
        return sum(float(self.model.loss(ev)) for ev in self._eval) / len(self._eval)

    @torch.no_grad()
    def accuracy(self, theta: torch.Tensor) -> float:
        """Share of the held-out windows' next tokens that ``theta`` ranks first."""
        load_flat(self.model, theta)
        hits = sum(int((self.model(ev[:, :-1]).argmax(-1) == ev[:, 1:]).sum())
                   for ev in self._eval)
        return hits / sum(ev[:, 1:].numel() for ev in self._eval)
