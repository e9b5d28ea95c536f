"""A load-generator process of the nodes benchmark: the node agents of some replicas, each with
its own lease, keep-alives and record, and the reaction of a replica's agents to the end of one
of its nodes. It runs as ``python -m ftsystem.benchmarks.controller.agents``: its WorkerConfig
on stdin's first line, then one command a line (``restart``, ``report``), each answered by one
JSON line on stdout; EOF ends it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass

from ftsystem.benchmarks.controller.config import KeepAliveMode
from ftsystem.benchmarks.controller.keepalive_per_call import PerCallKeepAlives
from ftsystem.benchmarks.controller.keepalive_schedule import KeepAliveSchedule, KeepAliveStats
from ftsystem.benchmarks.controller.keepalive_streams import BatchedKeepAlives
from ftsystem.control import keys
from ftsystem.control.membership import Registration, ReplicaState
from ftsystem.control.store import Store, StoreError


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    """What one load-generator process simulates (sent as JSON on its stdin)."""

    url: str
    job: str
    replicas: list[str]
    nodes_per_replica: int
    lease_ttl_s: int
    node_lease_ttl_s: int
    node_keepalive_s: float
    replica_keepalive_s: float
    progress_s: float
    setup_concurrency: int
    keepalive: str
    keepalive_streams: int
    keepalive_tick_s: float


@dataclass(slots=True)
class SimReplica:
    """A replica as its agents see it: node leases, the replica lease, the generation."""

    rid: str
    index: int
    node_leases: list[int]
    generation: int = 0
    lease: int = 0
    up: bool = False
    step: int = 0
    progress: asyncio.Task | None = None
    reaction: asyncio.Task | None = None


class NodeAgents:
    """The node agents of some replicas, in one process: what each holds and writes in etcd,
    and the reaction of a replica's agents to the end of one of its nodes."""

    def __init__(self, cfg: WorkerConfig, store: Store) -> None:
        self.cfg, self.store = cfg, store
        self.schedule = KeepAliveSchedule()
        self.stats = KeepAliveStats()
        self.keepalives = (
            BatchedKeepAlives(cfg.url, self._on_reply, cfg.keepalive_streams)
            if cfg.keepalive == KeepAliveMode.BATCHED.value
            else PerCallKeepAlives(cfg.url, self._on_reply))
        self.replicas = {rid: SimReplica(rid, int(rid[1:]), [0] * cfg.nodes_per_replica)
                         for rid in cfg.replicas}
        self.limit = asyncio.Semaphore(cfg.setup_concurrency)
        self.rng = random.Random(os.getpid())
        self.node_deletes = 0
        self.reaction_s: list[float] = []
        self.tasks: list[asyncio.Task] = []

    # --- lifecycle ---

    async def start(self) -> dict:
        """Every agent up, keep-alives running, reactions armed; the leases for the bench."""
        await self.keepalives.open()
        self._background(self.keepalives.reader_task)
        self._background(asyncio.create_task(self._keep_alive_loop()))
        await asyncio.gather(*(self._start_replica(r) for r in self.replicas.values()))
        _, revision = await self.store.get_prefix(keys.spec(self.cfg.job))
        for rid in self.replicas:
            self._background(asyncio.create_task(self._react(rid, revision + 1)))
        return {"node_leases": {r.rid: r.node_leases for r in self.replicas.values()},
                "replica_leases": {r.rid: r.lease for r in self.replicas.values()}}

    def _background(self, task: asyncio.Task | None) -> None:
        """A background task that fails ends the process: the benchmark sees it exit."""
        if task is None:
            return
        self.tasks.append(task)
        task.add_done_callback(_exit_on_failure)

    async def _start_replica(self, r: SimReplica) -> None:
        await asyncio.gather(*(self._start_node(r, rank) for rank in range(len(r.node_leases))))
        await self._start_generation(r)

    async def _start_node(self, r: SimReplica, rank: int) -> None:
        async with self.limit:
            lease = await self.store.grant(self.cfg.node_lease_ttl_s)
            self._hold(lease, self.cfg.node_keepalive_s)
            record = {"node_id": f"{r.rid}-n{rank:05d}", "host": "127.0.0.1",
                      "pid": os.getpid(), "lease": lease, "generation": r.generation}
            await self.store.put_json(keys.agent(self.cfg.job, r.rid, rank), record, lease=lease)
        r.node_leases[rank] = lease

    async def _start_generation(self, r: SimReplica) -> None:
        """Node rank 0 opens a generation: the replica lease, then the registration."""
        async with self.limit:
            r.lease = await self.store.grant(self.cfg.lease_ttl_s)
            self._hold(r.lease, self.cfg.replica_keepalive_s)
            await self._write_generation(r, running=True)
            await self.store.put(keys.replica(self.cfg.job, r.rid),
                                 self._registration(r, ReplicaState.READY), lease=r.lease)
        r.up, r.step = True, 0
        r.progress = asyncio.create_task(self._progress(r))

    async def _write_generation(self, r: SimReplica, *, running: bool) -> None:
        await self.store.put_json(keys.generation(self.cfg.job, r.rid),
                                  {"generation": r.generation, "replica_lease": r.lease,
                                   "running": running})

    def _registration(self, r: SimReplica, state: str) -> str:
        return Registration(replica_id=r.rid, state=state, generation=r.generation,
                            step=r.step, host="127.0.0.1", pid=os.getpid(), lease=r.lease,
                            store_addr=f"127.0.0.1:{20000 + r.index}",
                            metrics_addr=f"127.0.0.1:{40000 + r.index}").to_json()

    async def _progress(self, r: SimReplica) -> None:
        """Rank 0's rate-limited progress: the registration rewritten with the step."""
        while True:
            await asyncio.sleep(self.cfg.progress_s)
            r.step += 1
            try:
                await self.store.put(keys.replica(self.cfg.job, r.rid),
                                     self._registration(r, ReplicaState.MEMBER), lease=r.lease)
            except StoreError:
                return  # the replica lease was revoked under it: its agents restart it

    # --- keep-alives ---

    def _hold(self, lease: int, interval_s: float) -> None:
        # Agents start at unrelated times, so their keep-alives have independent phases: a
        # random first one (rather than all one interval after a setup that takes seconds).
        now = time.monotonic()
        self.schedule.add(lease, interval_s, self.rng.uniform(0.0, interval_s), now)
        self.stats.add(lease, now)

    def _drop(self, lease: int) -> None:
        self.schedule.remove(lease)
        self.stats.remove(lease)

    async def _keep_alive_loop(self) -> None:
        while True:
            nxt = self.schedule.next_due()
            wait = self.cfg.keepalive_tick_s if nxt is None else nxt - time.monotonic()
            # At most 0.1 s: a lease added meanwhile (a restart) may be due sooner.
            await asyncio.sleep(min(max(wait, self.cfg.keepalive_tick_s), 0.1))
            now = time.monotonic()
            leases, late = self.schedule.due(now)
            self.stats.on_sent(leases, now, late)
            if leases:
                await self.keepalives.send(leases)

    def _on_reply(self, lease: int, ttl: int) -> None:
        self.stats.on_reply(lease, ttl, time.monotonic())

    # --- the reaction ---

    async def _react(self, rid: str, start_revision: int) -> None:
        """A replica's agents watch its node records: one that disappears ends the generation."""
        async for event in self.store.watch_prefix(keys.replica_agents(self.cfg.job, rid),
                                                   start_revision=start_revision):
            if event.kind == "DELETE":
                self.node_deletes += 1
                self._node_gone(self.replicas[rid], int(keys.last_segment(event.key)))

    def _node_gone(self, r: SimReplica, rank: int) -> None:
        self._drop(r.node_leases[rank])
        if r.up:
            r.up = False
            r.reaction = asyncio.create_task(self._end_generation(r, time.perf_counter()))

    async def _end_generation(self, r: SimReplica, seen: float) -> None:
        _cancel(r.progress)
        await self.store.revoke(r.lease)  # the decision path: the registration goes with it
        self.reaction_s.append(time.perf_counter() - seen)
        self._drop(r.lease)
        await self._write_generation(r, running=False)  # after: off the decision path

    # --- commands from the benchmark ---

    async def restart(self, rid: str, rank: int | None) -> dict:
        """The replica's next generation, with a new agent on ``rank`` if its node died."""
        r = self.replicas[rid]
        if r.reaction is not None:
            await r.reaction
            r.reaction = None
        if r.up:  # a reported failure: the replica lease was revoked from outside
            r.up = False
            _cancel(r.progress)
            self._drop(r.lease)
            await self._write_generation(r, running=False)
        if rank is not None:
            await self._start_node(r, rank)
        r.generation += 1
        await self._start_generation(r)
        return {"node_lease": r.node_leases[rank] if rank is not None else None,
                "replica_lease": r.lease}

    def report(self, reset: bool) -> dict:
        """Counters for the benchmark; ``reset`` starts a new window of keep-alive figures."""
        return {"keepalive": self.stats.snapshot(reset), "node_deletes": self.node_deletes,
                "leases_held": len(self.schedule), "cpu_s": time.process_time(),
                "reaction_s": self.reaction_s, "stream_restarts": self.keepalives.restarts}


def _cancel(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()


def _exit_on_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        traceback.print_exception(task.exception(), file=sys.stderr)
        sys.stderr.flush()
        os._exit(3)


async def serve() -> None:
    """Answer the benchmark's commands on stdin until EOF."""
    reader = asyncio.StreamReader(limit=1 << 24)
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    cfg = WorkerConfig(**json.loads(await reader.readline()))
    async with Store(cfg.url) as store:
        agents = NodeAgents(cfg, store)
        _answer(await agents.start())
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["cmd"] == "restart":
                _answer(await agents.restart(cmd["replica"], cmd["rank"]))
            else:
                _answer(agents.report(cmd.get("reset", False)))


def _answer(reply: dict) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(serve())
