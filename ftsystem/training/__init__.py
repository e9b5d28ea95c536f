"""The training side: what runs inside every rank of a replica.

The public surface is small::

    from ftsystem.training import FTReplica, Checkpointer, TrainingState

Everything else (the fault-tolerant all-reduce, catch-up, fingerprints, shards) is the machinery
behind :class:`FTReplica`. Names are loaded on first use, so that the agent and the controller,
which only read the environment contract in ``runtime``, do not import torch.
"""

from importlib import import_module

_PUBLIC = {
    "FTReplica": "replica",
    "ReplicaEvictedError": "replica",
    "DivergenceError": "replica",
    "Checkpointer": "checkpoint",
    "TrainingState": "checkpoint",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_PUBLIC[name]}"), name)
