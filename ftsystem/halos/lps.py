"""A HALoS local parameter server as a process: ``python -m ftsystem.halos.lps --region R``.

It starts from the global model, fetched from the GPS. Each worker pseudo-gradient is applied
with local momentum (``rules.lps_apply``); when the K-th since the last merge lands, the delta goes
to the GPS in the background (workers keep pushing meanwhile) and the returned global model is
merged with weight alpha (``rules.lps_merge``).

It checkpoints its whole state (model, anchor, local momentum and its buffer, the updates since
the last merge, the delta in flight) to ``RealConfig.state_dir`` before it answers a push and
after each merge, so a restarted LPS resumes with its momentum and the updates it has not sent
yet. A delta that was in flight is sent again under its first (generation, seq): the GPS applies
it only if it had not already, and the LPS merges the answer as it would have.

HTTP: ``GET /model``; ``POST /push`` (body: a pseudo-gradient; headers: the worker's name,
generation, request number and the model version it started from), answered with the LPS's model;
``GET /metrics``. Once the run is over, pushes are refused with 410 and the LPS exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request, Response

from ftsystem.measure import metrics
from ftsystem.halos import rules
from ftsystem.halos.node import (
    FINISHED_STATUS,
    Header,
    Node,
    WireError,
    exit_now,
    http_client,
    pack,
    sender_tag,
    serve,
    server_app,
    tensor_response,
    unpack,
)
from ftsystem.halos.realconfig import GPS, RealConfig, lps_name
from ftsystem.halos.rules import LpsState, NesterovState, ServerState

log = logging.getLogger(__name__)


class LocalServer:
    """One LPS's state, its HTTP handlers and its exchanges with the GPS."""

    def __init__(self, node: Node, cfg: RealConfig) -> None:
        self.node, self.cfg = node, cfg
        self.client = http_client(cfg)
        self.state: LpsState | None = None
        self.version = 0
        """Updates (pushes and merges) this generation's model has absorbed."""
        self.last_request: dict[str, list[int]] = {}
        """Per worker, ``[generation, seq]`` of the last push applied: a retry is not reapplied."""
        self.finished = False
        self.failure: BaseException | None = None
        self.server = None  # the uvicorn server, once serving
        self._exchanges = 0
        self._tasks: set[asyncio.Task] = set()
        self.in_flight: tuple[torch.Tensor, dict[str, str]] | None = None
        """The delta sent to the GPS and not merged yet, with the headers it went with."""
        self.checkpoint = (Path(cfg.state_dir) / f"{node.name}.pt") if cfg.state_dir else None

    @property
    def stats(self) -> dict:
        return self.node.stats

    async def start(self) -> bool:
        """Resume from this LPS's checkpoint, else take the GPS's current model; False if the
        run is already over."""
        if self.checkpoint is not None and self.checkpoint.exists():
            self._resume(torch.load(self.checkpoint, weights_only=True))
            origin = {"from": "checkpoint", "version": self.version,
                      "since_merge": self.state.since_merge}
        else:
            reply = await self.node.request(self.client, GPS, "GET", "/model")
            if reply is None:
                return False
            self.state = LpsState.start(unpack(reply.content))
            origin = {"from": "gps", "gps_updates": int(reply.headers[Header.VERSION])}
        for counter in ("pushes", "merges", "deltas_sent"):
            self.stats.setdefault(counter, 0)
        self.stats.setdefault("per_worker", {})
        self.stats.setdefault("starts", []).append({
            "generation": self.node.ctx.generation, **origin, "pushes": self.stats["pushes"],
            "merges": self.stats["merges"], "time": time.time()})
        self.node.changed(self.stats["pushes"])
        await self.node.flush()
        return True

    def resume_exchange(self) -> None:
        """Send again the delta a previous generation had in flight (once serving)."""
        if self.in_flight is not None:
            self.spawn(self._exchange(*self.in_flight))

    def _resume(self, saved: dict) -> None:
        opt = NesterovState(momentum=saved["momentum"], pending=saved["pending"],
                            count=int(saved["count"]))
        self.state = LpsState(server=ServerState(theta=saved["theta"], opt=opt),
                              anchor=saved["anchor"], since_merge=int(saved["since_merge"]))
        self.version, self._exchanges = int(saved["version"]), int(saved["exchanges"])
        self.last_request = saved["last_request"]
        if saved["delta"] is not None:
            self.in_flight = (saved["delta"], saved["delta_headers"])

    def _save(self) -> None:
        """Checkpoint before a push is answered or a delta sent: a restart keeps all of it."""
        if self.checkpoint is None:
            return
        opt, delta = self.state.server.opt, self.in_flight
        tmp = self.checkpoint.with_suffix(".tmp")
        torch.save({"theta": self.state.server.theta, "anchor": self.state.anchor,
                    "momentum": opt.momentum, "pending": opt.pending, "count": opt.count,
                    "since_merge": self.state.since_merge, "version": self.version,
                    "exchanges": self._exchanges, "last_request": self.last_request,
                    "delta": None if delta is None else delta[0],
                    "delta_headers": None if delta is None else delta[1]}, tmp)
        os.replace(tmp, self.checkpoint)  # atomic: a crash leaves the old or the new one

    def app(self) -> FastAPI:
        app = server_app(f"HALoS {self.node.name}")
        app.get("/model")(self.get_model)
        app.post("/push")(self.post_push)
        return app

    def _model_response(self) -> Response:
        response = tensor_response(self.state.server.theta, {
            Header.VERSION: str(self.version), Header.GENERATION: str(self.node.ctx.generation)})
        metrics.HALOS_BYTES.labels(self.node.job, self.node.name, "sent").inc(len(response.body))
        return response

    async def get_model(self) -> Response:
        return self._model_response()

    async def post_push(self, request: Request) -> Response:
        body = await request.body()
        worker, tag = sender_tag(request.headers)
        if self.finished:
            return Response(status_code=FINISHED_STATUS, content="the run is over")
        if self.last_request.get(worker) == tag:
            return self._model_response()  # a retry of a push already applied: just answer
        try:
            grad = unpack(body)
        except WireError as e:
            return Response(status_code=400, content=str(e))
        if grad.shape != self.state.server.theta.shape:
            return Response(status_code=400, content=f"pseudo-gradient of shape "
                            f"{tuple(grad.shape)}, model of {tuple(self.state.server.theta.shape)}")
        metrics.HALOS_BYTES.labels(self.node.job, self.node.name, "received").inc(len(body))
        self._apply(worker, tag, grad, request.headers.get(Header.BASE, ""))
        await self.node.flush()  # counted in etcd before the worker is told
        return self._model_response()

    def _apply(self, worker: str, tag: list[int], grad: torch.Tensor, base: str) -> None:
        """One worker update; synchronous, so no other request interleaves with it."""
        self.state, delta = rules.lps_apply(self.state, grad, self.cfg.lps,
                                            accumulation_k=self.cfg.accumulation_k)
        self._observe_staleness(base)
        self.version += 1
        self.last_request[worker] = tag
        self.stats["pushes"] += 1
        self.stats["per_worker"][worker] = self.stats["per_worker"].get(worker, 0) + 1
        self.node.changed(self.stats["pushes"])
        metrics.HALOS_UPDATES.labels(self.node.job, self.node.name).inc()
        if delta is not None:  # lps_apply yields one delta per merge: one exchange at a time
            self._exchanges += 1
            self.in_flight = (delta, self.node.sender_headers(self._exchanges))
            self.stats["deltas_sent"] += 1
        self._save()
        if delta is not None:
            self.spawn(self._exchange(*self.in_flight))

    def _observe_staleness(self, base: str) -> None:
        generation, _, version = base.partition(":")
        if generation == str(self.node.ctx.generation) and version.isdigit():
            metrics.HALOS_STALENESS.labels(self.node.job, self.node.name).observe(
                self.version - int(version))

    async def _exchange(self, delta: torch.Tensor, headers: dict[str, str]) -> None:
        """Send the accumulated delta to the GPS and merge the global model it returns."""
        started = time.perf_counter()
        reply = await self.node.request(self.client, GPS, "POST", "/delta", body=pack(delta),
                                        headers=headers)
        if reply is None:
            return self.finish("the GPS refused the delta: the run is over")
        self.state = rules.lps_merge(self.state, unpack(reply.content), self.cfg.merge_alpha)
        self.version += 1
        self.in_flight = None
        self._save()
        elapsed = time.perf_counter() - started
        self.stats["merges"] += 1
        # Each round trip, to compare with what the link's shaping implies (tests, the docs).
        self.stats.setdefault("exchange_s", []).append(round(elapsed, 4))
        self.node.changed()
        metrics.HALOS_MERGES.labels(self.node.job, self.node.name).inc()
        metrics.HALOS_EXCHANGE.labels(self.node.job, self.node.name).observe(elapsed)
        log.info("merged global model %s (exchange %.3f s)", reply.headers[Header.VERSION],
                 elapsed)
        await self.node.flush()
        if reply.headers.get(Header.FINISHED) == "1":
            self.finish("this LPS's delta spent the global budget")

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run ``coro`` in the background; if it fails, the LPS stops and exits non-zero."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.failure = task.exception()  # exits non-zero: the agent restarts this LPS
            self.finish(f"{task.get_coro().__qualname__} failed: {self.failure!r}")

    async def drain(self) -> None:
        """Let an exchange in flight end: the GPS may have applied its delta as the last one
        (and announced the end before answering), so its merge must still be counted."""
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=self.cfg.request_timeout_s)

    async def wait_done(self) -> None:
        await self.node.wait_done()
        self.finish("the GPS declared the run over")

    def finish(self, reason: str) -> None:
        """Refuse further pushes and stop serving (requests in flight are answered)."""
        if not self.finished:
            log.info("finishing: %s", reason)
        self.finished = True
        if self.server is not None:
            self.server.should_exit = True


async def run(region: int) -> None:
    node = Node.from_env(lps_name(region))
    try:
        cfg = await node.start()
        if not 0 <= region < cfg.num_regions:
            raise SystemExit(f"--region {region}: the run has regions 0..{cfg.num_regions - 1}")
        lps = LocalServer(node, cfg)
        if not await lps.start():
            return
        lps.server, task, url = await serve(lps.app(), node.ctx.host)
        await node.register(role="lps", region=region, url=url)
        log.info("serving at %s from %s", url, lps.stats["starts"][-1]["from"])
        lps.resume_exchange()
        done = lps.spawn(lps.wait_done())
        await task
        done.cancel()
        await lps.drain()
        await node.flush()
        await lps.client.aclose()
        if lps.failure is not None:
            raise lps.failure
    finally:
        await node.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--region", type=int, required=True, help="the region this LPS serves")
    asyncio.run(run(parser.parse_args().region))
    exit_now()  # only after a clean end: an error exits the usual way, with its traceback


if __name__ == "__main__":
    main()
