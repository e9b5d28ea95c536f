"""An agent's hold on its node rank (``agent/slot.py``) against a real etcd."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from agent.slot import NodeSlot
from ftsystem.control import keys
from ftsystem.control.store import Store


class PutRetriedAfterReconnect(Store):
    """The store's retry of a transaction whose first attempt was applied but whose answer was
    lost with the connection: the retry finds the key present and reports failure."""

    async def put_if_absent(self, key, value, *, lease=None) -> bool:
        await super().put_if_absent(key, value, lease=lease)
        return False


def _slot(store: Store, job: str, uid: str, node_id: str) -> NodeSlot:
    rendezvous = SimpleNamespace(job=job, replica_id="r0")
    return NodeSlot(store, rendezvous, {"uid": uid, "node_id": node_id, "pid": 1})


def test_a_rank_is_taken_once_and_our_own_retried_put_counts_as_ours(etcd, job_id):
    async def scenario():
        async with Store(etcd.url) as store, \
                PutRetriedAfterReconnect(etcd.url) as retrying:
            first = _slot(store, job_id, "a1", "host-a")
            assert await first._try(0) is None and first.lease
            # Another machine's agent finds it held, and its own lease is given back.
            other = _slot(store, job_id, "b1", "host-b")
            holder = await other._try(0)
            assert holder["uid"] == "a1" and other.lease == 0
            # Our put went through, then the retry said "present": the rank is ours, and the
            # lease it was written with stays (revoking it would delete our own record).
            mine = _slot(retrying, job_id, "c1", "host-c")
            assert await mine._try(1) is None and mine.node_rank == 1
            record = await store.get_json(keys.agent(job_id, "r0", 1))
            assert record["uid"] == "c1" and record["lease"] == mine.lease
            assert await store.lease_ttl(mine.lease) is not None
    asyncio.run(scenario())
