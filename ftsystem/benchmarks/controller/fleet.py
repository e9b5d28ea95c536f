"""The load generators of the nodes benchmark, from the benchmark's side: one process each
(``agents``), asked one command at a time over its stdin and stdout."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path

from ftsystem.benchmarks.controller.agents import WorkerConfig
from ftsystem.benchmarks.controller.config import NodesConfig, deal
from ftsystem.benchmarks.controller.services import BenchError, tail
from ftsystem.launch.procs import die_with_parent


class LoadGenerator:
    """One load-generator process."""

    def __init__(self, proc: asyncio.subprocess.Process, replicas: list[str],
                 log_path: Path) -> None:
        self.proc, self.replicas, self.log_path = proc, replicas, log_path
        self._lock = asyncio.Lock()

    async def ask(self, cmd: dict) -> dict:
        """Send ``cmd`` (nothing if empty) and read the answer."""
        async with self._lock:
            if cmd:
                self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
                await self.proc.stdin.drain()
            line = await self.proc.stdout.readline()
        if not line:
            raise BenchError(f"a load generator exited with {await self.proc.wait()}: "
                             f"{tail(self.log_path)}")
        return json.loads(line)

    def check(self) -> None:
        if self.proc.returncode is not None:
            raise BenchError(f"a load generator exited with {self.proc.returncode}: "
                             f"{tail(self.log_path)}")


class Fleet:
    """The load generators, and the leases they hold that the benchmark ends."""

    def __init__(self, generators: list[LoadGenerator]) -> None:
        self.generators = generators
        self.owner = {rid: g for g in generators for rid in g.replicas}
        self.node_leases: dict[str, list[int]] = {}
        self.replica_leases: dict[str, int] = {}

    async def ready(self) -> None:
        """Wait until every generator's agents are up; learn their leases."""
        for reply in await asyncio.gather(*(g.ask({}) for g in self.generators)):
            self.node_leases.update(reply["node_leases"])
            self.replica_leases.update(reply["replica_leases"])

    async def restart(self, rid: str, rank: int | None) -> None:
        reply = await self.owner[rid].ask({"cmd": "restart", "replica": rid, "rank": rank})
        if rank is not None:
            self.node_leases[rid][rank] = reply["node_lease"]
        self.replica_leases[rid] = reply["replica_lease"]

    async def report(self, reset: bool = False) -> list[dict]:
        return list(await asyncio.gather(
            *(g.ask({"cmd": "report", "reset": reset}) for g in self.generators)))

    def check(self) -> None:
        for g in self.generators:
            g.check()


@asynccontextmanager
async def fleet(cfg: NodesConfig, url: str, job: str, ids: list[str], workdir: Path
                ) -> AsyncIterator[Fleet]:
    """Load generators for the replicas ``ids``, dealt over ``cfg.num_processes``; each logs
    to ``workdir``. At the end, EOF ends each; a stuck one is killed."""
    generators = []
    cmd = die_with_parent([sys.executable, "-m", "ftsystem.benchmarks.controller.agents"])
    try:
        for i, group in enumerate(deal(ids, cfg.num_processes)):
            log_path = workdir / f"load-{i}.log"
            with open(log_path, "ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    *cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                    limit=1 << 24)
            generators.append(LoadGenerator(proc, group, log_path))
            proc.stdin.write((json.dumps(asdict(_worker_config(cfg, url, job, group)))
                              + "\n").encode())
        yield Fleet(generators)
    finally:
        for g in generators:
            g.proc.stdin.close()
        for g in generators:
            try:
                async with asyncio.timeout(10):
                    await g.proc.wait()
            except TimeoutError:
                g.proc.kill()
                await g.proc.wait()


def _worker_config(cfg: NodesConfig, url: str, job: str, replicas: list[str]) -> WorkerConfig:
    return WorkerConfig(
        url=url, job=job, replicas=replicas, nodes_per_replica=cfg.nodes_per_replica,
        lease_ttl_s=cfg.lease_ttl_s, node_lease_ttl_s=cfg.node_lease_ttl_s,
        node_keepalive_s=cfg.node_keepalive_s, replica_keepalive_s=cfg.replica_keepalive_s,
        progress_s=cfg.progress_s, setup_concurrency=cfg.setup_concurrency,
        keepalive=cfg.keepalive.value, keepalive_streams=cfg.keepalive_streams,
        keepalive_tick_s=cfg.keepalive_tick_s)
