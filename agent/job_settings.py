"""What the job's spec decides for an agent and its ranks (pure).

The spec (``ftsystem job create``, ``docs/operations.md``) is the job's one source of its
settings: every agent of every replica must run with the same timeout (the controller derives
the replicas' lease rule from it) and write checkpoints by the same policy. So an agent takes
them from the spec, and a flag that contradicts the spec is refused rather than silently
obeyed on one node. The agent reads the spec again before each generation: a restarted replica
follows the spec as it is now, and a job deleted under it stops it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ftsystem.training.runtime import (DEFAULT_TIMEOUT_S, ENV_CHECKPOINT_DIR,
                                       ENV_CHECKPOINT_EVERY, ENV_CHECKPOINT_KEEP, ENV_TIMEOUT)


class SpecConflict(ValueError):
    """An agent's flag contradicts the job's spec; the message says which to change."""


def resolve_timeout(flag_s: float | None, spec: Mapping[str, Any] | None) -> float:
    """The one timeout: the spec's if it sets one (``--timeout``, if given, must agree), else
    ``--timeout``, else the default."""
    wanted = (spec or {}).get("timeout_s")
    if wanted is None:
        return DEFAULT_TIMEOUT_S if flag_s is None else flag_s
    if flag_s is not None and not math.isclose(flag_s, float(wanted)):
        raise SpecConflict(
            f"the job's spec sets the timeout to {float(wanted):g} s, but this agent was "
            f"started with --timeout {flag_s:g}: drop --timeout (the spec's applies), or "
            "delete and recreate the job with the timeout you want (ftsystem job create "
            "--timeout)")
    return float(wanted)


def rank_settings_env(spec: Mapping[str, Any] | None, timeout_s: float) -> dict[str, str]:
    """The ranks' environment for the spec's settings: the timeout, and the checkpoint policy
    when the spec has one (otherwise whatever the agent inherited stays)."""
    env = {ENV_TIMEOUT: f"{timeout_s:g}"}
    policy = (spec or {}).get("checkpoint") or {}
    if policy.get("every_steps"):
        env[ENV_CHECKPOINT_EVERY] = str(policy["every_steps"])
        env[ENV_CHECKPOINT_KEEP] = str(policy.get("keep", 3))
        if policy.get("dir"):
            env[ENV_CHECKPOINT_DIR] = str(policy["dir"])
    return env
