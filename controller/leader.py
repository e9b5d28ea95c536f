"""Leader election and the leader's membership loop.

Several controller instances may run; the one holding ``controller/leader`` (bound to its lease)
decides. The others wait for the key to disappear and campaign again. The leader writes epochs in
a transaction guarded by its leadership, so a deposed leader cannot publish. Replicas keep
stepping in their current epoch while no leader exists.

Two rules keep an etcd outage from looking like host failures, and make a dead host's removal
fast (both decided in ``ftsystem.control.membership``): registrations that vanish together, or that a
new leader finds missing, are held for a grace instead of removed (``held_members``); and when a
member reports a failed collective, its peers' lease renewals are checked, so a host that died
with its agent is removed in about a second instead of a lease TTL (``stale_members``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from ftsystem.control import keys
from ftsystem.control.jobs import JobSpec, JobSpecError, parse_spec
from ftsystem.control.records import RecordError, report_malformed, well_formed

from ftsystem.measure import metrics
from ftsystem.measure.ettr import LiveEttr
from ftsystem.control.membership import (CONFIRM_S, Epoch, LapseRule, LeaseReading,
                                 Registration, ReplicaState, assign_donors, decide,
                                 held_members, late_members, stale_members)
from ftsystem.training.runtime import DEFAULT_TIMEOUT_S
from ftsystem.control.store import Store, StoreError
from ftsystem.control.timeouts import Timeouts

log = logging.getLogger(__name__)

LEADER_RENEW_S = 0.25
"""The leader renews its lease this often, not every third of its TTL: when its lease is found
lapsed anyway, etcd (or this process) was stuck for over a second, not a renewal merely late."""
CONFIRM_POLL_S = 0.25
"""Members' leases are read this often during a confirmation window (``CONFIRM_S``)."""
_RECHECK = object()
"""Queued after each reading of the members' leases: decide again."""


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
    """The first epoch waits this long, from the spec's creation, for its number of replicas."""
    address: str = ""
    """host:port this instance serves at, published for discovery (empty: not published)."""
    replica_lease_ttl_s: int | None = None
    """The replicas' lease TTL: members that vanish in a mass lapse are held for it + 2 s.
    None: derived from the job spec's timeout, as the agents derive theirs."""


def lapse_rule(cfg: LeaderConfig, spec: JobSpec | None) -> LapseRule:
    """The rule for lapsed members, from the replicas' lease TTL: the configured one, else the
    one the agents derive from the spec's timeout (the default before a spec is read)."""
    ttl = cfg.replica_lease_ttl_s or Timeouts(spec.timeout_s if spec else DEFAULT_TIMEOUT_S
                                              ).lease_ttl_s
    return LapseRule.for_lease_ttl(ttl)


NUM_EPOCHS_KEPT = 50
"""Epochs a term remembers for its status (the epoch timeline)."""


@dataclass(frozen=True, slots=True)
class EpochMark:
    """An epoch as the timeline shows it: not its members, which may be thousands."""

    number: int
    time: float
    num_members: int
    reason: str
    paused: bool

    @classmethod
    def of(cls, epoch: Epoch) -> "EpochMark":
        return cls(number=epoch.number, time=epoch.time, num_members=len(epoch.members),
                   reason=epoch.reason, paused=epoch.paused)


@dataclass(slots=True)
class LiveTerm:
    """What this instance measures while it leads, for its status (the page, ``GET
    /v1/jobs/{job}/status``); empty while it does not (a standby names the leader instead)."""

    ettr: LiveEttr | None = None
    epochs: deque[EpochMark] = field(default_factory=lambda: deque(maxlen=NUM_EPOCHS_KEPT))
    """The epochs this term found or published, oldest first."""

    def begin(self, num_replicas: int, epoch: Epoch | None) -> LiveEttr:
        """A term starts measuring, from the epoch it found (if any)."""
        self.ettr = LiveEttr(num_replicas=num_replicas)
        self.epochs.clear()
        if epoch is not None:
            self.record(epoch)
        return self.ettr

    def record(self, epoch: Epoch) -> None:
        self.epochs.append(EpochMark.of(epoch))

    def end(self) -> None:
        self.ettr = None
        self.epochs.clear()


class JobDeletedError(StoreError):
    """The job's spec was deleted under the leader: its term ends, and the next one waits for
    a new spec, with nothing of the deleted job in memory."""


def spec_or_none(job: str, raw: bytes | None) -> JobSpec | None:
    """The stored spec, or None (logged) when it is malformed."""
    if raw is None:
        return None
    try:
        return parse_spec(json.loads(raw))
    except (JobSpecError, ValueError) as e:
        log.error("job %s: the stored spec is unusable (%s): fix it (ftsystem job delete, then "
                  "create)", job, e)
        return None


async def read_epoch(store: Store, job: str) -> Epoch | None:
    """The published epoch. A malformed one cannot be built on (the next epoch's number must
    exceed it): the leader says so and waits until the record is fixed or deleted."""
    key = keys.epoch(job)
    said = False
    while True:
        items, revision = await store.get_prefix(key)
        if key not in items:
            return None
        try:
            return Epoch.from_json(items[key])
        except RecordError as e:
            if not said:
                report_malformed(key, e)
                log.error("job %s: the epoch record %s is malformed, so no next epoch can be "
                          "numbered after it and the job cannot reconfigure: restart the job "
                          "from its last checkpoint (ftsystem job delete, then create)",
                          job, key)
                said = True
        async for _ in store.watch_prefix(key, start_revision=revision + 1):
            break  # it changed: read it again


async def wait_for_spec(store: Store, job: str) -> tuple[JobSpec, int]:
    """Block until the job has a valid spec; returns it and the revision it was read at.
    Woken by a watch on the spec key; says once that it waits."""
    key = keys.spec(job)
    said = False
    while True:
        items, revision = await store.get_prefix(key)
        if (spec := spec_or_none(job, items.get(key))) is not None:
            return spec, revision
        if not said and key not in items:
            log.info("job %s has no spec: no epoch before it exists (ftsystem job create %s, "
                     "or POST /v1/jobs/%s)", job, job, job)
            said = True
        async for _ in store.watch_prefix(key, start_revision=revision + 1):
            break  # it changed: read it again


async def run_elections(store: Store, cfg: LeaderConfig, is_leader: asyncio.Event,
                        term: LiveTerm | None = None) -> None:
    """Campaign, lead until the lease is lost, campaign again; forever, across etcd outages."""
    term = term if term is not None else LiveTerm()
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
            await _lead_while_leased(store, cfg, lease, term)
        except StoreError as e:
            log.warning("controller %s lost leadership: %s", cfg.instance_id, e)
        finally:
            is_leader.clear()
            term.end()
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


async def _lead_while_leased(store: Store, cfg: LeaderConfig, lease: int,
                             term: LiveTerm) -> None:
    keep_alive = asyncio.create_task(
        store.keep_alive(lease, cfg.lease_ttl_s, every_s=LEADER_RENEW_S))
    lead = asyncio.create_task(MembershipLoop(store, cfg, lease, term).run())
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

    def __init__(self, store: Store, cfg: LeaderConfig, lease: int,
                 term: LiveTerm | None = None) -> None:
        self.store, self.cfg, self.lease = store, cfg, lease
        self.term = term if term is not None else LiveTerm()
        self.registrations: dict[str, Registration] = {}
        self.assignments: dict[str, str | None] = {}
        self.epoch: Epoch | None = None
        self.started = time.monotonic()
        self.rule = lapse_rule(cfg, None)
        self.vanished: dict[str, float] = {}
        """Members whose registration is gone, and since when (see ``held_members``)."""
        self.suspected_at: list[float] = []
        """When the control plane was suspected: this term took over an epoch, or found its
        own lease lapsed."""
        self.held: frozenset[str] = frozenset()
        self.evicted: dict[str, int] = {}
        """Members removed for a stale lease, and the generation that was stale."""
        self.readings: dict[str, LeaseReading] = {}
        self.reported_at: float | None = None
        """When a member last reported a failed collective (``resync_after``)."""
        self.queue: asyncio.Queue = asyncio.Queue()
        self._confirming: asyncio.Task | None = None

    async def run(self) -> None:
        spec, spec_revision = await wait_for_spec(self.store, self.cfg.job)
        self.policy, self.rule = spec.policy, lapse_rule(self.cfg, spec)
        self.started = time.monotonic()  # the start timeout runs from the spec's arrival
        self.epoch = await read_epoch(self.store, self.cfg.job)
        items, revision = await self.store.get_prefix(keys.replicas(self.cfg.job))
        self.registrations = {keys.last_segment(k): reg for k, reg in
                              well_formed(items, Registration.from_json).items()}
        if self.epoch is not None:
            # A takeover may follow an outage that also took the previous leader's lease
            # (perhaps this instance's): members missing now, or whose lapsed leases etcd is
            # still revoking, are held; an empty epoch is never published for it.
            self.suspected_at.append(self.started)
            self.vanished = {m: self.started for m in self.epoch.members
                             if m not in self.registrations}
        # ETTR from the moment this instance leads (a new leader starts its own count),
        # against the job's capacity: every replica of the spec.
        self.ettr = self.term.begin(spec.replicas, self.epoch)
        watchers = [asyncio.create_task(self._watch(keys.replicas(self.cfg.job), revision + 1)),
                    asyncio.create_task(self._watch(keys.spec(self.cfg.job), spec_revision + 1))]
        try:
            await self._decide_forever()
        finally:
            for task in (*watchers, self._confirming):
                if task is not None:
                    task.cancel()

    async def _watch(self, prefix: str, start_revision: int) -> None:
        async for event in self.store.watch_prefix(prefix, start_revision=start_revision):
            await self.queue.put(event)
        raise StoreError(f"watch of {prefix} ended")

    async def _decide_forever(self) -> None:
        queue = self.queue
        next_tick = time.monotonic()
        while True:
            timeout = max(0.0, next_tick - time.monotonic())
            try:
                # Not wait_for: in Python 3.11 it can drop a cancellation (CPython gh-86296).
                async with asyncio.timeout(timeout):
                    event = await queue.get()
            except TimeoutError:
                next_tick = time.monotonic() + self.cfg.join_tick_s
                await self._decide(join_tick=True, seen=time.monotonic())
                continue
            seen = time.monotonic()
            self._apply(event)
            while not queue.empty():  # fold a burst of events into one decision
                self._apply(queue.get_nowait())
            await self._decide(join_tick=False, seen=seen)

    def _apply(self, event) -> None:
        if event is _RECHECK:
            return
        if event.key == keys.spec(self.cfg.job):
            return self._apply_spec(event)
        rid = keys.last_segment(event.key)
        if event.kind == "DELETE":
            self.registrations.pop(rid, None)
            # The eviction outlives the registration: a member cut off (named late, then its
            # lease expired) is registered again by its agent on a new lease, of the same
            # generation, once its link is back; it rejoins only as a new generation.
            self.ettr.forget(rid)
            if self.epoch is not None and rid in self.epoch.members:
                self.vanished[rid] = time.monotonic()
        else:
            try:
                reg = Registration.from_json(event.value)
            except RecordError as e:  # as good as no registration: it says nothing usable
                report_malformed(event.key, e)
                self.registrations.pop(rid, None)
                return
            self.registrations[rid] = reg
            self.vanished.pop(rid, None)
            if self.evicted.get(rid, reg.generation) != reg.generation:
                del self.evicted[rid]  # a new generation is judged afresh
            self.ettr.observe(rid, reg.step, reg.state == ReplicaState.MEMBER, time.time())

    def _apply_spec(self, event) -> None:
        if event.kind == "DELETE":
            raise JobDeletedError(f"job {self.cfg.job} was deleted: this term ends")
        if (spec := spec_or_none(self.cfg.job, event.value)) is not None:
            self.policy = spec.policy  # the next decision follows the new spec
            self.rule = lapse_rule(self.cfg, spec)
            self.ettr.num_replicas = spec.replicas

    async def _decide(self, *, join_tick: bool, seen: float) -> None:
        now = time.monotonic()
        self._note_report(now)
        nxt = self._next_epoch(join_tick, now)
        if nxt is not None and self._drops_unregistered(nxt) and await self._own_lease_lapsed():
            # etcd revokes expired leases in any order: the replicas' may go before this
            # leader's key does, which would still let it publish their removal.
            log.warning("this leader's lease lapsed too: etcd was unreachable, not the replicas")
            self.suspected_at.append(now)
            nxt = self._next_epoch(join_tick, now)
        if nxt is not None:
            await self._publish(nxt, seen)
        await self._assign_donors()
        self._export_ettr()

    def _next_epoch(self, join_tick: bool, now: float) -> Epoch | None:
        self._hold(now)
        self._evict_stale()
        self._evict_late()
        return decide(self.epoch, self.registrations, self.policy, join_tick=join_tick,
                      start_deadline_passed=now - self.started > self.cfg.start_timeout_s,
                      held=self.held, evicted=self.evicted)

    # --- a control-plane outage is not a host failure ----------------------------------------

    def _hold(self, now: float) -> None:
        horizon = self.rule.grace_s + self.rule.window_s
        self.vanished = {m: t for m, t in self.vanished.items() if now - t < horizon}
        self.suspected_at = [t for t in self.suspected_at if now - t < horizon]
        held = held_members(self.vanished, self.epoch.members if self.epoch else (),
                            suspected_at=self.suspected_at, now=now, rule=self.rule)
        if held - self.held:
            log.warning("holding %s: registrations gone together (an etcd outage?); removed "
                        "unless registered again within %.0f s",
                        ",".join(sorted(held - self.held)), self.rule.grace_s)
        self.held = held

    def _drops_unregistered(self, nxt: Epoch) -> bool:
        return self.epoch is not None and any(
            m not in nxt.members and m not in self.registrations for m in self.epoch.members)

    async def _own_lease_lapsed(self) -> bool:
        """Asked before removing a member whose registration vanished. The leader renews its
        lease every LEADER_RENEW_S: gone, or not renewed for over a second, means etcd was
        unreachable, and the replicas' leases lapsed with it. (If this term is over, the next
        publication or renewal says so.)"""
        ttl = await self.store.lease_ttl(self.lease)
        return ttl is None or LeaseReading(lease=self.lease, remaining=ttl[0], granted=ttl[1],
                                           at=time.monotonic()).stale

    # --- a data-plane failure confirmed by the control plane ---------------------------------

    def _note_report(self, now: float) -> None:
        """A member reported a failed collective: read every member's lease for a while."""
        epoch = self.epoch
        if epoch is None or not any(self.registrations[m].resync_after >= epoch.number
                                    for m in epoch.members if m in self.registrations):
            return
        self.reported_at = now
        if self._confirming is None or self._confirming.done():
            self._confirming = asyncio.create_task(self._confirm())

    async def _confirm(self) -> None:
        while time.monotonic() < self.reported_at + CONFIRM_S:
            await self._read_leases()
            await self.queue.put(_RECHECK)
            await asyncio.sleep(CONFIRM_POLL_S)

    async def _read_leases(self) -> None:
        members = self.epoch.members if self.epoch else ()
        leases = {m: self.registrations[m].lease for m in members
                  if m in self.registrations and self.registrations[m].lease}
        at = time.monotonic()
        try:
            ttls = await asyncio.gather(*map(self.store.lease_ttl, leases.values()))
        except StoreError as e:  # only an accelerator: lease expiry still removes a dead host
            log.warning("members' leases not read: %s", e)
            return
        for (member, lease), ttl in zip(leases.items(), ttls):
            if ttl is None:  # gone: its registration goes with it
                self.readings.pop(member, None)
            else:
                self.readings[member] = LeaseReading(lease=lease, remaining=ttl[0],
                                                     granted=ttl[1], at=at)

    def _evict_stale(self) -> None:
        if self.reported_at is None or self.epoch is None:
            return
        stale = stale_members(self.registrations, self.epoch.members, self.readings,
                              reported_at=self.reported_at, lapse_suspected=bool(self.held))
        for member in stale - set(self.evicted):
            self.evicted[member] = self.registrations[member].generation
            reading = self.readings[member]
            log.warning("removing %s: a peer's collective failed and its lease has not been "
                        "renewed for over a second (%d of %d s left)", member,
                        reading.remaining, reading.granted)

    def _evict_late(self) -> None:
        for member in late_members(self.epoch, self.registrations) - set(self.evicted):
            if member not in self.registrations:
                continue  # gone anyway
            self.evicted[member] = self.registrations[member].generation
            reporters = sorted(m for m, r in self.registrations.items() if member in r.late)
            log.warning("removing %s: named at the all-reduce of epoch %d, silent (its beats "
                        "stood still) or late past the straggler bound (reported by %s)",
                        member, self.epoch.number, ",".join(reporters))

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
            if await self.store.get(keys.spec(self.cfg.job)) is None:
                raise JobDeletedError(f"job {self.cfg.job} was deleted: this term ends")
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
        self.term.record(nxt)
