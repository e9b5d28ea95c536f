"""The membership epochs as a member would see them: a watcher of the job's epoch key, on its
own etcd connection, that timestamps each epoch once decoded; and the timings built on it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager

from ftsystem.benchmarks.controller.services import BenchError
from ftsystem.control import keys
from ftsystem.control.membership import Epoch
from ftsystem.control.store import Store


class EpochWatcher:
    """Follows the epoch key, queueing each epoch with the time it was seen; a wait takes the
    epochs in order, until one it wants."""

    def __init__(self, store: Store, job: str, timeout_s: float) -> None:
        self.store, self.key, self.timeout_s = store, keys.epoch(job), timeout_s
        self.queue: asyncio.Queue[tuple[float, Epoch]] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.skipped = 0
        """Epochs that no wait wanted: spurious membership changes."""

    async def start(self) -> None:
        _, revision = await self.store.get_prefix(self.key)
        self._task = asyncio.create_task(self._follow(revision + 1))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _follow(self, start_revision: int) -> None:
        async for event in self.store.watch_prefix(self.key, start_revision=start_revision):
            if event.key == self.key and event.kind == "PUT":
                epoch = Epoch.from_json(event.value)
                self.queue.put_nowait((time.perf_counter(), epoch))

    async def wait_for(self, wanted: Callable[[Epoch], bool], what: str,
                       check: Callable[[], None]) -> tuple[float, Epoch]:
        """The first epoch (and when it was seen) that satisfies ``wanted``; ``check`` raises
        if a process the epochs depend on has died."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            check()
            try:
                # Not wait_for: in Python 3.11 it can drop a cancellation (CPython gh-86296).
                async with asyncio.timeout(1.0):
                    seen, epoch = await self.queue.get()
            except TimeoutError:
                continue
            if wanted(epoch):
                return seen, epoch
            self.skipped += 1
        check()
        raise BenchError(f"no epoch with {what} within {self.timeout_s:.0f} s")

    async def wait_for_all(self, ids: Iterable[str], check: Callable[[], None]) -> float:
        """When the first epoch with exactly ``ids`` as members was seen."""
        everyone = frozenset(ids)
        seen, _ = await self.wait_for(lambda e: frozenset(e.members) == everyone,
                                      f"all {len(everyone)} members", check)
        return seen

    async def time_removal(self, rid: str, end_lease: Awaitable[None], num_members: int,
                           check: Callable[[], None]) -> float:
        """Seconds from ending ``rid``'s lease to an epoch without it; raises if that epoch
        lost other members of the ``num_members`` too."""
        t0 = time.perf_counter()
        await end_lease
        seen, epoch = await self.wait_for(lambda e: rid not in e.members, f"{rid} removed",
                                          check)
        if len(epoch.members) != num_members - 1:
            raise BenchError(f"the epoch that removed {rid} has {len(epoch.members)} members, "
                             f"expected {num_members - 1}: other replicas were lost (leases "
                             "expired? the load may be more than this machine sustains)")
        return seen - t0

    async def time_join(self, rid: str, register: Awaitable[None],
                        check: Callable[[], None]) -> float:
        """Seconds from ``rid``'s next registration to an epoch with it."""
        t0 = time.perf_counter()
        await register
        seen, _ = await self.wait_for(lambda e: rid in e.members, f"{rid} rejoined", check)
        return seen - t0


@asynccontextmanager
async def job_under_test(url: str, job: str, num_replicas: int, timeout_s: float
                         ) -> AsyncIterator[tuple[Store, EpochWatcher]]:
    """The job's spec written, and a watcher of its epochs; yields a store for the benchmark's
    own writes and the watcher (each on its own connection)."""
    async with Store(url) as store, Store(url) as watch_store:
        await store.put_json(keys.spec(job), {"replicas": num_replicas, "min_replicas": 1})
        watcher = EpochWatcher(watch_store, job, timeout_s)
        await watcher.start()
        try:
            yield store, watcher
        finally:
            await watcher.stop()
