"""The chaos rate limit, kept in etcd: one budget for ``POST /v1/jobs/{job}/chaos`` on every
controller and for ``ftsystem chaos apply``, which writes to etcd directly.

Each accepted submission leaves a key on a lease of the window's length; a submission is refused
while the window holds ``limit`` of them. Count and record are two requests, not a transaction:
two submissions at the same instant may both pass. Chaos is an experiment, not a load; the limit
stops a runaway script, it is not a quota.
"""

from __future__ import annotations

import math
import os
import uuid

from ftsystem.control import keys

ENV_CHAOS_RATE = "FTSYSTEM_CHAOS_RATE"
"""Chaos specs accepted per window, ``N/SECONDS``."""
DEFAULT_RATE = "10/60"


class ChaosRateError(Exception):
    """Too many chaos submissions in the window: nothing was stored."""


def parse_rate(text: str) -> tuple[int, float]:
    """``"N/SECONDS"`` -> (N, SECONDS)."""
    limit, _, window = text.partition("/")
    try:
        parsed = int(limit), float(window)
    except ValueError:
        parsed = (0, 0.0)
    if parsed[0] < 1 or not parsed[1] > 0:
        raise ValueError(f"{ENV_CHAOS_RATE}={text!r}: expected N/SECONDS, e.g. 10/60")
    return parsed


def configured_rate() -> tuple[int, float]:
    return parse_rate(os.environ.get(ENV_CHAOS_RATE, DEFAULT_RATE))


async def take(store, job: str, limit: int, window_s: float) -> None:
    """Record one submission, or raise ``ChaosRateError`` if the window is full."""
    recent, _ = await store.get_prefix(keys.chaos_submissions(job))
    if len(recent) >= limit:
        raise ChaosRateError(f"at most {limit} chaos submissions per {window_s:g} s "
                             f"({ENV_CHAOS_RATE}); try again later")
    lease = await store.grant(max(1, math.ceil(window_s)))
    await store.put(keys.chaos_submission(job, uuid.uuid4().hex), b"", lease=lease)
