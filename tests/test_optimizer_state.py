"""The optimizer's part of the replicated state, from the user's side: whatever the optimizer
does with ``.grad`` and whatever state it keeps (slots created mid-run, moments in another
dtype than their parameters), a replica that catches up (loads a peer's snapshot, replays the
logged steps after it) or is repaired holds the peer's state bit for bit."""

from __future__ import annotations

import io

import torch
from torch import nn

from ftsystem.training.flat import FlatLayout
from ftsystem.training.local_state import LocalState
from ftsystem.training.parameters import trainable
from ftsystem.training.replicated import ReplicatedObjects
from ftsystem.training.shards import load_local_state, local_state
from ftsystem.training.update_log import UpdateLog
from ftsystem.training.wire import tree_tensors


class TrunkAndHead(nn.Module):
    """A model whose head is first used some steps into training (an auxiliary head, an
    expert no token was routed to before): its optimizer slots appear mid-run."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 8, dtype=dtype)
        self.head = nn.Linear(8, 2, dtype=dtype)

    def forward(self, x: torch.Tensor, with_head: bool) -> torch.Tensor:
        hidden = self.trunk(x.to(self.trunk.weight.dtype))
        return self.head(hidden) if with_head else hidden


class Fp32Momentum(torch.optim.Optimizer):
    """SGD with momentum kept in fp32 whatever the parameters' dtype, as mixed-precision
    optimizers keep their moments beside bf16 weights."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                slots = self.state[p]
                if "momentum" not in slots:
                    slots["momentum"] = torch.zeros_like(p, dtype=torch.float32)
                slots["momentum"].mul_(0.9).add_(p.grad.float())
                p.sub_((group["lr"] * slots["momentum"]).to(p.dtype))


def _replica(make_optimizer, dtype: torch.dtype = torch.float32) -> LocalState:
    torch.manual_seed(0)
    model = TrunkAndHead(dtype)
    log = UpdateLog()
    log.session_active = True  # a joiner is catching up: the log keeps every step
    state = LocalState("r", model, make_optimizer(model.parameters()),
                       FlatLayout(trainable(model)), ReplicatedObjects(), None, log,
                       lambda step: None)
    state.start()
    return state


def _live_step(state: LocalState, step: int, head_from: int = 0) -> None:
    """One step of the loop: forward and backward on this step's batch, then the commit."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
    state.model(x, with_head=step >= head_from).float().pow(2).mean().backward()
    state.commit(state._layout.pack(), epoch=1)


def _snapshot(state: LocalState) -> bytes:
    """What a donor serves (the catch-up snapshot) or the epoch's state sync sends."""
    return state.serialize()


def _catch_up(joiner: LocalState, snapshot: bytes, donor: LocalState, after: int) -> None:
    """Load the donor's snapshot of step ``after``, then replay its logged steps since."""
    joiner.load_serialized(snapshot, torch.device("cpu"))
    for step, update in donor.update_log.entries():
        if step > after:
            joiner.replay(update)


def _optimizer_tensors(state: LocalState) -> list[torch.Tensor]:
    return list(tree_tensors(state.optimizer.state_dict()["state"]))


def _assert_same(a: LocalState, b: LocalState) -> None:
    assert a.step == b.step and a.chain == b.chain
    ours, theirs = _optimizer_tensors(a), _optimizer_tensors(b)
    assert [(t.dtype, t.shape) for t in ours] == [(t.dtype, t.shape) for t in theirs]
    assert all(torch.equal(x, y) for x, y in zip(ours, theirs))
    assert a.digest() == b.digest()


def test_an_optimizer_that_writes_into_grad_catches_up_bit_for_bit():
    # SGD's foreach Nesterov step adds the momentum into .grad in place (foreach is torch's
    # default for CUDA tensors): the logged average must stay what the step ran on.
    def nesterov(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, foreach=True)
    donor, joiner = _replica(nesterov), _replica(nesterov)
    for step in range(2):
        _live_step(donor, step)
    snapshot = _snapshot(donor)
    for step in range(2, 7):
        _live_step(donor, step)
    _catch_up(joiner, snapshot, donor, after=2)
    _assert_same(donor, joiner)


class LateClippingSGD(torch.optim.SGD):
    """An optimizer that writes into .grad from its third step on only (a clip that starts to
    bite): the first step shows no write."""

    def step(self, closure=None):
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps >= 3:
            for group in self.param_groups:
                torch._foreach_mul_([p.grad for p in group["params"] if p.grad is not None],
                                    0.5)
        return super().step(closure)


def test_a_write_into_grad_that_starts_later_drops_that_step_from_the_log_and_no_more():
    def late_clipping(params):
        return LateClippingSGD(params, lr=0.05)
    donor, joiner = _replica(late_clipping), _replica(late_clipping)
    for step in range(3):
        _live_step(donor, step)
    # Step 3 ran on the average itself and wrote into it: its entry would replay otherwise
    # than it ran, so the log restarts after it, and the steps after run on a copy.
    assert [s for s, _ in donor.update_log.entries()] == []
    snapshot = _snapshot(donor)
    for step in range(3, 6):
        _live_step(donor, step)
    assert [s for s, _ in donor.update_log.entries()] == [4, 5, 6]
    joiner.optimizer.steps = 3  # what the donor's optimizer object counted (not its state)
    _catch_up(joiner, snapshot, donor, after=3)
    _assert_same(donor, joiner)


def test_an_optimizer_that_leaves_grad_alone_steps_on_the_logged_average_itself():
    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)
    donor = _replica(adamw)
    shared = []
    donor.optimizer.register_step_pre_hook(lambda *_: shared.append(
        donor.model.trunk.weight.grad.untyped_storage().data_ptr()))
    for step in range(3):
        _live_step(donor, step)
    logged = [u.grad.untyped_storage().data_ptr() for _, u in donor.update_log.entries()]
    # the first step ran on a copy (to find out), the later ones on the average itself
    assert shared[0] != logged[0] and shared[1:] == logged[1:]


def test_a_catch_up_into_an_optimizer_with_state_takes_the_slots_it_lacks():
    # The receiver has state for the trunk only (it stepped before the head was first used);
    # the donor's state has slots for the head too. A repair loads the same way.
    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2)
    donor, receiver = _replica(adamw), _replica(adamw)
    _live_step(receiver, 0, head_from=3)
    assert len(receiver.optimizer.state) == 2  # the trunk's weight and bias
    for step in range(5):
        _live_step(donor, step, head_from=3)
    snapshot = _snapshot(donor)
    for step in range(5, 7):
        _live_step(donor, step, head_from=3)
    _catch_up(receiver, snapshot, donor, after=5)
    _assert_same(donor, receiver)


def test_a_received_slot_keeps_its_dtype_and_does_not_take_its_parameters():
    # fp32 moments of bf16 parameters: a load that cast them to bf16 would leave every
    # catch-up a little off, and every later comparison would report it.
    def fp32_momentum(params):
        return Fp32Momentum(params, lr=0.05)
    donor = _replica(fp32_momentum, torch.bfloat16)
    for step in range(3):
        _live_step(donor, step)
    fresh, stepped = _replica(fp32_momentum, torch.bfloat16), \
        _replica(fp32_momentum, torch.bfloat16)
    _live_step(stepped, 0)
    for receiver in (fresh, stepped):
        _catch_up(receiver, _snapshot(donor), donor, after=3)
        assert {t.dtype for t in _optimizer_tensors(receiver)} == {torch.float32}
        _assert_same(donor, receiver)
    for step in range(3, 5):  # and they go on alike
        for state in (donor, fresh, stepped):
            _live_step(state, step)
    _assert_same(donor, fresh)
    _assert_same(donor, stepped)


def test_a_slot_received_for_a_parameter_this_replica_never_stepped_is_adopted():
    # The lower layer: load_local_state itself, with a state read as the wire carries it.
    torch.manual_seed(0)
    donor, receiver = TrunkAndHead(), TrunkAndHead()
    donor_opt = torch.optim.AdamW(donor.parameters(), lr=1e-2)
    receiver_opt = torch.optim.AdamW(receiver.parameters(), lr=1e-2)
    for model, optimizer, head in ((donor, donor_opt, True), (receiver, receiver_opt, False)):
        model(torch.ones(2, 4), with_head=head).pow(2).mean().backward()
        optimizer.step()
    out = io.BytesIO()
    torch.save(local_state(donor, donor_opt), out)
    out.seek(0)
    load_local_state(receiver, receiver_opt, torch.load(out, weights_only=True))
    ours = list(tree_tensors(receiver_opt.state_dict()["state"]))
    theirs = list(tree_tensors(donor_opt.state_dict()["state"]))
    assert len(ours) == len(theirs) and all(torch.equal(x, y) for x, y in zip(ours, theirs))
