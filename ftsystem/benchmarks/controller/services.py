"""What the controller benchmarks run against: a real etcd (embedded unless one is named) and a
real controller leader, as the ``ftsystem controller`` command in a subprocess or as the same
leader code (``run_elections``) in a task of the benchmark's own event loop."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

from controller.leader import LeaderConfig, run_elections
from ftsystem.benchmarks.controller.config import ControllerMode
from ftsystem.control.etcd_server import EmbeddedEtcd, free_port
from ftsystem.control.store import Store


class BenchError(RuntimeError):
    """The controller did not behave as the benchmark expects (no epoch, wrong members)."""


@dataclass(frozen=True, slots=True)
class Leader:
    """The controller leader under test."""

    check: Callable[[], None]
    """Raises BenchError if the leader has died."""
    api: str | None
    """Base URL of its REST API; None in-process (no HTTP server)."""
    pid: int | None
    """Its process; None in-process (it is ours)."""
    token: str | None = None
    """The job's token, which its API requires (None in-process)."""


@contextmanager
def workdir(keep: Path | None, prefix: str) -> Iterator[Path]:
    """Where etcd's data and the processes' logs go: ``keep``, or a temporary directory."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield Path(tmp)
        return
    if (keep / "etcd").exists():  # another run's keys would be this run's
        raise BenchError(f"{keep} already holds an etcd data directory: pick a new --logs")
    keep.mkdir(parents=True, exist_ok=True)
    yield keep


@contextmanager
def etcd(url: str | None, workdir: Path) -> Iterator[str]:
    """The given etcd, or an embedded one that lives as long as the context."""
    if url is not None:
        yield url
        return
    with EmbeddedEtcd(data_dir=workdir / "etcd") as server:
        yield server.url


def run_rounds(rounds: int, one_round: Callable[[], Awaitable[dict]]) -> list[dict]:
    """``one_round`` run ``rounds`` times in one event loop: grpc.aio binds its completion queue
    to the loops that used it, and a later loop in the same process has been seen to wait
    forever for the cancellation of a stream (the in-process leader's) whose completion went
    to a closed one."""
    async def all_rounds() -> list[dict]:
        return [await one_round() for _ in range(rounds)]
    return asyncio.run(all_rounds())


@asynccontextmanager
async def leader(mode: ControllerMode, url: str, job: str, workdir: Path
                 ) -> AsyncIterator[Leader]:
    """A controller leader for ``job``, as long as the context."""
    if mode is ControllerMode.SUBPROCESS:
        async with _leader_process(url, job, workdir / "controller.log") as handle:
            yield handle
    else:
        async with _leader_task(url, job) as handle:
            yield handle


@asynccontextmanager
async def _leader_process(url: str, job: str, log_path: Path) -> AsyncIterator[Leader]:
    port = free_port()
    cmd = [sys.executable, "-c", "from ftsystem.cli import main; main()", "controller",
           "--etcd", url, "--job", job, "--port", str(port), "--bind", "127.0.0.1"]
    # A random token keeps the controller closed, as by default; the bench reads with it.
    token = secrets.token_hex(16)
    env = os.environ | {"FTSYSTEM_API_TOKEN": token}
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)

    def check() -> None:
        if proc.poll() is not None:
            raise BenchError(f"the controller exited with {proc.returncode}: {tail(log_path)}")
    try:
        yield Leader(check, f"http://127.0.0.1:{port}", proc.pid, token)
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@asynccontextmanager
async def _leader_task(url: str, job: str) -> AsyncIterator[Leader]:
    store = Store(url)
    await store.connect()
    cfg = LeaderConfig(job=job, instance_id=f"bench-{os.getpid()}")
    task = asyncio.create_task(run_elections(store, cfg, asyncio.Event()))

    def check() -> None:
        if task.done():
            raise BenchError(f"the controller task ended: {task.exception()!r}")
    try:
        yield Leader(check, None, None)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()


def join_tick_s() -> float:
    """How often the leader admits joiners (its join tick)."""
    return LeaderConfig(job="x", instance_id="x").join_tick_s


def tail(path: Path, num_chars: int = 2000) -> str:
    """The end of a process's log, for an error that says why it died."""
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return f"(no log at {path})"
