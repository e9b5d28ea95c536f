"""Passes over a torch data loader that depend on the job alone: its seeds and the pass number.

A replica that receives the job's state loads its data loader's ``state_dict()``, and from then
on must draw the batches that the replicas which never loaded it draw, pass after pass. A
torchdata ``StatefulDataLoader`` restores the position inside a pass, but not what the next pass
starts from: its state holds the shuffle generator as it was at the start of the pass, while a
loader that ran the pass has also drawn its workers' base seed from that generator after the
permutation, a draw that a restored single-process loader does not repeat; its next shuffle
then differs. :class:`Passes` makes the start of every pass a function of its number: the
loader's generators are seeded with the seed each was built with plus the pass number (the rule
of ``DistributedSampler``), and a sampler or dataset that has ``set_epoch`` is told the number.
"""

from __future__ import annotations

from typing import Any

import torch

SEEDS = 2**64  # torch.Generator.manual_seed refuses larger seeds


def _samplers(loader: Any) -> list[Any]:
    """The loader's sampler, its batch sampler and the batch sampler's own sampler."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    return _distinct([getattr(loader, "sampler", None), batch_sampler,
                      getattr(batch_sampler, "sampler", None)])


def _distinct(objects: list[Any]) -> list[Any]:
    unique: dict[int, Any] = {id(o): o for o in objects if o is not None}
    return list(unique.values())


def _generators(loader: Any) -> list[torch.Generator]:
    found = [getattr(loader, "generator", None)]
    found += [getattr(sampler, "generator", None) for sampler in _samplers(loader)]
    return [g for g in _distinct(found) if isinstance(g, torch.Generator)]


def _stateful(obj: Any) -> bool:
    return all(callable(getattr(obj, name, None)) for name in ("state_dict", "load_state_dict"))


class Passes:
    """Puts a data loader at the start of pass ``number`` (0 first), before ``iter(loader)``."""

    def __init__(self, loader: Any) -> None:
        self._seeds = [(g, g.initial_seed()) for g in _generators(loader)]
        parts = _samplers(loader) + [getattr(loader, "dataset", None)]
        self._with_epoch = [p for p in _distinct(parts) if callable(getattr(p, "set_epoch", None))]

    def start(self, number: int) -> None:
        for generator, seed in self._seeds:
            generator.manual_seed((seed + number) % SEEDS)
        for part in self._with_epoch:
            part.set_epoch(number)


def why_not_resumable(loader: Any) -> str | None:
    """What makes ``loader``'s batches depend on more than its state and the pass number, as a
    sentence that says what to do; None when nothing does. Looks at its parts, draws nothing."""
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset) and not _stateful(dataset):
        return (f"{type(dataset).__name__} is an IterableDataset without state_dict() and "
                "load_state_dict(): a replica that receives the job's state could only re-read "
                "the stream from its start up to the position. Give the dataset both (its "
                "position in the stream), or use a map-style dataset")
    for sampler in _samplers(loader):
        if hasattr(sampler, "generator") and (sampler.generator is None
                                              or getattr(loader, "generator", None) is None):
            return (f"{type(loader).__name__}'s {type(sampler).__name__} shuffles with a seed "
                    "drawn from torch's global RNG (no generator given), which replicas do not "
                    "share: pass generator=torch.Generator().manual_seed(seed), with the job's "
                    "seed, to the loader (and that same generator to a sampler you build)")
    return None
