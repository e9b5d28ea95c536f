"""``bench controller --nodes``: the control plane at the scale of node agents.

N simulated node agents each hold their own node lease (``NODE_LEASE_TTL_S``, renewed every
``NODE_LEASE_RENEW_S``, as ``agent.slot`` does) bound to their record under
``agents/<replica>/<node rank>``; node rank 0 of each replica also holds the replica lease (TTL
``Timeouts(30).lease_ttl_s``, renewed every 0.5 s) bound to the registration, which it rewrites
with its step once a second. Load-generator processes (``agents``), each an event loop with its
own etcd connections, hold the agents of some replicas, and react to the DELETE of a node record
by revoking the replica's lease (the agents of agent/ notice a dead peer by UDP pulses, then
revoke the same way). The benchmark ends one lease at a time: a node lease (a node dies) or a
replica lease (an agent reports a failure), and times the epoch without the replica, together
with etcd's write and keep-alive rates and database size (``docs/scale.md``).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ftsystem.benchmarks.controller import etcd_rates, services
from ftsystem.benchmarks.controller.config import KINDS, NodesConfig
from ftsystem.benchmarks.controller.epochs import EpochWatcher, job_under_test
from ftsystem.benchmarks.controller.fleet import Fleet, fleet
from ftsystem.benchmarks.controller.nodes_report import nodes_result
from ftsystem.benchmarks.controller.services import BenchError
from ftsystem.control import keys
from ftsystem.control.store import Store


@dataclass(slots=True)
class LeaseEnds:
    """What ending leases has measured so far."""

    latencies: dict[str, list[float]] = field(
        default_factory=lambda: {kind: [] for kind in (*KINDS, "join")})
    """Seconds per kind of lease end (to the epoch without the replica), and per join."""
    node_revokes: int = 0
    """Node leases the benchmark revoked: any other node record's DELETE is a lease lost."""


def run_nodes(cfg: NodesConfig, rounds: int = 1) -> list[dict]:
    """The nodes benchmark's JSON (without ``machine``) for each round."""
    async def one_round() -> dict:
        with (services.workdir(cfg.logs_dir, "ftsystem-bench-nodes-") as workdir,
              services.etcd(cfg.etcd, workdir) as url):
            return nodes_result(cfg, await measure_nodes(cfg, url, workdir))
    return services.run_rounds(rounds, one_round)


async def measure_nodes(cfg: NodesConfig, url: str, workdir: Path) -> dict:
    """Start the agents, measure a steady window, then end ``num_samples`` leases per kind."""
    job = f"bench-nodes-{os.getpid()}"
    ids = [f"r{i:05d}" for i in range(cfg.num_replicas)]
    async with job_under_test(url, job, cfg.num_replicas, cfg.epoch_timeout_s) as (store,
                                                                                  watcher):
        try:
            async with (services.leader(cfg.controller, url, job, workdir) as leader,
                        fleet(cfg, url, job, ids, workdir) as agents):
                def check() -> None:
                    leader.check()
                    agents.check()
                return await _measure(cfg, url, job, store, watcher, agents, check, leader.pid,
                                      ids)
        finally:
            if cfg.etcd is not None:  # the leases expire by themselves within a TTL
                await store.delete_prefix(keys.job(job) + "/")


async def _measure(cfg: NodesConfig, url: str, job: str, store: Store, watcher: EpochWatcher,
                   agents: Fleet, check: Callable[[], None], controller_pid: int | None,
                   ids: list[str]) -> dict:
    start = time.perf_counter()
    await agents.ready()
    started = time.perf_counter()
    try:
        seen = await watcher.wait_for_all(ids, check)
    except BenchError as e:
        raise BenchError(f"{e}; {await _missing_registrations(store, job, ids)}") from e
    # Warm-up: every lease renewed once, so the window sees the keep-alive cadence, not setup.
    await asyncio.sleep(cfg.node_keepalive_s + 1.0)

    async def sample() -> etcd_rates.Sample:
        return await etcd_rates.sample(url, lambda: agents.report(reset=True), controller_pid)
    before = await sample()
    await asyncio.sleep(cfg.window_s)
    steady = etcd_rates.rates(before, await sample())
    before = await sample()
    ended, error = LeaseEnds(), None
    try:
        await _end_leases(cfg, store, watcher, agents, check, ids, ended)
    except BenchError as e:  # replicas lost: what the machine sustained goes in the JSON
        error = str(e)
    try:
        end = await sample()
    except BenchError:  # a process died: nothing more to measure
        if error is None:
            raise
        raise BenchError(error)
    return {"startup_s": started - start, "first_epoch_s": seen - start, "steady": steady,
            # Epochs no wait wanted: skipped by a wait, or still queued after the last.
            "samples": ended.latencies,
            "epochs_skipped": watcher.skipped + watcher.queue.qsize(),
            "error": error, "node_revokes": ended.node_revokes,
            "while_failing": etcd_rates.rates(before, end),
            "db_size_bytes": etcd_rates.metric(end.etcd, "etcd_mvcc_db_total_size_in_bytes"),
            "db_in_use_bytes": etcd_rates.metric(end.etcd,
                                                 "etcd_mvcc_db_total_size_in_use_in_bytes"),
            "node_deletes": sum(r["node_deletes"] for r in end.reports),
            "reaction_s": [s for r in end.reports for s in r["reaction_s"]]}


async def _missing_registrations(store: Store, job: str, ids: list[str]) -> str:
    """Why a first epoch never came: registrations whose lease lapsed during startup."""
    items, _ = await store.get_prefix(keys.replicas(job))
    missing = sorted(set(ids) - {keys.last_segment(k) for k in items})
    return (f"not registered: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
            "(their replica leases lapsed during startup: this machine did not sustain the load)"
            if missing else "every replica is registered")


async def _end_leases(cfg: NodesConfig, store: Store, watcher: EpochWatcher, agents: Fleet,
                      check: Callable[[], None], ids: list[str], out: LeaseEnds) -> None:
    """End one lease at a time, the two kinds alternating so that both see the same load;
    what is measured goes into ``out`` at once (kept if a later one fails)."""
    join_tick_s = services.join_tick_s()
    rng = random.Random(cfg.seed)
    for _ in range(cfg.num_samples):
        for kind in KINDS:
            rid, rank = rng.choice(ids), rng.randrange(cfg.nodes_per_replica)
            # Failures arrive at any phase of the leader's join tick, not just after a tick.
            await asyncio.sleep(rng.uniform(0.0, join_tick_s))
            if kind == "node_lease_end":  # a node dies: its agent's lease ends
                lease, restarted_rank = agents.node_leases[rid][rank], rank
                out.node_revokes += 1
            else:  # an agent reports a failure: it revokes the replica lease
                lease, restarted_rank = agents.replica_leases[rid], None
            out.latencies[kind].append(await watcher.time_removal(
                rid, store.revoke(lease), cfg.num_replicas, check))
            out.latencies["join"].append(await watcher.time_join(
                rid, agents.restart(rid, restarted_rank), check))
