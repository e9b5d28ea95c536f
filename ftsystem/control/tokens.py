"""The job's token: where a process finds it, and how a request proves it holds it.

One secret per job, from ``FTSYSTEM_API_TOKEN`` or from the file named by
``FTSYSTEM_API_TOKEN_FILE``. The controllers require it of every mutating request
(``controller.auth``); the agents hand it to their ranks, whose state servers require it of
every fetch (``ftsystem.training.state_access``). It travels as ``Authorization: Bearer
<token>``, is compared in constant time and is never logged. Nothing here imports the web stack:
the agent and the ranks use it too.
"""

from __future__ import annotations

import hmac
import os
from typing import Mapping

ENV_TOKEN = "FTSYSTEM_API_TOKEN"
ENV_TOKEN_FILE = "FTSYSTEM_API_TOKEN_FILE"


class AuthConfigError(ValueError):
    """Neither a token nor an explicit ``--insecure``: the process refuses to start."""


def load_token(env: Mapping[str, str] | None = None) -> str | None:
    """The job's token, or None when neither variable gives one; the file wins over the
    variable (a Kubernetes Secret is mounted as a file)."""
    env = os.environ if env is None else env
    if path := env.get(ENV_TOKEN_FILE):
        try:
            return open(path).read().strip() or None
        except OSError as e:
            raise AuthConfigError(f"{ENV_TOKEN_FILE}={path}: cannot read the token ({e})") from e
    return env.get(ENV_TOKEN) or None


def bearer_header(token: str) -> str:
    """The ``Authorization`` value that carries ``token``."""
    return f"Bearer {token}"


def bearer_matches(authorization: str, token: bytes) -> bool:
    """Whether an ``Authorization`` header carries ``token``, compared in constant time."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token)
