"""Shared fixtures: a real etcd on loopback, unique job ids, polling helpers."""

from __future__ import annotations

import itertools
import os
import time
from typing import Callable, TypeVar

import pytest

from ftsystem.etcd_server import EmbeddedEtcd

T = TypeVar("T")
_job_ids = itertools.count()

# Tests that expect an unreachable etcd should not wait the default 10 s for it.
os.environ.setdefault("FTSYSTEM_ETCD_RETRY_S", "10")


@pytest.fixture(scope="session")
def etcd(tmp_path_factory) -> EmbeddedEtcd:
    server = EmbeddedEtcd(data_dir=tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@pytest.fixture
def job_id(request) -> str:
    return f"t{next(_job_ids)}-{os.getpid()}"


def wait_for(predicate: Callable[[], T], timeout: float, what: str, poll: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
