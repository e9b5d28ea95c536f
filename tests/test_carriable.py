"""What replicated state may hold besides tensors: it loads back exactly (types and bits)
through the safe loader, and what cannot is named before it has to travel."""

from __future__ import annotations

import collections
import dataclasses
import enum
import io
import os
import pickle
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from ftsystem.training import carriable
from ftsystem.training.replicated import ReplicatedObjects
from ftsystem.training.wire import decode_state, encode_state


class Phase(enum.Enum):
    WARMUP = 1
    DECAY = 2


class NeverAllowed(enum.Enum):
    ON = 1


@dataclasses.dataclass(frozen=True)
class Window:
    start: int
    counts: collections.defaultdict


class Span(NamedTuple):
    start: int
    stop: int


class Opaque:
    pass


class Calls:
    """Unpickles as the call ``fn(arg)``: what a crafted state would do."""

    def __init__(self, fn: Any, arg: str) -> None:
        self.fn, self.arg = fn, arg

    def __reduce__(self) -> tuple:
        return self.fn, (self.arg,)


carriable.allow(Phase, Window, Span)


def _same(a: Any, b: Any) -> bool:
    """Equal in type and value, bit for bit (a NaN's payload too), containers' kinds included."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, (np.generic, np.ndarray)):
        return a.dtype == b.dtype and np.shape(a) == np.shape(b) and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return getattr(a, "default_factory", None) is getattr(b, "default_factory", None) and \
            list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return _same(vars(a), vars(b))
    return a == b


def _round_trip(state: Any) -> Any:
    out = io.BytesIO()
    torch.save(state, out)
    return carriable.load(out.getvalue())


def _numpy_cosine_training() -> tuple[torch.optim.Optimizer, LambdaLR]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    scheduler = LambdaLR(optimizer, lambda step: 0.5 * (1 + np.cos(np.pi * step / 100)))
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    return optimizer, scheduler


def test_a_numpy_lr_schedule_and_its_optimizer_round_trip_bit_exactly():
    optimizer, scheduler = _numpy_cosine_training()
    assert type(optimizer.param_groups[0]["lr"]) is np.float64  # what LambdaLR puts there
    for state in (scheduler.state_dict(), optimizer.state_dict()):
        carriable.check(state, "state")
        assert _same(_round_trip(state), state)


NAN_WITH_PAYLOAD = np.array([0x7FF8000000000123], dtype=np.uint64).view(np.float64)[0]


@pytest.mark.parametrize("value", [
    *(np.dtype(name).type(1) for name in carriable._NUMPY_DTYPES),
    np.float64(0.1), NAN_WITH_PAYLOAD, np.int64(-2**63), np.uint64(2**64 - 1), np.bool_(False),
    np.arange(6, dtype=np.float32).reshape(2, 3), np.array([NAN_WITH_PAYLOAD]),
    np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)), np.array([], dtype=np.uint8),
    Phase.DECAY, {Phase.WARMUP: 1}, Span(1, 2),
    collections.defaultdict(int, a=3), collections.defaultdict(list),
    collections.defaultdict(collections.defaultdict, x=collections.defaultdict(float, y=1.5)),
    collections.defaultdict(Phase), Window(3, collections.defaultdict(int, b=2)),
    slice(1, None, 2), collections.OrderedDict([("b", 1), ("a", 2)]),
    collections.Counter(a=3), b"", b"\x00\xff", {1, 2}, 1 + 2j,
], ids=repr)
def test_an_allowed_value_round_trips_exactly(value):
    state = {"leaf": value, "in_list": [value, (value,)]}
    carriable.check(state, "state")
    assert _same(_round_trip(state), state)


def test_a_defaultdict_stays_one_thing_where_it_is_shared():
    shared = collections.defaultdict(int, a=1)
    back = _round_trip({"x": shared, "y": [shared]})
    assert back["x"] is back["y"][0]
    back["x"]["missing"] += 1
    assert back["y"][0]["missing"] == 1


def test_a_registered_objects_state_crosses_a_snapshot_with_its_kinds():
    class Stats:
        def __init__(self) -> None:
            self.counts = collections.defaultdict(int)
            self.order = collections.OrderedDict()
            self.phase = Phase.WARMUP

        def state_dict(self) -> dict[str, Any]:
            return {"counts": self.counts, "order": self.order, "phase": self.phase,
                    "scale": np.float32(0.5), "mask": torch.ones(3)}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.counts, self.order, self.phase = state["counts"], state["order"], state["phase"]

    stats = Stats()
    stats.counts["seen"] += 2
    stats.order["z"] = 1
    sender = ReplicatedObjects()
    sender.register("stats", stats)
    out = io.BytesIO()
    encode_state(1, sender.step_state()).write_to(out)
    out.seek(0)
    _, received = decode_state(lambda buffer: out.readinto(buffer))
    assert _same(received, {"stats": stats.state_dict()})


def test_an_unknown_class_is_named_with_its_object_and_place():
    state = {"_last_lr": [0.1, Opaque()]}
    with pytest.raises(carriable.NotCarriable) as refused:
        carriable.check(state, "registered object 'lr_schedule'")
    message = str(refused.value)
    assert "registered object 'lr_schedule'" in message
    assert "['_last_lr'][1]" in message and "test_carriable.Opaque" in message
    assert "ftsystem.training.carriable.allow(" in message


@pytest.mark.parametrize("state, place, culprit", [
    ({"phase": NeverAllowed.ON}, "['phase']", "NeverAllowed"),
    ({"by_phase": {NeverAllowed.ON: 1}}, "['by_phase'][<NeverAllowed.ON: 1>] (its key)",
     "NeverAllowed"),
    ({"counts": collections.defaultdict(Opaque)}, "['counts']", "Opaque"),
    ({"objects": np.array([1, "a"], dtype=object)}, "['objects']", "ObjectDType"),
    ({"fn": [lambda: 0]}, "['fn'][0]", "function"),
], ids=["enum", "enum key", "defaultdict factory", "object array", "lambda"])
def test_what_the_safe_loader_refuses_is_found_and_placed(state, place, culprit):
    with pytest.raises(carriable.NotCarriable, match="optimizer state") as refused:
        carriable.check(state, "optimizer state")
    assert f"at {place} is refused" in str(refused.value) and culprit in str(refused.value)


def test_check_carriable_names_the_registered_object():
    class Holder:
        def state_dict(self) -> dict[str, Any]:
            return {"inner": {"thing": Opaque()}}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    objects = ReplicatedObjects()
    objects.register("lr_schedule", _numpy_cosine_training()[1])
    objects.check_carriable()
    objects.register("holder", Holder(), advanced_by="loop")
    with pytest.raises(carriable.NotCarriable,
                       match=r"registered object 'holder'.*\['inner'\]\['thing'\]"):
        objects.check_carriable()


@pytest.mark.parametrize("fn, arg", [
    (os.system, "touch {}"), (eval, "open({!r}, 'w')"), (exec, "open({!r}, 'w')"),
    (__import__, "os"), (getattr, "{}"),
], ids=["os.system", "eval", "exec", "__import__", "getattr"])
def test_a_state_that_calls_a_function_is_still_refused(tmp_path, fn, arg):
    marker = tmp_path / "ran"
    out = io.BytesIO()
    torch.save({"lr": Calls(fn, arg.format(str(marker)))}, out)
    with pytest.raises(pickle.UnpicklingError):
        carriable.load(out.getvalue())
    assert not marker.exists()


def test_only_classes_can_be_allowed():
    with pytest.raises(TypeError, match="only classes"):
        carriable.allow(eval)


def test_a_defaultdict_loaded_past_carriable_says_where_it_loads():
    out = io.BytesIO()
    torch.save(collections.defaultdict(int), out)
    out.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="carriable.load"):
        torch.load(out, weights_only=True)
