"""This rank's replicated state, and the only code that changes it.

The replicated state is the model's parameters and buffers, the optimizer's state, the
registered objects, the number of committed steps, the commit chain, and the loop-advanced
objects' states after the last step (the *carry*). :class:`LocalState` alone writes any of
them, in three ways:

- :meth:`commit` applies an averaged gradient as the next step (a live commit, or a joiner's
  join step);
- :meth:`replay` applies a peer's logged update as the next step;
- :meth:`load` takes a peer's whole state (a snapshot, the epoch's state sync, a checkpoint).

A live commit and a replay run the same function (:meth:`_advance`) in the same order: the
loop-advanced objects hold the states the step function ran with, the step function runs on
the averaged gradient, the step and chain advance, the loop-advanced objects' states after the
step are recorded, the update is logged. So a step function that reads a registered RNG or
loader gets the same result when a peer replays its step.
"""

from __future__ import annotations

import io
import logging
from typing import Callable

import torch
from torch import nn

from ftsystem.training import carriable
from ftsystem.training.fingerprint import GENESIS, chain_next, new_lineage, state_digest
from ftsystem.training.replicated import ReplicatedObjects
from ftsystem.training.flat import FlatLayout, release_grads
from ftsystem.training.shards import load_local_state, local, local_state
from ftsystem.training.snapshot import Snapshotter
from ftsystem.training.commit_times import CommitTimes
from ftsystem.training.update_log import LoggedUpdate, UpdateLog

log = logging.getLogger(__name__)


class StepInputs:
    """What the step function runs on: the logged average itself, or a copy of it, so that
    the update log keeps what the step ran on (a replay of it must run on the same values).

    A step function may write into ``.grad``: clipping, unscaling, an optimizer's own
    arithmetic (SGD's foreach Nesterov step adds the momentum into ``.grad``). No check sees
    every such write (``GradScaler.unscale_`` and writes through ``.data`` bump no version
    counter; a fused kernel may write through a raw pointer). So a step function of the
    loop's own always runs on a copy. The default ``optimizer.step()`` runs its first step
    on a copy too, which is then compared bit for bit with the average: if the step wrote
    into it, every step runs on a copy. Otherwise the later steps run on the average itself
    (no gradient-sized copy per step: about 4% of the step at 10M parameters on two cores,
    ``ftsystem bench overhead``), and a write that the version counter of the average shows
    after all (a step that writes only sometimes) makes that step :meth:`after_step` report
    the average spoiled, and every later step run on a copy."""

    def __init__(self, step_fn_given: bool) -> None:
        self._mode = "copy" if step_fn_given else "probe"
        self._scratch: torch.Tensor | None = None
        self._version = 0

    def before_step(self, average: torch.Tensor) -> torch.Tensor:
        """What to make the gradients of: ``average``, or a copy of it."""
        if self._mode == "trusted":
            self._version = average._version
            return average
        return self._copy(average)

    def after_step(self, average: torch.Tensor) -> bool:
        """Whether ``average`` still holds what the step ran on."""
        if self._mode == "probe":
            written = not torch.equal(self._scratch.view(torch.uint8),
                                      average.view(torch.uint8))
            # (an inference tensor keeps no version counter to watch)
            self._mode = "copy" if written or average.is_inference() else "trusted"
            if not written:
                self._scratch = None  # the copy is not needed again
            return True
        if self._mode == "trusted" and average._version != self._version:
            log.warning("the optimizer's step wrote into the averaged gradient it ran on: "
                        "that step is not kept for catch-up, and every step from here on "
                        "runs on a copy of the average")
            self._mode = "copy"
            return False
        return True

    def _copy(self, average: torch.Tensor) -> torch.Tensor:
        """``average`` copied into a buffer kept across steps (a new one per step would be
        page-faulted in: see UpdateLog.recycle)."""
        if self._scratch is None or self._scratch.shape != average.shape \
                or self._scratch.dtype != average.dtype:
            self._scratch = torch.empty_like(average)
        return self._scratch.copy_(average)


class ForkedHistory(RuntimeError):
    """A logged update does not continue this replica's commit chain (another history)."""


class LocalState:
    """The replicated state of this rank (see the module's doc)."""

    def __init__(self, name: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 layout: FlatLayout, objects: ReplicatedObjects,
                 step_fn: Callable[[], None] | None, update_log: UpdateLog,
                 on_step: Callable[[int], None], times: CommitTimes | None = None) -> None:
        """``on_step(step)``: told of every step this state reaches (the heartbeat);
        ``times``: where the parts of a step are timed."""
        self._name = name
        self._times = times or CommitTimes()
        self.model, self.optimizer, self.objects = model, optimizer, objects
        self._layout = layout
        self._params = layout.params
        self._device = layout.device
        self._step_fn = step_fn or optimizer.step
        self._inputs = StepInputs(step_fn is not None)
        self.update_log = update_log
        self.snapshotter = Snapshotter(self.state)
        self._on_step = on_step
        self._step = 0
        self._chain = GENESIS
        self._carry = b""
        self._fresh = True
        self._lineage = new_lineage()
        self._verified_step: int | None = None

    # --- reading ---------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Committed steps."""
        return self._step

    @property
    def chain(self) -> bytes:
        """The commit chain after :attr:`step` (``ftsystem.training.fingerprint``)."""
        return self._chain

    @property
    def carry(self) -> bytes:
        """The loop-advanced objects' states after :attr:`step`."""
        return self._carry

    @property
    def fresh(self) -> bool:
        """This rank holds no state of the job (it never received it, or dropped it)."""
        return self._fresh

    @property
    def lineage(self) -> int:
        """The copy lineage of this rank's state: a word of its own, or, once it copied a
        peer's whole state, the peer's, until a digest comparison finds it agreeing with the
        majority. Every state that descends from one copy holds the same word, and such
        states are one witness in a comparison (``fingerprint.lineage_votes``)."""
        return self._lineage

    @property
    def verified(self) -> bool:
        """The last digest comparison found this state agreeing with the majority, and no
        step was applied since."""
        return self._verified_step == self._step and not self._fresh

    def state(self) -> dict:
        """Everything replicated, at :attr:`step`: tensors by reference (see Snapshotter)."""
        return {**local_state(self.model, self.optimizer), "step": self._step,
                "objects": self.objects.step_state(), "carry": self._carry,
                "chain": self._chain, "lineage": self._lineage}

    def fingerprinted(self) -> dict:
        """What the state digest covers: everything replicated but the chain (compared on
        its own at every epoch entry) and the lineage, the loop-advanced objects decoded."""
        state = self.state()
        del state["chain"], state["lineage"]
        state["carry"] = self.objects.decode(self._carry)
        return state

    def digest(self) -> bytes:
        return state_digest(self.fingerprinted())

    def serialize(self) -> bytes:
        out = io.BytesIO()
        torch.save(self.state(), out)
        return out.getvalue()

    # --- writing ---------------------------------------------------------------------------

    def start(self) -> None:
        """The objects are registered: record what they hold now."""
        self._carry = self.objects.carry()

    def commit(self, grad: torch.Tensor, epoch: int, carry_before: bytes | None = None
               ) -> LoggedUpdate:
        """Apply ``grad``, averaged over the members of ``epoch``, as the next step.

        ``carry_before``: the loop-advanced objects' states to run the step function with
        (a joiner's join step takes the members'); None: the ones they hold now, which are
        only recorded. Loading them back would restart what they run (a loader's workers,
        whose RNG would start over and repeat the augmentation)."""
        received = carry_before is not None
        with self._times.part("carry"):
            if not received:
                carry_before = self.objects.carry()
        update = LoggedUpdate(grad, self._chain, chain_next(self._chain, self._step + 1, epoch),
                              carry_before=carry_before)
        return self._advance(update, load_before=received)

    def replay(self, logged: LoggedUpdate) -> None:
        """Apply a peer's logged update as the next step: this replica commits the same step
        bit for bit."""
        if logged.parent != self._chain:
            raise ForkedHistory(
                f"replica {self._name} at step {self._step}: the logged update for step "
                f"{self._step + 1} continues another history (commit chain "
                f"{logged.parent.hex()[:12]}, ours {self._chain.hex()[:12]})")
        # The log keeps it, and the source buffer is reused.
        grad = logged.grad.to(self._device, copy=True)
        try:
            self._advance(LoggedUpdate(grad, logged.parent, logged.chain, logged.carry,
                                       logged.carry_before), load_before=True)
        except Exception as e:
            raise RuntimeError(
                f"the step function failed replaying step {self._step + 1}: it runs without "
                "the forward and backward of that step, so it may use only the gradients, "
                "the model, the optimizer and registered objects (a GradScaler needs "
                "scale() called first: see docs/adopting.md)") from e

    def _advance(self, update: LoggedUpdate, load_before: bool) -> LoggedUpdate:
        """The one way a step is applied (see the module's doc). Returns what was logged:
        ``update`` with the carry after the step filled in (a live commit's)."""
        if load_before:
            self.objects.load_carry(update.carry_before)
        with self._times.part("unpack"):
            self.snapshotter.before_mutation()
            self._layout.unpack(self._inputs.before_step(update.grad))
        try:
            with self._times.part("step_fn"):
                self._step_fn()
        finally:
            release_grads(self._params)
        kept = self._inputs.after_step(update.grad)
        with self._times.part("carry"):
            if load_before and update.carry:  # a replay: the states the peer recorded
                self.objects.load_carry(update.carry)
                carry = update.carry
            else:
                carry = self.objects.carry()
        with self._times.part("log"):
            update = LoggedUpdate(update.grad, update.parent, update.chain, carry,
                                  update.carry_before)
            self._step, self._chain, self._carry = self._step + 1, update.chain, carry
            if kept:
                self.update_log.append(self._step, update)
            else:  # the entry is not what the step ran on: the log restarts after it
                self.update_log.clear()
            self._on_step(self._step)
        return update

    def load(self, state: dict, *, inherit_lineage: bool = True) -> None:
        """Take a peer's whole state (a snapshot, the epoch's state sync), and with it its
        lineage unless ``inherit_lineage`` is False (``entry_plan.copy_inherits_lineage``)."""
        self.snapshotter.before_mutation()
        self.update_log.clear()
        load_local_state(self.model, self.optimizer, state)
        self.objects.load_step_state(state["objects"])
        self.objects.load_carry(state["carry"])
        self._step, self._chain, self._carry = state["step"], state["chain"], state["carry"]
        self._fresh = False
        self._lineage = state["lineage"] if inherit_lineage else new_lineage()
        self._verified_step = None
        self._on_step(self._step)

    def load_serialized(self, payload: bytes, device: torch.device, *,
                        inherit_lineage: bool = True) -> None:
        self.load(carriable.load(io.BytesIO(payload), map_location=device),
                  inherit_lineage=inherit_lineage)

    def resumed(self, step: int) -> None:
        """The model, optimizer and :meth:`extras` were loaded from a disk checkpoint of
        ``step`` (every replica of a cold start loads the same one)."""
        self.update_log.clear()
        self._step, self._fresh = step, False
        self._verified_step = None
        self._on_step(step)

    def extras(self) -> dict:
        """What a disk checkpoint holds beside model and optimizer."""
        return {"objects": self.objects.step_state(), "carry": self._carry,
                "chain": self._chain}

    def load_extras(self, extras: dict) -> None:
        self.objects.load_step_state(extras["objects"])
        self.objects.load_carry(extras["carry"])
        self._carry, self._chain = extras["carry"], extras["chain"]

    def entered_epoch(self) -> None:
        """An epoch's entry left this rank with the job's state (it received it, or it was
        the job's already: the first member of a new job defines it)."""
        self._fresh = False

    def rewind_loop(self) -> None:
        """Put the loop-advanced objects back where :attr:`carry` says (a dropped warm-up
        step drew a batch)."""
        self.objects.load_carry(self._carry)

    def drop(self) -> None:
        """Forget the job's state: the next epoch's sync sends this replica the whole state
        (a repair, or a joiner whose donor turned out to be on another history)."""
        self._fresh = True

    def compared(self) -> None:
        """Its digest was compared with the others' and agreed with the majority's: whatever
        it copied was right, and from here on it computes a history of its own."""
        self._lineage = new_lineage()
        self._verified_step = self._step

    def receiving(self) -> None:
        """A snapshot is being received into this rank's own tensors: until it is loaded
        whole, this rank holds no state of the job."""
        self.snapshotter.before_mutation()
        self.update_log.clear()
        self._fresh = True

    def corrupt(self) -> None:
        """Fault injection (``STEP:corrupt``): change one parameter value in memory, as a bad
        memory cell or a faulty kernel would."""
        self.snapshotter.before_mutation()
        with torch.no_grad():
            local(self._params[0]).view(-1)[0] += 1.0
