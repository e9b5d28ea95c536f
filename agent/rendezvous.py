"""How the node agents of one replica meet in etcd and agree on each generation.

A replica of N nodes is supervised by N agents, one per node, like torchrun's agents:

1. **Slots.** An agent holds its node rank by holding ``agents/<replica>/<node rank>`` on its
   own lease (a create-if-absent transaction): two agents cannot hold one rank. A restarted
   agent of the same machine (same ``--node-id``) takes its rank back at once by revoking its
   previous incarnation's lease; a spare (``--spare``) waits and takes the first rank that
   falls free.
2. **Generations.** Once all N ranks are held, the agent of node rank 0 opens the next
   generation in one transaction on ``generations/<replica>`` (guarded by the revision it read):
   its number, the replica lease, where rank 0 of the replica listens (``MASTER_ADDR`` of node
   0), and which agent holds each rank. The others wait for a generation that names them.
3. **Ending.** Any agent ends a generation with a transaction that sets ``ended`` if it is still
   the current one: the winner alone records the failure. All agents then stop their ranks and
   the replica restarts as a whole once N nodes are back.
4. **Finishing.** An agent whose ranks finished the job's work marks the generation
   ``finished`` (the same transaction) before it gives up its node rank. The replica is done:
   whoever takes that rank next (a spare, a restarted agent) finds the mark and starts nothing.

The pure parts (shape checks, the ranks' environment) are functions apart from the etcd I/O.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, replace
from typing import Any

from ftsystem.control import keys
from ftsystem.control.store import Store

log = logging.getLogger(__name__)


class RendezvousError(RuntimeError):
    """A node agent started with input that contradicts its replica or job; nothing was
    launched. The message says what to change."""


@dataclass(frozen=True, slots=True)
class Layout:
    """The shape of a replica: every agent of the replica must be started with the same."""

    nodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node


@dataclass(frozen=True, kw_only=True, slots=True)
class Generation:
    """One run of a replica on all its nodes (``generations/<replica>``)."""

    number: int
    lease: int
    """The replica lease: the replica's registration is bound to it, and any of its agents
    revokes it to take the replica out of the job at once."""
    master_addr: str
    master_port: int
    agents: tuple[str, ...]
    """The agent (uid) holding each node rank."""
    ended: str = ""
    """Why it ended; empty while it runs."""
    finished: bool = False
    """Its ranks finished the job's work: the replica is done, and no agent starts another
    generation of it."""

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"agents": list(self.agents)}, sort_keys=True)

    @classmethod
    def from_json(cls, data: bytes | str) -> "Generation":
        raw = json.loads(data)
        return cls(**raw | {"agents": tuple(raw["agents"])})


def check_layout(mine: Layout, recorded: Layout | None, spec: dict[str, Any] | None,
                 replica_id: str) -> None:
    """Refuse an agent whose shape differs from its replica's (first agent's) or the job's."""
    if recorded is not None and recorded != mine:
        raise RendezvousError(
            f"replica {replica_id} runs {recorded.nodes} node(s) x {recorded.nproc_per_node} "
            f"rank(s), but this agent was started with --nodes {mine.nodes} --nproc-per-node "
            f"{mine.nproc_per_node}: start every agent of a replica with the same values")
    if not spec:
        return
    wanted = (spec.get("nodes_per_replica"), spec.get("nproc_per_node"))
    if wanted[0] is not None and wanted[0] != mine.nodes or \
            wanted[1] is not None and wanted[1] != mine.nproc_per_node:
        raise RendezvousError(
            f"job spec says {wanted[0]} node(s) x {wanted[1]} rank(s) per replica, but this "
            f"agent was started with --nodes {mine.nodes} --nproc-per-node "
            f"{mine.nproc_per_node}")


def check_replica(spec: dict[str, Any] | None, replica_id: str) -> None:
    """Refuse a replica the job's spec does not list."""
    ids = (spec or {}).get("replica_ids")
    if ids and replica_id not in ids:
        raise RendezvousError(
            f"replica {replica_id!r} is not in this job (its replicas: {', '.join(ids)}); "
            "check --job and --replica-id")


def check_node_rank(node_rank: int | None, layout: Layout) -> None:
    if node_rank is not None and not 0 <= node_rank < layout.nodes:
        raise RendezvousError(f"--node-rank {node_rank} is outside 0..{layout.nodes - 1} "
                              f"(--nodes {layout.nodes})")


def rank_env(layout: Layout, node_rank: int, local_rank: int, generation: Generation, *,
             max_restarts: int, run_id: str) -> dict[str, str]:
    """torchrun's environment for one rank of a replica (its own process group)."""
    rank = node_rank * layout.nproc_per_node + local_rank
    return {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(layout.world_size), "LOCAL_WORLD_SIZE": str(layout.nproc_per_node),
        "GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(layout.nodes),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(layout.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": generation.master_addr, "MASTER_PORT": str(generation.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(generation.number),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts), "TORCHELASTIC_RUN_ID": run_id,
    }


def replica_env(spec: dict[str, Any] | None, replica_id: str) -> dict[str, str]:
    """The replica's place in the job: ftsystem's names, and torchft's where they are known."""
    spec = spec or {}
    env = {}
    if "replicas" in spec:
        env["FTSYSTEM_NUM_REPLICAS"] = env["NUM_REPLICA_GROUPS"] = str(spec["replicas"])
    ids = spec.get("replica_ids") or []
    if replica_id in ids:
        env["REPLICA_GROUP_ID"] = str(ids.index(replica_id))
    return env


class Rendezvous:
    """The etcd side of one agent's replica: layout, slots, generations."""

    def __init__(self, store: Store, job: str, replica_id: str, layout: Layout) -> None:
        self.store, self.job, self.replica_id, self.layout = store, job, replica_id, layout

    async def check(self, node_rank: int | None) -> dict[str, Any] | None:
        """Validate this agent against the job's spec and the replica's recorded shape, and
        record the shape if this is the replica's first agent. Returns the spec."""
        check_node_rank(node_rank, self.layout)
        spec = await self.store.get_json(keys.spec(self.job))
        check_replica(spec, self.replica_id)
        check_layout(self.layout, None, spec, self.replica_id)  # before recording anything
        key = keys.layout(self.job, self.replica_id)
        await self.store.put_if_absent(key, json.dumps(asdict(self.layout)))
        recorded = await self.store.get_json(key)
        check_layout(self.layout, Layout(**recorded) if recorded else None, spec,
                     self.replica_id)
        return spec

    async def holders(self) -> tuple[dict[int, dict], int]:
        """Who holds each node rank now, and the revision read."""
        prefix = keys.replica_agents(self.job, self.replica_id)
        items, revision = await self.store.get_prefix(prefix)
        held = {}
        for key, value in items.items():
            suffix = key[len(prefix):]
            if suffix.isdigit():
                held[int(suffix)] = json.loads(value)
        return held, revision

    async def wait_full(self) -> dict[int, dict]:
        """Block until every node rank is held; returns the holders."""
        prefix = keys.replica_agents(self.job, self.replica_id)
        while True:
            held, revision = await self.holders()
            if len(held) >= self.layout.nodes:
                return held
            async for _ in self.store.watch_prefix(prefix, start_revision=revision + 1):
                break  # something changed: read again

    async def current(self) -> tuple[Generation | None, int]:
        raw, revision = await self.store.get_versioned(keys.generation(self.job,
                                                                       self.replica_id))
        return (Generation.from_json(raw) if raw else None), revision

    async def open(self, make: "callable[[int], Generation]") -> Generation | None:
        """Node rank 0: open the generation after the current one; None if another write to
        the generation key came first (read again and decide again)."""
        current, revision = await self.current()
        number = 0 if current is None else current.number + 1
        generation = make(number)
        if await self.store.put_if_unchanged(keys.generation(self.job, self.replica_id),
                                             revision, generation.to_json()):
            return generation
        return None

    async def wait_started(self) -> None:
        """Until the replica's first generation was opened."""
        await until_present(self.store, keys.generation(self.job, self.replica_id))

    async def wait_opened(self, uid: str, after: int) -> Generation:
        """Other node ranks: the first running generation numbered above ``after`` that
        names this agent."""
        key = keys.generation(self.job, self.replica_id)
        while True:
            # One read gives the value and the revision to watch from: nothing in between.
            items, revision = await self.store.get_prefix(key)
            current = Generation.from_json(items[key]) if key in items else None
            if current and current.number > after and not current.ended and uid in current.agents:
                return current
            async for _ in self.store.watch_prefix(key, start_revision=revision + 1):
                break

    async def end(self, number: int, reason: str) -> bool:
        """End generation ``number`` if it still runs; True for the one agent that ended it."""
        return await self._change_running(number, ended=reason)

    async def finish(self, number: int) -> bool:
        """Mark generation ``number`` finished if it still runs; True for the one agent that
        marked it (every agent of the generation tries: any one of them may be the last)."""
        return await self._change_running(number, finished=True)

    async def replace_lease(self, number: int, lease: int) -> None:
        """After an etcd outage outlived the replica lease: record its successor."""
        await self._change_running(number, lease=lease)

    async def _change_running(self, number: int, **change: Any) -> bool:
        """Write ``change`` into generation ``number`` while it is the current one and neither
        ended nor finished; True if this call wrote it. A concurrent write is read again."""
        key = keys.generation(self.job, self.replica_id)
        while True:
            raw, revision = await self.store.get_versioned(key)
            current = Generation.from_json(raw) if raw else None
            if current is None or current.number != number or current.ended or current.finished:
                return False
            if await self.store.put_if_unchanged(key, revision,
                                                 replace(current, **change).to_json()):
                return True


async def until_present(store: Store, key: str) -> None:
    """Until ``key`` exists (a watch from the revision read: no write in between is missed)."""
    while True:
        items, revision = await store.get_prefix(key)
        if key in items:
            return
        async for _ in store.watch_prefix(key, start_revision=revision + 1):
            break
