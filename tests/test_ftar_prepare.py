"""A published epoch's group is built in the background, before the training thread asks for it.

Two members in one process, each with its own FTAR and its own view of the published epochs, meet
in a real TCPStore and all-reduce over real Gloo groups.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from conftest import wait_for
from ftsystem.control.membership import Epoch
from ftsystem.training.ftar import EpochChanged, FaultTolerantAllReduce

TIMEOUT_S = 20.0
MEMBERS = ("r0", "r1")


class PublishedEpochs:
    """A member's view of the job's epochs: what ``ControlPlane`` offers the FTAR."""

    def __init__(self, replica_id: str) -> None:
        self.ctx = SimpleNamespace(job="j", replica_id=replica_id)
        self.epoch: Epoch | None = None
        self._changed = threading.Condition()

    def publish(self, epoch: Epoch) -> None:
        with self._changed:
            self.epoch = epoch
            self._changed.notify_all()

    def wait_for_epoch(self, newer_than: int, timeout_s: float) -> Epoch | None:
        with self._changed:
            self._changed.wait_for(lambda: self.epoch.number > newer_than, timeout_s)
            return self.epoch if self.epoch.number > newer_than else None


def _on_both(pool, fn):
    return [f.result(TIMEOUT_S) for f in [pool.submit(fn, i) for i in range(len(MEMBERS))]]


def test_a_published_epoch_is_built_before_it_is_configured_and_a_superseded_one_is_dropped():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=TIMEOUT_S))
    views = [PublishedEpochs(m) for m in MEMBERS]
    ftars = [FaultTolerantAllReduce(v, timeout_s=TIMEOUT_S) for v in views]

    def epoch(number: int) -> Epoch:
        return Epoch(number=number, members=MEMBERS, store_addr=f"127.0.0.1:{server.port}")

    def publish(number: int) -> None:
        for view in views:
            view.publish(epoch(number))

    def summed(i: int) -> float:
        tensor = torch.tensor([float(i + 1)])
        ftars[i].allreduce_sum(tensor)
        return tensor.item()

    with ThreadPoolExecutor(len(MEMBERS)) as pool:
        try:
            publish(1)
            _on_both(pool, lambda i: ftars[i].configure(views[i].epoch))
            assert _on_both(pool, summed) == [3.0, 3.0]

            publish(2)  # nobody calls configure: the members' watchers build its group
            wait_for(lambda: all(2 in f._builds for f in ftars), TIMEOUT_S, "the watchers' builds")
            builds = [f._builds[2] for f in ftars]
            assert all(b.done.wait(TIMEOUT_S) for b in builds)
            assert all(b.error is None and b.pg is not None for b in builds)
            # Epoch 1's group is still the one in use (a collective on it now would be
            # abandoned for epoch 2 unless done within a poll: not a thing to test).
            assert all(f.epoch.number == 1 and f._pg is not None and f._pg is not b.pg
                       for f, b in zip(ftars, builds))

            _on_both(pool, lambda i: ftars[i].configure(epoch(2)))
            assert [f._pg for f in ftars] == [b.pg for b in builds]  # adopted, not rebuilt
            assert _on_both(pool, summed) == [3.0, 3.0]

            publish(3)
            publish(4)  # 3 is superseded, built or not: configuring 4 drops it
            _on_both(pool, lambda i: ftars[i].configure(epoch(4)))
            assert all(f.epoch.number == 4 and not f._builds for f in ftars)
            for number in (3, 4):  # used or dropped: never built a second time
                again = ftars[0].prepare(epoch(number))
                assert again.done.is_set() and isinstance(again.error, EpochChanged)
            assert not ftars[0]._builds
            assert _on_both(pool, summed) == [3.0, 3.0]
        finally:
            for ftar in ftars:
                ftar.shutdown()
    closed = ftars[0].prepare(epoch(5))  # after shutdown nothing is built
    assert closed.done.is_set() and isinstance(closed.error, EpochChanged)
    assert not ftars[0]._builds


def test_a_joiner_that_watches_before_its_first_configure_has_the_join_epoch_built():
    """``watch`` before any ``configure`` (a joiner that registered ready): the first epoch
    naming it is built by the watchers alone, and configuring it adopts that build."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=TIMEOUT_S))
    views = [PublishedEpochs(m) for m in MEMBERS]
    ftars = [FaultTolerantAllReduce(v, timeout_s=TIMEOUT_S) for v in views]
    joined = Epoch(number=3, members=MEMBERS, store_addr=f"127.0.0.1:{server.port}")
    try:
        for view, ftar in zip(views, ftars):
            view.publish(Epoch(number=2, members=(view.ctx.replica_id,), store_addr="x:1"))
            ftar.watch(newer_than=2)
            view.publish(joined)
        wait_for(lambda: all(3 in f._builds for f in ftars), TIMEOUT_S, "the watchers' builds")
        builds = [f._builds[3] for f in ftars]
        assert all(b.done.wait(TIMEOUT_S) and b.error is None for b in builds)
        with ThreadPoolExecutor(len(MEMBERS)) as pool:
            _on_both(pool, lambda i: ftars[i].configure(joined))
            assert [f._pg for f in ftars] == [b.pg for b in builds]  # adopted, not rebuilt

            def summed(i: int) -> float:
                tensor = torch.tensor([float(i + 1)])
                ftars[i].allreduce_sum(tensor)
                return tensor.item()
            assert _on_both(pool, summed) == [3.0, 3.0]
    finally:
        for ftar in ftars:
            ftar.shutdown()
