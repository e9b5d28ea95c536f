"""A HALoS worker as a process: ``python -m ftsystem.halos.worker --worker I``.

It fetches its region's LPS model, runs its H local AdamW steps (H rescaled by its speed, each
step padded to ``local_step_s / speed``) on the small model of
``halos.workload`` (``rules.local_sgd`` through ``Workload.train``), pushes the pseudo-gradient and
continues from the model the LPS answers with, until the LPS says the run is over. A restarted
worker fetches the LPS's current model, continues its learning-rate schedule and its data stream
where its acknowledged pushes left them (its counters are in etcd), and starts a fresh AdamW.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

import httpx

from ftsystem.measure import metrics
from ftsystem.halos.node import Header, Node, exit_now, http_client, pack, unpack
from ftsystem.halos.realconfig import RealConfig, lps_name, worker_name
from ftsystem.halos.workload import Workload

log = logging.getLogger(__name__)


class Worker:
    """One worker's training loop against its LPS."""

    def __init__(self, node: Node, cfg: RealConfig, index: int) -> None:
        self.node, self.cfg, self.index = node, cfg, index
        self.lps = lps_name(cfg.worker_regions[index])
        self.work = Workload(cfg.workload, cfg.worker_regions, cfg.worker)
        self.client = http_client(cfg)
        self.seq = 0
        self.h = cfg.local_steps_of(index)
        """This worker's H, rescaled by its speed."""
        self.job_s = self.h * cfg.step_s_of(index)
        """The emulated compute time of one job: H steps at this worker's speed."""
        for counter in ("pushes", "local_steps"):
            node.stats.setdefault(counter, 0)
        # Skip the batches earlier generations consumed: each batch is read once.
        self.work.batches(index, node.stats["local_steps"])

    async def run(self) -> None:
        """Train and push until the run is over (from the run's start: every node is up)."""
        await self.node.wait_started()
        reply = await self.node.request(self.client, self.lps, "GET", "/model")
        if reply is not None:
            await self._started(reply)
        while reply is not None:
            reply = await self._round(reply)
        log.info("the run is over after %d acknowledged pushes", self.node.stats["pushes"])

    async def _started(self, model: httpx.Response) -> None:
        """Record where this generation started: which LPS model, after how much work."""
        stats = self.node.stats
        stats.setdefault("starts", []).append({
            "generation": self.node.ctx.generation,
            "lps_generation": int(model.headers[Header.GENERATION]),
            "lps_version": int(model.headers[Header.VERSION]),
            "pushes": stats["pushes"], "local_steps": stats["local_steps"], "time": time.time()})
        self.node.changed(stats["pushes"])
        await self.node.flush()
        log.info("fetched %s's model (version %s)", self.lps, model.headers[Header.VERSION])

    async def _round(self, model: httpx.Response) -> httpx.Response | None:
        """H local steps from the LPS model in ``model``; push; the LPS's answer (None: over)."""
        stats, h = self.node.stats, self.h
        started = time.perf_counter()
        # Blocking compute in the loop is fine: this process has nothing else to serve.
        lrs = self.cfg.lrs(self.cfg.schedule_position(stats["pushes"]), h)
        grad, losses = self.work.train(self.index, unpack(model.content), lrs)
        await asyncio.sleep(max(0.0, self.job_s - (time.perf_counter() - started)))
        self.seq += 1
        base = f"{model.headers[Header.GENERATION]}:{model.headers[Header.VERSION]}"
        headers = self.node.sender_headers(self.seq) | {Header.BASE: base}
        body = pack(grad)
        reply = await self.node.request(self.client, self.lps, "POST", "/push", body=body,
                                        headers=headers)
        if reply is None:
            return None
        stats["pushes"] += 1
        stats["local_steps"] += h
        stats["loss"] = sum(losses) / len(losses)
        self.node.changed(stats["pushes"])
        await self.node.flush()
        self._observe(len(body), len(reply.content), stats["loss"])
        return reply

    def _observe(self, sent: int, received: int, loss: float) -> None:
        job, name = self.node.job, self.node.name
        metrics.HALOS_WORKER_PUSHES.labels(job, name).inc()
        metrics.HALOS_WORKER_LOSS.labels(job, name).set(loss)
        metrics.HALOS_BYTES.labels(job, name, "sent").inc(sent)
        metrics.HALOS_BYTES.labels(job, name, "received").inc(received)


async def run(index: int) -> None:
    node = Node.from_env(worker_name(index))
    try:
        cfg = await node.start()
        if not 0 <= index < cfg.num_workers:
            raise SystemExit(f"--worker {index}: the run has workers 0..{cfg.num_workers - 1}")
        if await node.is_done():
            return
        worker = Worker(node, cfg, index)
        await node.register(role="worker", lps=worker.lps,
                            metrics=metrics.serve(node.ctx.host))
        try:
            await worker.run()
        finally:
            await worker.client.aclose()
    finally:
        await node.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", type=int, required=True, help="index of this worker")
    asyncio.run(run(parser.parse_args().worker))
    exit_now()  # only after a clean end: an error exits the usual way, with its traceback


if __name__ == "__main__":
    main()
