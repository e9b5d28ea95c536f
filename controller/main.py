"""``ftsystem controller``: serve the REST API and take part in leader election."""

from __future__ import annotations

import asyncio
import logging
import os
import socket

import uvicorn

from controller.app import create_app
from controller.leader import LeaderConfig
from ftsystem.control.store import Store


def serve(*, etcd: str, job: str, port: int, bind: str, advertise_address: str,
          instance_id: str | None = None, insecure: bool = False,
          public_read: bool = False) -> None:
    """Listen on ``bind:port``; publish ``advertise_address:port`` for discovery."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s controller %(message)s")
    cfg = LeaderConfig(job=job,
                       address=f"{advertise_address}:{port}",
                       instance_id=instance_id or f"{socket.gethostname()}-{os.getpid()}-{port}")
    # Refuses an open API first.
    app = create_app(Store(etcd), cfg, insecure=insecure, public_read=public_read)
    asyncio.run(_check_reachable(etcd))  # fail fast, with the store's message
    uvicorn.run(app, host=bind, port=port, log_level="warning")


async def _check_reachable(etcd: str) -> None:
    async with Store(etcd):
        pass
