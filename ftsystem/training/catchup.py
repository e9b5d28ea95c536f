"""Non-blocking catch-up: a donor serves a snapshot and a log of committed updates.

Donor side (every replica can donate):

- :class:`Snapshotter` takes a snapshot of the model and optimizer state at a step boundary
  without pausing training. On CPU it copies nothing: between a commit and the next
  ``optimizer.step()`` (the only thing that mutates that state) the live tensors *are* the
  snapshot, and they go on the wire straight from the model's memory; if the training thread
  reaches that ``optimizer.step()`` before the transfer is done, it first copies the tensors
  still to be sent (:meth:`EncodedState.freeze`). CUDA state is copied into pinned host memory
  on a side stream and thread (the analogue of that window), which the training thread waits
  for only if it reaches the next ``optimizer.step()`` first.
- The snapshot goes out as raw tensor bytes (:func:`encode_state`): a small header, the
  non-tensor rest of the state, then every tensor's storage as it lies in memory, written
  straight from it to the socket (no pickling, no intermediate buffer). ``sendall`` releases
  the GIL, so serving costs the donor's training thread nothing but memory bandwidth.
- :class:`UpdateLog` keeps the averaged gradient of each committed step (the exact input of
  the replica's step function; replaying it on the snapshot reproduces the donor's state bit
  for bit), with the commit chain around it and the loop-advanced objects' states after it.
  It always keeps the last few steps (for step reconciliation at epoch entry); while a
  catch-up session is active it keeps everything within a memory budget, dropping the oldest
  (a joiner that needs a dropped step fetches a newer snapshot).
- :class:`StateServer` answers ``/snapshot`` (take one and stream it), ``/log?after=STEP``
  and ``/layout`` (the shapes and dtypes of the state's tensors), and reports itself at
  ``/status``. A session ends once every replica it served is a member of the epoch (they
  are sent what they miss at the epoch's entry, not from here), or when nobody has asked for
  ``FTSYSTEM_CATCHUP_IDLE_S`` (10 s): a recovering replica that died no longer holds the
  donor's memory. Every request needs the job's token, and state goes only to members and
  assigned joiners (``ftsystem.training.state_access``).

Joiner side: :func:`fetch_snapshot` receives the tensors' bytes straight into the joiner's own
state tensors where their layout matches (``recv_into``: no allocation, no copy afterwards),
and the rest (a fresh optimizer's state) into tensors it allocates and zeroes from the donor's
layout while the donor waits for its next commit (:func:`receiving_buffers`); :func:`fetch_log`;
the replay is ``LocalState.replay`` (``ftsystem.training.local_state``).
"""

from __future__ import annotations

import http.client
import io
import json
import logging
import os
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO, Callable
from urllib.parse import parse_qs, urlparse

import torch

from ftsystem.training import carriable
from ftsystem.training.devices import cuda_device_of, use_device
from ftsystem.training.state_access import HEADER_REPLICA, Credentials, Refusal, StateAccess

log = logging.getLogger(__name__)

ENV_IDLE_S = "FTSYSTEM_CATCHUP_IDLE_S"
"""How long a donor keeps a snapshot and a growing log for a joiner that stopped asking."""
SESSION_POLL_S = 1.0
"""How often a donor checks whether its catch-up session is over."""
KEEP_MIN_ENTRIES = 4
DEFAULT_LOG_BUDGET_BYTES = 1 << 30


MAX_SPARE = 2


def _unshared(tensors: list[torch.Tensor], i: int) -> bool:
    """Whether ``tensors[i]`` is referenced by that list alone (no other name, no view)."""
    # getrefcount counts the list's reference and its own argument; a storage referenced by
    # this tensor alone has a use count of 2 while ``untyped_storage()`` holds it too.
    return sys.getrefcount(tensors[i]) == 2 and torch._C._storage_Use_Count(
        tensors[i].untyped_storage()._cdata) == 2


class DonorUnavailableError(RuntimeError):
    """The donor did not answer, or no longer has what the joiner needs."""


@dataclass(frozen=True, slots=True)
class LoggedUpdate:
    """What produced one committed step: the averaged gradient the step function ran on, the
    commit chain before and after it (``ftsystem.training.fingerprint``), and the loop-advanced
    objects' states (``ReplicatedObjects.carry``) after the step and when the step function
    ran (the loop had drawn the step's batch; the step function may draw too)."""

    grad: torch.Tensor
    parent: bytes
    chain: bytes
    carry: bytes = b""
    carry_before: bytes = b""

    @property
    def nbytes(self) -> int:
        return self.grad.numel() * self.grad.element_size() + len(self.carry) + \
            len(self.carry_before)


class UpdateLog:
    """What produced each recent committed step: ``step -> LoggedUpdate``."""

    def __init__(self, budget_bytes: int = DEFAULT_LOG_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, LoggedUpdate] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.session_active = False
        self._spare: list[torch.Tensor] = []

    def append(self, step: int, update: LoggedUpdate) -> None:
        """Record the update that produced ``step``. Its gradient must not be modified later."""
        with self._lock:
            self._entries[step] = update
            self._bytes += update.nbytes
            self._trim()

    def clear(self) -> None:
        """Forget everything: the state was replaced, older updates no longer lead to it."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def end_session(self) -> None:
        """No joiner is reading any more: keep only the last few updates."""
        with self._lock:
            self.session_active = False
            self._trim()

    def _trim(self) -> None:
        """Within the budget, always; beyond the last few steps (for step reconciliation) only
        while a joiner is reading. Entries larger than the budget are not kept at all: the
        members behind then receive the whole state at the epoch's entry."""
        while self._entries and (self._bytes > self.budget_bytes or (
                not self.session_active and len(self._entries) > KEEP_MIN_ENTRIES)):
            _, dropped = self._entries.popitem(last=False)
            self._bytes -= dropped.nbytes
            self._spare = [dropped.grad, *self._spare[:MAX_SPARE - 1]]

    def recycle(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer the log dropped, for the next step's gradients, if nobody else holds it.

        A fresh large buffer every step is page-faulted in: measured here at 100M parameters,
        222 ms to fill a new one against 37 ms to refill a used one. A dropped buffer may still
        be read (a log being served, a broadcast): it is reused only when neither a Python
        reference nor a view of its storage remains.
        """
        with self._lock:
            for i in range(len(self._spare)):
                if self._spare[i].numel() == numel and self._spare[i].dtype == dtype \
                        and _unshared(self._spare, i):
                    return self._spare.pop(i)
        return None

    def oldest(self) -> int | None:
        """The oldest step that can be produced from the log, or None when it is empty."""
        with self._lock:
            return next(iter(self._entries), None)

    def entries(self) -> list[tuple[int, LoggedUpdate]]:
        """All entries, oldest first: a consistent view that later trimming cannot change."""
        with self._lock:
            return list(self._entries.items())

    def since(self, after: int) -> list[tuple[int, LoggedUpdate]] | None:
        """Updates for steps ``after+1 ..``, or None when some of them were dropped."""
        with self._lock:
            steps = list(self._entries)
            if steps and after + 1 < steps[0]:
                return None
            return [(s, self._entries[s]) for s in steps if s > after]

    @property
    def nbytes(self) -> int:
        return self._bytes


class Snapshotter:
    """Snapshots of (model, optimizer) state taken between commits, served raw."""

    def __init__(self, state_fn: Callable[[], dict]) -> None:
        self._state_fn = state_fn
        self._requested = threading.Event()
        self._at_step: int | None = None
        self._ready = threading.Condition()
        self._copying: threading.Thread | None = None
        self._encoded: EncodedState | None = None
        self._live: EncodedState | None = None  # served from the state's own memory
        self.step = -1  # step of the snapshot being served, -1: none
        self.layout: bytes | None = None  # state_layout() as of the first commit

    def request(self, at_step: int | None = None) -> None:
        """Take a snapshot after the next commit, or after committing ``at_step`` exactly
        (the ranks of a joining replica need their shards of one step)."""
        self._at_step = at_step
        self._requested.set()

    def after_commit(self, step: int) -> None:
        """Called by the training thread after each commit: take a requested snapshot."""
        if self.layout is None:  # once, here: the training thread is between its steps
            self.layout = state_layout(self._state_fn())
        if not self._requested.is_set() or self._copying is not None:
            return
        if self._at_step is not None and step < self._at_step:
            return
        self._requested.clear()
        state = self._state_fn()  # references
        if any(t.is_cuda for t in tree_tensors(state)):
            self._copying = threading.Thread(target=self._copy, args=(step, state),
                                             daemon=True, name="ftsystem-snapshot")
            self._copying.start()
            return
        encoded = encode_state(step, state, live=True)
        with self._ready:
            self.step, self._encoded, self._live = step, encoded, encoded
            self._ready.notify_all()

    def before_mutation(self) -> None:
        """Called by the training thread before ``optimizer.step()`` or a state load: a copy
        in flight completes; a snapshot served from the live state is no longer offered, and
        its transfers in flight go on from copies of what they have still to send."""
        if self._copying is not None:
            self._copying.join()
            self._copying = None
        with self._ready:
            live, self._live = self._live, None
            if live is not None and self._encoded is live:
                self.step, self._encoded = -1, None
        if live is not None:
            live.freeze()

    def _copy(self, step: int, state: dict) -> None:
        # This thread starts on cuda:0: the copy's streams belong on the state's GPU.
        use_device(cuda_device_of(tree_tensors(state)))
        encoded = encode_state(step, host_copy(state))
        with self._ready:
            self.step, self._encoded = step, encoded
            self._ready.notify_all()

    def wait_newer(self, than: int, timeout_s: float) -> int:
        with self._ready:
            self._ready.wait_for(lambda: self.step > than, timeout_s)
            return self.step

    def taken(self, step: int) -> Transfer | None:
        """A transfer of the snapshot of ``step`` if it is still offered (the transfer keeps
        what it sends: neither freeing the snapshot nor the next mutation cuts it short)."""
        with self._ready:
            return self._encoded.open() if self.step == step else None

    def free(self) -> None:
        """Stop serving the snapshot and release it (a transfer in flight keeps its copy)."""
        with self._ready:
            self.step, self._encoded = -1, None

    def shutdown(self) -> None:
        self.free()


class EncodedState:
    """A state (a snapshot, a piece of the log) as it goes on the wire: ``prefix`` (header and
    the state's non-tensor rest), then each of ``tensors``' bytes in order.

    ``live``: the tensors are the replica's own, valid until :meth:`freeze` (called before
    they are mutated); otherwise they never change.
    """

    def __init__(self, prefix: bytes, tensors: list[torch.Tensor], live: bool = False) -> None:
        self.prefix, self.tensors = prefix, tensors
        self.nbytes = len(prefix) + sum(t.nbytes for t in tensors)
        self._live = live
        self._lock = threading.Lock()  # held while a chunk is written: freeze() waits for it
        self._positions: dict[Transfer, int] = {}  # open transfers: first tensor left to send

    def open(self) -> Transfer:
        """A transfer of this state; what it has still to send survives :meth:`freeze`."""
        transfer = Transfer(self)
        with self._lock:
            self._positions[transfer] = 0
        return transfer

    def write_to(self, out: BinaryIO) -> None:
        """Write it all; each tensor is written from its own memory (``sendall`` on a socket)."""
        self.open().write_to(out)

    def freeze(self) -> None:
        """The live tensors are about to change: the open transfers go on from copies of the
        tensors they have not sent yet. Waits for a chunk in flight (it reads live memory)."""
        with self._lock:
            if not self._live:
                return
            self._live = False
            first = min(self._positions.values(), default=len(self.tensors))
            for i in range(first, len(self.tensors)):
                self.tensors[i] = _cpu_copy(self.tensors[i])

    def _write(self, transfer: Transfer, out: BinaryIO) -> None:
        try:
            out.write(self.prefix)
            for i in range(len(self.tensors)):
                nbytes = self.tensors[i].nbytes
                for start in range(0, nbytes, WIRE_CHUNK_BYTES):
                    with self._lock:  # self.tensors[i] may be replaced by its copy meanwhile
                        out.write(as_bytes(self.tensors[i])[start:start + WIRE_CHUNK_BYTES])
                with self._lock:
                    self._positions[transfer] = i + 1
        finally:
            with self._lock:
                del self._positions[transfer]


@dataclass(eq=False, slots=True)
class Transfer:
    """One sending of an :class:`EncodedState` (open until written)."""

    state: EncodedState

    @property
    def nbytes(self) -> int:
        return self.state.nbytes

    def write_to(self, out: BinaryIO) -> None:
        self.state._write(self, out)


WIRE_CHUNK_BYTES = 4 << 20
"""Largest single write or read of tensor bytes: a bound on one call's blocking (and on how
long :meth:`EncodedState.freeze` waits for a write in flight), not a copy."""
_LENGTH = struct.Struct("!Q")


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype, bfloat16 included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def encode_state(step: int, state: Any, live: bool = False) -> EncodedState:
    """``state`` of ``step`` ready to send: its tensors (made contiguous) travel as raw bytes, and what is
    left (the tree with a meta tensor of each one's shape and dtype in its place, and the
    non-tensor values) is small enough to go through ``torch.save``. ``live``: the tensors
    are the replica's own (see :class:`EncodedState`)."""
    tensors: list[torch.Tensor] = []

    def take(tensor: torch.Tensor) -> torch.Tensor:
        tensors.append(tensor.detach().cpu().contiguous())
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    skeleton = io.BytesIO()
    torch.save(map_tensors(state, take), skeleton)
    header = json.dumps({"step": step, "skeleton_bytes": skeleton.tell(),
                         "tensor_bytes": [t.nbytes for t in tensors]}).encode()
    return EncodedState(_LENGTH.pack(len(header)) + header + skeleton.getvalue(), tensors, live)


def state_layout(state: Any) -> bytes:
    """The shapes and dtypes of ``state``'s tensors, in its tree (meta tensors), serialized:
    what a joiner allocates before the snapshot itself arrives (:func:`receiving_buffers`).
    A donor records it once: a layout does not change while a job trains, and a place that
    appears later (an optimizer that creates some state late) is allocated as it arrives."""
    out = io.BytesIO()
    torch.save(map_tensors(state, lambda t: torch.empty(t.shape, dtype=t.dtype,
                                                        device="meta")), out)
    return out.getvalue()


def receiving_buffers(own: dict[tuple, torch.Tensor], layout: dict[tuple, torch.Tensor]
                      ) -> dict[tuple, torch.Tensor]:
    """``own`` (tensors by place), completed with a zeroed tensor for each place of
    ``layout`` (meta tensors by place) that it has no fitting tensor for.

    Zeroed: a fresh process's new memory is page-faulted in at its first touch, and on this
    machine's VM that touch is slower than the wire (0.2 to 2 GB/s measured, against 2.4 to
    2.9 GB/s over loopback). Touched now, while the donor waits for its next commit, the
    pages are ready when the bytes arrive."""
    return own | {place: torch.zeros(meta.shape, dtype=meta.dtype)
                  for place, meta in layout.items()
                  if place not in own or not _fits(own[place], meta)}


def decode_state(read_into: Callable[[memoryview], None],
                 into: dict[tuple, torch.Tensor] | None = None) -> tuple[int, Any]:
    """(step, state) of an encoded state, read by ``read_into`` (which fills the whole
    buffer it is given): each tensor's bytes land directly in a tensor, the one ``into``
    holds at its place in the state's tree (see :func:`tensor_places`) when its shape and
    dtype match and it is a contiguous CPU tensor, otherwise one allocated for them."""
    length = bytearray(_LENGTH.size)
    read_into(memoryview(length))
    header_bytes = bytearray(_LENGTH.unpack(length)[0])
    read_into(memoryview(header_bytes))
    header = json.loads(header_bytes)
    skeleton_bytes = bytearray(header["skeleton_bytes"])
    read_into(memoryview(skeleton_bytes))
    skeleton = carriable.load(skeleton_bytes)
    sizes = iter(header["tensor_bytes"])
    into = into or {}

    def fill(place: tuple, meta: torch.Tensor) -> torch.Tensor:
        tensor = into.get(place)
        if tensor is None or not _fits(tensor, meta):
            tensor = torch.empty(meta.shape, dtype=meta.dtype)
        raw = as_bytes(tensor)
        if len(raw) != next(sizes):
            raise DonorUnavailableError("the state's header does not match its tensors")
        for start in range(0, len(raw), WIRE_CHUNK_BYTES):
            read_into(raw[start:start + WIRE_CHUNK_BYTES])
        return tensor
    return header["step"], map_tensors(skeleton, fill, with_place=True)


def _fits(tensor: torch.Tensor, meta: torch.Tensor) -> bool:
    return (tensor.device.type == "cpu" and tensor.is_contiguous() and
            tensor.shape == meta.shape and tensor.dtype == meta.dtype)


def tensor_places(tree: Any) -> dict[tuple, torch.Tensor]:
    """Every tensor of ``tree`` by its place in it (the keys and indices leading to it)."""
    places: dict[tuple, torch.Tensor] = {}

    def note(place: tuple, tensor: torch.Tensor) -> torch.Tensor:
        places[place] = tensor
        return tensor
    map_tensors(tree, note, with_place=True)
    return places


def host_copy(tree: Any) -> Any:
    """A host-memory copy of every tensor in ``tree``, taken without stalling the GPU.

    CUDA tensors are copied asynchronously into pinned memory on a side stream that first waits
    for the work already queued on the training stream; the training stream is not blocked,
    and this (side) thread waits for the copies alone. CPU tensors are cloned.
    """
    if not any(t.is_cuda for t in tree_tensors(tree)):
        return map_tensors(tree, _cpu_copy)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        copy = map_tensors(tree, _pinned_copy)
    side.synchronize()
    return copy


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    # contiguous: the copy goes on the wire as it lies in memory
    return tensor.detach().clone(memory_format=torch.contiguous_format)


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_cuda:
        return _cpu_copy(tensor)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    return host.copy_(tensor.detach(), non_blocking=True)


def map_tensors(tree: Any, fn: Callable[..., torch.Tensor], *, with_place: bool = False,
                _place: tuple = ()) -> Any:
    """``tree`` (dicts, lists, tuples) with ``fn`` applied to every tensor in it; with
    ``with_place``, ``fn(place, tensor)``, the place being the keys and indices to it.
    Containers keep their kind (an OrderedDict, a defaultdict with its factory, a namedtuple):
    a replica that receives the state must hold what the sender held."""
    if isinstance(tree, torch.Tensor):
        return fn(_place, tree) if with_place else fn(tree)
    if isinstance(tree, dict):
        return _dict_like(tree, {k: map_tensors(v, fn, with_place=with_place, _place=(*_place, k))
                                 for k, v in tree.items()})
    if isinstance(tree, (list, tuple)):
        items = [map_tensors(v, fn, with_place=with_place, _place=(*_place, i))
                 for i, v in enumerate(tree)]
        return type(tree)._make(items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree


def _dict_like(tree: dict, items: dict) -> dict:
    if type(tree) is dict:
        return items
    if isinstance(tree, defaultdict):
        return defaultdict(tree.default_factory, items)
    return type(tree)(items)


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
        self._fetchers: set[str] = set()  # the replicas served state in this session
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


def _get(url: str, timeout_s: float, credentials: Credentials) -> bytes:
    request = urllib.request.Request(url, headers=credentials.headers())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read()
    except (urllib.error.URLError, OSError) as e:
        raise DonorUnavailableError(f"{url}: {e}") from e


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A donor's state as a joiner received it."""

    step: int
    state: dict
    nbytes: int
    transfer_s: float
    """From the donor's first byte to its last: the wire, not the wait for a snapshot."""

    def stats(self) -> dict:
        """What a joiner reports of it (``catchup`` in its result)."""
        return {"snapshot_step": self.step, "snapshot_bytes": self.nbytes,
                "transfer_s": self.transfer_s,
                "transfer_bytes_per_s": self.nbytes / self.transfer_s if self.transfer_s else None}


Progress = Callable[[int, int], None]
"""Called as bytes arrive: (received so far, total)."""


Destinations = Callable[[dict[tuple, torch.Tensor]], dict[tuple, torch.Tensor]]
"""Given the donor's layout (meta tensors by place), the tensors to receive a state into."""


def fetch_snapshot(donor_addr: str, timeout_s: float, at_step: int | None = None, *,
                   credentials: Credentials, into: Destinations | None = None,
                   on_progress: Progress | None = None) -> Snapshot:
    """Ask the donor for a snapshot (of step ``at_step``, still to come, if given) and receive
    it; ``timeout_s`` bounds the wait for the snapshot and each read of it.

    ``into`` runs once the request is out, while the donor waits for its next commit to take
    the snapshot, on the donor's layout (``{}`` if it has none yet): the tensors it returns (by
    place, :func:`tensor_places`) receive the snapshot's where they fit
    (:func:`decode_state`), their contents overwritten even if the transfer fails."""
    query = "" if at_step is None else f"?step={at_step}"
    layout = fetch_layout(donor_addr, timeout_s, credentials=credentials) if into else {}
    return Snapshot(*_fetch_state(donor_addr, f"/snapshot{query}", timeout_s, credentials,
                                  into=None if into is None else (lambda: into(layout)),
                                  on_progress=on_progress))


def fetch_layout(donor_addr: str, timeout_s: float, *, credentials: Credentials
                 ) -> dict[tuple, torch.Tensor]:
    """The donor's :func:`state_layout` as meta tensors by place; ``{}`` when it has none
    yet (it has not committed) or cannot say (the snapshot's request then tells why)."""
    try:
        layout = _get(f"http://{donor_addr}/layout", timeout_s, credentials)
    except DonorUnavailableError as e:
        log.info("no layout from %s (%s): the snapshot arrives in memory allocated as it "
                 "comes", donor_addr, e)
        return {}
    return tensor_places(carriable.load(layout))


def _fetch_state(donor_addr: str, path: str, timeout_s: float, credentials: Credentials,
                 gone: int | None = None,
                 into: Callable[[], dict[tuple, torch.Tensor]] | None = None,
                 on_progress: Progress | None = None) -> tuple[int, Any, int, float] | None:
    """GET an encoded state: (its step, the state, bytes, seconds from its first byte to its
    last); None if the donor answers with the status ``gone``."""
    host, _, port = donor_addr.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("GET", path, headers=credentials.headers())
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


def fetch_head(donor_addr: str, timeout_s: float, *, credentials: Credentials) -> int:
    """The donor's committed step."""
    return json.loads(_get(f"http://{donor_addr}/status", timeout_s, credentials))["step"]


def fetch_log(donor_addr: str, after: int, timeout_s: float, *, credentials: Credentials
              ) -> tuple[list[tuple[int, LoggedUpdate]], int, int] | None:
    """Updates after ``after``, the donor's head step and the bytes moved; None if dropped."""
    fetched = _fetch_state(donor_addr, f"/log?after={after}", timeout_s, credentials,
                           gone=410)
    if fetched is None:
        return None
    head, data, nbytes, _ = fetched
    updates = [LoggedUpdate(*fields) for fields in
               zip(data["updates"], data["parents"], data["chains"], data["carries"],
                   data["carries_before"])]
    return list(zip(data["steps"], updates)), head, nbytes


def tree_tensors(tree: Any):
    """Every tensor in a tree of dicts, lists and tuples, in a deterministic order."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for key in sorted(tree, key=str):
            yield from tree_tensors(tree[key])
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from tree_tensors(item)
