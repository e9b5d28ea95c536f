"""Virtual time: what a transfer and a worker's job cost (the authors' simulator's model).

Transfers cost ``bytes * 8 / bandwidth`` with no latency term; compute costs
``local_step_time * steps / speed``. A synchronous all-reduce is a ring over all workers whose
bandwidth is the bottleneck of the best ring through the regions.
"""

from __future__ import annotations

from itertools import permutations
from collections.abc import Sequence


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
