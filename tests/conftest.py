"""Shared fixtures: a real etcd on loopback, unique job ids, polling helpers."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import httpx

import pytest

from ftsystem.cli import register_subcommands
from ftsystem.control.etcd_server import EmbeddedEtcd, free_port

# The tests drive the whole CLI through ``ftsystem.cli.app`` (typer's CliRunner); ``main``
# registers the sub-commands per invocation, so register them all here.
register_subcommands()

T = TypeVar("T")
API_TOKEN = "test-api-token"
"""The bearer token of the controllers ``controller_process`` starts (closed by default)."""
_job_ids = itertools.count()

# Tests that expect an unreachable etcd should not wait the default 10 s for it.
os.environ.setdefault("FTSYSTEM_ETCD_RETRY_S", "10")
# CI's two cores run a test's etcd, controllers, agents and ranks, and stall a process for
# seconds now and then: a 2 s straggler floor would evict healthy replicas there. The bound's
# own tests (test_stragglers.py, test_membership.py) remove or override it.
os.environ.setdefault("FTSYSTEM_STRAGGLER_FLOOR_S", "5")
# The same stalls can hold a process's beats: a silence of 2 s, not 0.6, names a member there
# (test_stragglers.py keeps the default).
os.environ.setdefault("FTSYSTEM_STRAGGLER_SILENCE_S", "2")
# Agents are closed by default: every agent a test starts finds the job's token in its
# environment, as in a deployment, and hands it to its ranks (the controllers use the same one).
os.environ.setdefault("FTSYSTEM_API_TOKEN", API_TOKEN)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory) -> EmbeddedEtcd:
    server = EmbeddedEtcd(data_dir=tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def slurm_cluster_session():
    """A real Slurm cluster of six nodes (``tests/slurm_cluster.py``), made once per run."""
    from ftsystem.launch.netns import netns_supported
    from slurm_cluster import SlurmCluster, missing_commands

    if missing := missing_commands():
        pytest.skip(f"Slurm is not installed: no {', '.join(missing)} "
                    "(bash scripts/install.sh --test installs them)")
    if why := netns_supported():
        pytest.fail(f"Slurm is installed but its test cluster cannot be made: {why}")
    with SlurmCluster(6) as cluster:
        yield cluster


@pytest.fixture
def slurm_cluster(slurm_cluster_session):
    """The session's Slurm cluster with no job and every node up and idle."""
    slurm_cluster_session.reset()
    return slurm_cluster_session


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


def descendants(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (threads and processes may vanish while we look)."""
    children: set[int] = set()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        return children
    for task in tasks:
        try:
            children |= {int(c) for c in (task / "children").read_text().split()}
        except FileNotFoundError:
            continue
    for child in set(children):
        children |= descendants(child)
    return children


def exit_code_within(process: subprocess.Popen, timeout: float, log: Path, what: str) -> int:
    """``process``'s exit code, which must come within ``timeout``; else fail with the end of
    its ``log``."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what} did not exit within {timeout:.0f} s:\n"
                             f"{log.read_text()[-3000:]}") from None


def serving(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def controller_process(etcd_url: str, job: str, log_dir: Path,
                       env: dict[str, str] | None = None, *, insecure: bool = False,
                       public_read: bool = False) -> Iterator[str]:
    """A real ``ftsystem controller`` for ``job``; yields its base URL once it serves. Its API
    token is ``API_TOKEN`` unless ``env`` configures another."""
    port = free_port()
    with open(log_dir / "controller.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ftsystem.cli", "controller", "--etcd",
                                 etcd_url, "--job", job, "--port", str(port),
                                 "--bind", "127.0.0.1", "--advertise-address", "127.0.0.1",
                                 *(["--insecure"] if insecure else []),
                                 *(["--public-read"] if public_read else [])],
                                env={**os.environ, "FTSYSTEM_API_TOKEN": API_TOKEN, **(env or {})},
                                stdout=log,
                                stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: serving(f"{base}/healthz"), 60, "the controller to serve")
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


def write_two_region_setup(directory: Path, *, worker_speeds: list[list[float]],
                           num_lps: int) -> tuple[Path, Path]:
    """The paper's setup cut to two regions, one-second steps and tiny H and K, with a trace of
    one model: HALoS benches run every code path on it in seconds. Returns (setup, trace)."""
    import json

    import yaml

    from ftsystem.halos.config import DEFAULT_SETUP

    doc = yaml.safe_load(DEFAULT_SETUP.read_text())
    doc.update(num_regions=2, network_bandwidth_gbps=[[100.0, 1.0], [1.0, 100.0]],
               worker_speeds=worker_speeds)
    doc["pythia_70m"]["local_step_time_ms"] = 1000.0
    doc["halos"].update(num_lps=num_lps, workers_per_lps=1, local_steps_H=2, accumulation_K=2)
    doc["diloco"]["local_steps_H"] = doc["async_local_sgd"]["local_steps_H"] = 4
    setup_path, trace_path = directory / "setup.yaml", directory / "trace.json"
    setup_path.write_text(yaml.safe_dump(doc))
    trace_path.write_text(json.dumps({"models": {"pythia-70m": {"params": 31_250_000}}}))
    return setup_path, trace_path
