"""shards: a replica's state as local tensors, moved between two models in place (one process;
the FSDP2 case runs end to end in test_hsdp_ranks.py and test_cold_start.py)."""

from __future__ import annotations

import io

import torch

from ftsystem.training.catchup import tree_tensors
from ftsystem.training.shards import (flat_grads, grads_as_views, load_local_state, local_state,
                             release_grads)
from ftsystem.example.workload import MarkovLanguage, ModelConfig, TinyGPT

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
    flat = flat_grads(list(a[0].parameters()), None)
    grads_as_views(params, flat)
    assert all(p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for p in params)
    a[1].step()
    b[1].step()
    assert _same(a, b)
    release_grads(params)
    assert all(p.grad is None for p in params)

