"""The user's stateful objects that every replica holds identically, beside model and optimizer.

A training loop has more state than parameters and optimizer slots: a learning-rate schedule,
a data loader's position, a ``GradScaler``, an EMA of the weights, maybe the RNG. Each is
registered once, before ``FTReplica.start()``, with the name it travels under:

.. code-block:: python

    ft.register("lr_schedule", scheduler)                    # advanced by the step function
    ft.register("ema", ema)
    batches = ft.register_data("data", loader)               # advanced by the loop itself

How an object reaches a replica that lacks it depends on who advances it:

- ``advanced_by="step"`` (the default): the step function (``FTReplica(step_fn=...)``, run
  after averaging) advances it, live and when a logged step is replayed, so replay reproduces
  it; its whole state travels only with full state (snapshots, the epoch's state sync, disk
  checkpoints).
- ``advanced_by="loop"``: the loop advances it outside the step (a data loader yields the next
  batch before backward). Replay cannot reproduce that, so its ``state_dict()`` is recorded
  after every commit (it must be small: a position, counters, an RNG state) and travels with
  each logged update as well.

Registered state must be the same on every replica at equal steps: it is part of the state
fingerprint (``ftsystem.training.fingerprint``), and a replica whose registered state differs is reported
as diverged. A data loader registered here therefore must not hold its replica's shard in its
state (a sampler's position does not; a ``DistributedSampler``'s rank is a constructor argument).
"""

from __future__ import annotations

import io
from typing import Any, Iterator, Literal, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

from ftsystem.training import carriable
from ftsystem.training.data import Passes, why_not_resumable
from ftsystem.training.fingerprint import state_digest
from ftsystem.training.wire import map_tensors

AdvancedBy = Literal["step", "loop"]
RESERVED = ("model", "optim", "hyper", "step", "objects", "carry", "chain")


class RegistrationError(ValueError):
    """An object cannot be registered (no ``state_dict``, a taken name, too late)."""


class RegistrationMismatch(RuntimeError):
    """Replicas of one job registered different objects: their states cannot be compared or
    exchanged. Every replica of a job must run the same program."""


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ReplicatedObjects:
    """The registry: names, objects and who advances them; their states as one tree."""

    def __init__(self) -> None:
        self._objects: dict[str, tuple[Stateful, AdvancedBy]] = {}
        self._frozen = False

    def register(self, name: str, obj: Any, advanced_by: AdvancedBy = "step") -> None:
        if self._frozen:
            raise RegistrationError(
                f"register({name!r}) after start(): a replica that joined may already have "
                "received the job's state without it. Register every object before start() "
                "(or before entering `with FTReplica(...)`)")
        if not isinstance(obj, Stateful):
            raise RegistrationError(
                f"register({name!r}, {type(obj).__name__}): the object has no state_dict() and "
                "load_state_dict(); wrap it in a class that has both")
        if advanced_by not in ("step", "loop"):
            raise RegistrationError(f"register({name!r}): advanced_by must be 'step' (the step "
                                    f"function advances it) or 'loop', not {advanced_by!r}")
        if not name or name in self._objects or name in RESERVED:
            raise RegistrationError(f"register({name!r}): the name is empty, taken, or one of "
                                    f"{', '.join(RESERVED)}")
        self._objects[name] = (obj, advanced_by)

    def freeze(self) -> None:
        self._frozen = True

    def signature(self) -> str:
        """What every replica of a job must agree on: the names and who advances each."""
        return ",".join(f"{name}:{by}" for name, (_, by) in sorted(self._objects.items()))

    def _named(self, advanced_by: AdvancedBy) -> dict[str, Stateful]:
        return {n: obj for n, (obj, by) in self._objects.items() if by == advanced_by}

    def step_state(self) -> dict[str, Any]:
        """The step-advanced objects' states (tensors by reference: copy before the next step
        if they must stay; the containers are fresh, so later reassignments do not leak in)."""
        return {n: map_tensors(obj.state_dict(), _local)
                for n, obj in self._named("step").items()}

    def carry(self) -> bytes:
        """The loop-advanced objects' states, serialized now (the loop will move them on)."""
        states = {n: obj.state_dict() for n, obj in self._named("loop").items()}
        if not states:
            return b""
        out = io.BytesIO()
        torch.save(states, out)
        return out.getvalue()

    def decode(self, carry: bytes) -> dict[str, Any]:
        """The states in a :meth:`carry` (for comparing them: serialized bytes need not be)."""
        if not carry:
            return {}
        return carriable.load(carry, map_location="cpu")

    def check_carriable(self) -> None:
        """Raise :class:`~ftsystem.training.carriable.NotCarriable`, naming the object, if a
        registered object's current state holds a value replicas cannot exchange."""
        for name, (obj, _) in self._objects.items():
            carriable.check(obj.state_dict(), f"registered object {name!r}")

    def load_step_state(self, states: dict[str, Any]) -> None:
        for name, obj in self._named("step").items():
            obj.load_state_dict(_sharded_as(obj.state_dict(), states[name]))

    def load_carry(self, carry: bytes) -> None:
        if not carry:
            return
        states = self.decode(carry)
        for name, obj in self._named("loop").items():
            obj.load_state_dict(states[name])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (the EMA of an FSDP2 model) as the shard this rank holds: states cross
    replicas shard by shard, rank k to rank k, as plain tensors."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sharded_as(own: Any, received: Any) -> Any:
    """``received`` (plain tensors) with each tensor that is a DTensor in ``own`` (the
    object's current state) made the same DTensor again, so ``load_state_dict`` copies a shard
    into its shard."""
    places = {}
    map_tensors(own, lambda place, t: places.setdefault(place, t), with_place=True)

    def like(place: tuple, tensor: torch.Tensor) -> torch.Tensor:
        mine = places.get(place)
        if not isinstance(mine, DTensor) or isinstance(tensor, DTensor):
            return tensor
        return DTensor.from_local(tensor.to(mine.device), mine.device_mesh, mine.placements,
                                  shape=mine.shape, stride=mine.stride(), run_check=False)
    return map_tensors(received, like, with_place=True)


class Batches:
    """Batches of a stateful data loader, one per ``next()``, the same on every replica whether
    or not it ever loaded the job's state.

    After ``load_state_dict`` (the replica received the job's state) the next batch comes from
    the loaded position: a torchdata ``StatefulDataLoader`` applies a loaded state only to its
    next ``iter()``, which this starts. At the end of a pass it starts the next one, after
    putting the loader at that pass's start (:class:`~ftsystem.training.data.Passes`): the
    order of every pass then follows from the job's seed and the pass number, which the state
    holds beside the loader's, instead of from what the loader drew before.
    """

    def __init__(self, loader: Any) -> None:
        if not isinstance(loader, Stateful):
            raise RegistrationError(
                f"{type(loader).__name__} has no state_dict()/load_state_dict(): use "
                "torchdata.stateful_dataloader.StatefulDataLoader (a drop-in DataLoader)")
        problem = why_not_resumable(loader)
        if problem:
            raise RegistrationError(problem)
        self.loader = loader
        self._passes = Passes(loader)
        self._iterator: Iterator | None = None
        self._start_pass(0)
        self._check_round_trip()

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        try:
            return next(self._iterator)
        except StopIteration:
            self._start_pass(self._pass + 1)
            self._iterator = iter(self.loader)
            return next(self._iterator)

    def state_dict(self) -> dict[str, Any]:
        return {"pass": self._pass, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The loaded position is inside this pass: its order must come from its start.
        self._start_pass(state["pass"])
        self.loader.load_state_dict(state["loader"])
        self._iterator = None

    def _start_pass(self, number: int) -> None:
        self._pass = number
        self._passes.start(number)

    def _check_round_trip(self) -> None:
        """A replica that loads this state must hold the state it was sent, or every state
        sync would report it diverged; checked on the state before the first batch."""
        sent = self.state_dict()
        before = state_digest(sent)
        self.load_state_dict(sent)
        if state_digest(self.state_dict()) != before:
            raise RegistrationError(
                f"{type(self.loader).__name__}: after load_state_dict(state), state_dict() "
                "differs from that state, so a replica that receives the job's state would "
                "not match the others. Make load_state_dict() restore exactly what "
                "state_dict() returns")


class RNGState:
    """torch's global RNG (CPU, and CUDA when present) as a registrable object.

    Register it (``advanced_by="loop"``: forward passes draw from it) when every replica seeds
    the same and must keep drawing the same numbers; replicas that want different dropout
    masks should not register it.
    """

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
