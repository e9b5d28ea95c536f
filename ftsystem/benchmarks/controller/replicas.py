"""``bench controller``: membership decision latency of the real leader at n replicas.

n simulated replicas register, each with its own lease. Then, one replica at a time, the
benchmark revokes the replica's lease (what an agent does the moment a process exits) and
measures the time until a separate watcher of the epoch key sees an epoch without that replica.
The replica re-registers with the next generation and the benchmark waits for its join epoch
(batched on the leader's tick) before the next revoke, so measurements never overlap.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import httpx

from ftsystem.benchmarks.controller import services
from ftsystem.benchmarks.controller.config import TARGET_P99_S, ReplicasConfig
from ftsystem.benchmarks.controller.epochs import EpochWatcher, job_under_test
from ftsystem.benchmarks.controller.stats import summarize
from ftsystem.control import keys
from ftsystem.control.membership import Registration, ReplicaState
from ftsystem.control.store import Store
from ftsystem.control.tokens import bearer_header
from ftsystem.measure.report import print_table

T = TypeVar("T")


class SimulatedReplicas:
    """Registrations under ``replicas/``, each bound to its own lease."""

    def __init__(self, store: Store, job: str, cfg: ReplicasConfig) -> None:
        self.store, self.job, self.cfg = store, job, cfg
        self.ids = [f"r{i:05d}" for i in range(cfg.num_replicas)]
        self.leases: dict[str, int] = {}
        self.generations = dict.fromkeys(self.ids, 0)
        # Fake rendezvous addresses: the benchmark never connects to them.
        self.store_addrs = {rid: f"127.0.0.1:{20000 + i}" for i, rid in enumerate(self.ids)}
        self.metrics_addrs = {rid: f"127.0.0.1:{40000 + i}" for i, rid in enumerate(self.ids)}

    async def register(self, rid: str) -> None:
        lease = await self.store.grant(self.cfg.lease_ttl_s)
        reg = Registration(replica_id=rid, state=ReplicaState.READY,
                           generation=self.generations[rid], host="127.0.0.1",
                           store_addr=self.store_addrs[rid],
                           metrics_addr=self.metrics_addrs[rid])
        await self.store.put(keys.replica(self.job, rid), reg.to_json(), lease=lease)
        self.leases[rid] = lease

    async def register_all(self) -> None:
        await self._each(self.register, self.ids)

    async def fail(self, rid: str) -> None:
        """What an agent does when the replica's process exits: revoke its lease."""
        await self.store.revoke(self.leases.pop(rid))

    async def restart(self, rid: str) -> None:
        self.generations[rid] += 1
        await self.register(rid)

    async def revoke_all(self) -> None:
        await self._each(self.store.revoke, list(self.leases.values()))

    async def _each(self, call: Callable[[T], Awaitable[object]], args: list[T]) -> None:
        """``call`` on each of ``args``, ``register_concurrency`` at a time."""
        limit = asyncio.Semaphore(self.cfg.register_concurrency)

        async def one(arg: T) -> None:
            async with limit:
                await call(arg)
        await asyncio.gather(*(one(arg) for arg in args))


def run(cfg: ReplicasConfig, rounds: int = 1) -> list[dict]:
    """The benchmark's JSON (without ``machine``) for each of ``rounds`` rounds, each on an etcd
    of its own."""
    async def one_round() -> dict:
        with (services.workdir(None, "ftsystem-bench-controller-") as workdir,
              services.etcd(cfg.etcd, workdir) as url):  # blocks the loop, idle until measured
            return round_result(cfg, await measure(cfg, url, workdir))
    return services.run_rounds(rounds, one_round)


async def measure(cfg: ReplicasConfig, url: str, workdir: Path) -> dict:
    """Register, wait for the full epoch, then time ``num_revokes`` removals; seconds."""
    job = f"bench-controller-{os.getpid()}"
    async with job_under_test(url, job, cfg.num_replicas, cfg.epoch_timeout_s) as (store,
                                                                                  watcher):
        replicas = SimulatedReplicas(store, job, cfg)
        try:
            async with services.leader(cfg.controller, url, job, workdir) as leader:
                result = await _measure_revokes(cfg, replicas, watcher, leader.check)
                result["scrape"] = (await _time_scrapes(leader.api, leader.token,
                                                        cfg.num_scrapes)
                                    if leader.api else None)
                return result
        finally:
            if cfg.etcd is not None:  # an embedded etcd goes away with everything in it
                await replicas.revoke_all()
                await store.delete_prefix(keys.job(job) + "/")


async def _measure_revokes(cfg: ReplicasConfig, replicas: SimulatedReplicas,
                           watcher: EpochWatcher, check: Callable[[], None]) -> dict:
    start = time.perf_counter()
    await replicas.register_all()
    registered = time.perf_counter()
    seen = await watcher.wait_for_all(replicas.ids, check)
    join_tick_s = services.join_tick_s()
    rng = random.Random(cfg.seed)
    decisions, joins = [], []
    for _ in range(cfg.num_revokes):
        rid = rng.choice(replicas.ids)
        # Failures arrive at any phase of the leader's join tick, not just after a tick.
        await asyncio.sleep(rng.uniform(0.0, join_tick_s))
        decisions.append(await watcher.time_removal(rid, replicas.fail(rid), cfg.num_replicas,
                                                    check))
        joins.append(await watcher.time_join(rid, replicas.restart(rid), check))
    return {"registration_s": registered - start, "first_epoch_s": seen - start,
            "decisions": decisions, "joins": joins, "join_tick_s": join_tick_s}


async def _time_scrapes(api: str, token: str | None, num_scrapes: int) -> dict:
    """What Prometheus pays per scrape of service discovery and of the controller's metrics
    (with the job's token, as Prometheus sends it)."""
    timings: dict[str, list[float]] = {"sd": [], "metrics": []}
    headers = {"Authorization": bearer_header(token)} if token else {}
    async with httpx.AsyncClient(base_url=api, timeout=30, headers=headers) as client:
        for _ in range(num_scrapes):
            for name, path in (("sd", "/v1/sd/prometheus"), ("metrics", "/metrics")):
                t0 = time.perf_counter()
                response = await client.get(path)
                response.raise_for_status()
                timings[name].append(time.perf_counter() - t0)
        targets = sum(len(g["targets"]) for g in (await client.get("/v1/sd/prometheus")).json())
    return {"sd_s": summarize(timings["sd"]), "metrics_s": summarize(timings["metrics"]),
            "sd_targets": targets, "scrapes": num_scrapes}


def round_result(cfg: ReplicasConfig, raw: dict) -> dict:
    """One round's JSON from the raw measurement (pure)."""
    return {"replicas": cfg.num_replicas, "revokes": len(raw["decisions"]),
            "decision_latency_s": summarize(raw["decisions"]), "target_p99_s": TARGET_P99_S,
            "registration_s": raw["registration_s"], "first_epoch_s": raw["first_epoch_s"],
            "join_latency_s": summarize(raw["joins"]), "join_tick_s": raw["join_tick_s"],
            "scrape_latency_s": raw["scrape"],
            "controller": cfg.controller.value, "etcd": cfg.etcd or "embedded"}


def print_result(result: dict) -> None:
    d, j = result["decision_latency_s"], result["join_latency_s"]
    scrape = result["scrape_latency_s"]
    scrape_rows = [(f"scrape {name}", *(1000 * v for v in scrape[key].values()))
                   for name, key in (("/v1/sd/prometheus", "sd_s"), ("/metrics", "metrics_s"))
                   if scrape]
    print_table(f"controller ({result['controller']}), {result['replicas']} replicas, "
                f"{result['revokes']} revokes",
                ["measure", "p50 (ms)", "p99 (ms)", "mean (ms)", "max (ms)"],
                [("removal: revoke -> epoch seen", *(1000 * d[k] for k in d)),
                 ("join: register -> epoch seen", *(1000 * j[k] for k in j)), *scrape_rows])
    verdict = "meets" if d["p99"] <= result["target_p99_s"] else "MISSES"
    print_table("summary", ["registration (s)", "first epoch (s)", "target p99 (ms)", "verdict"],
                [(result["registration_s"], result["first_epoch_s"],
                  1000 * result["target_p99_s"], verdict)])
