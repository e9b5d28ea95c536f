"""A newer epoch interrupts a member's connect to an epoch's store that never answers.

The store here is a real listening socket that never accepts a store's handshake: a client's
connect waits as it would for a host that died just before the epoch naming it was published.
"""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from ftsystem.control.membership import Epoch
from ftsystem.training.ftar import EpochChanged, FaultTolerantAllReduce

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
