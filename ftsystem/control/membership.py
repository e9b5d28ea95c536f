"""Membership epochs and the pure decision function that produces them.

``decide(current, registrations, policy, join_tick=...)`` is the whole policy: no I/O, so it is
unit- and property-tested without etcd. The controller's leader calls it on every registration
change (removals take effect at once) and on a short tick (joins are batched, so a restart storm
does not become a reconfiguration storm).
"""

from __future__ import annotations

import json
import math
import time
from bisect import bisect_left, bisect_right
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Collection, Mapping

from ftsystem.control.records import decoder


class ReplicaState(StrEnum):
    STARTING = "starting"        # the agent launched it; not yet able to train
    CATCHING_UP = "catching_up"  # loading state from a donor; not a member
    READY = "ready"              # can join at the next epoch
    MEMBER = "member"            # trains in the current epoch
    DONE = "done"                # reached the last step; stays to serve late joiners


ELIGIBLE = frozenset({ReplicaState.READY, ReplicaState.MEMBER, ReplicaState.DONE})


@dataclass(frozen=True, kw_only=True, slots=True)
class Registration:
    """What a replica publishes under ``replicas/<id>``, bound to its lease."""

    replica_id: str
    state: ReplicaState
    generation: int
    step: int = 0
    host: str = ""
    store_addr: str = ""
    """host:port of the TCPStore this replica hosts (used for rendezvous when it leads an epoch)."""
    pid: int = 0
    metrics_addr: str = ""
    state_addr: str = ""
    """host:port of this replica's catch-up state server (snapshots and the update log)."""
    resync_after: int = 0
    """Set to an epoch number when a collective failed here without a membership change:
    asks the leader for a new epoch so that all members reconfigure and reconcile."""
    lease: int = 0
    """The replica lease this registration is bound to (0: unknown, an older writer)."""
    late: tuple[str, ...] = ()
    """With ``resync_after``: the members that had not arrived at this replica's all-reduce
    within the straggler bound (``ftsystem.control.timeouts.StragglerBound``); the leader takes them
    out of the epoch (:func:`late_members`)."""
    catchup: dict = field(default_factory=dict)
    """While ``catching_up``: how far (``bytes`` received, ``snapshot_received`` of
    ``snapshot_bytes`` of the snapshot in flight, ``steps_replayed``), updated at most every
    half second (the status page shows it)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: bytes | str) -> "Registration":
        """Raises :class:`~ftsystem.control.records.RecordError` for a malformed record."""
        return _decode_registration(data)


@dataclass(frozen=True, kw_only=True, slots=True)
class Epoch:
    """A membership epoch: who all-reduces together, in which order, and where they meet."""

    number: int
    members: tuple[str, ...]
    generations: Mapping[str, int] = field(default_factory=dict)
    store_addr: str = ""
    paused: bool = False
    reason: str = ""
    time: float = 0.0

    def rank_of(self, replica_id: str) -> int:
        return self.members.index(replica_id)

    def to_json(self) -> str:
        # Not dataclasses.asdict: its deep copy costs ~14 ms per epoch at 2,048 members.
        raw = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps({**raw, "members": list(self.members),
                           "generations": dict(self.generations)}, sort_keys=True)

    @classmethod
    def from_json(cls, data: bytes | str) -> "Epoch":
        """Raises :class:`~ftsystem.control.records.RecordError` for a malformed record."""
        return _decode_epoch(data)


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    min_replicas: int = 1
    """Below this many eligible replicas the job pauses instead of training on too few."""
    initial_replicas: int = 1
    """The first epoch waits for this many replicas (until the start deadline passes)."""


def decide(current: Epoch | None, registrations: Mapping[str, Registration], policy: Policy, *,
           join_tick: bool, start_deadline_passed: bool = True, now: float | None = None,
           held: Collection[str] = (), evicted: Mapping[str, int] | None = None
           ) -> Epoch | None:
    """The next epoch, or None when the current one stands.

    A member leaves when its registration is gone, no longer eligible, or of another
    generation (it restarted). Removals always produce a new epoch; joins only on a tick or
    together with a removal.

    ``held`` members stay although their registration is gone: a suspected control-plane
    outage, not their failure (:func:`held_members`). ``evicted`` maps members whose lease was
    found stale (:func:`stale_members`) to that registration's generation: it counts as gone, so
    the member neither stays nor joins again until it registers a new generation.
    """
    evicted = evicted or {}
    alive = {rid: reg for rid, reg in registrations.items()
             if reg.state in ELIGIBLE and evicted.get(rid) != reg.generation}
    now = time.time() if now is None else now
    if current is None:
        return _first_epoch(alive, policy, start_deadline_passed, now)
    kept = [m for m in current.members if _stays(m, current, alive, registrations, held)]
    removed = len(kept) < len(current.members)
    joiners = sorted(set(alive) - set(kept)) if (join_tick or removed) else []
    resync = any(alive[m].resync_after >= current.number for m in kept if m in alive)
    if not removed and not joiners and not resync:
        return None
    reason = "removal" if removed else "join" if joiners else "resync"
    return _make_epoch(current.number + 1, kept + joiners, alive, policy, reason, now, current)


def _stays(member: str, current: Epoch, alive: Mapping[str, Registration],
           registrations: Mapping[str, Registration], held: Collection[str]) -> bool:
    if member in alive:
        return alive[member].generation == current.generations.get(member)
    return member in held and member not in registrations


# --- a control-plane outage is not a host failure --------------------------------------------

@dataclass(frozen=True, kw_only=True, slots=True)
class LapseRule:
    """When vanished registrations point at the control plane rather than at the replicas.

    Modelled on Kubernetes' node lifecycle controller: when most nodes of a zone turn unhealthy
    at once, it suspects the network or itself rather than every node, and stops evicting. Here
    every lease lapses at once when etcd was unreachable for longer than the lease TTL (etcd
    revokes all expired leases when it comes back), although every replica still trains.
    """

    grace_s: float
    """How long a held member has to register again before it is removed."""
    window_s: float = 2.0
    """Registrations vanishing this close together vanished together (etcd revokes expired
    leases at up to 1,000/s, so a lapse of thousands spreads over seconds); and a member missing
    this soon after the leader began leading counts as part of a lapse."""

    @classmethod
    def for_lease_ttl(cls, lease_ttl_s: float) -> "LapseRule":
        """A live agent finds its lapsed lease at its next keep-alive (well within a TTL) and
        re-registers on a new one; the margin covers etcd's expiry granularity (0.5 s) and the
        re-registration itself."""
        return cls(grace_s=lease_ttl_s + 2)


def held_members(vanished: Mapping[str, float], members: Collection[str], *,
                 suspected_at: Collection[float], now: float, rule: LapseRule
                 ) -> frozenset[str]:
    """The members whose registration vanished but who stay in the epoch for now.

    ``vanished`` maps a member (of this or a recent epoch) to when the leader saw its
    registration gone. Such a member is held for ``rule.grace_s`` after it vanished when

    - at least half of the members, and at least 2, vanished within ``rule.window_s`` of it; or
    - it vanished within ``rule.window_s`` of a moment in ``suspected_at``: when the leader
      took over an existing epoch (it cannot tell an outage from failures: its predecessor, or
      its own previous term, may have lost its lease in that very outage; Kubernetes'
      controller, too, gives every node a full grace when it starts), or when it found its own
      lease lapsed.

    A member vanishing alone is not held: that is the fast path of an agent that revoked its
    replica's lease on a failure, and it must stay fast.
    """
    members = set(members)
    recent = {m: t for m, t in vanished.items() if now - t < rule.grace_s + rule.window_s}
    times = sorted(recent.values())
    threshold = max(2, math.ceil(len(members | set(recent)) / 2))

    def suspect(t: float) -> bool:
        together = bisect_right(times, t + rule.window_s) - bisect_left(times, t - rule.window_s)
        return together >= threshold or any(abs(t - s) <= rule.window_s for s in suspected_at)

    return frozenset(m for m, t in recent.items()
                     if m in members and now - t < rule.grace_s and suspect(t))


# --- a data-plane failure confirmed by the control plane -------------------------------------

STALE_AFTER_S = 1
"""Live agents renew the replica lease every 0.5 s: one not renewed for longer than this
belongs to a replica whose agent (or host) stopped."""
CONFIRM_S = 3.0
"""After a member reports a failed collective, its peers' leases are judged for this long."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseReading:
    """What etcd answered about a member's replica lease (LeaseTimeToLive)."""

    lease: int
    remaining: int
    """Seconds left, truncated to whole seconds as etcd reports it."""
    granted: int
    at: float
    """When it was asked (the leader's monotonic clock)."""

    @property
    def stale(self) -> bool:
        # Right after a renewal etcd reports granted - 1 (truncation); granted - 2 and below
        # means more than STALE_AFTER_S without one.
        return self.remaining <= self.granted - 1 - STALE_AFTER_S


def stale_members(registrations: Mapping[str, Registration], members: Collection[str],
                  readings: Mapping[str, LeaseReading], *, reported_at: float,
                  lapse_suspected: bool = False, confirm_s: float = CONFIRM_S
                  ) -> frozenset[str]:
    """Members to remove at once because, after a peer reported a failed collective at
    ``reported_at``, their lease went stale: a host that died with its agent (nobody revokes
    its lease) is removed in about a second instead of the lease's TTL.

    Judged are members whose registration names its lease (``lease != 0``) and whose reading,
    of that lease, was taken within ``confirm_s`` after the report. Nobody is removed while a
    mass lapse is suspected, nor when at least half of the judged members, and at least 2, look
    stale: stale leases then say more about the control plane than about the replicas.
    """
    if lapse_suspected:
        return frozenset()
    judged = {m: readings[m] for m in members
              if m in registrations and registrations[m].lease and m in readings
              and readings[m].lease == registrations[m].lease
              and reported_at <= readings[m].at <= reported_at + confirm_s}
    stale = frozenset(m for m, reading in judged.items() if reading.stale)
    if len(stale) >= 2 and 2 * len(stale) >= len(judged):
        return frozenset()
    return stale


def late_members(current: Epoch | None, registrations: Mapping[str, Registration]
                 ) -> frozenset[str]:
    """Members to take out of ``current`` because a member found them late at a step's
    all-reduce (it waited the straggler bound and they had not arrived): alive, but holding
    everyone back. A report counts in the epoch it was made in. Nobody is removed when at
    least half of the members, and at least 2, are named: a machine-wide slowdown, not
    stragglers. The named replicas rejoin after their agent restarts them (catch-up)."""
    if current is None:
        return frozenset()
    named = frozenset(
        late for m in current.members if m in registrations
        and registrations[m].resync_after >= current.number
        for late in registrations[m].late if late in current.members and late != m)
    if len(named) >= 2 and 2 * len(named) >= len(current.members):
        return frozenset()
    return named


def assign_donors(epoch: Epoch | None, registrations: Mapping[str, Registration],
                  assignments: Mapping[str, str | None]) -> dict[str, str | None]:
    """Donor of every catching-up replica: keep a valid one, else the least-loaded member.

    Donors are members of the current (unpaused) epoch, never a replica that is itself
    catching up. None means no donor exists (the joiner then joins with a full state sync).
    """
    donors = [m for m in (epoch.members if epoch and not epoch.paused else ())
              if m in registrations and registrations[m].state == ReplicaState.MEMBER]
    joiners = sorted(rid for rid, r in registrations.items()
                     if r.state == ReplicaState.CATCHING_UP)
    load = {d: 0 for d in donors}
    result: dict[str, str | None] = {}
    for joiner in joiners:
        if assignments.get(joiner) in load:
            result[joiner] = assignments[joiner]
            load[assignments[joiner]] += 1
    for joiner in joiners:
        if joiner not in result:
            donor = min(donors, key=lambda d: (load[d], donors.index(d)), default=None)
            result[joiner] = donor
            if donor is not None:
                load[donor] += 1
    return result


def _first_epoch(alive: Mapping[str, Registration], policy: Policy,
                 start_deadline_passed: bool, now: float) -> Epoch | None:
    wanted = policy.initial_replicas if not start_deadline_passed else policy.min_replicas
    if not alive or len(alive) < wanted:
        return None
    return _make_epoch(1, sorted(alive), alive, policy, "start", now)


def _make_epoch(number: int, members: list[str], alive: Mapping[str, Registration],
                policy: Policy, reason: str, now: float, previous: Epoch | None = None
                ) -> Epoch:
    # Held members have no registration: their generation is the previous epoch's, and the
    # members meet at the store of the first member that is registered (any member's will do).
    registered = [m for m in members if m in alive]
    return Epoch(number=number, members=tuple(members),
                 generations={m: alive[m].generation if m in alive else previous.generations[m]
                              for m in members},
                 store_addr=alive[registered[0]].store_addr if registered
                 else previous.store_addr if previous else "",
                 paused=len(members) < policy.min_replicas, reason=reason, time=now)


_decode_registration = decoder("registration", Registration)
_decode_epoch = decoder("epoch", Epoch)
