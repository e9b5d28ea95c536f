"""Bearer-token authentication for the controller's mutating endpoints.

The token comes from ``FTSYSTEM_API_TOKEN`` or from the file named by
``FTSYSTEM_API_TOKEN_FILE``; it is compared in constant time and never logged. Without a
token configured the endpoints are open (a warning says so at start).
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections import deque

from fastapi import HTTPException, Request

log = logging.getLogger(__name__)
ENV_TOKEN = "FTSYSTEM_API_TOKEN"
ENV_TOKEN_FILE = "FTSYSTEM_API_TOKEN_FILE"


def load_token() -> str | None:
    if path := os.environ.get(ENV_TOKEN_FILE):
        try:
            return open(path).read().strip() or None
        except OSError as e:
            raise RuntimeError(f"{ENV_TOKEN_FILE}={path}: cannot read the token ({e})") from e
    return os.environ.get(ENV_TOKEN) or None


class BearerAuth:
    """A FastAPI dependency: 401 unless ``Authorization: Bearer <token>`` matches."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None
        if token is None:
            log.warning("no API token configured (%s): mutating endpoints are open", ENV_TOKEN)

    def __call__(self, request: Request) -> None:
        if self._token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), self._token):
            raise HTTPException(401, "missing or wrong bearer token: send "
                                     "'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})


class RateLimit:
    """At most ``limit`` calls per ``window_s`` (sliding window); 429 beyond."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit, self.window_s = limit, window_s
        self._calls: deque[float] = deque()

    def __call__(self) -> None:
        now = time.monotonic()
        while self._calls and now - self._calls[0] > self.window_s:
            self._calls.popleft()
        if len(self._calls) >= self.limit:
            raise HTTPException(429, f"at most {self.limit} chaos orders per "
                                     f"{self.window_s:.0f} s; try again later")
        self._calls.append(now)
