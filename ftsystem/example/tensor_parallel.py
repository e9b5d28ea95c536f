"""The example's model for replicas that use tensor parallelism (``ftsystem.example.train --tp N``).

``TinyGPT`` is built from ``nn.TransformerEncoderLayer``, whose attention keeps its projections
packed in one tensor: tensor parallelism cannot split it by heads. ``TinyDecoder`` is the same
size of decoder laid out as Llama is (separate query, key, value and output projections, an MLP
of two linears, pre-norms, an untied output head), so the plan torchtitan applies to Llama fits it:
column-wise into attention and the MLP, row-wise out of them, sequence parallelism on the norms
and the residual stream. Under that plan the gradients of the norms come out as partial sums
(each rank holds one addend) and the embedding's as a replicated tensor: ``FTReplica`` places
them as their parameters before they cross replicas (``shards.align_grads``).

It has no position embedding: the example's language is a first-order Markov chain, whose next
token depends on the current one only.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from ftsystem.example.workload import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.num_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.d_model, cfg.d_model)
                                              for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape  # under tensor parallelism each rank computes its own heads
        q, k, v = (w(x).view(b, n, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attention = Attention(cfg)
        self.w1, self.w2 = nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.Linear(4 * cfg.d_model,
                                                                                cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.w2(nn.functional.gelu(self.w1(self.ffn_norm(x))))


class TinyDecoder(nn.Module):
    """A decoder-only transformer with the Llama layout (see the module's doc)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over a batch of sequences of ``seq_len + 1`` tokens."""
        logits = self(batch[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           batch[:, 1:].reshape(-1))


def parallelize(model: TinyDecoder, tp_mesh: DeviceMesh) -> None:
    """Tensor parallelism over ``tp_mesh`` with sequence parallelism, as torchtitan plans Llama.

    The residual stream stays a DTensor sharded along the sequence; attention and the MLP take
    it whole (an all-gather), split the heads and the hidden units column-wise and give it back
    sharded (a reduce-scatter). ``seq_len`` and ``num_heads`` must be multiples of the degree.
    """
    degree = tp_mesh.size()
    if model.cfg.seq_len % degree or model.cfg.num_heads % degree:
        raise ValueError(f"tensor parallelism of degree {degree} needs seq_len "
                         f"({model.cfg.seq_len}) and num_heads ({model.cfg.num_heads}) to be "
                         "multiples of it")
    sequence = Shard(1)
    parallelize_module(model, tp_mesh, {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence,
                               use_local_output=False),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=sequence, output_layouts=Replicate()),
    })
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(sequence,),
                                            desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=sequence, use_local_output=False),
            "ffn_norm": SequenceParallel(),
            "w1": ColwiseParallel(input_layouts=sequence),
            "w2": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        })
