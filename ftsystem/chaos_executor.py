"""Following the job's chaos orders and executing one's share of them, with outcomes recorded.

Shared by the agent (replica actions on its own replica) and by ``ftsystem run``'s service
supervisor (controller and etcd kills): each says which orders are its own and how to act.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Callable

from ftsystem import keys, metrics
from ftsystem.chaos import Order
from ftsystem.store import Store

log = logging.getLogger(__name__)


class ChaosActionError(RuntimeError):
    """An order could not be carried out; the message becomes its recorded outcome."""


class OrderExecutor:
    """Runs ``act(order)`` at each pending order's time for the orders ``mine`` selects."""

    def __init__(self, store: Store, job: str, *, mine: Callable[[Order], bool],
                 act: Callable[[Order], Awaitable[str]]) -> None:
        self.store, self.job = store, job
        self._mine, self._act = mine, act
        self._seen: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        """Follow ``chaos/`` and schedule every pending order of ours (until cancelled)."""
        prefix = keys.chaos_orders(self.job)
        items, revision = await self.store.get_prefix(prefix)
        for value in items.values():
            self._schedule(Order.from_json(value))
        async for event in self.store.watch_prefix(prefix, start_revision=revision + 1):
            if event.kind == "PUT":
                self._schedule(Order.from_json(event.value))

    def _schedule(self, order: Order) -> None:
        if order.state != "pending" or order.id in self._seen or not self._mine(order):
            return
        self._seen.add(order.id)
        task = asyncio.create_task(self._execute(order))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _execute(self, order: Order) -> None:
        await asyncio.sleep(max(0.0, order.at - time.time()))
        executed_at = time.time()
        try:
            state, outcome = "done", await self._act(order)
        except ChaosActionError as e:
            state, outcome = "failed", str(e)
        log.info("chaos %s: %s %s -> %s", order.id, order.action, order.replica, outcome)
        metrics.FAILURES_INJECTED.labels(self.job, order.action, state).inc()
        done = dataclasses.replace(order, state=state, outcome=outcome, executed_at=executed_at)
        await self.store.put(keys.chaos(self.job, order.id), done.to_json())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
