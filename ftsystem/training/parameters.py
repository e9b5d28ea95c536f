"""Which parameters the replicas average, fixed when ``FTReplica`` is constructed.

Every member all-reduces one flat buffer of the trainable parameters' gradients
(``shards.flat_grads``), and the update log replays that layout: a replica whose set changed
would pair its buffer with another layout. So the set is taken once, checked at construction
against what cannot work, and checked again at every commit:

- sparse gradients (``nn.Embedding(sparse=True)``) cannot be averaged in a dense buffer;
- a parameter the optimizer steps that is not one of the model's would never be averaged;
- a parameter unfrozen, frozen or added (``add_param_group``) after construction changes the
  layout: the commit refuses it, saying what to do.

A parameter that no member used in a step keeps no gradient, as under DDP (``shards``).
"""

from __future__ import annotations

import torch
from torch import nn


class ParameterSetChanged(RuntimeError):
    """The trainable parameters differ from those ``FTReplica`` was constructed with."""


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def check_model(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The parameters to average; raises ``ValueError`` for a model they cannot be taken from."""
    params = trainable(model)
    if not params:
        raise ValueError("FTReplica: the model has no parameter that requires a gradient")
    sparse = [name for name, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ValueError(
            f"FTReplica: {', '.join(sparse)} produce sparse gradients, which the replicas "
            "cannot average in their flat buffer: construct them with sparse=False (the "
            "default); a dense gradient of the same embedding is averaged as any other")
    ours = {id(p) for p in model.parameters()}
    outside = [i for i, group in enumerate(optimizer.param_groups)
               for p in group["params"] if id(p) not in ours]
    if outside:
        raise ValueError(
            f"FTReplica: the optimizer steps {len(outside)} parameter(s) (param_groups "
            f"{sorted(set(outside))}) that are not the model's: their gradients would never be "
            "averaged. Pass the module that holds every parameter the optimizer steps")
    return params


class ParameterSet:
    """The trainable parameters at construction, and the check that they stayed so."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self._model, self._optimizer = model, optimizer
        self.params = check_model(model, optimizer)
        self._ids = [id(p) for p in self.params]
        self._stepped = self._optimizer_ids()

    def _optimizer_ids(self) -> list[int]:
        return [id(p) for group in self._optimizer.param_groups for p in group["params"]]

    def check_unchanged(self) -> None:
        now = [id(p) for p in trainable(self._model)]
        if now != self._ids:
            raise ParameterSetChanged(
                f"the trainable parameters changed after FTReplica was constructed "
                f"({len(self._ids)} then, {len(now)} now: a parameter was frozen or unfrozen "
                "with requires_grad_, or replaced). Every replica averages, logs and replays "
                "one layout of gradients: set requires_grad on every parameter before "
                "constructing FTReplica. A parameter that is simply unused in a step needs "
                "nothing: it keeps no gradient, as under DDP")
        if self._optimizer_ids() != self._stepped:
            raise ParameterSetChanged(
                "the optimizer's parameters changed after FTReplica was constructed "
                "(add_param_group): create every parameter group before constructing "
                "FTReplica")
