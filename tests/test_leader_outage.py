"""The real leader (``run_elections``, in-process) against a real etcd, with simulated replicas:
an etcd outage that lapses every lease is not a host failure, a member's stale lease
confirms a peer's report of a failed collective at once, and a member taken out stays out
until it comes back as a new generation, also when its lease expired meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time
from typing import AsyncIterator, Callable

import pytest

from controller.leader import LeaderConfig, run_elections
from ftsystem.control import keys
from ftsystem.control.etcd_server import EmbeddedEtcd
from ftsystem.control.membership import Epoch, Registration, ReplicaState
from ftsystem.control.store import LeaseLostError, Store

RENEW_S = 0.5  # as the agents renew the replica lease


class SimReplica:
    """What an agent and its replica's rank 0 do in etcd: a lease renewed every 0.5 s and the
    registration bound to it; after an outage took the lease, a new lease and the registration
    again (the same generation, or the next one when the replica died meanwhile)."""

    def __init__(self, url: str, job: str, rid: str, ttl_s: int) -> None:
        self.store, self.job, self.rid, self.ttl_s = Store(url), job, rid, ttl_s
        self.registration = Registration(replica_id=rid, state=ReplicaState.MEMBER,
                                         generation=0, store_addr=f"127.0.0.1:{rid}")
        self.renewing = True
        self.died_in_outage = False
        self.lapses = 0
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.store.connect()
        await self._register_on_new_lease()
        self._task = asyncio.create_task(self._renew_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.store.close()

    async def put(self, **changes) -> None:
        self.registration = dataclasses.replace(self.registration, **changes)
        await self.store.put(keys.replica(self.job, self.rid), self.registration.to_json(),
                             lease=self.registration.lease)

    async def _register_on_new_lease(self) -> None:
        lease = await self.store.grant(self.ttl_s)
        if self.died_in_outage and self.lapses:
            await self.put(lease=lease, generation=self.registration.generation + 1,
                           state=ReplicaState.READY)
        else:
            await self.put(lease=lease)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            if not self.renewing:
                continue
            try:
                await self.store.refresh(self.registration.lease)
            except LeaseLostError:
                self.lapses += 1
                await self._register_on_new_lease()


class EpochLog:
    """Every epoch the leader publishes, with when it was seen."""

    def __init__(self, store: Store, job: str) -> None:
        self.store, self.key = store, keys.epoch(job)
        self.seen: list[tuple[float, Epoch]] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        _, revision = await self.store.get_prefix(self.key)
        self._task = asyncio.create_task(self._follow(revision + 1))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _follow(self, start_revision: int) -> None:
        async for event in self.store.watch_prefix(self.key, start_revision=start_revision):
            if event.key == self.key and event.kind == "PUT":
                self.seen.append((time.monotonic(), Epoch.from_json(event.value)))
                self._changed.set()

    async def wait_for(self, wanted: Callable[[Epoch], bool], what: str,
                       timeout_s: float) -> tuple[float, Epoch]:
        deadline = time.monotonic() + timeout_s
        while True:
            for seen, epoch in self.seen:
                if wanted(epoch):
                    return seen, epoch
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no epoch with {what} within {timeout_s:.0f} s; "
                                     f"published: {[self._brief(e) for _, e in self.seen]}")
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))

    @staticmethod
    def _brief(epoch: Epoch) -> str:
        return f"{epoch.number} {epoch.reason} {dict(epoch.generations)}"


@contextlib.asynccontextmanager
async def running_leader(url: str, job: str, *, ttl_s: int, name: str) -> AsyncIterator[None]:
    store = Store(url)
    await store.connect()
    cfg = LeaderConfig(job=job, instance_id=f"{name}-{os.getpid()}", replica_lease_ttl_s=ttl_s)
    leader = asyncio.create_task(run_elections(store, cfg, asyncio.Event()))
    try:
        yield
    finally:
        leader.cancel()  # a clean stop: it revokes its lease, the leader key goes with it
        await asyncio.gather(leader, return_exceptions=True)
        await store.close()


@contextlib.asynccontextmanager
async def simulated_job(url: str, job: str, rids: str, *, ttl_s: int
                        ) -> AsyncIterator[tuple[dict[str, SimReplica], EpochLog, Store]]:
    """Simulated replicas registered, and a log of the epochs published."""
    store = Store(url)
    await store.connect()
    await store.put_json(keys.spec(job), {"replicas": len(rids), "min_replicas": 1})
    replicas = {rid: SimReplica(url, job, rid, ttl_s) for rid in rids}
    epochs = EpochLog(store, job)
    try:
        for replica in replicas.values():
            await replica.start()
        await epochs.start()
        yield replicas, epochs, store
    finally:
        for replica in replicas.values():
            await replica.stop()
        await epochs.stop()
        await store.close()


@contextlib.asynccontextmanager
async def job_with_leader(url: str, job: str, rids: str, *, ttl_s: int
                          ) -> AsyncIterator[tuple[dict[str, SimReplica], EpochLog, Store]]:
    """Simulated replicas, the real leader running, and the first epoch seen."""
    async with simulated_job(url, job, rids, ttl_s=ttl_s) as (replicas, epochs, store):
        async with running_leader(url, job, ttl_s=ttl_s, name="leader"):
            await epochs.wait_for(lambda e: set(e.members) == set(rids), "every replica", 30)
            yield replicas, epochs, store


@pytest.fixture
def own_etcd(tmp_path):
    """An etcd of this test alone: it is paused (SIGSTOP), which the session's must not be."""
    with EmbeddedEtcd(data_dir=tmp_path / "etcd") as server:
        yield server


def test_an_etcd_outage_that_lapses_every_lease_removes_nobody(own_etcd, job_id):
    asyncio.run(_outage(own_etcd, job_id))


async def _outage(etcd: EmbeddedEtcd, job: str) -> None:
    ttl = 2
    async with job_with_leader(etcd.url, job, "abc", ttl_s=ttl) as (replicas, epochs, store):
        _, first = epochs.seen[-1]
        replicas["c"].died_in_outage = True  # its agent restarts it once etcd is back
        os.kill(etcd.process.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(ttl + 2)  # the outage itself: every lease lapses
        finally:
            os.kill(etcd.process.pid, signal.SIGCONT)
        resumed = time.monotonic()
        _, replaced = await epochs.wait_for(lambda e: e.generations.get("c") == 1,
                                            "c's new generation", 60)
        # Past the grace (TTL + 2 s) nothing is removed either: a and b registered again.
        grace_over = resumed + ttl + 2 + 2
        while time.monotonic() < grace_over:
            await asyncio.sleep(0.25)
        assert all(r.lapses >= 1 for r in replicas.values()), "no lease lapsed"
        after = [e for _, e in epochs.seen if e.number > first.number]
        assert after, "no epoch after the outage"
        for epoch in after:
            assert {"a", "b"} <= set(epoch.members), EpochLog._brief(epoch)
            assert epoch.generations["a"] == 0 and epoch.generations["b"] == 0
        assert set(replaced.members) == {"a", "b", "c"}
        assert after[-1].generations == {"a": 0, "b": 0, "c": 1}
        items, _ = await store.get_prefix(keys.replicas(job))
        assert len(items) == 3


def test_a_stale_lease_confirms_a_reported_failure_at_once(etcd, job_id):
    asyncio.run(_stale(etcd, job_id))


async def _stale(etcd: EmbeddedEtcd, job: str) -> None:
    ttl = 10
    async with job_with_leader(etcd.url, job, "abc", ttl_s=ttl) as (replicas, epochs, store):
        _, first = epochs.seen[-1]
        dead = replicas["b"]
        dead.renewing = False  # its host died with its agent: nobody revokes its lease
        reported = time.monotonic()
        await replicas["a"].put(resync_after=first.number)
        seen, removal = await epochs.wait_for(lambda e: "b" not in e.members,
                                              "b removed", 3 * ttl)
        # The removal came from the stale lease, not from its expiry: it still exists.
        assert await store.lease_ttl(dead.registration.lease) is not None
        assert removal.members == ("a", "c") and removal.reason == "removal"
        assert seen - reported < ttl / 2, f"removed {seen - reported:.1f} s after the report"
        # b's registration (of the stale generation) does not bring it back on a join tick.
        await asyncio.sleep(1.0)
        assert all("b" not in e.members for _, e in epochs.seen if e.number >= removal.number)


def test_a_new_leader_holds_the_members_it_finds_unregistered(etcd, job_id):
    asyncio.run(_takeover(etcd, job_id))


async def _takeover(etcd: EmbeddedEtcd, job: str) -> None:
    ttl = 2
    grace = ttl + 2
    async with simulated_job(etcd.url, job, "abc", ttl_s=ttl) as (replicas, epochs, store):
        async with running_leader(etcd.url, job, ttl_s=ttl, name="first"):
            _, first = await epochs.wait_for(lambda e: len(e.members) == 3, "every replica", 30)
        # No leader now; a and b lapse (as in an outage that also took the leader's lease):
        # a's agent registers it again soon after, b's host is gone.
        for rid in "ab":
            replicas[rid].renewing = False
            await store.revoke(replicas[rid].registration.lease)
        began = time.monotonic()
        async with running_leader(etcd.url, job, ttl_s=ttl, name="second"):
            await asyncio.sleep(0.5)
            replicas["a"].renewing = True  # finds its lease gone: a new one, the same generation
            seen, removal = await epochs.wait_for(lambda e: "b" not in e.members,
                                                  "b removed", 30)
        assert seen - began >= grace, f"b removed {seen - began:.1f} s after the takeover"
        assert removal.members == ("a", "c") and removal.generations == {"a": 0, "c": 0}
        for _, epoch in epochs.seen:
            assert epoch.members and "a" in epoch.members, EpochLog._brief(epoch)


def test_a_member_named_late_stays_out_when_its_lease_expires_and_comes_back(etcd, job_id):
    asyncio.run(_late_then_lapsed(etcd, job_id))


async def _late_then_lapsed(etcd: EmbeddedEtcd, job: str) -> None:
    """Seen in ``bench ettr``: a partitioned member, named late and removed, had its lease
    expire; back online, its agent registered it again (same generation) and the leader let
    it join, holding the survivors in an epoch with a member that was about to exit."""
    ttl = 10
    async with job_with_leader(etcd.url, job, "abc", ttl_s=ttl) as (replicas, epochs, store):
        _, first = epochs.seen[-1]
        cut = replicas["b"]
        await replicas["a"].put(resync_after=first.number, late=("b",))
        _, removal = await epochs.wait_for(lambda e: "b" not in e.members, "b removed", ttl)
        old_lease = cut.registration.lease
        await store.revoke(old_lease)  # expired while cut off: its registration goes with it
        deadline = time.monotonic() + 30
        while cut.registration.lease == old_lease:  # its agent's next renewal replaces it
            assert time.monotonic() < deadline, "b was not registered again"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # join ticks
        assert all("b" not in e.members for _, e in epochs.seen if e.number >= removal.number)
        # Restarted by its agent (a new generation), it joins again.
        await cut.put(generation=1, state=ReplicaState.READY)
        await epochs.wait_for(lambda e: e.generations.get("b") == 1, "b's new generation", 30)


def test_a_leader_cancelled_while_registrations_stream_in_stops(etcd, job_id):
    """The leader's decision loop ends when cancelled (a lost lease, a stop) even as an event
    arrives at that moment; Python 3.11's ``asyncio.wait_for`` returned the event then and
    dropped the cancellation, and a deposed leader went on deciding."""
    async def scenario() -> int:
        async with Store(etcd.url) as store:
            await store.put_json(keys.spec(job_id), {"replicas": 2, "min_replicas": 1})
            flooding = True

            async def flood() -> None:  # a registration rewritten as fast as etcd takes it
                reg = Registration(replica_id="r0", state=ReplicaState.READY, generation=0)
                while flooding:
                    await store.put(keys.replica(job_id, "r0"), reg.to_json())
            writer = asyncio.create_task(flood())
            try:
                for attempt in range(60):
                    cfg = LeaderConfig(job=job_id, instance_id=f"t{attempt}")
                    leading = asyncio.Event()
                    leader = asyncio.create_task(run_elections(store, cfg, leading))
                    await asyncio.wait_for(leading.wait(), 10)
                    await asyncio.sleep(attempt % 10 * 0.003)
                    leader.cancel()
                    done, _ = await asyncio.wait({leader}, timeout=5)
                    if not done:
                        return attempt
                return -1
            finally:
                flooding = False
                await asyncio.gather(writer, return_exceptions=True)
    assert asyncio.run(scenario()) == -1, "a cancelled leader went on deciding"
