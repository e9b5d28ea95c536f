"""A member waiting on an epoch's store that never answers is not held by it: a newer epoch
interrupts its connect, and a check of the arrival marks names the store's host late.

The silent stores are real: a listening socket that never answers a store's handshake (a client's
connect waits as it would for a host that died just before the epoch naming it was published),
and a TCPStore whose process is SIGSTOPped (a hung ``members[0]``, which hosts the store).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torchft.process_group import create_store_client

from ftsystem.control.membership import Epoch
from ftsystem.training.ftar import (ARRIVAL_STORE_TIMEOUT_S, SILENT_AFTER_S, EpochChanged,
                                    FaultTolerantAllReduce, _Beats, _MarksRead, silent_members)

TIMEOUT_S = 20.0


def test_a_newer_epoch_interrupts_the_connect_to_a_silent_store():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes TCP handshakes; nobody answers the store's
    port = silent.getsockname()[1]
    epoch = Epoch(number=1, members=("r0", "r1"))
    control = SimpleNamespace(epoch=epoch, ctx=SimpleNamespace(job="j", replica_id="r1"))
    ftar = FaultTolerantAllReduce(control, timeout_s=TIMEOUT_S)
    newer = threading.Timer(0.5, lambda: setattr(control, "epoch",
                                                 Epoch(number=2, members=("r1",))))
    newer.start()
    started = time.monotonic()
    try:
        with pytest.raises(EpochChanged):
            ftar._barrier(f"127.0.0.1:{port}/ftsystem/j/epoch/1/shard/0", 1, 2, epoch)
        assert time.monotonic() - started < TIMEOUT_S / 2
    finally:
        newer.cancel()
        silent.close()


def _serve_store(ports) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    ports.put(store.port)
    time.sleep(120)


def test_a_frozen_store_names_its_host_late_within_the_store_timeout_or_at_once_after_an_early_read():
    """members[0] hosts the epoch's store; SIGSTOPped, it never answers a check of the marks."""
    # spawn, not fork: a fork copies whatever lock another test's thread (gRPC's, the
    # etcd client's) held at that instant, and the child then never got to serve its store.
    spawn = multiprocessing.get_context("spawn")
    ports = spawn.Queue()
    host = spawn.Process(target=_serve_store, args=(ports,), daemon=True)
    host.start()
    try:
        epoch = Epoch(number=1, members=("r0", "r1"))
        control = SimpleNamespace(epoch=epoch, ctx=SimpleNamespace(job="j", replica_id="r1"))
        ftar = FaultTolerantAllReduce(control, timeout_s=TIMEOUT_S)
        ftar._arrivals = create_store_client(f"127.0.0.1:{ports.get(timeout=60)}/j/steps",
                                             timedelta(seconds=ARRIVAL_STORE_TIMEOUT_S))
        ftar._arrivals.set("1", "7")  # r1 is at step 7, r0 never marked it
        assert ftar._late_members(epoch, 7) == ("r0",)
        ftar._arrivals.set("0", "7")
        assert ftar._late_members(epoch, 7) == ()  # everyone is there: the collective is slow
        os.kill(host.pid, signal.SIGSTOP)  # r0 froze: its store no longer answers
        started = time.monotonic()
        assert ftar._late_members(epoch, 7) == ("r0",)
        assert time.monotonic() - started < ARRIVAL_STORE_TIMEOUT_S + 2

        # A read started half a bound before the check, and still unanswered at it, names
        # the store's host at once: no second read, no second store timeout.
        early = ftar._read_marks(epoch, 7)
        assert not early.done.wait(1.0)
        ftar._read_marks = None  # the answer must come from the early read alone
        assert ftar._late_members(epoch, 7, early, silence_s=1.0) == ("r0",)
    finally:
        host.kill()
        host.join()


def test_an_early_read_still_unanswered_at_the_bound_names_the_store_host_whatever_the_poll_timing(
        monkeypatch):
    """The early read starts at the first poll past bound - lead, the check at the first poll
    past the bound: the read may have waited a little less than lead. It must still count as
    the store's silence (it once cost a second read and a store timeout, at random, 4 s)."""
    from ftsystem.training import ftar as module
    from ftsystem.training.ftar import Stragglers, _MarksRead, _StragglerCheck

    now = [100.0]
    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                        sleep=time.sleep))
    epoch = Epoch(number=1, members=("r0", "r1"))
    control = SimpleNamespace(epoch=epoch, ctx=SimpleNamespace(job="j", replica_id="r1"))
    ftar = FaultTolerantAllReduce(control, timeout_s=TIMEOUT_S)
    reads = []

    def silent_read(epoch, step):  # a frozen store: no read is ever answered
        reads.append(_MarksRead(now[0]))
        return reads[-1]
    monkeypatch.setattr(ftar, "_read_marks", silent_read)

    check = _StragglerCheck(ftar, epoch, 7, bound_s=2.0)
    check.silence.next_at = math.inf  # its reads of the beats: the test below
    now[0] = check.check_at - check.lead_s + 0.002  # the poll that starts the early read
    check.poll()
    assert len(reads) == 1
    now[0] = check.check_at + 0.001  # the first poll past the bound
    started = time.monotonic()
    with pytest.raises(Stragglers) as raised:
        check.poll()
    assert raised.value.late == ("r0",) and len(reads) == 1  # no second read
    assert time.monotonic() - started < ARRIVAL_STORE_TIMEOUT_S / 2


def test_a_member_marked_at_the_step_whose_beats_stand_still_is_named_silent():
    """A member that arrived and then froze inside the all-reduce (a SIGSTOP: its mark says it
    is there, so the collective looked only slow, and the survivors waited for the watchdog) is
    named once its beats stood still between two reads; a live one, beating, is not."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))

    def client():
        return create_store_client(f"127.0.0.1:{server.port}/j/steps",
                                   timedelta(seconds=ARRIVAL_STORE_TIMEOUT_S))
    epoch = Epoch(number=1, members=("r0", "r1", "r2"))
    control = SimpleNamespace(epoch=epoch, ctx=SimpleNamespace(job="j", replica_id="r2"))
    ftar = FaultTolerantAllReduce(control, timeout_s=TIMEOUT_S)
    ftar._arrivals = client()
    for rank in range(3):
        ftar._arrivals.set(str(rank), "7")  # everyone marked step 7
    ftar._arrivals.add("beat0", 4)  # r0 beat, then froze after its mark
    live = _Beats(client(), rank=1)  # r1 beats
    mine = _Beats(client(), rank=2)  # and so does r2, which reads: its beats are the clock
    try:
        early = ftar._read_marks(epoch, 7)
        assert early.done.wait(5)
        time.sleep(SILENT_AFTER_S + 0.4)
        assert ftar._late_members(epoch, 7, early) == ("r0",)
        early = ftar._read_marks(epoch, 7)  # too close to the next read to tell: only slow
        assert early.done.wait(5)
        assert ftar._late_members(epoch, 7, early) == ()
    finally:
        live.stop()
        mine.stop()


def test_silent_members_are_those_whose_beats_stood_still_whatever_their_mark():
    early = _MarksRead(10.0, late=("r1",), beats={"r0": 4, "r1": 2, "r2": 9, "r3": 0, "r4": 5},
                       beats_read=(10.0, 10.1))
    now = _MarksRead(11.0, late=("r1",), beats={"r0": 4, "r1": 2, "r2": 14, "r3": 0, "r4": 8},
                     beats_read=(11.0, 11.1))
    # r0 (marked) and r1 (not arrived) stood still: silent, as a dead host is wherever it was
    # in its step. r2 reads, and beat 5 times meanwhile. r3 had not beaten yet (building its
    # group): not judged. r4 beats.
    assert silent_members(early, now, me="r2") == ("r0", "r1")
    assert silent_members(None, now, me="r2") == ()
    # r2's own beats moved less than half of the span's 4.5: this machine, or the store's host,
    # ran too little to tell a silent member from one held back (a loaded machine, where a live
    # member's beats stood still 2 s while the store's host starved)
    starved = _MarksRead(11.0, late=("r1",), beats=now.beats | {"r2": 11},
                         beats_read=(11.0, 11.1))
    assert silent_members(early, starved, me="r2") == ()
    # Counts read less than SILENT_AFTER_S apart tell nothing, also when the early read started
    # long before (a slow store answered it late).
    late_answer = _MarksRead(10.0, late=(), beats=early.beats, beats_read=(10.9, 10.95))
    assert silent_members(late_answer, now, me="r2") == ()


def test_a_wait_names_a_member_whose_beats_stood_still_within_a_second(monkeypatch):
    """The silence check of a wait at a step's all-reduce: the beats read once the wait has
    lasted SILENCE_LEAD_S, and again SILENT_AFTER_S after that read answered; a member whose
    count did not move is named by the poll that sees the second read, long before the bound."""
    from ftsystem.training import ftar as module
    from ftsystem.training.ftar import SILENCE_LEAD_S, SilentMembers, _StragglerCheck

    now = [100.0]
    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                        sleep=time.sleep))
    epoch = Epoch(number=1, members=("r0", "r1", "r2"))
    control = SimpleNamespace(epoch=epoch, ctx=SimpleNamespace(job="j", replica_id="r2"))
    ftar = FaultTolerantAllReduce(control, timeout_s=TIMEOUT_S)
    counts = iter([{"r0": 3, "r1": 7, "r2": 5}, {"r0": 3, "r1": 10, "r2": 8}])
    reads = []

    def answered_read(epoch, step):  # a store that answers at once
        read = _MarksRead(now[0], late=(), beats=next(counts), beats_read=(now[0], now[0]))
        read.done.set()
        reads.append(read)
        return read
    monkeypatch.setattr(ftar, "_read_marks", answered_read)

    check = _StragglerCheck(ftar, epoch, 7, bound_s=10.0)
    check.poll()
    assert reads == []  # a short wait reads nothing
    now[0] += SILENCE_LEAD_S
    check.poll()  # the first read
    check.poll()  # ... answered: compared with nothing
    now[0] += SILENT_AFTER_S + 0.01
    check.poll()  # the second read
    with pytest.raises(SilentMembers) as raised:
        check.poll()
    assert raised.value.late == ("r0",) and len(reads) == 2
    assert "r0 stopped beating" in str(raised.value)
