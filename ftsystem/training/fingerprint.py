"""Fingerprints of the replicated state, and the verdict when members' fingerprints differ.

Two fingerprints, one cheap and constant, one thorough and periodic:

- The **commit chain**: after each committed step, ``chain = H(chain, step, epoch)``, where
  ``epoch`` is the epoch whose all-reduce produced the step. Members that committed a step in
  the same epoch applied the same average, so equal chains mean the same history. A step
  committed only by a replica that then died, and passed on to a joiner, while the survivors
  redid it in a later epoch, leaves the joiner with another chain at the same step number: the
  fork is visible at the next epoch entry, at no cost per step. Logged updates carry the chain
  before and after them, and a replica replays an update only onto the chain it continues.
- The **state digest**: a hash of parameters, optimizer state and registered objects, compared
  among the members every ``FTSYSTEM_FINGERPRINT_EVERY`` steps. It catches what no chain can:
  a step function that depends on something unregistered, nondeterminism, corrupted memory.

Digests are 16 bytes (BLAKE2b): two int64 words, so they travel in an all-reduce.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

DIGEST_BYTES = 16
WORDS = DIGEST_BYTES // 8
GENESIS = bytes(DIGEST_BYTES)
"""The chain of a replica that has committed nothing."""


def chain_next(chain: bytes, step: int, epoch: int) -> bytes:
    """The chain after committing ``step`` in ``epoch`` on top of ``chain``."""
    return hashlib.blake2b(chain + struct.pack("<qq", step, epoch),
                           digest_size=DIGEST_BYTES).digest()


def state_digest(tree: Any) -> bytes:
    """A hash of every tensor's bytes (with dtype and shape) and every other leaf's ``repr``,
    keys in sorted order: equal for bitwise-equal states in any two processes."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    _feed(h, tree)
    return h.digest()


def _feed(h: "hashlib._Hash", tree: Any) -> None:
    if isinstance(tree, torch.Tensor):
        # A DTensor (an EMA of an FSDP2 model) is hashed by the shard this rank holds: a
        # replica's ranks compare their shards with the same ranks of the other replicas.
        t = (tree.to_local() if isinstance(tree, DTensor) else tree).detach()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        # On the host: hashlib reads the buffer directly (no copy for CPU tensors) and
        # releases the GIL while hashing.
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    elif isinstance(tree, dict):
        h.update(b"{")
        for key in sorted(tree, key=str):
            h.update(repr(key).encode())
            _feed(h, tree[key])
        h.update(b"}")
    elif isinstance(tree, (list, tuple)):
        h.update(b"[")
        for item in tree:
            _feed(h, item)
        h.update(b"]")
    elif isinstance(tree, (bytes, bytearray)):
        h.update(b"B%d:" % len(tree))
        h.update(tree)
    else:
        h.update(f"{type(tree).__name__}:{tree!r}".encode())


def to_words(digest: bytes) -> list[int]:
    return list(struct.unpack(f"<{WORDS}q", digest))


def from_words(words: list[int]) -> bytes:
    return struct.pack(f"<{WORDS}q", *(int(w) for w in words))


@dataclass(frozen=True, slots=True)
class Judgement:
    """The outcome of comparing the members' digests (indices into the epoch's members)."""

    divergent: tuple[int, ...]
    """Members whose digest differs from the majority's (all of them when there is none)."""
    majority: tuple[int, ...]
    """Members that hold the majority digest; empty when no digest has a strict majority."""

    @property
    def agreed(self) -> bool:
        return not self.divergent

    @property
    def repairable(self) -> bool:
        return bool(self.majority)


def new_lineage() -> int:
    """A lineage word no other state holds: the state of a replica that computed its own steps
    since its last agreeing comparison (or since it started) is a history of its own."""
    return int.from_bytes(os.urandom(8), "little", signed=True) or 1


def lineage_votes(values: list, lineages: list[int]) -> Counter:
    """Votes per value, one per copy lineage that holds it.

    Members of one lineage hold states that descend from one whole-state copy made since the
    last agreeing comparison (``LocalState.lineage``): whatever the copied state held, right
    or wrong, every one of them holds too, so together they are one witness of it, however
    many they are and whoever copied from whom (a cycle of copies included). Members of one
    lineage that hold different values are a witness each: one of them changed since the copy.
    A corruption therefore never has more than one vote: it spreads only by copies, and a copy
    takes its source's lineage."""
    return Counter(value for value, _ in dict.fromkeys(zip(values, lineages)))


def describe_split(digests: list[bytes], lineages: list[int], names: list[str]) -> str:
    """Who holds which state and with how many votes, for a message a person reads:
    ``"r0, r1 hold one state (1 vote: they copied it from one another); r2 another (1 vote)"``."""
    votes = lineage_votes(digests, lineages)
    parts = []
    for n, digest in enumerate(dict.fromkeys(digests)):
        holders = [name for name, d in zip(names, digests) if d == digest]
        why = ": they copied it from one another" if votes[digest] < len(holders) else ""
        parts.append(f"{', '.join(holders)} hold{'s' if len(holders) == 1 else ''} "
                     f"{'one state' if n == 0 else 'another'} ({votes[digest]} "
                     f"vote{'' if votes[digest] == 1 else 's'}{why})")
    return "; ".join(parts)


def judge(digests: list[bytes], lineages: list[int] | None = None) -> Judgement:
    """Who differs from whom: a digest with more than half of the votes
    (:func:`lineage_votes`) is the truth, every member holding another is divergent. With no
    strict majority (a 1-1 split, or all different) nobody can tell which state is right.

    ``lineages``: per member, its copy lineage (None: every member a lineage of its own).
    """
    if lineages is None:
        lineages = list(range(len(digests)))
    votes = lineage_votes(digests, lineages)
    common, count = votes.most_common(1)[0]
    if all(d == common for d in digests):
        return Judgement(divergent=(), majority=tuple(range(len(digests))))
    if 2 * count > sum(votes.values()):
        return Judgement(divergent=tuple(i for i, d in enumerate(digests) if d != common),
                         majority=tuple(i for i, d in enumerate(digests) if d == common))
    return Judgement(divergent=tuple(range(len(digests))), majority=())
