"""The example workload: a small GPT-style model and a synthetic language to learn.

The language is a first-order Markov chain over a small vocabulary whose transition table is
drawn from a seed: every token has a few likely successors, so the chain's entropy is far below
``log(vocab)`` and a model that learns it shows a clearly falling loss. Nothing is downloaded.

Batches are a pure function of ``(seed, shard, step)``: replica ``r`` of ``n`` reads shard ``r``,
so replicas read disjoint data, and a restarted replica reads exactly what it would have read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    vocab_size: int = 64
    """Tokens in the synthetic language."""
    seq_len: int = 32
    """Context length of a sample."""
    d_model: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads per block."""
    dropout: float = 0.0
    """Dropout in the blocks (training mode only)."""

    @classmethod
    def for_params(cls, num_params: int) -> "ModelConfig":
        """A config of roughly ``num_params`` parameters (12 * layers * d^2 dominates)."""
        num_layers = 2 if num_params < 5_000_000 else 4
        d_model = int(math.sqrt(num_params / (12 * num_layers)))
        d_model = max(64, d_model // 64 * 64)
        return cls(vocab_size=256, seq_len=64, d_model=d_model, num_layers=num_layers,
                   num_heads=d_model // 64)


class TinyGPT(nn.Module):
    """A decoder-only transformer: token + position embeddings, causal blocks, tied head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        block = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.num_heads, dim_feedforward=4 * cfg.d_model, dropout=cfg.dropout,
            batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, cfg.num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        mask = torch.triu(torch.full((cfg.seq_len, cfg.seq_len), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)
        # GPT-2's init: unit-variance embeddings would give a tied head huge initial logits.
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        x = self.blocks(x, mask=self.causal_mask[:n, :n], is_causal=True)
        return self.norm(x) @ self.tok.weight.T

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over a batch of sequences of ``seq_len + 1`` tokens."""
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           batch[:, 1:].reshape(-1))


class MarkovBatches(torch.utils.data.Dataset):
    """A map-style dataset over one shard of the language: item ``i`` is the shard's batch
    ``i`` (``batch_size`` sequences), so a loader runs with ``batch_size=None``."""

    def __init__(self, language: MarkovLanguage, *, shard: int, num_batches: int,
                 batch_size: int, seq_len: int) -> None:
        self.language, self.shard, self.num_batches = language, shard, num_batches
        self.batch_size, self.seq_len = batch_size, seq_len

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.language.batch(shard=self.shard, step=index, batch_size=self.batch_size,
                                   seq_len=self.seq_len)


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass(kw_only=True, slots=True)
class MarkovLanguage:
    """A seeded Markov chain with ``branching`` likely successors per token."""

    vocab_size: int = 64
    seed: int = 0
    branching: int = 3
    transitions: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        logits = torch.full((self.vocab_size, self.vocab_size), -8.0)
        succ = torch.stack([torch.randperm(self.vocab_size, generator=gen)[: self.branching]
                            for _ in range(self.vocab_size)])
        logits.scatter_(1, succ, torch.randn(self.vocab_size, self.branching, generator=gen))
        self.transitions = logits.softmax(dim=1)

    def entropy(self) -> float:
        """Per-token entropy in nats under the stationary-agnostic uniform start: a loss floor."""
        p = self.transitions
        return float(-(p * p.log()).sum(dim=1).mean())

    def batch(self, *, shard: int, step: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """Deterministic batch for ``(shard, step)``: ``batch_size`` sequences of ``seq_len+1``."""
        gen = torch.Generator().manual_seed(hash((self.seed, shard, step)) & 0x7FFF_FFFF)
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=gen)
        for i in range(seq_len):
            probs = self.transitions[tokens[:, i]]
            tokens[:, i + 1] = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        return tokens
