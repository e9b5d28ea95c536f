"""The pure decision logic: epochs from registrations, and the state-sync plan."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from ftsystem.control.membership import (CONFIRM_S, Epoch, LapseRule, LeaseReading, Policy,
                                 Registration, ReplicaState, assign_donors, decide,
                                 held_members, late_members, stale_members)
from ftsystem.control.timeouts import StragglerBound, TimeoutConfigError, Timeouts

READY, MEMBER = ReplicaState.READY, ReplicaState.MEMBER


def reg(rid: str, state=MEMBER, generation: int = 0) -> Registration:
    return Registration(replica_id=rid, state=state, generation=generation,
                        store_addr=f"{rid}:1")


def regs(*items: Registration) -> dict[str, Registration]:
    return {r.replica_id: r for r in items}


def epoch(number: int, *members: str, generation: int = 0) -> Epoch:
    return Epoch(number=number, members=members, generations={m: generation for m in members},
                 store_addr=f"{members[0]}:1" if members else "")


def test_first_epoch_waits_for_initial_replicas_until_the_deadline():
    policy = Policy(min_replicas=1, initial_replicas=3)
    two = regs(reg("a", READY), reg("b", READY))
    assert decide(None, two, policy, join_tick=True, start_deadline_passed=False) is None
    first = decide(None, two, policy, join_tick=True, start_deadline_passed=True)
    assert first.number == 1 and first.members == ("a", "b") and first.store_addr == "a:1"


def test_removal_is_immediate_and_keeps_survivor_order():
    current = epoch(4, "c", "a", "b")
    nxt = decide(current, regs(reg("c"), reg("b")), Policy(), join_tick=False)
    assert nxt.number == 5 and nxt.members == ("c", "b") and nxt.reason == "removal"
    assert nxt.store_addr == "c:1"


def test_joins_wait_for_the_tick():
    current = epoch(2, "a")
    registrations = regs(reg("a"), reg("b", READY))
    assert decide(current, registrations, Policy(), join_tick=False) is None
    nxt = decide(current, registrations, Policy(), join_tick=True)
    assert nxt.members == ("a", "b") and nxt.reason == "join"


def test_a_restarted_member_is_removed_then_rejoins():
    current = epoch(3, "a", "b")
    nxt = decide(current, regs(reg("a"), reg("b", READY, generation=1)), Policy(),
                 join_tick=False)
    assert nxt.reason == "removal" and nxt.members == ("a", "b")
    assert nxt.generations == {"a": 0, "b": 1}


def test_starting_replicas_are_not_members():
    current = epoch(1, "a")
    assert decide(current, regs(reg("a"), reg("b", ReplicaState.STARTING)), Policy(),
                  join_tick=True) is None


def test_below_min_replicas_the_epoch_is_paused():
    nxt = decide(epoch(1, "a", "b"), regs(reg("a")), Policy(min_replicas=2), join_tick=False)
    assert nxt.paused and nxt.members == ("a",)


def test_epoch_json_round_trip():
    e = epoch(7, "x", "y")
    assert Epoch.from_json(e.to_json()) == e


ids = st.sampled_from(["a", "b", "c", "d", "e"])
registration_sets = st.dictionaries(
    ids, st.tuples(st.sampled_from(list(ReplicaState)), st.integers(0, 2)))


@given(members=st.lists(ids, unique=True, max_size=5), raw=registration_sets,
       tick=st.booleans(), min_replicas=st.integers(1, 3))
def test_decide_properties(members, raw, tick, min_replicas):
    current = Epoch(number=5, members=tuple(members), generations={m: 0 for m in members})
    registrations = {rid: reg(rid, state, gen) for rid, (state, gen) in raw.items()}
    nxt = decide(current, registrations, Policy(min_replicas=min_replicas), join_tick=tick)
    alive = {rid for rid, r in registrations.items()
             if r.state in (ReplicaState.READY, MEMBER, ReplicaState.DONE)}
    dead = [m for m in members if m not in alive or registrations[m].generation != 0]
    if dead:
        assert nxt is not None  # a removal is never deferred
    if nxt is None:
        return
    assert nxt.number == 6
    assert set(nxt.members) <= alive and len(set(nxt.members)) == len(nxt.members)
    for d in set(dead) & set(nxt.members):
        assert nxt.generations[d] != 0  # only a restarted generation comes back
    survivors = [m for m in members if m not in dead]
    assert list(nxt.members[:len(survivors)]) == survivors
    assert nxt.paused == (len(nxt.members) < min_replicas)
    assert all(nxt.generations[m] == registrations[m].generation for m in nxt.members)




def test_donors_are_spread_and_kept():
    current = epoch(3, "a", "b", "c")
    registrations = regs(reg("a"), reg("b"), reg("c"), reg("x", ReplicaState.CATCHING_UP),
                         reg("y", ReplicaState.CATCHING_UP), reg("z", ReplicaState.CATCHING_UP))
    assert assign_donors(current, registrations, {}) == {"x": "a", "y": "b", "z": "c"}
    # an existing assignment stands; the others go to the least loaded
    assert assign_donors(current, registrations, {"z": "a"}) == {"x": "b", "y": "c", "z": "a"}


def test_no_donor_when_nobody_trains():
    registrations = regs(reg("x", ReplicaState.CATCHING_UP))
    assert assign_donors(None, registrations, {}) == {"x": None}
    assert assign_donors(epoch(2, "a"), registrations, {}) == {"x": None}  # a is gone


@given(members=st.lists(ids, unique=True, max_size=5), raw=registration_sets,
       previous=st.dictionaries(ids, ids))
def test_donor_assignment_properties(members, raw, previous):
    registrations = {rid: reg(rid, state, gen) for rid, (state, gen) in raw.items()}
    current = Epoch(number=2, members=tuple(members), generations={m: 0 for m in members})
    result = assign_donors(current, registrations, previous)
    joiners = {r for r, x in registrations.items() if x.state == ReplicaState.CATCHING_UP}
    assert set(result) == joiners
    donors = [d for d in result.values() if d is not None]
    for d in donors:  # a donor trains in the epoch and is not catching up itself
        assert d in members and registrations[d].state == MEMBER
    loads = [donors.count(m) for m in members if m in registrations
             and registrations[m].state == MEMBER]
    kept = {j: d for j, d in previous.items() if j in result and result[j] == d}
    if not kept and loads:
        assert max(loads) - min(loads) <= 1  # spread evenly when starting from scratch


def test_resync_request_reconfigures_the_same_members():
    current = epoch(4, "a", "b")
    asking = Registration(replica_id="b", state=MEMBER, generation=0, resync_after=4)
    nxt = decide(current, regs(reg("a"), asking), Policy(), join_tick=False)
    assert nxt.number == 5 and nxt.members == ("a", "b") and nxt.reason == "resync"
    assert decide(nxt, regs(reg("a"), asking), Policy(), join_tick=True) is None


# --- a control-plane outage is not a host failure ---------------------------------------------

RULE = LapseRule(grace_s=12.0, window_s=2.0)


def held(vanished, members, now, suspected_at=(0.0,)):
    return held_members(vanished, members, suspected_at=suspected_at, now=now, rule=RULE)


def test_lapse_rule_grace_is_the_lease_ttl_plus_a_margin():
    assert LapseRule.for_lease_ttl(10).grace_s == 12


def test_a_member_vanishing_alone_is_not_held():
    assert held({"b": 100.0}, ("a", "b", "c"), now=100.0) == frozenset()


def test_members_vanishing_together_are_held_until_the_grace_ends():
    vanished = {"a": 100.0, "b": 100.5, "c": 101.0}
    assert held(vanished, ("a", "b", "c"), now=101.0) == {"a", "b", "c"}
    # the first one was already removed when the others followed: it still counts
    assert held(vanished, ("b", "c"), now=101.0) == {"b", "c"}
    assert held(vanished, ("a", "b", "c"), now=112.2) == {"b", "c"}
    assert held(vanished, ("a", "b", "c"), now=113.0) == frozenset()


def test_less_than_half_vanishing_together_is_not_held():
    members = ("a", "b", "c", "d", "e")
    assert held({"a": 100.0, "b": 100.1}, members, now=100.2) == frozenset()
    assert held({"a": 100.0, "b": 100.1, "c": 100.2}, members, now=100.2) == {"a", "b", "c"}
    # far apart they are separate failures
    assert held({"a": 100.0, "b": 103.0, "c": 106.0}, members, now=106.0) == frozenset()


def test_a_new_leader_holds_the_members_it_finds_unregistered():
    assert held({"c": 50.0}, ("a", "b", "c"), now=50.0, suspected_at=(50.0,)) == {"c"}
    # and members vanishing right after it began (their leases are being revoked)
    assert held({"c": 51.5}, ("a", "b", "c"), now=51.5, suspected_at=(50.0,)) == {"c"}
    assert held({"c": 53.0}, ("a", "b", "c"), now=53.0, suspected_at=(50.0,)) == frozenset()
    assert held({"c": 50.0}, ("a", "b", "c"), now=62.0, suspected_at=(50.0,)) == frozenset()


def test_a_lapse_of_the_leaders_own_lease_holds_who_vanished_with_it():
    assert held({"c": 80.0}, ("a", "b", "c"), now=80.1, suspected_at=(0.0, 80.1)) == {"c"}


def test_held_members_stay_in_the_epoch():
    current = epoch(4, "a", "b", "c")
    assert decide(current, regs(reg("b")), Policy(), join_tick=True, held={"a", "c"}) is None
    # with nobody registered (a new leader right after an outage) the epoch stands
    assert decide(current, {}, Policy(), join_tick=True, held={"a", "b", "c"}) is None
    # a held member that registers again with its generation is simply kept
    assert decide(current, regs(reg("a"), reg("b"), reg("c")), Policy(), join_tick=True,
                  held={"a", "c"}) is None


def test_a_held_member_restarted_as_a_new_generation_is_replaced():
    current = epoch(4, "a", "b", "c")
    nxt = decide(current, regs(reg("a", READY, generation=1), reg("b")), Policy(),
                 join_tick=False, held={"a", "c"})
    assert nxt.reason == "removal" and nxt.members == ("b", "c", "a")
    assert nxt.generations == {"a": 1, "b": 0, "c": 0}
    assert nxt.store_addr == "b:1"  # the first registered member's store


def test_joins_go_on_during_a_hold():
    current = epoch(4, "a", "b")
    nxt = decide(current, regs(reg("b"), reg("x", READY)), Policy(), join_tick=True,
                 held={"a"})
    assert nxt.reason == "join" and nxt.members == ("a", "b", "x")
    assert nxt.generations == {"a": 0, "b": 0, "x": 0} and nxt.store_addr == "b:1"
    only_held = decide(current, regs(reg("x", READY)), Policy(), join_tick=True,
                       held={"a", "b"})
    assert only_held.members == ("a", "b", "x") and only_held.store_addr == "x:1"


@given(members=st.lists(ids, unique=True, max_size=5), raw=registration_sets,
       hold=st.sets(ids), tick=st.booleans())
def test_decide_never_drops_a_held_unregistered_member(members, raw, hold, tick):
    current = Epoch(number=5, members=tuple(members), generations={m: 0 for m in members},
                    store_addr="old:1")
    registrations = {rid: reg(rid, state, gen) for rid, (state, gen) in raw.items()}
    nxt = decide(current, registrations, Policy(), join_tick=tick, held=hold)
    stays = [m for m in members if m in hold and m not in registrations]
    members_after = nxt.members if nxt is not None else current.members
    assert set(stays) <= set(members_after)
    if nxt is not None:
        assert all(nxt.generations[m] == 0 for m in stays)
        registered = [m for m in nxt.members if m in registrations]
        assert nxt.store_addr == (registrations[registered[0]].store_addr if registered
                                  else "old:1")


times = st.floats(0, 30, allow_nan=False)


@given(vanished=st.dictionaries(ids, times), members=st.sets(ids), now=times,
       began=times)
def test_held_members_properties(vanished, members, now, began):
    now = max([now, began, *vanished.values()])
    result = held(vanished, members, now=now, suspected_at=(began,))
    assert result <= set(members) & set(vanished)
    assert all(now - vanished[m] < RULE.grace_s for m in result)
    if len(vanished) == 1 and all(abs(t - began) > RULE.window_s for t in vanished.values()):
        assert result == frozenset()  # the fast path: one failure alone is never held
    for m in result:  # each held member is part of a lapse or of a suspected moment
        t = vanished[m]
        together = sum(abs(u - t) <= RULE.window_s for u in vanished.values()
                       if now - u < RULE.grace_s + RULE.window_s)
        assert together >= 2 or abs(t - began) <= RULE.window_s


# --- a data-plane failure confirmed by the control plane --------------------------------------

def leased(rid: str, lease: int, generation: int = 0) -> Registration:
    return Registration(replica_id=rid, state=MEMBER, generation=generation, lease=lease)


def reading(lease: int, remaining: int, at: float = 10.5, granted: int = 10) -> LeaseReading:
    return LeaseReading(lease=lease, remaining=remaining, granted=granted, at=at)


def test_registration_lease_defaults_for_older_writers():
    old = '{"replica_id": "a", "state": "member", "generation": 2}'
    assert Registration.from_json(old).lease == 0
    assert Registration.from_json(leased("a", 77).to_json()).lease == 77


def test_a_lease_not_renewed_for_over_a_second_is_stale():
    assert not reading(1, remaining=9).stale  # renewed within the last second
    assert reading(1, remaining=8).stale
    assert not reading(1, remaining=1, granted=2).stale
    assert reading(1, remaining=0, granted=2).stale


def test_a_stale_member_is_removed_after_a_report():
    registrations = regs(leased("a", 1), leased("b", 2), leased("c", 3))
    readings = {"a": reading(1, 9), "b": reading(2, 8), "c": reading(3, 9)}
    assert stale_members(registrations, ("a", "b", "c"), readings, reported_at=10.0) == {"b"}
    # not while a mass lapse is suspected
    assert stale_members(registrations, ("a", "b", "c"), readings, reported_at=10.0,
                         lapse_suspected=True) == frozenset()
    # readings from before the report, or after the confirmation window, do not count
    assert stale_members(registrations, ("a", "b", "c"), readings, reported_at=11.0) == set()
    assert stale_members(registrations, ("a", "b", "c"), readings, reported_at=7.0) == set()


def test_only_a_reading_of_the_registered_lease_is_judged():
    readings = {"b": reading(2, 3)}
    assert stale_members(regs(leased("a", 1), leased("b", 5)), ("a", "b"), readings,
                         reported_at=10.0) == set()  # b registered on a new lease since
    assert stale_members(regs(leased("a", 1), leased("b", 0)), ("a", "b"), {"b": reading(0, 3)},
                         reported_at=10.0) == set()  # lease 0: never judged


def test_many_stale_leases_point_at_the_control_plane():
    registrations = regs(leased("a", 1), leased("b", 2), leased("c", 3), leased("d", 4))
    readings = {"a": reading(1, 9), "b": reading(2, 7), "c": reading(3, 6), "d": reading(4, 9)}
    assert stale_members(registrations, tuple("abcd"), readings, reported_at=10.0) == set()


def test_an_evicted_member_is_removed_and_does_not_rejoin_until_it_restarts():
    current = epoch(4, "a", "b", "c")
    registrations = regs(reg("a"), reg("b"), reg("c"))
    nxt = decide(current, registrations, Policy(), join_tick=True, evicted={"b": 0})
    assert nxt.reason == "removal" and nxt.members == ("a", "c")
    assert decide(nxt, registrations, Policy(), join_tick=True, evicted={"b": 0}) is None
    restarted = {**registrations, "b": reg("b", READY, generation=1)}
    assert decide(nxt, restarted, Policy(), join_tick=True, evicted={"b": 0}).members == (
        "a", "c", "b")


@given(raw=st.dictionaries(ids, st.tuples(st.integers(0, 3), st.integers(-1, 10),
                                          st.floats(0, 20, allow_nan=False))),
       members=st.lists(ids, unique=True, max_size=5), reported=st.floats(0, 20),
       suspected=st.booleans())
def test_stale_members_properties(raw, members, reported, suspected):
    registrations = {rid: leased(rid, lease) for rid, (lease, _, _) in raw.items()}
    readings = {rid: reading(lease, remaining, at) for rid, (lease, remaining, at) in raw.items()}
    result = stale_members(registrations, members, readings, reported_at=reported,
                           lapse_suspected=suspected)
    assert result <= set(members)
    if suspected:
        assert result == frozenset()
    for m in result:
        assert registrations[m].lease != 0 and readings[m].stale
        assert reported <= readings[m].at <= reported + CONFIRM_S
    judged = [m for m in members if m in registrations and registrations[m].lease
              and reported <= readings[m].at <= reported + CONFIRM_S]
    assert len(result) <= 1 or 2 * len(result) < len(judged)


# --- stragglers: taken out when a member found them late ---------------------------------------

def late_report(rid: str, epoch_number: int, *late: str) -> Registration:
    return Registration(replica_id=rid, state=MEMBER, generation=0, resync_after=epoch_number,
                        late=late)


def test_a_member_named_late_is_taken_out_and_stays_out_until_it_restarts():
    current = epoch(4, "a", "b", "c")
    registrations = regs(late_report("a", 4, "c"), reg("b"), reg("c"))
    assert late_members(current, registrations) == {"c"}
    evicted = {m: registrations[m].generation for m in late_members(current, registrations)}
    nxt = decide(current, registrations, Policy(), join_tick=True, evicted=evicted)
    assert nxt.members == ("a", "b") and nxt.reason == "removal"
    # The next tick does not take it back while it is the same generation...
    assert decide(nxt, registrations, Policy(), join_tick=True, evicted=evicted) is None
    # ...and the report, made in epoch 4, no longer counts in epoch 5.
    assert late_members(nxt, registrations) == frozenset()


def test_late_reports_that_cannot_be_stragglers_are_ignored():
    current = epoch(4, "a", "b", "c", "d")
    # From an earlier epoch, naming itself, or naming a non-member.
    assert late_members(current, regs(late_report("a", 3, "c"), late_report("b", 4, "b"),
                                      late_report("c", 4, "x"), reg("d"))) == frozenset()
    # Half of the members named: a machine-wide slowdown, not stragglers.
    assert late_members(current, regs(late_report("a", 4, "c", "d"), reg("b"), reg("c"),
                                      reg("d"))) == frozenset()
    assert late_members(epoch(4, "a", "b"), regs(late_report("a", 4, "b"), reg("b"))) == {"b"}


def test_registration_json_round_trip_keeps_the_late_members():
    report = late_report("a", 4, "b", "c")
    assert Registration.from_json(report.to_json()) == report
    older = '{"replica_id": "a", "state": "member", "generation": 0}'  # written before `late`
    assert Registration.from_json(older).late == ()


def test_the_straggler_bound_follows_the_step_time_between_floor_and_ceiling():
    bound = StragglerBound(factor=4.0, floor_s=2.0, ceiling_s=10.0)
    assert bound.bound_s([]) == 10.0  # nothing observed yet: the ceiling
    assert bound.bound_s([0.1, 0.1, 5.0]) == 2.0  # fast steps: the floor
    assert bound.bound_s([1.0, 1.5, 1.0, 30.0]) == 5.0  # 4 x the median, not the mean
    assert bound.bound_s([4.0]) == 10.0
    derived = StragglerBound.from_env({}, Timeouts(30.0))
    assert (derived.floor_s, derived.ceiling_s) == (2.0, 10.0)
    assert StragglerBound.from_env({}, Timeouts(6.0)).floor_s == 2.0
    # A floor above a job's ceiling (set for every job, this one with a short timeout): the
    # ceiling wins.
    assert StragglerBound.from_env({"FTSYSTEM_STRAGGLER_FLOOR_S": "20"},
                                   Timeouts(30.0)).bound_s([0.1]) == 10.0
    with pytest.raises(TimeoutConfigError, match="FTSYSTEM_STRAGGLER_FLOOR_S"):
        StragglerBound.from_env({"FTSYSTEM_STRAGGLER_FLOOR_S": "0"}, Timeouts(30.0))
    with pytest.raises(TimeoutConfigError, match="numbers"):
        StragglerBound.from_env({"FTSYSTEM_STRAGGLER_FACTOR": "fast"}, Timeouts(30.0))
    # The silence: 0.6 s by default, longer if set, never shorter than three beats.
    assert derived.silence_s == 0.6
    assert StragglerBound.from_env({"FTSYSTEM_STRAGGLER_SILENCE_S": "2"},
                                   Timeouts(30.0)).silence_s == 2.0
    with pytest.raises(TimeoutConfigError, match="FTSYSTEM_STRAGGLER_SILENCE_S"):
        StragglerBound.from_env({"FTSYSTEM_STRAGGLER_SILENCE_S": "0.3"}, Timeouts(30.0))
