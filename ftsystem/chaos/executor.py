"""Following the job's chaos orders and executing one's share of them, with outcomes recorded.

Shared by the agent (replica actions on its own replica) and by ``ftsystem run``'s service
supervisor (controller and etcd kills): each says which orders are its own and how to act.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Awaitable, Callable

from ftsystem.control import keys

from ftsystem.measure import metrics
from ftsystem.chaos.spec import Order, read_orders
from ftsystem.control.store import Store

log = logging.getLogger(__name__)

STEP_POLL_S = 0.25


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
        for order in read_orders(items):
            self._schedule(order)
        async for event in self.store.watch_prefix(prefix, start_revision=revision + 1):
            if event.kind == "PUT":
                for order in read_orders({event.key: event.value}):
                    self._schedule(order)

    def _schedule(self, order: Order) -> None:
        if order.state != "pending" or order.id in self._seen or not self._mine(order):
            return
        self._seen.add(order.id)
        task = asyncio.create_task(self._execute(order))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _execute(self, order: Order) -> None:
        await asyncio.sleep(max(0.0, order.at - time.time()))
        if order.after_step:
            await self._wait_for_step(order.after_step)
        executed_at = time.time()
        try:
            state, outcome = "done", await self._act(order)
        except ChaosActionError as e:
            state, outcome = "failed", str(e)
        log.info("chaos %s: %s %s -> %s", order.id, order.action, order.replica, outcome)
        metrics.FAILURES_INJECTED.labels(self.job, order.action, state).inc()
        done = dataclasses.replace(order, state=state, outcome=outcome, executed_at=executed_at)
        await self.store.put(keys.chaos(self.job, order.id), done.to_json())

    async def _wait_for_step(self, step: int) -> None:
        """Until some replica reports ``step`` (progress is written about once a second)."""
        while True:
            items, _ = await self.store.get_prefix(keys.replicas(self.job))
            if max((json.loads(v).get("step", 0) for v in items.values()), default=0) >= step:
                return
            await asyncio.sleep(STEP_POLL_S)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
