"""HALoS update rules: hand-computed cases and properties (pure functions, no simulator)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ftsystem.halos import rules, timemodel
from ftsystem.halos.config import DelayedNesterovConfig
from ftsystem.halos.rules import NesterovState, ServerState

torch.set_num_threads(1)

floats = st.floats(min_value=-10, max_value=10, allow_nan=False, width=32)
vectors = st.lists(floats, min_size=1, max_size=6)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float64)


def run_nesterov(cfg: DelayedNesterovConfig, theta: torch.Tensor, grads):
    state = NesterovState.zeros_like(theta)
    for g in grads:
        theta, state = rules.delayed_nesterov(theta, g, state, cfg)
    return theta, state


# --- delayed Nesterov: hand-computed -------------------------------------------------------

def test_delayed_nesterov_by_hand_c0():
    # N = 2, lr = 0.5 -> step = lr * N = 1.0, beta = 0.5, c = 0.
    # g1 = (.2, .4): not a momentum step: theta -= 1.0 * g1/2 -> (1 - .1, 2 - .2) = (.9, 1.8).
    # g2 = (.6, 0): buf = (.8, .4), m = buf/2 = (.4, .2);
    #   theta -= 1.0 * (.5*m + g2/2) = (.2 + .3, .1 + 0) -> (.4, 1.7).
    # g3 = (.2, .2): c = 0, no momentum: theta -= g3/2 -> (.3, 1.6); m stays (.4, .2).
    cfg = DelayedNesterovConfig(lr=0.5, beta=0.5, buffer=2)
    theta, state = run_nesterov(cfg, t(1.0, 2.0), [t(.2, .4), t(.6, 0), t(.2, .2)])
    torch.testing.assert_close(theta, t(.3, 1.6))
    torch.testing.assert_close(state.momentum, t(.4, .2))
    torch.testing.assert_close(state.pending, t(.2, .2))
    assert state.count == 3


def test_delayed_nesterov_by_hand_c_half():
    # As above with c = .5; the momentum step's factor is 1 - c*N + c = .5.
    # g1: m = 0, so (.9, 1.8) as before.
    # g2: m = (.4, .2); theta -= .5*.5*m + g2/2 = (.1 + .3, .05 + 0) -> (.5, 1.75).
    # g3 = (.2, .2): theta -= c*beta*m + g3/2 = (.1 + .1, .05 + .1) -> (.3, 1.6).
    # g4 = (0, 0): buf = (.2, .2), m = .5*(.4, .2) + (.1, .1) = (.3, .2);
    #   theta -= .5*.5*m = (.075, .05) -> (.225, 1.55).
    cfg = DelayedNesterovConfig(lr=0.5, beta=0.5, buffer=2, c=0.5)
    theta, state = run_nesterov(cfg, t(1.0, 2.0), [t(.2, .4), t(.6, 0), t(.2, .2), t(0, 0)])
    torch.testing.assert_close(theta, t(.225, 1.55))
    torch.testing.assert_close(state.momentum, t(.3, .2))


def test_delayed_nesterov_does_not_change_its_arguments():
    theta, g = t(1.0, 2.0), t(.5, .5)
    state = NesterovState.zeros_like(theta)
    rules.delayed_nesterov(theta, g, state, DelayedNesterovConfig(lr=1, beta=.9))
    assert torch.equal(theta, t(1.0, 2.0)) and torch.equal(state.momentum, t(0, 0))


@settings(max_examples=40, deadline=None)
@given(lr=st.floats(0.01, 1.0), beta=st.floats(0.01, 0.99),
       grads=st.lists(st.lists(floats, min_size=3, max_size=3), min_size=1, max_size=6))
def test_buffer_1_c_0_is_pytorch_nesterov_sgd(lr, beta, grads):
    theta0 = t(0.5, -1.0, 2.0)
    theta, _ = run_nesterov(DelayedNesterovConfig(lr=lr, beta=beta, buffer=1), theta0,
                            [t(*g) for g in grads])
    p = nn.Parameter(theta0.clone())
    sgd = torch.optim.SGD([p], lr=lr, momentum=beta, nesterov=True)
    for g in grads:
        p.grad = t(*g)
        sgd.step()
    torch.testing.assert_close(theta, p.detach())


@settings(max_examples=40, deadline=None)
@given(lr=st.floats(0.01, 1.0), buffer=st.integers(1, 5),
       grads=st.lists(st.lists(floats, min_size=2, max_size=2), min_size=1, max_size=12))
def test_no_momentum_is_plain_sgd_with_lr_per_update(lr, buffer, grads):
    # beta = 0: whatever N is, each pseudo-gradient moves the model by lr * g.
    theta, _ = run_nesterov(DelayedNesterovConfig(lr=lr, beta=0.0, buffer=buffer), t(1.0, 1.0),
                            [t(*g) for g in grads])
    expected = t(1.0, 1.0) - lr * torch.stack([t(*g) for g in grads]).sum(dim=0)
    torch.testing.assert_close(theta, expected)


# --- servers ----------------------------------------------------------------------------------

def test_gps_by_hand():
    # The paper's GPS: lr .15, N = 2 -> step .3, beta .5.
    # delta .4: theta = 1 - .3 * .4/2 = .94.  delta .2: m = .6/2 = .3,
    # theta = .94 - .3 * (.5*.3 + .2/2) = .94 - .075 = .865.
    cfg = DelayedNesterovConfig(lr=0.15, beta=0.5, buffer=2)
    state = ServerState.start(t(1.0))
    for delta in (t(.4), t(.2)):
        state = rules.server_apply(state, delta, cfg)
    torch.testing.assert_close(state.theta, t(.865))


def test_diloco_round_by_hand():
    # Mean pseudo-gradient .3; Nesterov lr .7, momentum .9: m = .3,
    # theta = 1 - .7 * (.3 + .9 * .3) = 1 - .399 = .601.
    cfg = DelayedNesterovConfig(lr=0.7, beta=0.9)
    state = rules.diloco_round(ServerState.start(t(1.0)), [t(.2), t(.4)], cfg)
    torch.testing.assert_close(state.theta, t(.601))


def test_lps_sends_after_k_updates_and_merges():
    # Plain SGD at the LPS (lr 1, beta 0) so each update subtracts g. K = 2.
    cfg = DelayedNesterovConfig(lr=1.0, beta=0.0)
    lps = rules.LpsState.start(t(1.0, 1.0))
    lps, delta = rules.lps_apply(lps, t(.5, 0), cfg, accumulation_k=2)
    assert delta is None
    lps, delta = rules.lps_apply(lps, t(0, .25), cfg, accumulation_k=2)
    torch.testing.assert_close(delta, t(.5, .25))            # anchor (1, 1) - (.5, .75)
    lps, delta = rules.lps_apply(lps, t(.5, .5), cfg, accumulation_k=2)
    assert delta is None                                      # waiting for the global model
    torch.testing.assert_close(lps.server.theta, t(0, .25))
    lps = rules.lps_merge(lps, t(2.0, 2.0), alpha=0.25)       # .75*(0, .25) + .25*(2, 2)
    torch.testing.assert_close(lps.server.theta, t(.5, .6875))
    torch.testing.assert_close(lps.anchor, t(.5, .6875))
    assert lps.since_merge == 0
    lps, _ = rules.lps_apply(lps, t(.1, .1), cfg, accumulation_k=2)
    lps, delta = rules.lps_apply(lps, t(.1, .1), cfg, accumulation_k=2)
    torch.testing.assert_close(delta, t(.2, .2))              # measured from the new anchor


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 6), n=st.integers(0, 15))
def test_lps_sends_once_per_merge(k, n):
    lps, sent = rules.LpsState.start(t(0.0)), 0
    for _ in range(n):
        lps, delta = rules.lps_apply(lps, t(1.0), DelayedNesterovConfig(lr=.1, beta=.9, buffer=2),
                                     accumulation_k=k)
        sent += delta is not None
    assert sent == (1 if n >= k else 0)


def test_merge_by_hand():
    torch.testing.assert_close(rules.merge(t(1, 3), t(3, -1), 0.25), t(1.5, 2.0))


@settings(max_examples=50, deadline=None)
@given(pair=st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(floats, min_size=n, max_size=n), st.lists(floats, min_size=n, max_size=n))))
def test_merge_alpha_0_is_identity_and_1_is_global(pair):
    local, global_ = t(*pair[0]), t(*pair[1])
    assert torch.equal(rules.merge(local, global_, 0.0), local)
    assert torch.equal(rules.merge(local, global_, 1.0), global_)


# --- worker ---------------------------------------------------------------------------------

class Quadratic(nn.Module):
    """loss = |w - target|^2 / 2, so the gradient is w - target."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n, dtype=torch.float64))

    def loss(self, target: torch.Tensor) -> torch.Tensor:
        return ((self.w - target) ** 2).sum() / 2


def test_local_sgd_by_hand():
    # SGD from w = 1 towards 0: grad = w. lr .1: w = .9; lr .2: w = .9 - .18 = .72.
    # Pseudo-gradient = received - local = 1 - .72 = .28.
    model = Quadratic(1)
    received = t(1.0)
    grad, losses = rules.local_sgd(model, torch.optim.SGD(model.parameters(), lr=0.1), received,
                                   [t(0.0), t(0.0)], [0.1, 0.2], grad_clip=0.0)
    torch.testing.assert_close(grad, t(.28))
    assert losses == pytest.approx([0.5, 0.405])
    assert torch.equal(received, t(1.0))  # the server's tensor is untouched


def test_local_sgd_clips_gradients():
    # grad 1 clipped to .5: w = 1 - .05 = .95; grad .95 clipped to .5: w = .9 -> pseudo-grad .1.
    model = Quadratic(1)
    grad, _ = rules.local_sgd(model, torch.optim.SGD(model.parameters(), lr=0.1), t(1.0),
                              [t(0.0), t(0.0)], [0.1, 0.1], grad_clip=0.5)
    torch.testing.assert_close(grad, t(.1))


@settings(max_examples=20, deadline=None)
@given(values=vectors)
def test_zero_local_steps_give_zero_pseudo_gradient(values):
    model = Quadratic(len(values))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grad, losses = rules.local_sgd(model, opt, t(*values), [], [], grad_clip=1.0)
    assert torch.count_nonzero(grad) == 0 and losses == []


def test_pseudo_gradient_is_received_minus_local():
    torch.testing.assert_close(rules.pseudo_gradient(t(1, 2), t(.5, 3)), t(.5, -1))


@pytest.mark.parametrize("h,speed,max_speed,expected", [
    (8, 0.907, 0.907, 8),     # the fastest worker keeps H
    (8, 0.232, 0.907, 3),     # 8 * .2558 = 2.05 -> 3
    (32, 0.107, 0.907, 4),    # 32 * .1180 = 3.78 -> 4
    (8, 0.3, 0.3, 8),         # an integer up to float error gains no step
    (1, 0.01, 1.0, 1),        # at least one step
])
def test_scaled_local_steps(h, speed, max_speed, expected):
    assert rules.scaled_local_steps(h, speed, max_speed) == expected


@given(h=st.integers(1, 64), speed=st.floats(0.001, 1.0))
def test_scaled_local_steps_within_1_and_h(h, speed):
    assert 1 <= rules.scaled_local_steps(h, speed, 1.0) <= h


def test_warmup_cosine_lr_by_hand():
    # warmup 10, total 110: half way through warmup .5; half way through decay
    # .1 + .9 * .5 * (1 + cos(pi/2)) = .55; the end and beyond .1 (of max 1e-3).
    lr = lambda i: rules.warmup_cosine_lr(i, max_lr=1e-3, warmup=10, total=110)  # noqa: E731
    assert [lr(0), lr(5), lr(10), lr(60), lr(110), lr(500)] == pytest.approx(
        [0, 5e-4, 1e-3, 5.5e-4, 1e-4, 1e-4])


# --- time model -----------------------------------------------------------------------------

PAPER_BW = [[100.0, 0.537, 0.935, 0.202], [0.537, 100.0, 0.386, 0.117],
            [0.935, 0.386, 100.0, 0.127], [0.202, 0.117, 0.127, 100.0]]


def test_time_model_by_hand():
    assert timemodel.transfer_s(10**9, 8.0) == pytest.approx(1.0)        # 8 Gbit over 8 Gbit/s
    assert timemodel.compute_s(8, 0.5, 0.25) == pytest.approx(4.0)
    assert timemodel.ring_allreduce_s(10**9, 4, 8.0) == pytest.approx(1.5)  # 6 chunks of .25 s
    assert timemodel.ring_allreduce_s(10**9, 1, 8.0) == 0.0
    assert timemodel.async_job_s(model_bytes=10**9, gbps=8.0, steps=8, speed=0.5,
                                 step_time_s=0.25) == pytest.approx(6.0)


def test_best_ring_of_the_paper():
    # Every ring enters and leaves region 3 over two of .202, .117, .127: best .202 & .127,
    # e.g. 0-1-2-3-0 whose slowest link is .127.
    assert timemodel.best_ring_gbps(PAPER_BW) == 0.127
    assert timemodel.best_ring_gbps([[5.0]]) == 5.0
    assert math.isclose(timemodel.best_ring_gbps([[1, 2], [2, 1]]), 2)
