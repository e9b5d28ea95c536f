"""An agent's hold on its node rank: ``agents/<replica>/<node rank>`` on the agent's own lease.

Created only if absent, so two agents never hold one rank. The lease is a node lease in the
Kubernetes sense (``NODE_LEASE_TTL_S``, renewed every ``NODE_LEASE_RENEW_S``): the only steady
etcd traffic a node adds is one keep-alive per 10 s, and no writes. If an etcd outage outlives
the lease, the record is written again, but only if the rank is still free: a spare may have
taken it meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ftsystem.control import keys
from ftsystem.control.store import LeaseLostError, Store, StoreError
from ftsystem.control.timeouts import NODE_LEASE_RENEW_S, NODE_LEASE_TTL_S

from agent.rendezvous import Rendezvous, RendezvousError

log = logging.getLogger(__name__)


class SlotTaken(RendezvousError):
    """Another machine's agent holds the node rank."""


class NodeSlot:
    def __init__(self, store: Store, rendezvous: Rendezvous, record: dict, *,
                 ttl_s: int = NODE_LEASE_TTL_S, renew_s: float = NODE_LEASE_RENEW_S) -> None:
        self.store, self.rendezvous = store, rendezvous
        self.ttl_s, self.renew_s = ttl_s, renew_s
        self.record = record
        """What the record says about this agent: uid, node_id, host, pid, pulse address."""
        self.node_rank: int | None = None
        self.lease = 0

    @property
    def key(self) -> str:
        return keys.agent(self.rendezvous.job, self.rendezvous.replica_id, self.node_rank)

    async def claim(self, node_rank: int) -> None:
        """Hold ``node_rank``; a previous incarnation of this machine's agent is displaced,
        another machine's agent is an error (:class:`SlotTaken`)."""
        for _ in range(5):
            holder = await self._try(node_rank)
            if holder is None:
                return
            if holder.get("node_id") != self.record["node_id"]:
                raise SlotTaken(
                    f"node rank {node_rank} of replica {self.rendezvous.replica_id} is held by "
                    f"another agent (node id {holder.get('node_id')!r}, host "
                    f"{holder.get('host')}, pid {holder.get('pid')}): give each node its own "
                    "--node-rank, or start this agent with --spare")
            log.info("node rank %d: displacing the previous agent of this node (pid %s)",
                     node_rank, holder.get("pid"))
            if holder.get("lease"):
                await self.store.revoke(int(holder["lease"]))
        raise RendezvousError(f"could not take node rank {node_rank}: it changed hands "
                              "five times while trying")

    async def claim_free(self) -> int:
        """A spare: once the replica has run, wait for a node rank that nobody holds, and
        hold it."""
        spare_key = keys.spare_agent(self.rendezvous.job, self.rendezvous.replica_id,
                                     self.record["uid"])
        lease = await self.store.grant(self.ttl_s)
        await self.store.put_json(spare_key, self.record, lease=lease)
        keep_alive = asyncio.create_task(self.store.keep_alive(lease, self.ttl_s, self.renew_s))
        log.info("spare of replica %s: waiting for a node rank to fall free",
                 self.rendezvous.replica_id)
        try:
            # A spare stands in for a node that was there and is gone, never for one that is
            # still starting: it waits for the replica's first generation.
            await self.rendezvous.wait_started()
            while True:
                held, revision = await self.rendezvous.holders()
                for rank in range(self.rendezvous.layout.nodes):
                    if rank not in held and await self._try(rank) is None:
                        log.info("spare takes node rank %d", rank)
                        return rank
                prefix = keys.replica_agents(self.rendezvous.job, self.rendezvous.replica_id)
                async for _ in self.store.watch_prefix(prefix, start_revision=revision + 1):
                    break
        finally:
            keep_alive.cancel()
            await asyncio.shield(self._revoke(lease))

    async def _try(self, node_rank: int) -> dict[str, Any] | None:
        """Take ``node_rank`` if free; None when taken, else its holder's record."""
        lease = await self.store.grant(self.ttl_s)
        key = keys.agent(self.rendezvous.job, self.rendezvous.replica_id, node_rank)
        value = json.dumps(self.record | {"lease": lease, "node_rank": node_rank})
        while True:
            if await self.store.put_if_absent(key, value, lease=lease):
                break
            holder = await self.store.get_json(key)
            if holder is None:
                continue  # freed between the put and the read: try again
            if holder.get("uid") == self.record["uid"] and holder.get("lease") == lease:
                # Our own put, applied before a reconnect made the store retry it: we hold it.
                break
            await self._revoke(lease)
            return holder
        self.node_rank, self.lease = node_rank, lease
        return None

    async def hold(self) -> None:
        """Keep the rank until cancelled; raises :class:`SlotTaken` if an outage outlived the
        lease and another agent took the rank meanwhile."""
        while True:
            try:
                await self.store.keep_alive(self.lease, self.ttl_s, self.renew_s)
            except LeaseLostError:
                log.warning("node rank %d: lease lost (etcd outage); taking it again",
                            self.node_rank)
                holder = await self._try(self.node_rank)
                if holder is not None and holder.get("uid") != self.record["uid"]:
                    raise SlotTaken(f"node rank {self.node_rank} was taken by agent "
                                    f"{holder.get('uid')} while this one was cut off")

    async def release(self) -> None:
        if self.lease:
            await self._revoke(self.lease)
            self.lease = 0

    async def _revoke(self, lease: int) -> None:
        try:
            await self.store.revoke(lease)
        except StoreError:
            pass  # it expires by itself
