"""The pure decision logic: epochs from registrations, and the state-sync plan."""

from __future__ import annotations

from hypothesis import given, strategies as st

from ftsystem.ftar import plan_state_sync
from ftsystem.membership import (Epoch, Policy, Registration, ReplicaState, assign_donors,
                                 decide)

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


def test_sync_plan_job_start_broadcasts_from_member_zero():
    assert plan_state_sync([0, 0, 0], [True, True, True]) == (0, [1, 2])


def test_sync_plan_steady_state_moves_nothing():
    assert plan_state_sync([9, 9], [False, False]) == (0, [])


def test_sync_plan_joiner_and_uncommitted_step():
    # member 1 committed step 10, member 0 did not; member 2 is a fresh joiner
    assert plan_state_sync([10, 11, 0], [False, False, True]) == (1, [0, 2])


@given(st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=1, max_size=6))
def test_sync_plan_properties(members):
    steps, fresh = [s for s, _ in members], [f for _, f in members]
    donor, receivers = plan_state_sync(steps, fresh)
    synced = [i for i, f in enumerate(fresh) if not f]
    if synced:
        assert not fresh[donor] and steps[donor] == max(steps[i] for i in synced)
    assert donor not in receivers
    # after the transfer everybody holds the donor's state
    assert all(steps[i] == steps[donor] and not fresh[i]
               for i in range(len(steps)) if i not in receivers and i != donor)


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
