"""The agent's side of failure injection: execute this replica's chaos orders, record outcomes.

Signals go to the replica's process groups, so every rank (and anything it started) is hit:
``kill`` is SIGKILL; ``hang`` is SIGSTOP for the order's duration, then SIGCONT; ``slow``
stops and continues the replica in a duty cycle (``ftsystem.chaos.slow_pattern``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from typing import Callable

from ftsystem import keys, metrics
from ftsystem.chaos import Order, slow_pattern
from ftsystem.procs import signal_group
from ftsystem.store import Store

log = logging.getLogger(__name__)


class ChaosExecutor:
    def __init__(self, store: Store, job: str, replica_id: str,
                 running_pids: Callable[[], list[int]]) -> None:
        self.store, self.job, self.replica_id = store, job, replica_id
        self._running_pids = running_pids
        self._seen: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        """Follow ``chaos/`` and schedule every pending order for this replica."""
        prefix = keys.chaos_orders(self.job)
        items, revision = await self.store.get_prefix(prefix)
        for value in items.values():
            self._schedule(Order.from_json(value))
        async for event in self.store.watch_prefix(prefix, start_revision=revision + 1):
            if event.kind == "PUT":
                self._schedule(Order.from_json(event.value))

    def _schedule(self, order: Order) -> None:
        if order.replica != self.replica_id or order.state != "pending" or order.id in self._seen:
            return
        self._seen.add(order.id)
        task = asyncio.create_task(self._execute(order))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _execute(self, order: Order) -> None:
        await asyncio.sleep(max(0.0, order.at - time.time()))
        executed_at = time.time()
        pids = self._running_pids()
        if not pids:
            state, outcome = "failed", "replica not running (restarting or finished)"
        else:
            outcome = await self._act(order, pids)
            state = "done"
        log.info("chaos %s: %s %s -> %s", order.id, order.action, self.replica_id, outcome)
        metrics.FAILURES_INJECTED.labels(self.job, order.action, state).inc()
        done = dataclasses.replace(order, state=state, outcome=outcome, executed_at=executed_at)
        await self.store.put(keys.chaos(self.job, order.id), done.to_json())

    async def _act(self, order: Order, pids: list[int]) -> str:
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

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        signal_group(pid, sig)
