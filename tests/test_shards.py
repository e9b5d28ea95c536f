"""shards: a replica's state as local tensors, moved between two models in place (one process,
and two Gloo ranks for FSDP2's shards; the FSDP2 case runs end to end in test_hsdp_ranks.py and
test_cold_start.py)."""

from __future__ import annotations

import io
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from ftsystem.control.etcd_server import free_port
from ftsystem.training.flat import FlatLayout, forward_buffers, release_grads
from ftsystem.training.shards import load_local_state, local_state
from ftsystem.training.wire import tree_tensors
from ftsystem.example.workload import MarkovLanguage, ModelConfig, TinyGPT
from renaming_model import FusedPair

LANGUAGE = MarkovLanguage()


def _replica(seed: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(ModelConfig())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: TinyGPT, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        model.loss(LANGUAGE.batch(shard=0, step=step, batch_size=4, seq_len=32)).backward()
        optimizer.step()


def _same(a: tuple, b: tuple) -> bool:
    left = list(tree_tensors([a[0].state_dict(), a[1].state_dict()]))
    right = list(tree_tensors([b[0].state_dict(), b[1].state_dict()]))
    return len(left) == len(right) and all(torch.equal(x, y) for x, y in zip(left, right))


def test_a_serialized_state_loads_in_place_into_a_fresh_replica_bit_for_bit():
    donor, joiner = _replica(0), _replica(1)
    _train(*donor, range(3))
    buf = io.BytesIO()
    torch.save(local_state(*donor), buf)  # what the snapshot and the state sync send
    buf.seek(0)
    load_local_state(*joiner, torch.load(buf, weights_only=True))
    assert _same(donor, joiner)
    _train(*donor, range(3, 5))  # and they stay equal when they go on alike
    _train(*joiner, range(3, 5))
    assert _same(donor, joiner)


def test_a_fresh_optimizer_adopts_the_received_slots_without_a_step_or_a_copy():
    donor, joiner = _replica(0), _replica(1)
    _train(*donor, range(3))
    received = torch.load(_saved(local_state(*donor)), weights_only=True)
    steps = []
    joiner[1].register_step_pre_hook(lambda *_: steps.append(1))
    load_local_state(*joiner, received)
    assert not steps  # DCP would have created the state with a step at lr 0
    adopted = {p: s for p, s in joiner[1].state.items()}
    names = dict(joiner[0].named_parameters())
    assert all(adopted[names[name]][slot] is tensor
               for name, slots in received["optim"].items() for slot, tensor in slots.items())
    assert _same(donor, joiner)


def test_a_model_whose_names_differ_from_dcps_gets_the_slots_copied_bit_for_bit():
    donor, joiner = _replica(0), _replica(1)
    _train(*donor, range(3))
    wrapped = torch.compile(joiner[0])  # named "_orig_mod.*"; DCP strips the prefix
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    load_local_state(wrapped, optimizer, torch.load(_saved(local_state(*donor)),
                                                     weights_only=True))
    assert _same(donor, (joiner[0], optimizer))


def _saved(state: dict) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_reading_a_state_does_not_initialize_the_optimizer():
    model, optimizer = _replica(0)
    before = [p.clone() for p in model.parameters()]
    assert local_state(model, optimizer)["optim"] == {} and not optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_unstepped_state_resets_a_stepped_optimizer():
    fresh, trained = _replica(0), _replica(1)
    _train(*trained, range(2))
    load_local_state(*trained, local_state(*fresh))
    assert not trained[1].state and _same(fresh, trained)


def test_flat_gradients_as_views_give_the_same_step_without_copies():
    a, b = _replica(0), _replica(0)
    a[1].zero_grad()
    a[0].loss(LANGUAGE.batch(shard=0, step=9, batch_size=4, seq_len=32)).backward()
    params = list(b[0].parameters())
    flat = FlatLayout(list(a[0].parameters())).pack()
    FlatLayout(params).unpack(flat)
    assert all(p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for p in params)
    a[1].step()
    b[1].step()
    assert _same(a, b)
    release_grads(params)
    assert all(p.grad is None for p in params)



class CountingSGD(torch.optim.SGD):
    """An optimizer whose per-parameter state holds plain Python numbers beside tensors (as
    Adafactor-style optimizers keep step counts and running scalars)."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                slots = self.state[p]
                slots["steps"] = slots.get("steps", 0) + 1
                slots["scale"] = slots.get("scale", 1.0) * 0.9
                slots["moment"] = slots.get("moment", torch.zeros_like(p)) + p.detach()


def _sgd_replica(seed: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyGPT(ModelConfig())
    return model, CountingSGD(model.parameters(), lr=1e-2)


def _slots(optimizer: torch.optim.Optimizer) -> list:
    return [(s["steps"], s["scale"], s["moment"].sum().item())
            for s in optimizer.state.values()]


def test_non_tensor_optimizer_slots_move_to_a_stepped_and_to_a_fresh_optimizer():
    donor = _sgd_replica(0)
    _train(*donor, range(3))
    for stepped in (True, False):
        receiver = _sgd_replica(1)
        if stepped:
            _train(*receiver, range(1))
        load_local_state(*receiver, torch.load(_saved(local_state(*donor)), weights_only=True))
        assert _slots(receiver[1]) == _slots(donor[1]) and _same(donor, receiver), stepped


def test_mixed_dtype_parameters_average_in_one_buffer_and_step_in_their_own_dtype():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].to(torch.bfloat16)
    params = list(model.parameters())
    x = torch.randn(3, 4)
    model[1](model[0](x).to(torch.bfloat16)).float().pow(2).mean().backward()
    expected = [p.grad.clone() for p in params]
    flat = FlatLayout(params).pack()
    assert flat.dtype == torch.float32
    release_grads(params)
    FlatLayout(params).unpack(flat)
    assert [p.grad.dtype for p in params] == [p.dtype for p in params]
    assert all(torch.equal(g, p.grad) for g, p in zip(expected, params))


def test_a_parameter_no_member_used_keeps_no_gradient_as_under_ddp():
    # An unused branch (an expert no token was routed to): zeros would let AdamW's weight
    # decay and momentum move it; DDP leaves its gradient None, and so does the average.
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    params = [*used.parameters(), *unused.parameters()]
    used(torch.randn(2, 3)).sum().backward()
    flat = FlatLayout(params).pack()
    other_member = FlatLayout(params).pack()
    summed = flat + other_member
    release_grads(params)
    FlatLayout(params).unpack(summed / 2)
    assert all(p.grad is not None for p in used.parameters())
    assert all(p.grad is None for p in unused.parameters())
    before = [p.detach().clone() for p in unused.parameters()]
    torch.optim.AdamW(params, lr=0.1, weight_decay=0.5).step()
    assert all(torch.equal(b, p) for b, p in zip(before, unused.parameters()))


def test_a_parameter_one_member_used_gets_the_average_with_the_others_zeros():
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3)
    params = list(layer.parameters())
    layer(torch.randn(2, 3)).sum().backward()
    mine = FlatLayout(params).pack()
    expected = [p.grad.clone() / 2 for p in params]
    release_grads(params)
    theirs = FlatLayout(params).pack()  # no gradient at all on the other member
    FlatLayout(params).unpack((mine + theirs) / 2)
    assert all(torch.equal(e, p.grad) for e, p in zip(expected, params))


def test_non_persistent_buffers_travel_with_the_state():
    # A buffer left out of state_dict() (persistent=False: a mask, a table, a counter a
    # forward updates) is replicated state all the same.
    def replica(fill: float):
        model = torch.nn.Linear(2, 2)
        model.register_buffer("seen", torch.full((3,), fill), persistent=False)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)
    donor, receiver = replica(7.0), replica(0.0)
    state = local_state(*donor)
    assert torch.equal(state["buffers"]["seen"], torch.full((3,), 7.0))
    load_local_state(*receiver, torch.load(_saved(state), weights_only=True))
    assert torch.equal(receiver[0].seen, torch.full((3,), 7.0))


def test_a_model_whose_state_dict_renames_its_tensors_moves_them_as_its_modules_hold_them():
    replicas = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(FusedPair(), torch.nn.Linear(8, 2))
        replicas.append((model, torch.optim.AdamW(model.parameters(), lr=1e-2)))
    (donor, donor_opt), (joiner, joiner_opt) = replicas
    donor(torch.ones(3, 4)).sum().backward()
    donor_opt.step()
    state = local_state(donor, donor_opt)
    assert "0.fused.weight" in state["model"] and "0.a.weight" not in state["model"]
    load_local_state(joiner, joiner_opt, torch.load(_saved(state), weights_only=True))
    assert all(torch.equal(a, b) for a, b in zip(donor.parameters(), joiner.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(
        tree_tensors(donor_opt.state_dict()), tree_tensors(joiner_opt.state_dict())))


def _fsdp2_rank(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = TinyGPT(ModelConfig())
        for block in model.blocks.layers:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        _train(model, optimizer, range(2))
        shards = {n: p.to_local().clone() for n, p in model.named_parameters()}
        with torch.no_grad():  # FSDP2 leaves the root's parameters unsharded after this
            model.loss(LANGUAGE.batch(shard=1, step=0, batch_size=4, seq_len=32))
        state = torch.load(_saved(local_state(model, optimizer)), weights_only=True)
        assert all(torch.equal(state["model"][n], s) for n, s in shards.items())
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().zero_()
            model.loss(LANGUAGE.batch(shard=1, step=0, batch_size=4, seq_len=32))
        load_local_state(model, optimizer, state)
        assert all(torch.equal(p.to_local(), shards[n]) for n, p in model.named_parameters())
    finally:
        dist.destroy_process_group()


def test_an_fsdp2_replica_reads_and_loads_its_shards_after_a_forward_without_backward():
    mp.spawn(_fsdp2_rank, args=(2, free_port()), nprocs=2)


def _batch_norm_member(dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6)).to(dtype)
    return model, FlatLayout(list(model.parameters()), forward_buffers(model))


def test_a_member_with_no_gradient_at_all_sends_its_statistics_not_zeros():
    # A member that skipped its batch's backward commits with no gradient at all: its running
    # statistics are what it holds, and the average must not be pulled toward zero.
    (model, layout), (idle, idle_layout) = _batch_norm_member(), _batch_norm_member()
    for member in (model, idle):
        member[1].num_batches_tracked.fill_(40)
        member[1].running_mean.fill_(1.0)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    expected_mean = (model[1].running_mean + idle[1].running_mean) / 2
    summed = layout.pack() + idle_layout.pack()
    release_grads(list(model.parameters()))
    layout.unpack(summed / 2)
    assert torch.equal(model[1].running_mean, expected_mean)
    assert model[1].num_batches_tracked.item() == 40  # (41 + 40) / 2, not (41 + 0) / 2


def test_a_joiner_join_step_sends_zeros_for_the_statistics_too():
    # The join step's sum is divided by the members that sent gradients: the joiner's
    # statistics must not count.
    (model, layout), (joiner, joiner_layout) = _batch_norm_member(), _batch_norm_member()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    expected = [b.clone() for b in forward_buffers(model)]
    summed = layout.pack() + joiner_layout.pack(statistics=False)
    release_grads(list(model.parameters()))
    joiner_layout.unpack(summed)
    assert all(torch.equal(e, b) for e, b in zip(expected, forward_buffers(joiner)))


def test_statistics_and_counters_of_a_bf16_model_travel_without_rounding():
    # bf16 holds integers exactly only up to 256: 300 + 1 would stay 300 in a bf16 buffer.
    members = [_batch_norm_member(torch.bfloat16) for _ in range(2)]
    for model, _ in members:
        model[1].num_batches_tracked.fill_(300)
        model(torch.randn(8, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    (model, layout), (other, other_layout) = members
    expected = ((model[1].running_var.float() + other[1].running_var.float()) / 2) \
        .to(torch.bfloat16)
    summed = layout.pack() + other_layout.pack()
    layout.unpack(summed / 2)
    assert model[1].num_batches_tracked.item() == 301
    assert torch.equal(model[1].running_var, expected)
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
