"""A registered data loader yields the same batches whether or not its replica ever loaded the
job's state: over several passes, from any position, with the loader recipes the docs name;
and a loader that cannot resume is refused at registration."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from ftsystem.training.fingerprint import state_digest
from ftsystem.training.replicated import Batches, RegistrationError, ReplicatedObjects

# torchdata 0.11 calls a torch API that torch has deprecated since.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

ITEMS, BATCH = 10, 2
PASS = ITEMS // BATCH
PASSES = 6  # what the replicas draw after the restore: the dataset is much shorter than the job


def shuffled(num_workers: int = 0) -> StatefulDataLoader:
    """The recipe of docs/adopting.md."""
    return StatefulDataLoader(list(range(ITEMS)), batch_size=BATCH, shuffle=True,
                              num_workers=num_workers,
                              generator=torch.Generator().manual_seed(1234))


def sequential() -> StatefulDataLoader:
    return StatefulDataLoader(list(range(ITEMS)), batch_size=BATCH)


def distributed() -> StatefulDataLoader:
    # rank 1 of 2 replicas' shards: its rank is a constructor argument, not state
    sampler = DistributedSampler(list(range(ITEMS)), num_replicas=2, rank=1, shuffle=True, seed=5)
    return StatefulDataLoader(list(range(ITEMS)), batch_size=BATCH, sampler=sampler)


def draw(batches: Batches, n: int) -> list[list[int]]:
    return [next(batches).tolist() for _ in range(n)]


def restored_replica_follows(make: Callable[[], Any], at: int, receiver_at: int) -> None:
    """Three replicas: ``kept`` and ``donor`` never load state; ``receiver``, after drawing
    ``receiver_at`` batches, loads ``donor``'s state taken after ``at`` batches. From then on
    all three must draw the same batches and hold the same state."""
    kept, donor, receiver = Batches(make()), Batches(make()), Batches(make())
    draw(kept, at)
    draw(donor, at)
    draw(receiver, receiver_at)
    receiver.load_state_dict(donor.state_dict())
    for step in range(PASSES * PASS):
        want = next(kept).tolist()
        assert next(donor).tolist() == want
        assert next(receiver).tolist() == want, f"step {at + step} after the restore"
        assert state_digest(receiver.state_dict()) == state_digest(kept.state_dict())


# (batches the donor drew, batches the receiver drew): one pass is 5 batches
POSITIONS = {
    "step 0": (0, 0),
    "mid-pass": (3, 3),
    "mid-pass, receiver behind": (7, 1),
    "mid-pass, receiver ahead": (12, 17),
    "after the last batch of a pass": (PASS, PASS),
    "after the last batch of the third pass": (3 * PASS, 2),
    "first batch of a pass": (PASS + 1, 2 * PASS),
    "receiver at a pass boundary": (8, 2 * PASS),
}


@pytest.mark.parametrize("at,receiver_at", POSITIONS.values(), ids=POSITIONS.keys())
def test_a_restored_shuffled_loader_draws_what_the_others_draw(at, receiver_at):
    restored_replica_follows(shuffled, at, receiver_at)


@pytest.mark.timeout(10)  # each case starts 2 workers per pass of 3 loaders: about 1.5 s
@pytest.mark.parametrize("at,receiver_at", [(3, 3), (PASS, 2), (PASS + 2, 1)])
def test_a_restored_shuffled_loader_with_workers_draws_what_the_others_draw(at, receiver_at):
    restored_replica_follows(lambda: shuffled(num_workers=2), at, receiver_at)


@pytest.mark.parametrize("make", [sequential, distributed])
@pytest.mark.parametrize("at,receiver_at", [(0, 0), (3, 1), (PASS, PASS), (2 * PASS + 1, 4)])
def test_sequential_and_distributed_samplers_resume_too(make, at, receiver_at):
    restored_replica_follows(make, at, receiver_at)


def test_a_state_restored_twice_and_passed_on_still_agrees():
    kept, first, second = Batches(shuffled()), Batches(shuffled()), Batches(shuffled())
    draw(kept, 4)
    draw(first, 9)
    first.load_state_dict(kept.state_dict())
    draw(kept, 3)
    draw(first, 3)
    second.load_state_dict(first.state_dict())  # a replica restored from a restored one
    first.load_state_dict(first.state_dict())
    for _ in range(PASSES * PASS):
        want = next(kept).tolist()
        assert next(first).tolist() == want and next(second).tolist() == want


def test_every_pass_is_a_new_order_the_same_on_every_replica():
    drawn = draw(Batches(shuffled()), 3 * PASS)
    assert drawn == draw(Batches(shuffled()), 3 * PASS)
    orders = {tuple(x for batch in drawn[p * PASS:(p + 1) * PASS] for x in batch)
              for p in range(3)}
    assert len(orders) == 3 and all(sorted(order) == list(range(ITEMS)) for order in orders)


def test_a_distributed_sampler_sees_each_pass_as_its_epoch():
    batches, sampler = Batches(distributed()), distributed().sampler
    for epoch in range(3):  # its shard: 5 items, 3 batches
        sampler.set_epoch(epoch)
        assert [x for batch in draw(batches, 3) for x in batch] == list(sampler)


def test_the_loader_state_travels_through_the_registry():
    sender, receiver = ReplicatedObjects(), ReplicatedObjects()
    ahead, behind = Batches(shuffled()), Batches(shuffled())
    sender.register("data", ahead, advanced_by="loop")
    receiver.register("data", behind, advanced_by="loop")
    draw(ahead, 2 * PASS + 3)
    receiver.load_carry(sender.carry())
    assert draw(behind, 3 * PASS) == draw(ahead, 3 * PASS)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(ITEMS))


class StatefulStream(IterableDataset):
    def __init__(self) -> None:
        self.start = 0

    def __iter__(self):
        for i in range(self.start, ITEMS):
            self.start = i + 1
            yield i
        self.start = 0

    def state_dict(self) -> dict[str, int]:
        return {"start": self.start}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["start"]


class CountsRestores(StatefulDataLoader):
    """A loader whose state tells whether it was ever restored, as a replica's would differ."""

    restores = 0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "restores": self.restores}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restores += 1
        super().load_state_dict({k: v for k, v in state.items() if k != "restores"})


REFUSED = {
    "a DataLoader": (lambda: DataLoader(list(range(ITEMS)), batch_size=BATCH),
                     "no state_dict.*StatefulDataLoader"),
    "shuffle without a generator": (
        lambda: StatefulDataLoader(list(range(ITEMS)), batch_size=BATCH, shuffle=True),
        "global RNG.*generator=torch.Generator"),
    "a random sampler without a generator": (
        lambda: StatefulDataLoader(list(range(ITEMS)), batch_size=BATCH,
                                   sampler=RandomSampler(list(range(ITEMS)))),
        "global RNG.*generator=torch.Generator"),
    "an iterable dataset without state": (
        lambda: StatefulDataLoader(Stream(), batch_size=BATCH),
        "Stream.*state_dict"),
    "a state that changes when loaded": (
        lambda: CountsRestores(list(range(ITEMS)), batch_size=BATCH),
        r"state_dict\(\) differs from that state"),
}


@pytest.mark.parametrize("make,message", REFUSED.values(), ids=REFUSED.keys())
def test_a_loader_that_cannot_resume_is_refused_with_what_to_do(make, message):
    with pytest.raises(RegistrationError, match=message):
        Batches(make())


def test_an_iterable_dataset_with_state_is_accepted_and_resumes():
    def make() -> StatefulDataLoader:
        return StatefulDataLoader(StatefulStream(), batch_size=BATCH)
    restored_replica_follows(make, 3, 7)


def test_registering_draws_nothing_the_first_pass_is_the_loaders_own():
    assert draw(Batches(shuffled()), PASS) == [batch.tolist() for batch in shuffled()]
