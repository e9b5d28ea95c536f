"""Virtual time: what a transfer and a worker's job cost (the authors' simulator's model).

Transfers cost ``bytes * 8 / bandwidth`` with no latency term; compute costs
``local_step_time * steps / speed``. A synchronous all-reduce is a ring over all workers whose
bandwidth is the bottleneck of the best ring through the regions.

With link sharing (``SharedLink``, an option, off by default as in the authors' simulator) the
transfers in flight on one link share its bandwidth equally.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import permutations

import simpy

_DONE_BITS = 1.0  # a transfer with less than a bit left is complete (float residue)


def transfer_s(num_bytes: int, gbps: float) -> float:
    """Seconds to move ``num_bytes`` over a link of ``gbps`` Gbit/s."""
    return num_bytes * 8 / (gbps * 1e9)


def compute_s(steps: int, speed: float, step_time_s: float) -> float:
    """Seconds a worker of relative ``speed`` needs for ``steps`` local steps."""
    return step_time_s * steps / speed


def best_ring_gbps(bandwidth_gbps: Sequence[Sequence[float]]) -> float:
    """Bandwidth of the best ring through all regions: max over rings of the slowest link.

    Exhaustive over orders that start at region 0 (a ring has no start), fine for the handful
    of regions of a geo-distributed setup. One region: its internal bandwidth.
    """
    n = len(bandwidth_gbps)
    if n == 1:
        return bandwidth_gbps[0][0]
    best = 0.0
    for rest in permutations(range(1, n)):
        ring = (0, *rest)
        best = max(best, min(bandwidth_gbps[ring[i]][ring[(i + 1) % n]] for i in range(n)))
    return best


def ring_allreduce_s(num_bytes: int, num_workers: int, gbps: float) -> float:
    """A ring all-reduce of ``num_bytes`` among ``num_workers``: 2(n-1) chunks of bytes/n each."""
    if num_workers == 1:
        return 0.0
    return 2 * (num_workers - 1) * transfer_s(num_bytes / num_workers, gbps)


def async_job_s(*, model_bytes: int, gbps: float, steps: int, speed: float,
                step_time_s: float) -> float:
    """An asynchronous worker's job: fetch the model, run its steps, send the pseudo-gradient."""
    return 2 * transfer_s(model_bytes, gbps) + compute_s(steps, speed, step_time_s)


class SharedLink:
    """One link (one direction) whose bandwidth its transfers in flight share equally.

    Processor sharing: with n transfers in flight each moves at ``gbps / n``; when one starts
    or ends the others' rates change from that instant. One transfer alone takes exactly
    ``transfer_s``. No latency and no per-flow caps (a flow's own rate limit, TCP ramp-up):
    the simplest model in which concurrent transfers slow each other down.
    """

    def __init__(self, env: simpy.Environment, gbps: float) -> None:
        self.env, self.bits_per_s = env, gbps * 1e9
        self._left: dict[simpy.Event, float] = {}  # transfer -> bits still to move
        self._since = env.now
        self._timer = 0  # generation of the pending completion timer; older ones do nothing

    @property
    def in_flight(self) -> int:
        return len(self._left)

    def transfer(self, num_bytes: float) -> simpy.Event:
        """Start moving ``num_bytes`` now; the event fires when the last byte has arrived."""
        self._advance()
        done = self.env.event()
        self._left[done] = num_bytes * 8
        self._schedule()
        return done

    def _advance(self) -> None:
        """Charge the time since the last change to every transfer in flight."""
        if self._left:
            moved = (self.env.now - self._since) * self.bits_per_s / len(self._left)
            self._left = {e: bits - moved for e, bits in self._left.items()}
        self._since = self.env.now

    def _schedule(self) -> None:
        for event in [e for e, bits in self._left.items() if bits <= _DONE_BITS]:
            del self._left[event]
            event.succeed()
        self._timer += 1
        if self._left:
            wait = min(self._left.values()) * len(self._left) / self.bits_per_s
            self.env.process(self._wake(self._timer, wait))

    def _wake(self, timer: int, wait: float):
        yield self.env.timeout(wait)
        if timer == self._timer:
            self._advance()
            self._schedule()
