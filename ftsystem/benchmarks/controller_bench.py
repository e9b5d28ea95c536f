"""``ftsystem bench controller``: membership decision latency of the real leader at scale.

Against a real etcd (embedded unless ``--etcd`` names one) and a real controller leader, n
simulated replicas register, each with its own lease. Then, one replica at a time, the benchmark
revokes the replica's lease (what an agent does the moment a process exits) and measures the
time until a separate watcher of the epoch key, on its own connection, sees an epoch without
that replica. The replica re-registers with the next generation and the benchmark waits for its
join epoch (batched on the leader's tick) before the next revoke, so measurements never overlap.

The controller runs as the ``ftsystem controller`` command in a subprocess by default, so that
its event loop does not share a core with the load generator; ``--controller in-process`` runs
the same leader code (``run_elections``) as a task in the benchmark's own event loop, which is
what a profiler of this command sees.
"""

from __future__ import annotations

import asyncio
import enum
import os
import random
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterator, Optional

import typer

from ftsystem.cli import ETCD_HELP, _fail, bench_app

if TYPE_CHECKING:
    from ftsystem.membership import Epoch
    from ftsystem.store import Store

TARGET_P99_S = 0.1
"""The issue's target: p99 decision latency at most 100 ms at 2,048 replicas."""
FULL_REPLICAS, FULL_REVOKES = 2048, 50
QUICK_REPLICAS, QUICK_REVOKES = 512, 20


class ControllerMode(str, enum.Enum):
    SUBPROCESS = "subprocess"
    IN_PROCESS = "in-process"


class BenchError(RuntimeError):
    """The controller did not behave as the benchmark expects (no epoch, wrong members)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    num_replicas: int
    """Simulated replicas registered before the first revoke."""
    num_revokes: int
    """Lease revocations measured, one at a time."""
    etcd: str | None
    """etcd endpoints; None starts an embedded single-node etcd."""
    controller: ControllerMode
    """How the real leader runs: a subprocess, or a task of this process."""
    lease_ttl_s: int = 300
    """Replica lease TTL: long enough that no keep-alive is needed during the run."""
    register_concurrency: int = 128
    """Registrations (grant + put) in flight at once."""
    epoch_timeout_s: float = 120.0
    """How long to wait for an expected epoch before giving up."""
    seed: int = 0
    """Seeds the choice of revoked replicas and the revoke phases relative to the tick."""
    num_scrapes: int = 20
    """Timed GETs of /v1/sd/prometheus and of /metrics (subprocess controller only)."""


# --- processes -----------------------------------------------------------------------------------

@contextmanager
def _etcd(url: str | None, workdir: Path) -> Iterator[str]:
    """The given etcd, or an embedded one that lives as long as the context."""
    if url is not None:
        yield url
        return
    from ftsystem.etcd_server import EmbeddedEtcd
    with EmbeddedEtcd(data_dir=workdir / "etcd") as server:
        yield server.url


@asynccontextmanager
async def _controller(mode: ControllerMode, url: str, job: str, workdir: Path
                      ) -> AsyncIterator[tuple[Callable[[], None], str | None]]:
    """Run a controller leader for ``job``; yields a check that raises if it has died, and
    the base URL of its REST API (None in-process: no HTTP server there)."""
    if mode is ControllerMode.SUBPROCESS:
        async with _controller_subprocess(url, job, workdir / "controller.log") as check:
            yield check
    else:
        async with _controller_task(url, job) as check:
            yield check


@asynccontextmanager
async def _controller_subprocess(url: str, job: str, log_path: Path
                                 ) -> AsyncIterator[tuple[Callable[[], None], str]]:
    from ftsystem.etcd_server import free_port
    port = free_port()
    cmd = [sys.executable, "-c", "from ftsystem.cli import main; main()", "controller",
           "--etcd", url, "--job", job, "--port", str(port)]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)

    def check() -> None:
        if proc.poll() is not None:
            raise BenchError(f"the controller exited with {proc.returncode}: "
                             f"{_tail(log_path)}")
    try:
        yield check, f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@asynccontextmanager
async def _controller_task(url: str, job: str
                           ) -> AsyncIterator[tuple[Callable[[], None], None]]:
    from controller.leader import LeaderConfig, run_elections
    from ftsystem.store import Store
    store = Store(url)
    await store.connect()
    cfg = LeaderConfig(job=job, instance_id=f"bench-{os.getpid()}")
    task = asyncio.create_task(run_elections(store, cfg, asyncio.Event()))

    def check() -> None:
        if task.done():
            raise BenchError(f"the controller task ended: {task.exception()!r}")
    try:
        yield check, None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()


def _tail(path: Path, num_chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return "(no controller log)"


# --- the watcher and the simulated replicas ----------------------------------------------------

class EpochWatcher:
    """Follows the epoch key on its own connection, timestamping each epoch once decoded."""

    def __init__(self, store: Store, job: str) -> None:
        from ftsystem import keys
        self.store, self.key = store, keys.epoch(job)
        self.queue: asyncio.Queue[tuple[float, Epoch]] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        _, revision = await self.store.get_prefix(self.key)
        self._task = asyncio.create_task(self._follow(revision + 1))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _follow(self, start_revision: int) -> None:
        from ftsystem.membership import Epoch
        async for event in self.store.watch_prefix(self.key, start_revision=start_revision):
            if event.key == self.key and event.kind == "PUT":
                epoch = Epoch.from_json(event.value)
                self.queue.put_nowait((time.perf_counter(), epoch))

    async def wait_for(self, wanted: Callable[[Epoch], bool], what: str, timeout_s: float,
                       check: Callable[[], None]) -> tuple[float, Epoch]:
        """The first epoch (and when it was seen) that satisfies ``wanted``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            check()
            try:
                seen, epoch = await asyncio.wait_for(self.queue.get(), 1.0)
            except asyncio.TimeoutError:
                continue
            if wanted(epoch):
                return seen, epoch
        check()
        raise BenchError(f"no epoch with {what} within {timeout_s:.0f} s")


class Replicas:
    """Simulated replicas: registrations under ``replicas/``, each bound to its own lease."""

    def __init__(self, store: Store, job: str, cfg: BenchConfig) -> None:
        self.store, self.job, self.cfg = store, job, cfg
        self.ids = [f"r{i:05d}" for i in range(cfg.num_replicas)]
        self.leases: dict[str, int] = {}
        self.generations = dict.fromkeys(self.ids, 0)
        # Fake rendezvous addresses: the benchmark never connects to them.
        self.store_addrs = {rid: f"127.0.0.1:{20000 + i}" for i, rid in enumerate(self.ids)}
        self.metrics_addrs = {rid: f"127.0.0.1:{40000 + i}" for i, rid in enumerate(self.ids)}

    async def register(self, rid: str) -> None:
        from ftsystem import keys
        from ftsystem.membership import Registration, ReplicaState
        lease = await self.store.grant(self.cfg.lease_ttl_s)
        reg = Registration(replica_id=rid, state=ReplicaState.READY,
                           generation=self.generations[rid], host="127.0.0.1",
                           store_addr=self.store_addrs[rid],
                           metrics_addr=self.metrics_addrs[rid])
        await self.store.put(keys.replica(self.job, rid), reg.to_json(), lease=lease)
        self.leases[rid] = lease

    async def register_all(self) -> None:
        limit = asyncio.Semaphore(self.cfg.register_concurrency)

        async def one(rid: str) -> None:
            async with limit:
                await self.register(rid)
        await asyncio.gather(*(one(rid) for rid in self.ids))

    async def fail(self, rid: str) -> None:
        """What an agent does when the replica's process exits: revoke its lease."""
        await self.store.revoke(self.leases.pop(rid))

    async def restart(self, rid: str) -> None:
        self.generations[rid] += 1
        await self.register(rid)

    async def revoke_all(self) -> None:
        limit = asyncio.Semaphore(self.cfg.register_concurrency)

        async def one(lease: int) -> None:
            async with limit:
                await self.store.revoke(lease)
        await asyncio.gather(*(one(lease) for lease in self.leases.values()))


# --- the measurement ---------------------------------------------------------------------------

async def measure(cfg: BenchConfig, url: str, workdir: Path) -> dict:
    """Register, wait for the full epoch, then time ``num_revokes`` removals; seconds."""
    from ftsystem import keys
    from ftsystem.store import Store
    job = f"bench-controller-{os.getpid()}"
    async with Store(url) as store, Store(url) as watch_store:
        await store.put_json(keys.spec(job), {"replicas": cfg.num_replicas, "min_replicas": 1})
        watcher = EpochWatcher(watch_store, job)
        replicas = Replicas(store, job, cfg)
        await watcher.start()
        try:
            async with _controller(cfg.controller, url, job, workdir) as (check, api):
                result = await _run(cfg, replicas, watcher, check)
                result["scrape"] = await _time_scrapes(api, job, cfg.num_scrapes) if api else None
                return result
        finally:
            await watcher.stop()
            if cfg.etcd is not None:  # an embedded etcd goes away with everything in it
                await replicas.revoke_all()
                await store.delete_prefix(keys.job(job) + "/")


async def _run(cfg: BenchConfig, replicas: Replicas, watcher: EpochWatcher,
               check: Callable[[], None]) -> dict:
    from controller.leader import LeaderConfig
    start = time.perf_counter()
    await replicas.register_all()
    registered = time.perf_counter()
    everyone = frozenset(replicas.ids)
    seen, _ = await watcher.wait_for(lambda e: frozenset(e.members) == everyone,
                                     f"all {cfg.num_replicas} members", cfg.epoch_timeout_s,
                                     check)
    join_tick_s = LeaderConfig(job="x", instance_id="x").join_tick_s
    rng = random.Random(cfg.seed)
    decisions, joins = [], []
    for _ in range(cfg.num_revokes):
        rid = rng.choice(replicas.ids)
        # Failures arrive at any phase of the leader's join tick, not just after a tick.
        await asyncio.sleep(rng.uniform(0.0, join_tick_s))
        decisions.append(await _time_removal(cfg, replicas, watcher, check, rid))
        joins.append(await _time_join(cfg, replicas, watcher, check, rid))
    return {"registration_s": registered - start, "first_epoch_s": seen - start,
            "decisions": decisions, "joins": joins, "join_tick_s": join_tick_s}


async def _time_removal(cfg: BenchConfig, replicas: Replicas, watcher: EpochWatcher,
                        check: Callable[[], None], rid: str) -> float:
    t0 = time.perf_counter()
    await replicas.fail(rid)
    seen, epoch = await watcher.wait_for(lambda e: rid not in e.members, f"{rid} removed",
                                         cfg.epoch_timeout_s, check)
    if len(epoch.members) != cfg.num_replicas - 1:
        raise BenchError(f"the epoch that removed {rid} has {len(epoch.members)} members, "
                         f"expected {cfg.num_replicas - 1}: the controller lost others")
    return seen - t0


async def _time_join(cfg: BenchConfig, replicas: Replicas, watcher: EpochWatcher,
                     check: Callable[[], None], rid: str) -> float:
    t0 = time.perf_counter()
    await replicas.restart(rid)
    seen, _ = await watcher.wait_for(lambda e: rid in e.members, f"{rid} rejoined",
                                     cfg.epoch_timeout_s, check)
    return seen - t0


async def _time_scrapes(api: str, job: str, num_scrapes: int) -> dict:
    """What Prometheus pays per scrape of service discovery and of the controller's metrics."""
    import httpx
    timings: dict[str, list[float]] = {"sd": [], "metrics": []}
    async with httpx.AsyncClient(base_url=api, timeout=30) as client:
        for _ in range(num_scrapes):
            for name, path in (("sd", "/v1/sd/prometheus"), ("metrics", "/metrics")):
                t0 = time.perf_counter()
                response = await client.get(path)
                response.raise_for_status()
                timings[name].append(time.perf_counter() - t0)
        targets = sum(len(g["targets"]) for g in (await client.get("/v1/sd/prometheus")).json())
    return {"sd_s": summarize(timings["sd"]), "metrics_s": summarize(timings["metrics"]),
            "sd_targets": targets, "scrapes": num_scrapes}


def summarize(samples: list[float]) -> dict[str, float]:
    import numpy as np
    values = np.asarray(samples, dtype=float)
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
            "mean": float(values.mean()), "max": float(values.max())}


def run(cfg: BenchConfig) -> dict:
    """The benchmark's JSON (without ``machine``)."""
    with tempfile.TemporaryDirectory(prefix="ftsystem-bench-controller-") as tmp:
        workdir = Path(tmp)
        with _etcd(cfg.etcd, workdir) as url:
            raw = asyncio.run(measure(cfg, url, workdir))
    return {"replicas": cfg.num_replicas, "revokes": len(raw["decisions"]),
            "decision_latency_s": summarize(raw["decisions"]), "target_p99_s": TARGET_P99_S,
            "registration_s": raw["registration_s"], "first_epoch_s": raw["first_epoch_s"],
            "join_latency_s": summarize(raw["joins"]), "join_tick_s": raw["join_tick_s"],
            "scrape_latency_s": raw["scrape"],
            "controller": cfg.controller.value, "etcd": cfg.etcd or "embedded"}


# --- the command -------------------------------------------------------------------------------

@bench_app.command("controller")
def controller_bench(
        replicas: Optional[int] = typer.Option(
            None, min=2, help=f"simulated replicas (default {FULL_REPLICAS}; "
                              f"{QUICK_REPLICAS} with --quick)"),
        revokes: Optional[int] = typer.Option(
            None, min=1, help=f"lease revocations to time (default {FULL_REVOKES}; "
                              f"{QUICK_REVOKES} with --quick)"),
        quick: bool = typer.Option(False, "--quick", help="fewer replicas and revokes"),
        etcd: Optional[str] = typer.Option(None, help=ETCD_HELP + "; default: embedded"),
        controller: ControllerMode = typer.Option(
            ControllerMode.SUBPROCESS, help="run the leader as `ftsystem controller` in a "
                                            "subprocess, or as a task in this process"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="write the results here"),
) -> None:
    """Membership decision latency: lease revoked -> epoch without the replica seen."""
    from ftsystem.report import machine, write_json
    from ftsystem.store import StoreError, parse_endpoints
    if etcd is not None:
        try:
            parse_endpoints(etcd)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--etcd") from e
    cfg = BenchConfig(
        num_replicas=replicas or (QUICK_REPLICAS if quick else FULL_REPLICAS),
        num_revokes=revokes or (QUICK_REVOKES if quick else FULL_REVOKES),
        etcd=etcd, controller=controller)
    try:
        result = run(cfg)
    except (StoreError, RuntimeError) as e:  # BenchError, etcd not installed or not starting
        raise _fail(str(e))
    result["machine"] = machine()
    _print(result)
    write_json(json_out, result)


def _print(result: dict) -> None:
    from ftsystem.report import print_table
    d, j = result["decision_latency_s"], result["join_latency_s"]
    print_table(f"controller ({result['controller']}), {result['replicas']} replicas, "
                f"{result['revokes']} revokes",
                ["measure", "p50 (ms)", "p99 (ms)", "mean (ms)", "max (ms)"],
                [("removal: revoke -> epoch seen", *(1000 * d[k] for k in d)),
                 ("join: register -> epoch seen", *(1000 * j[k] for k in j))]
                + [(f"scrape {name}", *(1000 * v for v in result["scrape_latency_s"][key].values()))
                   for name, key in (("/v1/sd/prometheus", "sd_s"), ("/metrics", "metrics_s"))
                   if result["scrape_latency_s"]])
    verdict = "meets" if d["p99"] <= result["target_p99_s"] else "MISSES"
    print_table("summary", ["registration (s)", "first epoch (s)", "target p99 (ms)", "verdict"],
                [(result["registration_s"], result["first_epoch_s"],
                  1000 * result["target_p99_s"], verdict)])
