"""What every process of a HALoS run in real mode shares: etcd, the wire, the HTTP server.

A node (the GPS, an LPS, a worker) runs under ``ftsystem agent``, which hands it the
``FTSYSTEM_*`` environment of ``runtime.ReplicaContext``: etcd, the job, its generation and the
agent's lease. Through :class:`Node` it

- reads the run's ``RealConfig`` and its own cumulative counters from etcd (a restarted node
  continues them), and writes the counters back before it acknowledges what they count;
- registers its address under ``keys.halos_node``, bound to the agent's lease: the agent revokes
  the lease the moment the process exits, so a dead node's address disappears at once;
- finds its peers there, and keeps asking while a peer restarts (:meth:`Node.request`);
- learns that the run has started from ``keys.halos_start`` (the launcher writes it once every
  node is registered) and that it is over from ``keys.halos_done``, which the GPS writes once.

Tensors travel as ``torch.save`` bytes in HTTP bodies; metadata in ``x-halos-*`` headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import socket
import sys
from typing import Any, NoReturn

import httpx
import torch

from ftsystem.control import keys
from ftsystem.halos.realconfig import RealConfig
from ftsystem.training.runtime import Heartbeat, ReplicaContext
from ftsystem.control.store import Store

log = logging.getLogger(__name__)

TENSOR_MEDIA_TYPE = "application/x-torch"
FINISHED_STATUS = 410  # Gone: the run is over; the request was not applied


class Header:
    """Request and response metadata (HTTP header names)."""

    NODE = "x-halos-node"
    """Sender's node name."""
    GENERATION = "x-halos-generation"
    """Sender's generation (agent restarts); with ``SEQ`` it makes a retried request idempotent."""
    SEQ = "x-halos-seq"
    """Sender's request number within its generation."""
    VERSION = "x-halos-version"
    """Updates the answering server's model has absorbed (LPS: since it started; GPS: all)."""
    BASE = "x-halos-base"
    """``generation:version`` of the LPS model a worker's pseudo-gradient was computed from."""
    FINISHED = "x-halos-finished"
    """``1`` on the GPS's answer to the delta that spent the budget."""


class WireError(ValueError):
    """A request body is not one serialized tensor."""


class PeerUnavailableError(RuntimeError):
    """A peer stayed unregistered or unreachable longer than ``RealConfig.peer_wait_s``."""


def pack(tensor: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(tensor.detach().contiguous(), buf)
    return buf.getvalue()


def unpack(data: bytes) -> torch.Tensor:
    """The tensor in ``data``; ``weights_only`` so that a peer can never make us unpickle code."""
    try:
        tensor = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - malformed archives raise a dozen types, struct.error...
        raise WireError(f"body is not a serialized tensor: {e}") from None
    if not isinstance(tensor, torch.Tensor):
        raise WireError(f"body holds a {type(tensor).__name__}, not a tensor")
    return tensor


class Node:
    """One HALoS process's control plane: config, counters, registration, peers, the end."""

    def __init__(self, name: str, ctx: ReplicaContext) -> None:
        self.name, self.ctx = name, ctx
        self.store = Store(ctx.etcd)
        self.heartbeat = Heartbeat(ctx.heartbeat_path)
        self.stats: dict[str, Any] = {}
        """Cumulative counters, written to ``keys.halos_stat`` by :meth:`flush`."""
        self.config: RealConfig | None = None
        self._changes = self._written = 0
        self._flush_lock = asyncio.Lock()
        self._addresses: dict[str, str] = {}

    @classmethod
    def from_env(cls, name: str) -> Node:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s halos[{name}] %(levelname)s %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
        torch.set_num_threads(1)  # tiny tensors, shared cores: threads cost more than they give
        return cls(name, ReplicaContext.from_env())

    @property
    def job(self) -> str:
        return self.ctx.job

    async def start(self) -> RealConfig:
        """Connect, read the run's config and this node's counters so far."""
        await self.store.connect()
        raw = await self.store.get(keys.halos_config(self.job))
        if raw is None:
            raise RuntimeError(f"no HALoS config at {keys.halos_config(self.job)}: start the run "
                               "with `ftsystem halos run`, which writes it")
        self.config = RealConfig.from_json(raw)
        self.stats = await self.store.get_json(keys.halos_stat(self.job, self.name)) or {}
        self.stats["generation"] = self.ctx.generation
        return self.config

    async def register(self, **fields: Any) -> None:
        """Publish this node (address, role) on the agent's lease: it dies with the process."""
        value = {"name": self.name, "pid": os.getpid(), "generation": self.ctx.generation,
                 **fields}
        await self.store.put_json(keys.halos_node(self.job, self.name), value,
                                  lease=self.ctx.lease_id)

    def changed(self, progress: int | None = None) -> None:
        """Counters changed (and, for the agent's failure records, progress reached)."""
        self._changes += 1
        if progress is not None:
            self.heartbeat.beat(progress)

    async def flush(self) -> None:
        """Return once every change made before the call is in etcd.

        Callers wait here before they acknowledge what they counted, so a counter in etcd never
        lags what a peer was told. Concurrent callers share writes: each write stores the newest
        counters, and a caller whose change is already written returns without one.
        """
        wanted = self._changes
        async with self._flush_lock:
            if self._written >= wanted:
                return
            current = self._changes
            await self.store.put_json(keys.halos_stat(self.job, self.name), self.stats)
            self._written = current

    async def is_done(self) -> bool:
        return await self.store.get(keys.halos_done(self.job)) is not None

    async def wait_done(self) -> None:
        """Return when the GPS has declared the run over."""
        await self._wait_key(keys.halos_done(self.job))

    async def wait_started(self) -> None:
        """Return once the launcher has seen every node registered (at once for a node
        restarted later)."""
        await self._wait_key(keys.halos_start(self.job))

    async def _wait_key(self, key: str) -> None:
        items, revision = await self.store.get_prefix(key)
        if key in items:
            return
        events = self.store.watch_prefix(key, start_revision=revision + 1)
        async with contextlib.aclosing(events):
            async for event in events:
                if event.key == key and event.kind == "PUT":
                    return

    async def request(self, client: httpx.AsyncClient, peer: str, method: str, path: str, *,
                      body: bytes | None = None,
                      headers: dict[str, str] | None = None) -> httpx.Response | None:
        """Send to ``peer`` until it answers; None once the run is over (it answered 410).

        A peer that does not answer is looked up again in etcd, where its next incarnation
        registers a new address; ``headers`` should make a retry idempotent (``Header.SEQ``).
        Gives up with :class:`PeerUnavailableError` after ``peer_wait_s`` without an answer.
        """
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + self.config.peer_wait_s, 0.05
        while True:
            url = self._addresses.get(peer) or await self._lookup(peer)
            if url is not None:
                try:
                    reply = await client.request(method, url + path, content=body,
                                                 headers=headers)
                    return _accepted(reply, peer, path)
                except httpx.TransportError as e:
                    log.info("%s at %s did not answer (%r); looking it up again", peer, url, e)
                    self._addresses.pop(peer, None)
            if await self.is_done():
                return None
            if loop.time() > deadline:
                raise PeerUnavailableError(
                    f"{peer} unreachable for {self.config.peer_wait_s:.0f} s; is its agent "
                    f"running? (see the run's agent-{peer}.log)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _lookup(self, peer: str) -> str | None:
        registration = await self.store.get_json(keys.halos_node(self.job, peer))
        if registration is None:
            return None
        self._addresses[peer] = registration["url"]
        return registration["url"]

    def sender_headers(self, seq: int) -> dict[str, str]:
        """Who sends request ``seq``: the receiver applies each (name, generation, seq) once."""
        return {Header.NODE: self.name, Header.GENERATION: str(self.ctx.generation),
                Header.SEQ: str(seq)}

    async def close(self) -> None:
        await self.store.close()


def sender_tag(headers: Any) -> tuple[str, list[int]]:
    """The sender of a request and its ``[generation, seq]`` (see :meth:`Node.sender_headers`)."""
    tag = [int(headers.get(Header.GENERATION, -1)), int(headers.get(Header.SEQ, -1))]
    return headers.get(Header.NODE, "?"), tag


def _accepted(reply: httpx.Response, peer: str, path: str) -> httpx.Response | None:
    if reply.status_code == FINISHED_STATUS:
        return None
    if reply.status_code != 200:
        raise RuntimeError(f"{peer} refused {path}: HTTP {reply.status_code}: {reply.text[:300]}")
    return reply


def http_client(config: RealConfig) -> httpx.AsyncClient:
    """A client for node-to-node calls (loopback: no proxies from the environment)."""
    return httpx.AsyncClient(timeout=config.request_timeout_s, trust_env=False)


async def serve(app: Any, host: str) -> tuple[Any, asyncio.Task, str]:
    """Serve ``app`` on a free port of ``host``; returns the server, its task and its URL.

    The socket is bound here, before uvicorn starts, so that the port is known at once.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start
            raise RuntimeError("the HTTP server stopped before it started")
        await asyncio.sleep(0.01)
    return server, task, f"http://{host}:{sock.getsockname()[1]}"


def server_app(title: str) -> Any:
    """A FastAPI app with this process's Prometheus metrics at ``/metrics``."""
    from fastapi import FastAPI, Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    app = FastAPI(title=title)

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def tensor_response(tensor: torch.Tensor, headers: dict[str, str], **kwargs: Any) -> Any:
    from fastapi import Response

    return Response(pack(tensor), media_type=TENSOR_MEDIA_TYPE, headers=headers, **kwargs)


def exit_now(code: int = 0) -> NoReturn:
    """End the process once its work is done and its counters are in etcd.

    Skips the interpreter's teardown (torch, gRPC threads): on a loaded machine it can outlast
    the agent's heartbeat watchdog, which would record a finished node as hung and restart it.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
