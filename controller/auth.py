"""Bearer-token authentication for the controller's API.

Closed by default: every request to the API (every route but the probes ``/healthz`` and
``/readyz``, which ``controller.app`` keeps off the API router) needs ``Authorization: Bearer
<token>``, reads included. ``--public-read`` opens the reads (GET and HEAD: the status page,
``/metrics``, the job's state) to anyone who reaches the port; every mutating request still
needs the token. The token comes from ``FTSYSTEM_API_TOKEN`` or from the file named by
``FTSYSTEM_API_TOKEN_FILE``; it is compared in constant time and never logged. A controller with
no token starts only when told ``--insecure`` explicitly.

The scheme is FastAPI's ``HTTPBearer``, so the OpenAPI schema declares it on every operation
that requires it (``/docs`` offers to send it).
"""

from __future__ import annotations

import logging

from fastapi import HTTPException, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ftsystem.control.tokens import (  # noqa: F401 (AuthConfigError, load_token: this API)
    ENV_TOKEN, ENV_TOKEN_FILE, AuthConfigError, bearer_matches, load_token)

log = logging.getLogger(__name__)
READ_ONLY_METHODS = frozenset({"GET", "HEAD"})
SCHEME = HTTPBearer(
    auto_error=False, scheme_name="jobToken",
    description=f"The job's token ({ENV_TOKEN} or {ENV_TOKEN_FILE} of the controller). Every "
                "request but GET /healthz and /readyz needs it; a controller started with "
                "--public-read serves GET and HEAD without it.")
"""The scheme the schema declares. ``auto_error=False``: ``BearerAuth`` answers a missing
token itself, with a 401 that says what to send."""


class BearerAuth:
    """A FastAPI dependency: 401 for a request without the matching bearer token, except
    reads under ``public_read``."""

    def __init__(self, token: str | None, *, insecure: bool = False,
                 public_read: bool = False) -> None:
        if token is None and not insecure:
            raise AuthConfigError(
                f"no API token: set {ENV_TOKEN} (or {ENV_TOKEN_FILE} to a file holding it), "
                "or pass --insecure to leave the API open to anyone who reaches this port")
        if token is not None and insecure:
            log.warning("--insecure has no effect: an API token is configured and required")
        elif token is None:
            log.warning("--insecure: the API is open to anyone who reaches this port")
        if public_read and token is not None:
            log.warning("--public-read: GET and HEAD (the job's state, the status page, "
                        "/metrics) are open to anyone who reaches this port")
        self._token = token.encode() if token else None
        self.public_read = public_read

    def __call__(self, request: Request, credentials: HTTPAuthorizationCredentials | None
                 = Security(SCHEME)) -> None:
        if self._token is None or (self.public_read and request.method in READ_ONLY_METHODS):
            return
        given = f"{credentials.scheme} {credentials.credentials}" if credentials else ""
        if not bearer_matches(given, self._token):
            raise HTTPException(401, "missing or wrong bearer token: send 'Authorization: "
                                     "Bearer <the job's token>' (the controller's "
                                     f"{ENV_TOKEN} or {ENV_TOKEN_FILE})",
                                headers={"WWW-Authenticate": "Bearer"})
