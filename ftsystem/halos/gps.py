"""The HALoS global parameter server as a process: ``python -m ftsystem.halos.gps``.

It applies each LPS delta with global momentum (``rules.server_apply``) and answers with the
global model. After every update it evaluates the global model's held-out loss (the run's loss
curve) and checkpoints its state to ``RealConfig.state_dir`` before it answers, so a restarted GPS
resumes exactly where it was and recognizes a delta it already applied. After ``num_updates``
deltas it writes ``keys.halos_done`` and stops; later deltas are refused with 410.

HTTP: ``GET /model``; ``POST /delta`` (body: the delta; headers: the LPS's name, generation and
request number); ``GET /metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

import torch
from fastapi import FastAPI, Request, Response
from starlette.background import BackgroundTask

from ftsystem.control import keys

from ftsystem.measure import metrics
from ftsystem.halos import rules
from ftsystem.halos.node import (
    FINISHED_STATUS,
    Header,
    Node,
    WireError,
    exit_now,
    sender_tag,
    serve,
    server_app,
    tensor_response,
    unpack,
)
from ftsystem.halos.realconfig import GPS, RealConfig
from ftsystem.halos.rules import NesterovState, ServerState
from ftsystem.halos.workload import Workload

log = logging.getLogger(__name__)


class GlobalServer:
    """The GPS's state and its HTTP handlers."""

    def __init__(self, node: Node, cfg: RealConfig) -> None:
        self.node, self.cfg = node, cfg
        self.work = Workload(cfg.workload, cfg.worker_regions, cfg.worker)  # theta0, held-out data
        self.state = ServerState.start(self.work.theta0)
        self.last_request: dict[str, list[int]] = {}
        """Per LPS, ``[generation, seq]`` of its last delta applied: a retry is not reapplied."""
        self.finished = False
        self.server = None  # the uvicorn server, once serving
        self.checkpoint = Path(cfg.state_dir) / "gps.pt" if cfg.state_dir else None

    @property
    def updates(self) -> int:
        return self.node.stats["updates"]

    def resume_or_start(self) -> None:
        """Resume from the checkpoint if a previous generation left one, else the initial model."""
        stats = self.node.stats
        if self.checkpoint is not None and self.checkpoint.exists():
            saved = torch.load(self.checkpoint, weights_only=True)
            opt = NesterovState(momentum=saved["momentum"], pending=saved["pending"],
                                count=int(saved["count"]))
            self.state = ServerState(theta=saved["theta"], opt=opt)
            self.last_request = saved["last_request"]
            stats["updates"], stats["per_lps"] = int(saved["updates"]), dict(saved["per_lps"])
            stats.setdefault("loss", [])
            origin = "checkpoint"
        else:
            if stats.get("updates"):
                log.warning("no checkpoint: the global model of %d updates is lost; starting "
                            "from the initial model", stats["updates"])
            stats.update(updates=0, per_lps={}, loss=[])
            origin = "initial"
        self.finished = self.updates >= self.cfg.num_updates
        stats.setdefault("starts", []).append({"generation": self.node.ctx.generation,
                                               "from": origin, "updates": self.updates,
                                               "time": time.time()})
        if not stats["loss"]:
            self._evaluate()
        self.node.changed(self.updates)

    def app(self) -> FastAPI:
        app = server_app("HALoS GPS")
        app.get("/model")(self.get_model)
        app.post("/delta")(self.post_delta)
        return app

    def _model_response(self, **kwargs) -> Response:
        headers = {Header.VERSION: str(self.updates),
                   Header.FINISHED: "1" if self.finished else "0"}
        response = tensor_response(self.state.theta, headers, **kwargs)
        metrics.HALOS_BYTES.labels(self.node.job, GPS, "sent").inc(len(response.body))
        return response

    async def get_model(self) -> Response:
        return self._model_response()

    async def post_delta(self, request: Request) -> Response:
        body = await request.body()
        lps, tag = sender_tag(request.headers)
        if self.finished:
            return Response(status_code=FINISHED_STATUS, content="the run is over")
        if self.last_request.get(lps) == tag:
            return self._model_response()  # a retry of a delta already applied: just answer
        try:
            delta = unpack(body)
        except WireError as e:
            return Response(status_code=400, content=str(e))
        if delta.shape != self.state.theta.shape:
            return Response(status_code=400, content=f"delta of shape {tuple(delta.shape)}, "
                            f"model of {tuple(self.state.theta.shape)}")
        metrics.HALOS_BYTES.labels(self.node.job, GPS, "received").inc(len(body))
        spent = self._apply(lps, tag, delta)  # synchronous: no request interleaves with it
        await self.node.flush()
        if not spent:
            return self._model_response()
        await self.declare_done()
        return self._model_response(background=BackgroundTask(self._stop))

    async def declare_done(self) -> None:
        """Tell every node that the budget is spent: they finish and exit."""
        await self.node.store.put_json(keys.halos_done(self.node.job), {
            "updates": self.updates, "loss": self.node.stats["loss"][-1][1], "time": time.time()})
        log.info("global update budget of %d spent; the run is over", self.cfg.num_updates)

    def _apply(self, lps: str, tag: list[int], delta: torch.Tensor) -> bool:
        """Apply one delta; True if it was the last of the budget."""
        started = time.perf_counter()
        self.state = rules.server_apply(self.state, delta, self.cfg.gps)
        stats = self.node.stats
        stats["updates"] += 1
        stats["per_lps"][lps] = stats["per_lps"].get(lps, 0) + 1
        self.last_request[lps] = tag
        self.finished = self.updates >= self.cfg.num_updates
        loss = self._evaluate()
        self._save()
        # The server's share of an LPS's round trip (update, held-out loss, checkpoint), which
        # the simulator's time model does not charge.
        stats.setdefault("apply_s", []).append(round(time.perf_counter() - started, 4))
        self.node.changed(self.updates)
        metrics.HALOS_UPDATES.labels(self.node.job, GPS).inc()
        metrics.HALOS_GLOBAL_UPDATES.labels(self.node.job).set(self.updates)
        log.info("global update %d from %s: held-out loss %.4f", self.updates, lps, loss)
        return self.finished

    def _evaluate(self) -> float:
        loss = self.work.evaluate(self.state.theta)
        self.node.stats["loss"].append([self.updates, loss, time.time()])
        metrics.HALOS_GLOBAL_LOSS.labels(self.node.job).set(loss)
        return loss

    def _save(self) -> None:
        """Checkpoint before answering: the LPS is told only what a restart would keep."""
        if self.checkpoint is None:
            return
        tmp = self.checkpoint.with_suffix(".tmp")
        opt = self.state.opt
        torch.save({"theta": self.state.theta, "momentum": opt.momentum, "pending": opt.pending,
                    "count": opt.count, "last_request": self.last_request,
                    "updates": self.updates, "per_lps": self.node.stats["per_lps"]}, tmp)
        os.replace(tmp, self.checkpoint)  # atomic: a crash leaves the old or the new one

    def _stop(self) -> None:
        if self.server is not None:  # None when the app is served by someone else (tests)
            self.server.should_exit = True


async def run() -> None:
    node = Node.from_env(GPS)
    try:
        cfg = await node.start()
        if await node.is_done():
            return  # restarted after the end: nothing left to do
        gps = GlobalServer(node, cfg)
        gps.resume_or_start()
        await node.flush()
        if gps.finished:  # the previous generation died between its last update and this
            await gps.declare_done()
            return
        gps.server, task, url = await serve(gps.app(), node.ctx.host)
        await node.register(role="gps", url=url)
        log.info("serving at %s from %d updates", url, gps.updates)
        await task
    finally:
        await node.close()


def main() -> None:
    asyncio.run(run())
    exit_now()  # only after a clean end: an error exits the usual way, with its traceback


if __name__ == "__main__":
    main()
