"""The job's token: where a process finds it, and how a request proves it holds it.

One secret per job, from ``FTSYSTEM_API_TOKEN`` or from the file named by
``FTSYSTEM_API_TOKEN_FILE``. The controllers require it of every mutating request
(``controller.auth``). The ranks never see it: their agent hands them the state servers' key,
derived from it (:func:`state_key`), from which each replica's own token follows
(:func:`replica_token`); a state server accepts a fetch only with the token of the replica the
fetch names (``ftsystem.training.state_access``). Tokens travel as ``Authorization: Bearer
<token>``, are compared in constant time and are never logged. Nothing here imports the web
stack: the agent and the ranks use it too.
"""

from __future__ import annotations

import hashlib
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


def state_key(job_token: str) -> str:
    """The key of the job's state servers, derived from the job's token: whoever holds it can
    verify (and make) replica tokens, but cannot use the controllers' API."""
    return hmac.new(job_token.encode(), b"ftsystem state servers", hashlib.sha256).hexdigest()


def checkpoint_key(key: str) -> str:
    """The key that signs the job's disk checkpoints, derived from the state servers' key
    (every rank holds it): a checkpoint another job wrote, or one forged, does not load."""
    return hmac.new(key.encode(), b"ftsystem checkpoints", hashlib.sha256).hexdigest()


def replica_token(key: str, replica_id: str) -> str:
    """The token with which replica ``replica_id`` fetches state: a holder of one replica's
    token cannot fetch as another."""
    return hmac.new(key.encode(), b"replica " + replica_id.encode(), hashlib.sha256).hexdigest()
