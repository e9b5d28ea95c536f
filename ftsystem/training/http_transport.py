"""State transfer over HTTP: a donor's :class:`StateServer` and a joiner's :class:`HTTPTransport`.

:class:`StateServer` answers ``/snapshot`` (take one and stream it), ``/log?after=STEP`` and
``/layout`` (the shapes and dtypes of the state's tensors), and reports itself at ``/status``.
A session ends once every replica it served is a member of the epoch (they are sent what they
miss at the epoch's entry, not from here), or when nobody has asked for
``FTSYSTEM_CATCHUP_IDLE_S`` (10 s): a recovering replica that died no longer holds the donor's
memory. Every request needs the job's token, and state goes only to members and assigned
joiners (``ftsystem.training.state_access``).

:class:`HTTPTransport` is the joiner's side (a
:class:`~ftsystem.training.transport.StateTransport`): it reads the donor's ``/layout`` before
asking for a snapshot, so that the snapshot's bytes are read straight into the tensors the
joiner gives (``readinto``), in the wire format of ``ftsystem.training.wire``.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse

import torch

from ftsystem.training import carriable
from ftsystem.training.snapshot import Snapshotter
from ftsystem.training.state_access import HEADER_REPLICA, Credentials, Refusal, StateAccess
from ftsystem.training.transport import (Destinations, DonorUnavailableError, Progress, Snapshot,
                                         StateTransport)
from ftsystem.training.update_log import LoggedUpdate, UpdateLog
from ftsystem.training.wire import (EncodedState, Transfer, decode_state, encode_state,
                                    tensor_places)

log = logging.getLogger(__name__)

ENV_IDLE_S = "FTSYSTEM_CATCHUP_IDLE_S"
"""How long a donor keeps a snapshot and a growing log for a joiner that stopped asking."""
SESSION_POLL_S = 1.0
"""How often a donor checks whether its catch-up session is over."""


class StateServer:
    """HTTP endpoints of a donor: ``GET /snapshot`` and ``GET /log?after=STEP``, for the
    fetchers ``access`` lets in."""

    def __init__(self, host: str, snapshotter: Snapshotter, update_log: UpdateLog,
                 current_step: Callable[[], int], timeout_s: float, *, access: StateAccess,
                 before_serving: Callable[[], None] = lambda: None) -> None:
        """``before_serving`` runs before a snapshot or log is served (fault injection)."""
        self.snapshotter, self.update_log = snapshotter, update_log
        self._access = access
        self._before_serving = before_serving
        self._current_step, self._timeout_s = current_step, timeout_s
        self._last_request = 0.0
        self._idle_s = float(os.environ.get(ENV_IDLE_S, "10"))
        self._fetchers: set[str] = set()  # the replicas served state in this catch-up session
        self.bytes_served = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                server._handle(self)

            def log_message(self, *args: Any) -> None:
                pass  # one line per request would flood the replica's log

        self._http = ThreadingHTTPServer((host, 0), Handler)
        self._http.daemon_threads = True
        self.address = f"{host}:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, daemon=True,
                         name="ftsystem-state-server").start()
        threading.Thread(target=self._expire_sessions, daemon=True,
                         name="ftsystem-state-expiry").start()

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        url = urlparse(request.path)
        if refusal := self._access.authenticate(request.headers):
            _refuse(request, refusal)
            return
        if url.path == "/status":
            _reply(request, json.dumps(self.status()).encode())
            return
        if url.path not in ("/snapshot", "/log", "/layout"):
            request.send_error(404, "expected /snapshot, /log?after=STEP, /layout or /status")
            return
        if refusal := self._access.authorize(request.headers):
            _refuse(request, refusal)
            return
        if url.path == "/layout":
            self._serve_layout(request)
            return
        self._last_request = time.monotonic()
        self.update_log.session_active = True
        self._fetchers.add(request.headers[HEADER_REPLICA])  # authorize() required it
        self._before_serving()
        if url.path == "/snapshot":
            at = parse_qs(url.query).get("step")
            self._serve_snapshot(request, int(at[0]) if at else None)
        elif url.path == "/log":
            after = int(parse_qs(url.query).get("after", ["-1"])[0])
            self._serve_log(request, after)

    def status(self) -> dict:
        return {"step": self._current_step(), "snapshot_step": self.snapshotter.step,
                "log_oldest": self.update_log.oldest(),
                "log_bytes": self.update_log.nbytes, "bytes_served": self.bytes_served,
                "session_active": self.update_log.session_active}

    def _serve_layout(self, request: BaseHTTPRequestHandler) -> None:
        if self.snapshotter.layout is None:
            request.send_error(404, "no layout yet: this replica has not committed a step")
            return
        _reply(request, self.snapshotter.layout)

    def _serve_snapshot(self, request: BaseHTTPRequestHandler, at_step: int | None) -> None:
        if at_step is not None:
            self._serve_snapshot_of(request, at_step)
            return
        deadline = time.monotonic() + self._timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.snapshotter.step < 0:
                self.snapshotter.request()
            step = self.snapshotter.wait_newer(-1, left)
            # A snapshot of the live state is offered until the next optimizer step: if that
            # came first, the next commit's snapshot is taken.
            if step >= 0 and (transfer := self.snapshotter.taken(step)) is not None:
                self._send(request, transfer)
                return
        request.send_error(503, "no snapshot within the timeout (is this replica training?)")

    def _serve_snapshot_of(self, request: BaseHTTPRequestHandler, step: int) -> None:
        """A snapshot taken right after committing ``step`` (which is still to come)."""
        if self.snapshotter.step != step:
            if self._current_step() >= step:
                request.send_error(409, f"step {step} is committed already; ask for a later one")
                return
            self.snapshotter.request(at_step=step)
        taken = self.snapshotter.wait_newer(step - 1, self._timeout_s)
        if taken != step:
            request.send_error(409, f"took a snapshot of step {taken}, not {step}")
            return
        self._stream(request, step)

    def _stream(self, request: BaseHTTPRequestHandler, step: int) -> None:
        transfer = self.snapshotter.taken(step)
        if transfer is None:
            request.send_error(503, f"the snapshot of step {step} is no longer offered")
            return
        self._send(request, transfer)

    def _send(self, request: BaseHTTPRequestHandler, encoded: EncodedState | Transfer) -> None:
        request.send_response(200)
        request.send_header("Content-Length", str(encoded.nbytes))
        request.end_headers()
        encoded.write_to(request.wfile)
        self.bytes_served += encoded.nbytes
        self._last_request = time.monotonic()  # a long transfer is not an idle session

    def _serve_log(self, request: BaseHTTPRequestHandler, after: int) -> None:
        entries = self.update_log.since(after)
        if entries is None:
            self.snapshotter.free()  # the joiner will ask for a newer one
            request.send_error(410, f"updates after step {after} were dropped; fetch a snapshot")
            return
        self._send(request, encode_state(self._current_step(), {
            "steps": [s for s, _ in entries], "updates": [u.grad for _, u in entries],
            "parents": [u.parent for _, u in entries], "chains": [u.chain for _, u in entries],
            "carries": [u.carry for _, u in entries],
            "carries_before": [u.carry_before for _, u in entries]}))

    def _expire_sessions(self) -> None:
        while True:
            time.sleep(SESSION_POLL_S)
            if self.update_log.session_active and (why := self._session_over()):
                log.info("catch-up session over (%s): freeing snapshot and log", why)
                self.update_log.end_session()
                self.snapshotter.free()
                self._fetchers.clear()

    def _session_over(self) -> str | None:
        """Why the session is over, if it is: nobody asked for ``idle_s``, or everyone served
        is a member now and asked nothing for a poll. A long session costs the members: the
        log then keeps every update within its budget, so each step's gradients go to a
        fresh buffer, page-faulted in (measured at 10M parameters here: the members' steps took
        0.65-0.73 s in the 10 s after a join, 0.55-0.66 s with the session over 1 s after)."""
        idle = time.monotonic() - self._last_request
        if idle > self._idle_s:
            return f"idle for {idle:.0f}s"
        served = set(self._fetchers)
        if idle > SESSION_POLL_S and served and self._access.are_members(served):
            return f"{', '.join(sorted(served))} joined"
        return None

    def shutdown(self) -> None:
        self._http.shutdown()


def _refuse(request: BaseHTTPRequestHandler, refusal: Refusal) -> None:
    """The refusal's message is both the reason phrase and the body: a fetcher reports it.
    It may quote what the request sent: the status line gets it as plain ASCII."""
    body = refusal.message.encode()
    request.send_response(refusal.status, refusal.message.encode("ascii", "replace").decode())
    if refusal.status == 401:
        request.send_header("WWW-Authenticate", "Bearer")
    request.send_header("Content-Type", "text/plain; charset=utf-8")
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    request.wfile.write(body)


def _reply(request: BaseHTTPRequestHandler, body: bytes) -> None:
    request.send_response(200)
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    request.wfile.write(body)


class HTTPTransport(StateTransport):
    """Fetches from a donor's :class:`StateServer` (``donor_addr``: its ``host:port``) with
    ``credentials``; ``timeout_s`` bounds the wait for a snapshot and each read of it."""

    def __init__(self, timeout_s: float, credentials: Credentials) -> None:
        self.timeout_s, self.credentials = timeout_s, credentials

    def fetch_snapshot(self, donor_addr: str, at_step: int | None = None, *,
                       into: Destinations | None = None,
                       on_progress: Progress | None = None) -> Snapshot:
        """Ask the donor for a snapshot (of step ``at_step``, still to come, if given) and
        receive it; ``timeout_s`` bounds the wait for the snapshot and each read of it.

        ``into`` runs once the request is out, while the donor waits for its next commit to
        take the snapshot, on the donor's layout (``{}`` if it has none yet): the tensors it
        returns (by place, ``wire.tensor_places``) receive the snapshot's where they fit
        (``wire.decode_state``), their contents overwritten even if the transfer fails."""
        query = "" if at_step is None else f"?step={at_step}"
        layout = self.fetch_layout(donor_addr) if into else {}
        return Snapshot(*self._fetch_state(donor_addr, f"/snapshot{query}",
                                           into=None if into is None else (lambda: into(layout)),
                                           on_progress=on_progress))

    def fetch_layout(self, donor_addr: str) -> dict[tuple, torch.Tensor]:
        """The donor's ``wire.state_layout`` as meta tensors by place; ``{}`` when it has none
        yet (it has not committed) or cannot say (the snapshot's request then tells why)."""
        try:
            layout = self._get(f"http://{donor_addr}/layout")
        except DonorUnavailableError as e:
            log.info("no layout from %s (%s): the snapshot arrives in memory allocated as it "
                     "comes", donor_addr, e)
            return {}
        return tensor_places(carriable.load(layout))

    def fetch_head(self, donor_addr: str) -> int:
        """The donor's committed step."""
        return json.loads(self._get(f"http://{donor_addr}/status"))["step"]

    def fetch_log(self, donor_addr: str, after: int
                  ) -> tuple[list[tuple[int, LoggedUpdate]], int, int] | None:
        """Updates after ``after``, the donor's head step and the bytes moved; None if dropped."""
        fetched = self._fetch_state(donor_addr, f"/log?after={after}", gone=410)
        if fetched is None:
            return None
        head, data, nbytes, _ = fetched
        updates = [LoggedUpdate(*fields) for fields in
                   zip(data["updates"], data["parents"], data["chains"], data["carries"],
                       data["carries_before"])]
        return list(zip(data["steps"], updates)), head, nbytes

    def _get(self, url: str) -> bytes:
        request = urllib.request.Request(url, headers=self.credentials.headers())
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return response.read()
        except (urllib.error.URLError, OSError) as e:
            raise DonorUnavailableError(f"{url}: {e}") from e

    def _fetch_state(self, donor_addr: str, path: str, gone: int | None = None,
                     into: Callable[[], dict[tuple, torch.Tensor]] | None = None,
                     on_progress: Progress | None = None
                     ) -> tuple[int, Any, int, float] | None:
        """GET an encoded state: (its step, the state, bytes, seconds from its first byte to
        its last); None if the donor answers with the status ``gone``."""
        host, _, port = donor_addr.rpartition(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)
        try:
            connection.request("GET", path, headers=self.credentials.headers())
            destinations = into() if into is not None else {}
            response = connection.getresponse()
            if response.status == gone:
                return None
            if response.status != 200:
                raise DonorUnavailableError(f"{donor_addr}{path}: {response.status} "
                                            f"{response.reason}")
            total, received = int(response.getheader("Content-Length")), 0
            started = time.monotonic()

            def read_into(buffer: memoryview) -> None:
                nonlocal received
                _read_exactly(response, buffer)
                received += len(buffer)
                if on_progress is not None:
                    on_progress(received, total)
            step, state = decode_state(read_into, destinations)
            return step, state, total, time.monotonic() - started
        except (OSError, http.client.HTTPException) as e:
            raise DonorUnavailableError(f"{donor_addr}{path} failed: {e}") from e
        finally:
            connection.close()


def _read_exactly(response: http.client.HTTPResponse, buffer: memoryview) -> None:
    filled = 0
    while filled < len(buffer):
        n = response.readinto(buffer[filled:])
        if not n:
            raise DonorUnavailableError("the donor closed the connection mid-transfer")
        filled += n
