"""Bearer-token authentication for the controller's mutating requests.

Closed by default: every request that changes something (any method but GET, HEAD and
OPTIONS, on any route, present or future) needs ``Authorization: Bearer <token>``. The token
comes from ``FTSYSTEM_API_TOKEN`` or from the file named by ``FTSYSTEM_API_TOKEN_FILE``; it is
compared in constant time and never logged. A controller with no token starts only when told
``--insecure`` explicitly.
"""

from __future__ import annotations

import logging

from fastapi import HTTPException, Request

from ftsystem.control.tokens import (  # noqa: F401 (AuthConfigError, load_token: this API)
    ENV_TOKEN, ENV_TOKEN_FILE, AuthConfigError, bearer_matches, load_token)

log = logging.getLogger(__name__)
READ_ONLY_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class BearerAuth:
    """A FastAPI dependency: 401 for a mutating request without the matching bearer token."""

    def __init__(self, token: str | None, *, insecure: bool = False) -> None:
        if token is None and not insecure:
            raise AuthConfigError(
                f"no API token: set {ENV_TOKEN} (or {ENV_TOKEN_FILE} to a file holding it), "
                "or pass --insecure to leave the mutating endpoints open to anyone who reaches "
                "this port")
        if token is not None and insecure:
            log.warning("--insecure has no effect: an API token is configured and required")
        elif token is None:
            log.warning("--insecure: mutating endpoints are open to anyone who reaches this port")
        self._token = token.encode() if token else None

    def __call__(self, request: Request) -> None:
        if self._token is None or request.method in READ_ONLY_METHODS:
            return
        if not bearer_matches(request.headers.get("authorization", ""), self._token):
            raise HTTPException(401, "missing or wrong bearer token: send "
                                     "'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})
