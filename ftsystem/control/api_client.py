"""A client of the controller's REST API with the job's token, for the CLI (``ftsystem job``,
``ftsystem status``, ``ftsystem watch``).

Every failure is one ``ApiError`` whose message says what to do: the controller does not
answer, the token is missing or refused, or the API refused the request (its ``detail``).
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from ftsystem.control.tokens import ENV_TOKEN, ENV_TOKEN_FILE, bearer_header

ENV_CONTROLLER = "FTSYSTEM_CONTROLLER"
ENV_WAIT = "FTSYSTEM_CONTROLLER_WAIT_S"
DEFAULT_CONTROLLER = "http://127.0.0.1:8080"
RETRY_EVERY_S = 1.0
TIMEOUT_S = 10.0
"""Per request: the API reads etcd, which answers in milliseconds unless it is down (then the
controller answers 503 after its own retry deadline, FTSYSTEM_ETCD_RETRY_S)."""


class ApiError(Exception):
    """A request that did not succeed; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ControllerClient:
    """Requests to one controller, each with ``Authorization: Bearer <token>`` when a token
    is given (a controller with ``--public-read`` or ``--insecure`` serves reads without).
    ``wait_s``: how long a request is retried while the controller does not answer or answers
    503 (etcd unreachable), for a deployment step that may start before the controllers."""

    def __init__(self, base_url: str, token: str | None, *, timeout_s: float = TIMEOUT_S,
                 wait_s: float = 0.0):
        if not base_url.startswith(("http://", "https://")):
            base_url = "http://" + base_url
        self.base_url = base_url.rstrip("/")
        self.token, self.timeout_s, self.wait_s = token, timeout_s, wait_s
        headers = {"Authorization": bearer_header(token)} if token else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout_s)

    def __enter__(self) -> "ControllerClient":
        return self

    def __exit__(self, *_: object) -> None:
        self._http.close()

    def at(self, base_url: str) -> "ControllerClient":
        """A client of another instance of the same job, with the same token."""
        return ControllerClient(base_url, self.token, timeout_s=self.timeout_s)

    def get(self, path: str, **params: Any) -> Any:
        return self._request("GET", path, params=params)

    def post(self, path: str, body: Any, **params: Any) -> Any:
        return self._request("POST", path, json=body, params=params)

    def delete(self, path: str, **params: Any) -> Any:
        return self._request("DELETE", path, params=params)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return self._request_once(method, path, **kwargs)
            except ApiError as e:
                if e.status not in (0, 503) or time.monotonic() + RETRY_EVERY_S > deadline:
                    raise
            time.sleep(RETRY_EVERY_S)

    def _request_once(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            why = str(e) or type(e).__name__
            waited = f" within {self.wait_s:g} s" if self.wait_s else ""
            raise ApiError(f"the controller at {self.base_url} does not answer{waited} "
                           f"({why}): start it (ftsystem controller --etcd URL --job JOB), or "
                           f"point --controller (or {ENV_CONTROLLER}) at a running one") from e
        if response.status_code == 401:
            raise ApiError(self._refused(), 401)
        if response.is_error:
            raise ApiError(_detail(response), response.status_code)
        try:
            return response.json()
        except ValueError as e:
            raise ApiError(f"{self.base_url}{path} answered something other than JSON: is "
                           "it an ftsystem controller?", response.status_code) from e

    def _refused(self) -> str:
        where = f"the controller at {self.base_url}"
        if self.token is None:
            return (f"{where} needs the job's token: set {ENV_TOKEN}, or {ENV_TOKEN_FILE} (or "
                    "--token-file) to a file holding it")
        return (f"{where} refused the token: give the token of the job it serves ({ENV_TOKEN}, "
                f"{ENV_TOKEN_FILE} or --token-file)")


def _detail(response: httpx.Response) -> str:
    """The API's ``detail``: a message, or FastAPI's list of validation errors."""
    try:
        detail = response.json()["detail"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:300]}"
    if isinstance(detail, list):
        return "; ".join(f"{'.'.join(map(str, d.get('loc', [])[1:])) or 'body'}: {d.get('msg')}"
                         for d in detail if isinstance(d, dict))
    return str(detail)
