"""Leader election and the leader's membership loop.

Several controller instances may run; the one holding ``controller/leader`` (bound to its lease)
decides. The others wait for the key to disappear and campaign again. The leader writes epochs in
a transaction guarded by its leadership, so a deposed leader cannot publish. Replicas keep
stepping in their current epoch while no leader exists.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from ftsystem import keys, metrics
from ftsystem.ettr import LiveEttr
from ftsystem.membership import (Epoch, Policy, Registration, ReplicaState, assign_donors,
                                 decide)
from ftsystem.store import Store, StoreError

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class LeaderConfig:
    job: str
    """The job this controller manages."""
    instance_id: str
    """Unique name of this controller instance (the leader key's value)."""
    lease_ttl_s: int = 2
    """Leader lease TTL: how long a crashed leader blocks a successor, at most."""
    join_tick_s: float = 0.25
    """Joins are batched on this tick."""
    start_timeout_s: float = 60.0
    """The first epoch waits this long for the spec's number of replicas."""
    min_replicas: int = 1
    """Used when the job has no spec in etcd."""
    address: str = ""
    """host:port this instance serves at, published for discovery (empty: not published)."""


async def read_policy(store: Store, cfg: LeaderConfig) -> Policy:
    spec = await store.get_json(keys.spec(cfg.job)) or {}
    min_replicas = int(spec.get("min_replicas", cfg.min_replicas))
    return Policy(min_replicas=min_replicas,
                  initial_replicas=int(spec.get("replicas", min_replicas)))


async def run_elections(store: Store, cfg: LeaderConfig, is_leader: asyncio.Event) -> None:
    """Campaign, lead until the lease is lost, campaign again; forever, across etcd outages."""
    while True:
        try:
            lease = await campaign(store, cfg)
        except StoreError as e:
            log.warning("controller %s cannot campaign: %s", cfg.instance_id, e)
            await asyncio.sleep(1.0)
            continue
        log.info("controller %s leads job %s", cfg.instance_id, cfg.job)
        is_leader.set()
        metrics.IS_LEADER.labels(cfg.job).set(1)
        try:
            await _lead_while_leased(store, cfg, lease)
        except StoreError as e:
            log.warning("controller %s lost leadership: %s", cfg.instance_id, e)
        finally:
            is_leader.clear()
            metrics.IS_LEADER.labels(cfg.job).set(0)
            await _revoke_quietly(store, lease)


async def campaign(store: Store, cfg: LeaderConfig) -> int:
    """Block until this instance holds the leader key; returns the lease bound to it."""
    key = keys.leader(cfg.job)
    while True:
        lease = await store.grant(cfg.lease_ttl_s)
        if await store.put_if_absent(key, cfg.instance_id, lease=lease):
            return lease
        await store.revoke(lease)
        await _wait_deleted(store, key)


async def _wait_deleted(store: Store, key: str) -> None:
    items, revision = await store.get_prefix(key)
    if key not in items:
        return
    async for event in store.watch_prefix(key, start_revision=revision + 1):
        if event.key == key and event.kind == "DELETE":
            return


async def _lead_while_leased(store: Store, cfg: LeaderConfig, lease: int) -> None:
    keep_alive = asyncio.create_task(store.keep_alive(lease, cfg.lease_ttl_s))
    lead = asyncio.create_task(MembershipLoop(store, cfg, lease).run())
    try:
        done, _ = await asyncio.wait({keep_alive, lead}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # re-raise why leadership ended
    finally:
        for task in (keep_alive, lead):
            task.cancel()
        await asyncio.gather(keep_alive, lead, return_exceptions=True)


async def _revoke_quietly(store: Store, lease: int) -> None:
    try:
        await store.revoke(lease)
    except StoreError:
        pass  # the lease expires by itself


class MembershipLoop:
    """Follows registrations and publishes epochs as ``decide`` says."""

    def __init__(self, store: Store, cfg: LeaderConfig, lease: int) -> None:
        self.store, self.cfg, self.lease = store, cfg, lease
        self.registrations: dict[str, Registration] = {}
        self.assignments: dict[str, str | None] = {}
        self.epoch: Epoch | None = None
        self.started = time.monotonic()

    async def run(self) -> None:
        self.policy = await read_policy(self.store, self.cfg)
        raw = await self.store.get(keys.epoch(self.cfg.job))
        self.epoch = Epoch.from_json(raw) if raw else None
        items, revision = await self.store.get_prefix(keys.replicas(self.cfg.job))
        self.registrations = {keys.last_segment(k): Registration.from_json(v)
                              for k, v in items.items()}
        # ETTR from the moment this instance leads (a new leader starts its own count).
        self.ettr = LiveEttr(num_replicas=self.policy.initial_replicas)
        queue: asyncio.Queue = asyncio.Queue()
        watcher = asyncio.create_task(self._watch(revision + 1, queue))
        try:
            await self._decide_forever(queue)
        finally:
            watcher.cancel()

    async def _watch(self, start_revision: int, queue: asyncio.Queue) -> None:
        async for event in self.store.watch_prefix(keys.replicas(self.cfg.job),
                                                   start_revision=start_revision):
            await queue.put(event)
        raise StoreError("registration watch ended")

    async def _decide_forever(self, queue: asyncio.Queue) -> None:
        next_tick = time.monotonic()
        while True:
            timeout = max(0.0, next_tick - time.monotonic())
            try:
                event = await asyncio.wait_for(queue.get(), timeout)
            except asyncio.TimeoutError:
                next_tick = time.monotonic() + self.cfg.join_tick_s
                await self._decide(join_tick=True, seen=time.monotonic())
                continue
            seen = time.monotonic()
            self._apply(event)
            while not queue.empty():  # fold a burst of events into one decision
                self._apply(queue.get_nowait())
            await self._decide(join_tick=False, seen=seen)

    def _apply(self, event) -> None:
        rid = keys.last_segment(event.key)
        if event.kind == "DELETE":
            self.registrations.pop(rid, None)
            self.ettr.forget(rid)
        else:
            reg = self.registrations[rid] = Registration.from_json(event.value)
            self.ettr.observe(rid, reg.step, reg.state == ReplicaState.MEMBER, time.time())

    async def _decide(self, *, join_tick: bool, seen: float) -> None:
        if self.epoch is None:  # the spec may be written after the controller started
            self.policy = await read_policy(self.store, self.cfg)
        deadline_passed = time.monotonic() - self.started > self.cfg.start_timeout_s
        nxt = decide(self.epoch, self.registrations, self.policy, join_tick=join_tick,
                     start_deadline_passed=deadline_passed)
        if nxt is not None:
            await self._publish(nxt, seen)
        await self._assign_donors()
        self._export_ettr()

    def _export_ettr(self) -> None:
        for kind, value in self.ettr.values(time.time()).items():
            if value is not None:
                metrics.ETTR.labels(self.cfg.job, kind.removeprefix("ettr_")).set(value)

    async def _assign_donors(self) -> None:
        wanted = assign_donors(self.epoch, self.registrations, self.assignments)
        for joiner in set(self.assignments) - set(wanted):
            await self.store.delete(keys.catchup(self.cfg.job, joiner))
        for joiner, donor in wanted.items():
            if joiner in self.assignments and self.assignments[joiner] == donor:
                continue
            addr = self.registrations[donor].state_addr if donor else ""
            await self.store.put_json(keys.catchup(self.cfg.job, joiner),
                                      {"donor": donor, "state_addr": addr}, lease=self.lease)
            log.info("catch-up: %s <- %s", joiner, donor)
        self.assignments = wanted

    async def _publish(self, nxt: Epoch, seen: float) -> None:
        published = await self.store.put_if_equal(
            keys.leader(self.cfg.job), self.cfg.instance_id,
            keys.epoch(self.cfg.job), nxt.to_json())
        if not published:
            raise StoreError("leader key changed hands; stepping down")
        job = self.cfg.job
        metrics.DECISION_LATENCY.labels(job).observe(time.monotonic() - seen)
        metrics.MEMBERSHIP_CHANGES.labels(job, nxt.reason).inc()
        metrics.EPOCH.labels(job).set(nxt.number)
        metrics.EPOCH_MEMBERS.labels(job).set(len(nxt.members))
        before = set(self.epoch.members) if self.epoch else set()
        log.info("epoch %d (%s): %d members, -[%s] +[%s]%s", nxt.number, nxt.reason,
                 len(nxt.members), ",".join(sorted(before - set(nxt.members))),
                 ",".join(sorted(set(nxt.members) - before)), " PAUSED" if nxt.paused else "")
        self.epoch = nxt
