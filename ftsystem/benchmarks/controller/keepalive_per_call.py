"""Keep-alives one LeaseKeepAlive stream each, as aetcd's ``refresh_lease`` opens one: what node
agents renewing that way would cost etcd (``Store.keep_alive`` keeps its stream open)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aetcd

from ftsystem.control.store import parse_endpoints


class PerCallKeepAlives:
    """The same interface as ``BatchedKeepAlives``: ``open``, ``send``, ``close``."""

    def __init__(self, url: str, on_reply: Callable[[int, int], None],
                 max_in_flight: int = 256) -> None:
        self.endpoint = parse_endpoints(url)[0]
        self.on_reply = on_reply
        self._limit = asyncio.Semaphore(max_in_flight)
        self._tasks: set[asyncio.Task] = set()
        self.reader_task: asyncio.Task | None = None
        """None: no background reader (each call reads its own reply)."""
        self.restarts = 0
        """Always 0: no stream outlives a call."""

    async def open(self) -> None:
        self._client = aetcd.Client(self.endpoint.host, self.endpoint.port, timeout=5)
        await self._client.connect()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.close()

    async def send(self, leases: list[int]) -> None:
        for lease in leases:
            task = asyncio.create_task(self._one(lease))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _one(self, lease: int) -> None:
        async with self._limit:
            try:
                reply = await self._client.refresh_lease(lease)
            except Exception:  # noqa: BLE001 - etcd answers "not found" for a revoked lease
                reply = None
        self.on_reply(lease, reply.TTL if reply is not None else 0)
