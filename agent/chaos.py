"""The agent's side of failure injection: execute this replica's chaos orders.

Signals go to the replica's process groups, so every rank (and anything it started) is hit:
``kill`` is SIGKILL; ``hang`` is SIGSTOP for the order's duration, then SIGCONT; ``slow``
stops and continues the replica in a duty cycle (``ftsystem.chaos.spec.slow_pattern``).
``partition`` takes the link of the host (network namespace) the agent runs in down for the
duration: the replica and its agent are cut off together, as by a failed switch port, and
packets are dropped without a reset.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Callable

from ftsystem.chaos.spec import REPLICA_ACTIONS, Order, slow_pattern
from ftsystem.chaos.executor import ChaosActionError, OrderExecutor
from ftsystem.launch.netns import ENV_NETNS, NetnsError, set_link
from ftsystem.launch.procs import signal_group
from ftsystem.control.store import Store


def replica_executor(store: Store, job: str, replica_id: str,
                     running_pids: Callable[[], list[int]],
                     mine: Callable[[], bool] = lambda: True) -> OrderExecutor:
    """The executor of ``replica_id``'s orders; ``running_pids`` gives its process groups.
    Of a replica's agents, the one ``mine()`` is true for acts (node rank 0): killing or
    cutting off one node takes the whole replica down (host orders, to one node, are
    ``ftsystem run``'s)."""

    async def act(order: Order) -> str:
        if order.action == "partition":
            return await _partition(order.duration_s)
        pids = running_pids()
        if not pids:
            raise ChaosActionError("replica not running (restarting or finished)")
        return await _signal_action(order, pids)

    return OrderExecutor(store, job, mine=lambda order: order.action in REPLICA_ACTIONS and
                         order.replica == replica_id and mine(),
                         act=act)


async def _signal_action(order: Order, pids: list[int]) -> str:
    if order.action == "kill":
        _signal_all(pids, signal.SIGKILL)
        return f"SIGKILL to {len(pids)} process group(s)"
    if order.action == "hang":
        _signal_all(pids, signal.SIGSTOP)
        await asyncio.sleep(order.duration_s)
        _signal_all(pids, signal.SIGCONT)
        return f"stopped for {order.duration_s:g}s"
    for run_s, stop_s in slow_pattern(order.duration_s, order.slow_fraction):
        _signal_all(pids, signal.SIGSTOP)
        await asyncio.sleep(stop_s)
        _signal_all(pids, signal.SIGCONT)
        await asyncio.sleep(run_s)
    return f"stopped {order.slow_fraction:.0%} of every period for {order.duration_s:g}s"


async def _partition(duration_s: float) -> str:
    netns = os.environ.get(ENV_NETNS)
    if not netns:
        raise ChaosActionError("partition needs the replica's agent to run in a network "
                               "namespace (ftsystem run --netns); nothing was done")
    try:
        set_link(False)
        try:
            await asyncio.sleep(duration_s)
        finally:
            set_link(True)  # also when the agent is stopped mid-partition
    except NetnsError as e:
        raise ChaosActionError(f"partition of host {netns} failed: {e}") from e
    return f"host {netns} cut off for {duration_s:g}s"


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        signal_group(pid, sig)
