"""The one writer of the replicated state: a replica that replays a peer's logged steps ends
bit for bit where the peer is, whatever the step function does that a reasonable loop does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ftsystem.training.fingerprint import state_digest
from ftsystem.training.local_state import LocalState
from ftsystem.training.parameters import (ParameterSet, ParameterSetChanged, check_model,
                                          trainable)
from ftsystem.training.replicated import ReplicatedObjects, RNGState
from ftsystem.training.flat import FlatLayout, forward_buffers
from ftsystem.training.update_log import UpdateLog


class Counter:
    """A loop-advanced counter the step function reads."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


class HalvingSGD(torch.optim.SGD):
    """An optimizer that writes into .grad through .data, as some fused kernels do (no
    version-counter bump)."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.data.mul_(0.5)
        return super().step(closure)


def _replica(step_fn_for, seed: int = 0, optimizer_class=torch.optim.AdamW):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = optimizer_class(model.parameters(), lr=1e-2)
    objects = ReplicatedObjects()
    counter = Counter()
    objects.register("rng", RNGState(), "loop")
    objects.register("counter", counter, "loop")
    params = list(model.parameters())
    log = UpdateLog()
    log.session_active = True  # a joiner is catching up: the donor keeps every step
    state = LocalState("r", model, optimizer, FlatLayout(params), objects,
                       step_fn_for(model, optimizer, counter), log, lambda step: None)
    state.start()
    return state, model, counter


def _live_steps(state: LocalState, model: nn.Module, counter: Counter, steps: int) -> None:
    for step in range(steps):
        torch.manual_seed(100 + step)  # the loop's forward draws from the registered RNG
        x = torch.randn(5, 4)
        counter.n += 1  # the loop advances it before the step function runs
        model(x).pow(2).mean().backward()
        grad = state._layout.pack()
        state.commit(grad, epoch=1)


def _replay_all(donor: LocalState, joiner: LocalState) -> None:
    for _, update in donor.update_log.entries():
        joiner.replay(update)


def _assert_same(a: LocalState, b: LocalState) -> None:
    assert a.step == b.step and a.chain == b.chain
    assert state_digest(a.fingerprinted()) == state_digest(b.fingerprinted())


def test_a_step_function_that_draws_from_a_registered_rng_replays_bit_for_bit():
    def step_fn_for(model, optimizer, counter):
        def step() -> None:
            for p in model.parameters():  # gradient noise from the registered RNG
                p.grad.add_(torch.randn_like(p.grad), alpha=1e-3)
            optimizer.step()
        return step
    donor, model, counter = _replica(step_fn_for)
    joiner, _, _ = _replica(step_fn_for)
    _live_steps(donor, model, counter, 6)
    _replay_all(donor, joiner)
    _assert_same(donor, joiner)


def test_a_step_function_that_reads_a_loop_counter_replays_bit_for_bit():
    def step_fn_for(model, optimizer, counter):
        def step() -> None:
            for group in optimizer.param_groups:  # a schedule kept by the loop
                group["lr"] = 1e-2 / counter.n
            optimizer.step()
        return step
    donor, model, counter = _replica(step_fn_for)
    joiner, _, _ = _replica(step_fn_for)
    _live_steps(donor, model, counter, 5)
    _replay_all(donor, joiner)
    _assert_same(donor, joiner)


def test_an_optimizer_that_writes_grad_through_data_replays_bit_for_bit():
    def default_step(model, optimizer, counter):
        return None
    donor, model, counter = _replica(default_step, optimizer_class=HalvingSGD)
    joiner, _, _ = _replica(default_step, optimizer_class=HalvingSGD)
    _live_steps(donor, model, counter, 4)
    _replay_all(donor, joiner)
    _assert_same(donor, joiner)


def test_the_default_step_keeps_the_logged_average_intact():
    donor, model, counter = _replica(lambda model, optimizer, counter: None)
    joiner, _, _ = _replica(lambda model, optimizer, counter: None)
    _live_steps(donor, model, counter, 4)
    _replay_all(donor, joiner)
    _assert_same(donor, joiner)
    assert len(donor.update_log.entries()) == 4


def test_a_parameter_set_that_changes_after_construction_is_refused_with_what_to_do():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    params = ParameterSet(model, optimizer)
    params.check_unchanged()
    model[0].weight.requires_grad_(False)
    with pytest.raises(ParameterSetChanged, match="set requires_grad on every parameter before"):
        params.check_unchanged()
    model[0].weight.requires_grad_(True)
    params.check_unchanged()
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    with pytest.raises(ParameterSetChanged, match="add_param_group"):
        params.check_unchanged()


def test_models_whose_gradients_cannot_be_averaged_are_refused_at_construction():
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="0 produce sparse gradients.*sparse=False"):
        check_model(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1))
    model, stray = nn.Linear(4, 2), nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="not the model's"):
        check_model(model, torch.optim.SGD([*model.parameters(), stray], lr=0.1))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter that requires a gradient"):
        check_model(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1))


def test_batch_norm_statistics_follow_a_replay_and_are_the_members_average():
    # The forward updates the running statistics; a replay runs no forward. They travel in
    # the averaged buffer, so two members with different data hold the same statistics and a
    # replica replaying the log ends where they are.
    def member(seed: int):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        layout = FlatLayout(trainable(model), forward_buffers(model))
        log = UpdateLog()
        log.session_active = True
        state = LocalState("r", model, optimizer, layout, ReplicatedObjects(), None, log,
                           lambda step: None)
        state.start()
        return state, model, torch.Generator().manual_seed(seed)
    a, b, joiner = member(1), member(2), member(3)
    for _ in range(5):
        packed = []
        for state, model, data in (a, b):
            model(torch.randn(8, 4, generator=data)).pow(2).mean().backward()
            packed.append(state._layout.pack())
        average = (packed[0] + packed[1]) / 2
        for state, _, _ in (a, b):
            state.commit(average.clone(), epoch=1)
    _assert_same(a[0], b[0])
    _replay_all(a[0], joiner[0])
    _assert_same(a[0], joiner[0])
    assert a[1][1].num_batches_tracked.item() == 5


@pytest.mark.parametrize("takes_join_step", [False, True])
def test_a_former_joiner_no_longer_replays_its_donors_log(takes_join_step):
    # While it waits for its first epoch a joiner keeps up with its donor's log; once an
    # entry lets it in, that log is nothing to it, also while it waits to take its join step
    # again: it must not replay a donor's steps on its own.
    from types import SimpleNamespace
    from unittest.mock import create_autospec

    from ftsystem.training.joiner import Joiner
    from ftsystem.training.phase import Lifecycle, Phase
    from ftsystem.training.replica import FTReplica
    from ftsystem.training.settings import ReplicaSettings
    from ftsystem.training.transport import StateTransport

    ctx = SimpleNamespace(job="j", replica_id="r1", timeout_s=1.0, world_size=1, rank=0)
    transport = create_autospec(StateTransport, instance=True)
    joiner = Joiner(ctx, control=None, replica=None, state=None, transport=transport,
                    settings=ReplicaSettings())
    joiner._donor_addr = "127.0.0.1:1"  # what catch_up() leaves behind
    lifecycle = Lifecycle("r1")
    lifecycle.move(Phase.JOINING)
    replica = SimpleNamespace(lifecycle=lifecycle, joiner=joiner, _entered=None)
    FTReplica._after_entry(replica, SimpleNamespace(takes_join_step=takes_join_step))
    assert lifecycle.is_(Phase.JOIN_STEP if takes_join_step else Phase.MEMBER)
    joiner.keep_up()  # would fetch the donor's log (and fail: there is no donor, no state)
    transport.fetch_log.assert_not_called()


class Augmented(torch.utils.data.Dataset):
    """Each item drawn with the loader worker's RNG, as a random crop or flip is."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(1)


def _augmenting_loader():
    from torchdata.stateful_dataloader import StatefulDataLoader
    return StatefulDataLoader(Augmented(), batch_size=1, num_workers=2,
                              generator=torch.Generator().manual_seed(0))


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_live_commits_leave_a_worker_based_loader_running():
    # Only a received state (a join step, a replay, a sync) is loaded into the loop's objects:
    # reloading the loader at every commit would respawn its workers and reset their RNG, so
    # the augmentation would repeat.
    from ftsystem.training.replicated import Batches
    plain = [next(batch).item() for batch in [iter(_augmenting_loader())] for _ in range(4)]

    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    objects = ReplicatedObjects()
    batches = Batches(_augmenting_loader())
    objects.register("data", batches, "loop")
    state = LocalState("r", model, optimizer, FlatLayout(list(model.parameters())), objects,
                       None, UpdateLog(), lambda step: None)
    state.start()
    seen = []
    for _ in range(4):
        x = next(batches)
        seen.append(x.item())
        model(x).pow(2).mean().backward()
        state.commit(state._layout.pack(), epoch=1)
    assert seen == plain
