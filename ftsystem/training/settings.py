"""A replica's settings from the environment, read once when ``FTReplica`` is constructed.

A malformed value fails the construction with the variable's name, before the replica
registers or trains: never in the middle of a step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ftsystem.training.overlap import DEFAULT_BUCKET_CAP_BYTES
from ftsystem.training.runtime import ENV_CHECKPOINT_DIR, ENV_CHECKPOINT_EVERY, ENV_CHECKPOINT_KEEP
from ftsystem.training.update_log import DEFAULT_LOG_BUDGET_BYTES, PLACES

ENV_LOG_BUDGET = "FTSYSTEM_CATCHUP_LOG_BYTES"
"""Bytes of averaged gradients a donor keeps for joiners (its update log's budget)."""
ENV_LOG_PLACE = "FTSYSTEM_CATCHUP_LOG_PLACE"
"""Where the update log of GPU gradients lives: ``auto`` (default: on the host when the budget
is over a quarter of the GPU's free memory at start), ``device`` or ``host``."""
ENV_BACKEND = "FTSYSTEM_FTAR_BACKEND"
"""The backend of the cross-replica groups: unset, NCCL for GPU gradients and Gloo for CPU ones;
``gloo`` moves GPU gradients through host memory (replicas that share one GPU, as in tests,
cannot form an NCCL group)."""
BACKENDS = ("nccl", "gloo")
ENV_CATCHUP_MODE = "FTSYSTEM_CATCHUP"
"""``nonblocking`` (default): catch up from a donor while the others train; ``blocking``:
join at once and receive the whole state in the epoch's sync (the members wait for it)."""
ENV_OVERLAP = "FTSYSTEM_OVERLAP"
"""``1``: send gradient buckets during backward; ``0``: one buffer after it; unset: buckets for
gradients on a GPU or of several buckets (see ``gradient_sum.overlap_by_default``)."""
ENV_BUCKET_BYTES = "FTSYSTEM_BUCKET_BYTES"
"""Largest gradient bucket of the overlap (default 25 MiB, like DDP's ``bucket_cap_mb``)."""
ENV_WARM_UP = "FTSYSTEM_WARM_UP"
"""``1`` (default): a joiner computes one step of the loop, thrown away, before it catches up
and joins (see ``joiner.Joiner``); ``0``: it catches up at once."""
ENV_CATCHUP_PAUSE = "FTSYSTEM_CATCHUP_PAUSE_S"
"""Fault injection: a joiner waits this long after loading a snapshot (a slow link)."""
ENV_CATCHUP_TRIES = "FTSYSTEM_CATCHUP_TRIES"
"""Snapshots a joiner fetches before it gives up catching up while the others train and
joins with a blocking state sync instead (a link too slow for the donor's log window)."""
ENV_FINGERPRINT_EVERY = "FTSYSTEM_FINGERPRINT_EVERY"
"""Committed steps between comparisons of the members' state digests (default 100; every
replica of a job must use the same value). Measured by ``ftsystem bench fingerprint``."""
DEFAULT_FINGERPRINT_EVERY = 100
DEFAULT_CATCHUP_TRIES = 3


def env_int(env: Mapping[str, str], name: str, default: int) -> int:
    """A positive integer from the environment, or an error that names the variable."""
    text = env.get(name, str(default))
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"{name}={text!r}: expected a positive integer (default {default})")
    return int(text)


def env_seconds(env: Mapping[str, str], name: str) -> float:
    text = env.get(name, "0")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(f"{name}={text!r}: expected seconds, 0 or more")
    return value


@dataclass(frozen=True)
class CheckpointSettings:
    directory: str
    every: int
    keep: int


@dataclass(frozen=True)
class ReplicaSettings:
    fingerprint_every: int = DEFAULT_FINGERPRINT_EVERY
    log_budget_bytes: int = DEFAULT_LOG_BUDGET_BYTES
    log_place: str = "auto"
    backend: str | None = None
    blocking_catchup: bool = False
    overlap: bool | None = None
    """None: decided from the gradients' size and device."""
    bucket_bytes: int = DEFAULT_BUCKET_CAP_BYTES
    warm_up: bool | None = None
    """None: on where the model is on a GPU (see ``FTReplica``'s ``warm_up``)."""
    catchup_pause_s: float = 0.0
    catchup_tries: int = DEFAULT_CATCHUP_TRIES
    checkpoint: CheckpointSettings | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ReplicaSettings":
        env = os.environ if env is None else env
        mode = env.get(ENV_CATCHUP_MODE, "nonblocking")
        if mode not in ("nonblocking", "blocking"):
            raise ValueError(f"{ENV_CATCHUP_MODE}={mode!r}: expected nonblocking or blocking")
        overlap = env.get(ENV_OVERLAP)
        backend = env.get(ENV_BACKEND) or None
        if backend not in (None, *BACKENDS):
            raise ValueError(f"{ENV_BACKEND}={backend!r}: expected one of {', '.join(BACKENDS)}")
        log_place = env.get(ENV_LOG_PLACE, "auto")
        if log_place not in PLACES:
            raise ValueError(f"{ENV_LOG_PLACE}={log_place!r}: expected one of {', '.join(PLACES)}")
        directory = env.get(ENV_CHECKPOINT_DIR)
        return cls(
            fingerprint_every=env_int(env, ENV_FINGERPRINT_EVERY, DEFAULT_FINGERPRINT_EVERY),
            log_budget_bytes=env_int(env, ENV_LOG_BUDGET, DEFAULT_LOG_BUDGET_BYTES),
            log_place=log_place,
            backend=backend,
            blocking_catchup=mode == "blocking",
            overlap=None if overlap is None else overlap != "0",
            bucket_bytes=env_int(env, ENV_BUCKET_BYTES, DEFAULT_BUCKET_CAP_BYTES),
            warm_up=None if env.get(ENV_WARM_UP) is None else env[ENV_WARM_UP] != "0",
            catchup_pause_s=env_seconds(env, ENV_CATCHUP_PAUSE),
            catchup_tries=env_int(env, ENV_CATCHUP_TRIES, DEFAULT_CATCHUP_TRIES),
            checkpoint=CheckpointSettings(directory, env_int(env, ENV_CHECKPOINT_EVERY, 100),
                                          env_int(env, ENV_CHECKPOINT_KEEP, 3))
            if directory else None)
