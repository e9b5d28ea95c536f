"""Pure logic of the whole training state: registration, loop-advanced state, fingerprints,
the verdict on differing digests, fork-aware state sync planning, the new fault phases."""

from __future__ import annotations

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from ftsystem.chaos.faults import FaultPoint, FaultSchedule, parse_fault_point
from ftsystem.training.fingerprint import (GENESIS, chain_next, from_words, judge, state_digest,
                                  to_words)
from ftsystem.training.entry_plan import MemberRow, plan_entry
from ftsystem.training.replicated import (Batches, RegistrationError, ReplicatedObjects, RNGState)

# torchdata 0.11 calls a torch API that torch has deprecated since.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def _scheduler() -> torch.optim.lr_scheduler.LambdaLR:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)


def test_registering_an_object_without_state_dict_says_what_to_do():
    objects = ReplicatedObjects()
    with pytest.raises(RegistrationError, match="no state_dict.*wrap it"):
        objects.register("counter", object())


def test_registering_after_start_is_refused():
    objects = ReplicatedObjects()
    objects.register("lr", _scheduler())
    objects.freeze()  # FTReplica.start()
    with pytest.raises(RegistrationError, match="after start"):
        objects.register("ema", _scheduler())


@pytest.mark.parametrize("name", ["", "model", "lr"])
def test_a_taken_or_reserved_name_is_refused(name):
    objects = ReplicatedObjects()
    objects.register("lr", _scheduler())
    with pytest.raises(RegistrationError, match="empty, taken"):
        objects.register(name, _scheduler())


def test_signature_names_every_object_and_who_advances_it():
    objects = ReplicatedObjects()
    objects.register("lr", _scheduler())
    objects.register("data", Batches(StatefulDataLoader(list(range(8)), batch_size=2)),
                     advanced_by="loop")
    assert objects.signature() == "data:loop,lr:step"


def test_loop_advanced_state_is_carried_and_a_loaded_loader_resumes_there():
    def loader():
        return StatefulDataLoader(list(range(20)), batch_size=2, shuffle=True,
                                  generator=torch.Generator().manual_seed(0))

    ahead, behind = Batches(loader()), Batches(loader())
    sender, receiver = ReplicatedObjects(), ReplicatedObjects()
    sender.register("data", ahead, advanced_by="loop")
    receiver.register("data", behind, advanced_by="loop")
    for _ in range(3):
        next(ahead)
    next(behind)  # an iterator already running, at another position
    receiver.load_carry(sender.carry())
    assert torch.equal(next(behind), next(ahead))
    assert state_digest(receiver.decode(receiver.carry())) == \
        state_digest(sender.decode(sender.carry()))


def test_batches_start_the_next_pass_at_the_end_of_one():
    batches = Batches(StatefulDataLoader(list(range(4)), batch_size=2))
    assert [next(batches).tolist() for _ in range(3)] == [[0, 1], [2, 3], [0, 1]]


def test_rng_state_round_trips():
    rng = RNGState()
    saved = rng.state_dict()
    first = torch.rand(3)
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(3), first)


def test_state_digest_sees_one_bit_and_the_scheduler():
    state = {"model": {"w": torch.ones(4)}, "objects": {"lr": _scheduler().state_dict()}}
    same = {"objects": {"lr": _scheduler().state_dict()}, "model": {"w": torch.ones(4)}}
    assert state_digest(state) == state_digest(same)  # key order does not matter
    flipped = {"model": {"w": torch.ones(4)}, "objects": state["objects"]}
    flipped["model"]["w"].view(torch.int32)[2] ^= 1
    assert state_digest(flipped) != state_digest(state)
    stepped = _scheduler()
    stepped.optimizer.step()
    stepped.step()
    moved = {"model": {"w": torch.ones(4)}, "objects": {"lr": stepped.state_dict()}}
    assert state_digest(moved) != state_digest(state)


def test_the_commit_chain_depends_on_the_epoch_of_each_step():
    one = chain_next(chain_next(GENESIS, 1, 1), 2, 1)
    assert one == chain_next(chain_next(GENESIS, 1, 1), 2, 1)
    assert one != chain_next(chain_next(GENESIS, 1, 1), 2, 2)  # step 2 redone in epoch 2
    assert from_words(to_words(one)) == one


def test_judge_names_the_minority_or_finds_no_majority():
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    assert judge([a, a, a]).agreed
    verdict = judge([a, b, a])
    assert verdict.divergent == (1,) and verdict.majority == (0, 2) and verdict.repairable
    assert not judge([a, b]).repairable and judge([a, b]).divergent == (0, 1)
    assert not judge([a, b, c]).repairable


def test_the_entry_plan_resyncs_a_fork_at_the_same_step():
    x, y = b"x" * 16, b"y" * 16

    def plan(steps, chains):
        p = plan_entry([MemberRow(step=s, chain=c) for s, c in zip(steps, chains)])
        return p.donor, list(p.receivers)
    assert plan([9, 9, 9], [x, x, x]) == (0, [])
    assert plan([9, 9, 9], [x, y, x]) == (0, [1])
    assert plan([8, 9, 9], [y, x, x]) == (1, [0])


def test_sync_and_donate_faults_fire_at_the_first_chance_at_or_after_their_step():
    schedule = FaultSchedule([parse_fault_point("40:sync"), FaultPoint(50, "corrupt")])
    assert not schedule.fires(39, "sync")
    assert schedule.fires(45, "sync") and not schedule.fires(46, "sync")  # once
    assert not schedule.fires(51, "corrupt") and schedule.fires(50, "corrupt")
    with pytest.raises(ValueError, match="PHASE in"):
        parse_fault_point("40:explode")
