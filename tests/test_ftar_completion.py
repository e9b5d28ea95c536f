"""FTAR's wait on the NCCL path, as pure logic: the future completes when the collective is
queued, the data comes later, and errors are reported by the group afterwards.

The fake group plays NCCL: its future is complete at once, a thread writes the sum later, and
its ``errored()`` reports what a timeout's abort would. ``FaultTolerantAllReduce.data_arrival``
is pointed at that thread's write instead of a CUDA event.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ftsystem.training.ftar import (CollectiveFailed, DeviceWedged, EpochChanged,
                                   FaultTolerantAllReduce, device_arrival)
from ftsystem.control.membership import Epoch

DATA_DELAY_S = 0.2


class QueuedGroup:
    """Completes every future at once and writes the data ``DATA_DELAY_S`` later."""

    def __init__(self, error: Exception | None = None) -> None:
        self.written = threading.Event()
        self.error = error
        self.asked = 0

    def allreduce(self, tensors: list[torch.Tensor], opts) -> SimpleNamespace:
        future = torch.futures.Future()
        future.set_result(tensors)  # queued, not done: like NCCL's

        def write_later() -> None:
            time.sleep(DATA_DELAY_S)
            tensors[0].mul_(2)  # the sum of two equal replicas
            self.written.set()
        threading.Thread(target=write_later, daemon=True).start()
        return SimpleNamespace(get_future=lambda: future)

    def errored(self) -> Exception | None:
        self.asked += 1
        return self.error

    def abort(self, errored: bool = True) -> None:
        self.error = RuntimeError("aborted")


def ftar_on(group: QueuedGroup, *, device_path: bool = True) -> FaultTolerantAllReduce:
    epoch = Epoch(number=1, members=("r0", "r1"))
    control = SimpleNamespace(epoch=epoch, ctx=SimpleNamespace(job="j", replica_id="r0"))
    ftar = FaultTolerantAllReduce(control, timeout_s=5)
    ftar._pg, ftar.epoch = group, epoch
    if device_path:
        ftar.data_arrival = lambda: group.written.is_set
    return ftar


def test_wait_returns_only_after_the_data_arrived():
    group = QueuedGroup()
    ftar = ftar_on(group)
    tensor = torch.ones(4)
    started = time.monotonic()
    ftar.allreduce_sum(tensor)
    assert group.written.is_set() and time.monotonic() - started >= DATA_DELAY_S * 0.9
    assert torch.equal(tensor, torch.full((4,), 2.0))
    assert group.asked == 1


def test_an_error_reported_after_the_future_fails_the_wait():
    ftar = ftar_on(QueuedGroup(error=RuntimeError("aborted")))
    with pytest.raises(CollectiveFailed, match="failed on the device: aborted"):
        ftar.allreduce_sum(torch.ones(4))


def test_the_group_that_issued_it_is_asked_after_a_newer_one_replaced_it():
    old = QueuedGroup()
    ftar = ftar_on(old)
    future = ftar.allreduce_sum_async(torch.ones(4))
    old.abort(errored=False)  # what configuring the next epoch does to it
    ftar._pg = QueuedGroup()
    with pytest.raises(CollectiveFailed, match="aborted"):
        ftar.wait(future)


def test_a_newer_epoch_interrupts_the_wait_for_data():
    group = QueuedGroup()
    ftar = ftar_on(group)
    ftar.data_arrival = lambda: lambda: False  # the device never gets there
    future = ftar.allreduce_sum_async(torch.ones(4))
    ftar.control.epoch = Epoch(number=2, members=("r0",))
    with pytest.raises(EpochChanged):
        ftar.wait(future)
    group.written.wait()  # no writer outlives its test


def test_the_cpu_path_trusts_the_future_and_asks_nothing():
    """Gloo's future means the data is there: no device wait, no ``errored()`` call (and
    this fake, whose future comes early, shows why the NCCL path needs both)."""
    assert device_arrival(torch.device("cpu")) is None
    group = QueuedGroup()
    ftar = ftar_on(group, device_path=False)
    assert ftar.data_arrival is None
    tensor = torch.ones(4)
    ftar.allreduce_sum(tensor)
    assert not group.written.is_set() and torch.equal(tensor, torch.ones(4))
    assert group.asked == 0
    group.written.wait()


class HungAbort(QueuedGroup):
    """A group whose abort blocks until released: ``ncclCommAbort`` of a wedged communicator."""

    def __init__(self) -> None:
        super().__init__()
        self.released = threading.Event()

    def abort(self, errored: bool = True) -> None:
        self.released.wait()
        super().abort(errored)


def test_a_hung_abort_after_an_unfinished_collective_stops_the_next_epoch():
    # The device's streams wait behind the unfinished collective until its group's abort
    # returns: the next epoch must not queue work (or block in a host copy) behind it.
    group = HungAbort()
    ftar = ftar_on(group)
    ftar.timeout_s = 0.3
    ftar.data_arrival = lambda: lambda: False  # the data never arrives
    future = ftar.allreduce_sum_async(torch.ones(4))
    ftar.control.epoch = Epoch(number=2, members=("r0",))
    with pytest.raises(EpochChanged):
        ftar.wait(future)
    ftar.abort()
    with pytest.raises(DeviceWedged, match="did not return within"):
        ftar._await_wedging_aborts()
    group.released.set()
    ftar._await_wedging_aborts()  # returned: the next epoch goes on
    group.written.wait()


def test_the_abort_of_a_group_whose_collectives_finished_is_not_waited_for():
    group = HungAbort()
    ftar = ftar_on(group)
    ftar.allreduce_sum(torch.ones(4))
    ftar.abort()
    started = time.monotonic()
    ftar._await_wedging_aborts()
    assert time.monotonic() - started < 0.1 and not group.released.is_set()
    group.released.set()
