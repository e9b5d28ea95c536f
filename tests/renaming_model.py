"""A module whose ``state_dict()`` renames its tensor, for tests of what moves a model's state."""

from __future__ import annotations

import torch


class FusedPair(torch.nn.Module):
    """One weight that state_dict() saves as two, under names no module has (as torchtitan's
    fused QKV projection saves its one weight as wq, wk and wv)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = torch.nn.Linear(4, 8, bias=False)
        self.register_state_dict_post_hook(self._split)

    @staticmethod
    def _split(module, state, prefix, metadata) -> None:
        first, second = state.pop(f"{prefix}fused.weight").chunk(2)
        state[f"{prefix}a.weight"], state[f"{prefix}b.weight"] = first, second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)
