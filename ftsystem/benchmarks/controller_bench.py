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

``--nodes N`` simulates N node agents instead (each with its own lease, keep-alives and record,
progress written by each replica's node 0), and measures the decision latency under that load
together with etcd's write and keep-alive rates and database size (``docs/scale.md``).
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import os
import random
import secrets
import struct
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Iterator, Optional

import typer

from ftsystem.cli import ETCD_HELP, _fail, bench_app
from ftsystem.control.timeouts import NODE_LEASE_RENEW_S, NODE_LEASE_TTL_S, Timeouts

if TYPE_CHECKING:
    from ftsystem.control.membership import Epoch
    from ftsystem.control.store import Store

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
    from ftsystem.control.etcd_server import EmbeddedEtcd
    with EmbeddedEtcd(data_dir=workdir / "etcd") as server:
        yield server.url


@asynccontextmanager
async def _controller(mode: ControllerMode, url: str, job: str, workdir: Path
                      ) -> AsyncIterator[tuple[Callable[[], None], str | None, int | None]]:
    """Run a controller leader for ``job``; yields a check that raises if it has died, the
    base URL of its REST API and its pid (both None in-process: no HTTP server, our pid)."""
    if mode is ControllerMode.SUBPROCESS:
        async with _controller_subprocess(url, job, workdir / "controller.log") as handle:
            yield handle
    else:
        async with _controller_task(url, job) as handle:
            yield handle


@asynccontextmanager
async def _controller_subprocess(url: str, job: str, log_path: Path
                                 ) -> AsyncIterator[tuple[Callable[[], None], str, int]]:
    from ftsystem.control.etcd_server import free_port
    port = free_port()
    cmd = [sys.executable, "-c", "from ftsystem.cli import main; main()", "controller",
           "--etcd", url, "--job", job, "--port", str(port), "--bind", "127.0.0.1"]
    # The bench only reads the API; a random token keeps the controller closed, as by default.
    env = os.environ | {"FTSYSTEM_API_TOKEN": secrets.token_hex(16)}
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)

    def check() -> None:
        if proc.poll() is not None:
            raise BenchError(f"the controller exited with {proc.returncode}: "
                             f"{_tail(log_path)}")
    try:
        yield check, f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@asynccontextmanager
async def _controller_task(url: str, job: str
                           ) -> AsyncIterator[tuple[Callable[[], None], None, None]]:
    from controller.leader import LeaderConfig, run_elections
    from ftsystem.control.store import Store
    store = Store(url)
    await store.connect()
    cfg = LeaderConfig(job=job, instance_id=f"bench-{os.getpid()}")
    task = asyncio.create_task(run_elections(store, cfg, asyncio.Event()))

    def check() -> None:
        if task.done():
            raise BenchError(f"the controller task ended: {task.exception()!r}")
    try:
        yield check, None, None
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
        from ftsystem.control import keys
        self.store, self.key = store, keys.epoch(job)
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
        from ftsystem.control.membership import Epoch
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
                # Not wait_for: in Python 3.11 it can drop a cancellation (CPython gh-86296).
                async with asyncio.timeout(1.0):
                    seen, epoch = await self.queue.get()
            except TimeoutError:
                continue
            if wanted(epoch):
                return seen, epoch
            self.skipped += 1
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
        from ftsystem.control import keys
        from ftsystem.control.membership import Registration, ReplicaState
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
    from ftsystem.control import keys
    from ftsystem.control.store import Store
    job = f"bench-controller-{os.getpid()}"
    async with Store(url) as store, Store(url) as watch_store:
        await store.put_json(keys.spec(job), {"replicas": cfg.num_replicas, "min_replicas": 1})
        watcher = EpochWatcher(watch_store, job)
        replicas = Replicas(store, job, cfg)
        await watcher.start()
        try:
            async with _controller(cfg.controller, url, job, workdir) as (check, api, _):
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


def run(cfg: BenchConfig, rounds: int = 1) -> list[dict]:
    """The benchmark's JSON (without ``machine``) for each of ``rounds`` rounds, each on an etcd
    of its own."""
    async def one_round() -> dict:
        with tempfile.TemporaryDirectory(prefix="ftsystem-bench-controller-") as tmp:
            workdir = Path(tmp)
            with _etcd(cfg.etcd, workdir) as url:  # blocks the loop, idle until measured
                return _round_result(cfg, await measure(cfg, url, workdir))
    return _in_one_loop(rounds, one_round)


def _in_one_loop(rounds: int, one_round: Callable[[], Awaitable[dict]]) -> list[dict]:
    """``one_round`` run ``rounds`` times in one event loop: grpc.aio binds its completion queue
    to the loops that used it, and a later loop in the same process has been seen to wait
    forever for the cancellation of a stream (the in-process leader's) whose completion went
    to a closed one."""
    async def all_rounds() -> list[dict]:
        return [await one_round() for _ in range(rounds)]
    return asyncio.run(all_rounds())


def _round_result(cfg: BenchConfig, raw: dict) -> dict:
    return {"replicas": cfg.num_replicas, "revokes": len(raw["decisions"]),
            "decision_latency_s": summarize(raw["decisions"]), "target_p99_s": TARGET_P99_S,
            "registration_s": raw["registration_s"], "first_epoch_s": raw["first_epoch_s"],
            "join_latency_s": summarize(raw["joins"]), "join_tick_s": raw["join_tick_s"],
            "scrape_latency_s": raw["scrape"],
            "controller": cfg.controller.value, "etcd": cfg.etcd or "embedded"}


# --- nodes mode: the control plane at the scale of node agents -----------------------------------
#
# ``--nodes N`` simulates N node agents instead of N replicas. Each holds its own node lease
# (``NODE_LEASE_TTL_S``, renewed every ``NODE_LEASE_RENEW_S``, as ``agent.slot`` does) bound to
# its record under ``agents/<replica>/<node rank>``; node rank 0 of each replica also holds the
# replica lease (TTL ``Timeouts(30).lease_ttl_s``, renewed every 0.5 s) bound to the
# registration, which it rewrites with its step once a
# second. Load-generator processes, each an event loop with its own etcd connections, hold the
# agents of some replicas, and react to the DELETE of a node record by revoking the replica's
# lease (the agents of agent/ notice a dead peer by UDP pulses, then revoke the same way). The
# benchmark ends one lease at a time: a node lease (a node dies) or a replica lease (an agent
# reports a failure), and times the epoch without the replica.

NODES_TARGET_P99_S = 0.05
"""The issue's target: p99 decision latency at most 50 ms at 16,384 node agents."""
NODES_FULL_REPLICAS, NODES_FULL_SAMPLES, NODES_FULL_WINDOW_S = 64, 50, 30.0
NODES_QUICK_REPLICAS, NODES_QUICK_SAMPLES, NODES_QUICK_WINDOW_S = 8, 10, 5.0
DEFAULT_PROCESSES = max(2, min(8, os.cpu_count() or 2))
"""One load generator per core: more only add wake-ups, stolen from etcd on a small machine
(measured on 2 cores: node-lease-end p99 36, 66, 82 ms with 2, 4, 8 processes)."""
KINDS = ("node_lease_end", "reported_failure")
# A keep-alive request on the wire: 5-byte gRPC prefix, 1-byte tag, a varint of at most 9 bytes.
# This many fit in one HTTP/2 DATA frame of the default maximum size (16 KiB).
KEEPALIVES_PER_FRAME = 1000


class KeepAliveMode(str, enum.Enum):
    BATCHED = "batched"
    PER_CALL = "per-call"


@dataclass(frozen=True, kw_only=True, slots=True)
class NodesConfig:
    num_nodes: int
    """Simulated node agents, each with its own lease; a multiple of ``num_replicas``."""
    num_replicas: int
    num_samples: int
    """Lease ends measured per kind (node lease end, reported failure), one at a time."""
    etcd: str | None
    controller: ControllerMode
    num_processes: int = DEFAULT_PROCESSES
    """Load-generator processes; replicas are spread over them."""
    keepalive: KeepAliveMode = KeepAliveMode.BATCHED
    """batched: one keep-alive request per lease per interval, sent over long-lived streams
    (``Store.keep_alive`` keeps one open per lease), many requests per write. per-call: one
    stream per keep-alive, as aetcd's ``refresh_lease`` does (what ``Store.keep_alive`` did
    before it kept its stream open)."""
    lease_ttl_s: int = Timeouts(30.0).lease_ttl_s
    """TTL of the replica lease (``--timeout`` 30 s, the default)."""
    node_lease_ttl_s: int = NODE_LEASE_TTL_S
    node_keepalive_s: float = NODE_LEASE_RENEW_S
    replica_keepalive_s: float = 0.5
    progress_s: float = 1.0
    """Rank 0 rewrites the registration with its step this often (rate-limited, per replica)."""
    window_s: float = NODES_FULL_WINDOW_S
    """Steady state (no failure) over which etcd's write and keep-alive rates are measured."""
    setup_concurrency: int = 32
    """Lease grants and record writes in flight at once, per process."""
    keepalive_streams: int = 64
    """LeaseKeepAlive streams per process (batched): etcd renews a stream's requests in turn."""
    keepalive_tick_s: float = 0.002
    """A process sends each keep-alive when it falls due, coalescing those due within a tick.
    Independent agents' keep-alives arrive spread out: a 50 ms tick's bursts (60 requests at
    once per process) alone raised etcd's p90 write latency from 9 ms to 65 ms (measured)."""
    epoch_timeout_s: float = 120.0
    seed: int = 0
    logs_dir: Path | None = None
    """Keep etcd's data and every process's log here (default: a temporary directory)."""

    @property
    def nodes_per_replica(self) -> int:
        return self.num_nodes // self.num_replicas


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerConfig:
    """What one load-generator process simulates (sent as JSON on its stdin)."""

    url: str
    job: str
    replicas: list[str]
    nodes_per_replica: int
    lease_ttl_s: int
    node_lease_ttl_s: int
    node_keepalive_s: float
    replica_keepalive_s: float
    progress_s: float
    setup_concurrency: int
    keepalive: str
    keepalive_streams: int
    keepalive_tick_s: float


def check_nodes_config(cfg: NodesConfig) -> None:
    if cfg.num_replicas < 2 or cfg.num_nodes % cfg.num_replicas:
        raise ValueError(f"--nodes {cfg.num_nodes} is not a multiple of --replicas "
                         f"{cfg.num_replicas} (at least 2): every replica has as many nodes")


def control_plane_budget(cfg: NodesConfig) -> dict[str, float]:
    """What the agents ask of etcd in steady state: keep-alives (served by the etcd leader,
    no raft proposal) and progress writes (each a raft proposal); generations are written only
    when one starts or ends, so not in steady state."""
    return {"keepalives_per_s": (cfg.num_nodes / cfg.node_keepalive_s
                                 + cfg.num_replicas / cfg.replica_keepalive_s),
            "writes_per_s": cfg.num_replicas / cfg.progress_s}


def spread(ids: list[str], num_processes: int) -> list[list[str]]:
    """Replicas dealt round-robin over the processes (whole replicas: a replica's reaction to
    its own node's end stays in one process, as it stays in one replica's agents)."""
    groups = [ids[i::num_processes] for i in range(min(num_processes, len(ids)))]
    return [g for g in groups if g]


def summarize_n(samples: list[float]) -> dict[str, float | None]:
    """``summarize`` and the number of samples; None for each figure when there is none."""
    if not samples:
        return {"p50": None, "p99": None, "mean": None, "max": None, "n": 0}
    return {**summarize(samples), "n": len(samples)}


# --- pure pieces of a load generator -------------------------------------------------------------

class KeepAliveSchedule:
    """When each held lease's next keep-alive is due; the caller passes the time."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []
        self._interval: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self._interval)

    def add(self, lease: int, interval_s: float, first_s: float, now: float) -> None:
        """A lease held from ``now`` on: its first keep-alive ``first_s`` later."""
        self._interval[lease] = interval_s
        heapq.heappush(self._heap, (now + first_s, lease))

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def remove(self, lease: int) -> None:
        self._interval.pop(lease, None)  # its heap entry is dropped when it falls due

    def due(self, now: float) -> tuple[list[int], float]:
        """The leases due by ``now`` (each rescheduled an interval on) and how late the most
        overdue one is: lateness is the load generator falling behind, not etcd."""
        leases, late = [], 0.0
        while self._heap and self._heap[0][0] <= now:
            at, lease = heapq.heappop(self._heap)
            interval = self._interval.get(lease)
            if interval is None:
                continue
            leases.append(lease)
            late = max(late, now - at)
            # A fixed cadence, unless more than an interval behind: then restart it from now.
            nxt = at + interval if at + interval > now else now + interval
            heapq.heappush(self._heap, (nxt, lease))
        return leases, late


class KeepAliveStats:
    """Keep-alives sent and answered; how long a lease went without a renewal (its safety
    margin: at TTL it expires)."""

    RTT_SAMPLES = 20_000
    """Round trips kept per window (a uniform sample of them): the report stays small."""

    def __init__(self) -> None:
        self.sent = self.replies = self.not_found = 0
        self.max_late_s = self.max_gap_s = 0.0
        self.rtts: list[float] = []
        self._rtts_seen = 0
        self._rng = random.Random(0)
        self._sent_at: dict[int, float] = {}
        self._renewed_at: dict[int, float] = {}

    def add(self, lease: int, now: float) -> None:
        self._renewed_at[lease] = now

    def remove(self, lease: int) -> None:
        self._sent_at.pop(lease, None)
        self._renewed_at.pop(lease, None)

    def on_sent(self, leases: list[int], now: float, late_s: float) -> None:
        self.sent += len(leases)
        self.max_late_s = max(self.max_late_s, late_s)
        for lease in leases:
            self._sent_at[lease] = now

    def on_reply(self, lease: int, ttl: int, now: float) -> None:
        self.replies += 1
        if ttl <= 0:  # revoked by the benchmark, and not yet dropped: not a renewal
            self.not_found += 1
            return
        sent = self._sent_at.get(lease)
        if sent is not None:
            self._sample_rtt(now - sent)
        last = self._renewed_at.get(lease)
        if last is not None:
            self.max_gap_s = max(self.max_gap_s, now - last)
            self._renewed_at[lease] = now

    def _sample_rtt(self, rtt: float) -> None:
        """Reservoir sampling: every round trip of the window equally likely to be kept."""
        self._rtts_seen += 1
        if len(self.rtts) < self.RTT_SAMPLES:
            self.rtts.append(rtt)
        else:
            slot = self._rng.randrange(self._rtts_seen)
            if slot < self.RTT_SAMPLES:
                self.rtts[slot] = rtt

    def snapshot(self, reset: bool) -> dict:
        rtt = summarize(self.rtts) if self.rtts else None
        out = {"sent": self.sent, "replies": self.replies, "not_found": self.not_found,
               "max_late_s": self.max_late_s, "max_gap_s": self.max_gap_s, "rtt_s": rtt,
               "rtt_samples": self.rtts if reset else []}
        if reset:
            self.rtts, self._rtts_seen = [], 0
            self.max_late_s = self.max_gap_s = 0.0
        return out


def keepalive_request(lease: int) -> bytes:
    """One gRPC message ``LeaseKeepAliveRequest{ID: lease}``, length-prefixed."""
    body = b"\x08" + _varint(lease)
    return b"\x00" + struct.pack(">I", len(body)) + body


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if not value:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition: each sample (name with labels) and its value."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def metric(samples: dict[str, float], name: str, label: str = "") -> float:
    """The sum of ``name``'s samples whose labels contain ``label``."""
    return sum(v for k, v in samples.items()
               if (k == name or k.startswith(name + "{")) and label in k)


# --- the keep-alive transports -------------------------------------------------------------------

class BatchedKeepAlives:
    """Long-lived LeaseKeepAlive streams, as etcd's Go client keeps one per client, on a
    minimal HTTP/2 connection of their own: keep-alives due together go out in one write.
    etcd still renews each lease on its own request; only the transport is shared.

    Why not grpcio: its asyncio stream costs ~165 us of Python per keep-alive (measured), so
    5,000/s would take most of a core of the two this machine has.

    etcd may end a stream: 3.4 does when its apply falls more than a second behind its
    commits ("waiting for the applied index took too long", seen on a starved machine). Its
    clients open another and carry on, and so does this one (``restarts`` counts them).
    """

    RECONNECT_FOR_S = 30.0

    def __init__(self, url: str, on_reply: Callable[[int, int], None],
                 num_streams: int = 64) -> None:
        from ftsystem.control.store import parse_endpoints
        self.endpoint = parse_endpoints(url)[0]
        self.on_reply, self.num_streams = on_reply, num_streams
        self.restarts = 0
        self._stream: _KeepAliveStreams | None = None
        self._up = asyncio.Event()
        self.reader_task: asyncio.Task | None = None
        """Fails only when no stream can be opened again for RECONNECT_FOR_S."""

    async def open(self) -> None:
        await self._connect()
        self.reader_task = asyncio.create_task(self._keep_open())

    async def close(self) -> None:
        if self.reader_task is not None:
            self.reader_task.cancel()
            await asyncio.gather(self.reader_task, return_exceptions=True)
        if self._stream is not None:
            self._stream.close()

    async def send(self, leases: list[int]) -> None:
        await self._up.wait()  # while a stream is being opened again, the keep-alives wait
        await self._stream.send(leases)

    async def _connect(self) -> None:
        host, port = self.endpoint.host, self.endpoint.port
        _, self._stream = await asyncio.get_running_loop().create_connection(
            lambda: _KeepAliveStreams(host, port, self.num_streams, self.on_reply), host, port)
        self._up.set()

    async def _keep_open(self) -> None:
        while True:
            try:
                await self._stream.ended
            except ConnectionError as e:
                print(f"keep-alive stream ended ({e}); opening another", file=sys.stderr)
            self._up.clear()
            self._stream.close()
            self.restarts += 1
            await self._reconnect()

    async def _reconnect(self) -> None:
        deadline = time.monotonic() + self.RECONNECT_FOR_S
        while True:
            try:
                return await self._connect()
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"no keep-alive stream to etcd for "
                                          f"{self.RECONNECT_FOR_S:.0f} s: {e}") from e
                await asyncio.sleep(0.1)


class _KeepAliveStreams(asyncio.Protocol):
    """One HTTP/2 connection carrying ``num_streams`` LeaseKeepAlive streams, each lease always
    on the same one; what falls due together goes out in one write, whatever the streams (a
    protocol rather than a stream reader: no task wakes up per chunk of replies).

    Several streams because etcd renews a stream's requests one after the other, and 3.4 makes
    each renewal wait until its apply has caught up with its commits: over a single stream,
    16,384 leases' renewals queue behind each other while etcd writes (at startup they did,
    until leases lapsed). Real agents each have their own stream.
    """

    PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
    OUR_WINDOW = 2**31 - 1

    def __init__(self, host: str, port: int, num_streams: int,
                 on_reply: Callable[[int, int], None]) -> None:
        self.authority, self.on_reply = f"{host}:{port}", on_reply
        self.stream_ids = [2 * i + 1 for i in range(num_streams)]  # client streams are odd
        self._conn_window = self._peer_initial = 65535
        self._windows = dict.fromkeys(self.stream_ids, 65535)
        self._grpc_bufs = dict.fromkeys(self.stream_ids, b"")
        self._window_open = asyncio.Event()
        self._frames_buf = b""
        self._received = 0
        self.ended: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        headers = b"".join(_hpack_literal(n, v) for n, v in (
            (":method", "POST"), (":scheme", "http"),
            (":path", "/etcdserverpb.Lease/LeaseKeepAlive"), (":authority", self.authority),
            ("content-type", "application/grpc"), ("te", "trailers")))
        # A huge receive window: the replies never wait for our WINDOW_UPDATEs.
        transport.write(
            self.PREFACE + _h2_frame(self.SETTINGS, 0, 0, struct.pack(">HI", 4, self.OUR_WINDOW))
            + _h2_frame(self.WINDOW_UPDATE, 0, 0, struct.pack(">I", self.OUR_WINDOW - 65535))
            + b"".join(_h2_frame(self.HEADERS, 0x4, sid, headers) for sid in self.stream_ids))

    def data_received(self, data: bytes) -> None:
        try:
            self._frames_buf = self._take_frames(self._frames_buf + data)
        except ConnectionError as e:
            self._end(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(ConnectionError(f"etcd closed the keep-alive connection ({exc})"))

    def close(self) -> None:
        self._transport.close()

    def _end(self, error: ConnectionError) -> None:
        if not self.ended.done():
            self.ended.set_exception(error)
        self._window_open.set()  # a sender waiting for window gives up

    async def send(self, leases: list[int]) -> None:
        """One DATA frame per stream with leases due, all in one write. No drain: HTTP/2 flow
        control already bounds what can wait in the send buffer."""
        by_stream: dict[int, list[bytes]] = {}
        for lease in leases:
            sid = self.stream_ids[lease % len(self.stream_ids)]
            by_stream.setdefault(sid, []).append(keepalive_request(lease))
        frames = []
        for sid, requests in by_stream.items():
            for start in range(0, len(requests), KEEPALIVES_PER_FRAME):
                payload = b"".join(requests[start:start + KEEPALIVES_PER_FRAME])
                if not await self._reserve(sid, len(payload)):
                    return  # lost, as those in flight are: the next interval sends them again
                frames.append(_h2_frame(self.DATA, 0, sid, payload))
        self._transport.write(b"".join(frames))

    async def _reserve(self, sid: int, size: int) -> bool:
        while min(self._conn_window, self._windows[sid]) < size:
            if self.ended.done():
                return False
            self._window_open.clear()  # etcd has not read what we sent: wait for it
            await self._window_open.wait()
        self._conn_window -= size
        self._windows[sid] -= size
        return True

    # --- receiving ---

    def _take_frames(self, buf: bytes) -> bytes:
        pos = 0
        while len(buf) - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if len(buf) - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            stream = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            self._frame(kind, flags, stream, buf[pos + 9:pos + 9 + length])
            pos += 9 + length
        return buf[pos:]

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind == self.DATA:
            self._data(stream, flags, payload)
        elif kind == self.SETTINGS and not flags & 0x1:
            self._settings(payload)
        elif kind == self.PING and not flags & 0x1:
            self._transport.write(_h2_frame(self.PING, 0x1, 0, payload))
        elif kind == self.WINDOW_UPDATE:
            increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if stream == 0:
                self._conn_window += increment
            elif stream in self._windows:
                self._windows[stream] += increment
            self._window_open.set()
        elif kind in (self.RST_STREAM, self.GOAWAY) or (kind == self.HEADERS and flags & 0x1):
            # Trailers carry grpc-status and grpc-message, Huffman-coded: kept raw here. One
            # stream ended ends them all: the connection is opened again.
            raise ConnectionError(f"etcd ended a keep-alive stream (HTTP/2 frame type {kind}: "
                                  f"{payload[:200]!r})")

    def _settings(self, payload: bytes) -> None:
        for offset in range(0, len(payload) - 5, 6):
            ident, value = struct.unpack(">HI", payload[offset:offset + 6])
            if ident == 4:  # SETTINGS_INITIAL_WINDOW_SIZE shifts every open stream's window
                for sid in self._windows:
                    self._windows[sid] += value - self._peer_initial
                self._peer_initial = value
                self._window_open.set()
        self._transport.write(_h2_frame(self.SETTINGS, 0x1, 0))

    def _data(self, stream: int, flags: int, payload: bytes) -> None:
        if flags & 0x8:  # PADDED
            payload = payload[1:len(payload) - payload[0]]
        self._received += len(payload)
        if self._received > self.OUR_WINDOW // 2:  # hand the window back long before it ends
            update = struct.pack(">I", self._received)
            self._transport.write(_h2_frame(self.WINDOW_UPDATE, 0, 0, update) + b"".join(
                _h2_frame(self.WINDOW_UPDATE, 0, sid, update) for sid in self.stream_ids))
            self._received = 0
        if stream in self._grpc_bufs:
            self._grpc_bufs[stream] = self._take_replies(self._grpc_bufs[stream] + payload)

    def _take_replies(self, buf: bytes) -> bytes:
        from aetcd.rpc import LeaseKeepAliveResponse
        pos = 0
        while len(buf) - pos >= 5:
            length = int.from_bytes(buf[pos + 1:pos + 5], "big")
            if len(buf) - pos < 5 + length:
                break
            reply = LeaseKeepAliveResponse.FromString(buf[pos + 5:pos + 5 + length])
            self.on_reply(reply.ID, reply.TTL)
            pos += 5 + length
        return buf[pos:]


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags))
            + stream.to_bytes(4, "big") + payload)


def _hpack_literal(name: str, value: str) -> bytes:
    """A header as an HPACK literal without indexing (no table, no Huffman: nothing to keep)."""
    raw_name, raw_value = name.encode(), value.encode()
    assert len(raw_name) < 127 and len(raw_value) < 127
    return b"\x00" + bytes((len(raw_name),)) + raw_name + bytes((len(raw_value),)) + raw_value


class PerCallKeepAlives:
    """One LeaseKeepAlive stream per keep-alive, as aetcd's ``refresh_lease`` opens one: what
    node agents renewing that way would cost etcd (``Store.keep_alive`` keeps its stream)."""

    def __init__(self, url: str, on_reply: Callable[[int, int], None],
                 max_in_flight: int = 256) -> None:
        from ftsystem.control.store import parse_endpoints
        self.endpoint = parse_endpoints(url)[0]
        self.on_reply = on_reply
        self._limit = asyncio.Semaphore(max_in_flight)
        self._tasks: set[asyncio.Task] = set()
        self.reader_task: asyncio.Task | None = None

    async def open(self) -> None:
        import aetcd
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


# --- a load-generator process --------------------------------------------------------------------

@dataclass(slots=True)
class SimReplica:
    """A replica as its agents see it: node leases, the replica lease, the generation."""

    rid: str
    index: int
    node_leases: list[int]
    generation: int = 0
    lease: int = 0
    up: bool = False
    step: int = 0
    progress: asyncio.Task | None = None
    reaction: asyncio.Task | None = None


class NodeAgents:
    """The node agents of some replicas, in one process: what each holds and writes in etcd,
    and the reaction of a replica's agents to the end of one of its nodes."""

    def __init__(self, cfg: WorkerConfig, store: Store) -> None:
        self.cfg, self.store = cfg, store
        self.schedule = KeepAliveSchedule()
        self.stats = KeepAliveStats()
        self.keepalives = (
            BatchedKeepAlives(cfg.url, self._on_reply, cfg.keepalive_streams)
            if cfg.keepalive == KeepAliveMode.BATCHED.value
            else PerCallKeepAlives(cfg.url, self._on_reply))
        self.replicas = {rid: SimReplica(rid, int(rid[1:]), [0] * cfg.nodes_per_replica)
                         for rid in cfg.replicas}
        self.limit = asyncio.Semaphore(cfg.setup_concurrency)
        self.rng = random.Random(os.getpid())
        self.node_deletes = 0
        self.reaction_s: list[float] = []
        self.tasks: list[asyncio.Task] = []

    # --- lifecycle ---

    async def start(self) -> dict:
        """Every agent up, keep-alives running, reactions armed; the leases for the bench."""
        from ftsystem.control import keys
        await self.keepalives.open()
        self._background(self.keepalives.reader_task)
        self._background(asyncio.create_task(self._keep_alive_loop()))
        await asyncio.gather(*(self._start_replica(r) for r in self.replicas.values()))
        _, revision = await self.store.get_prefix(keys.spec(self.cfg.job))
        for rid in self.replicas:
            self._background(asyncio.create_task(self._react(rid, revision + 1)))
        return {"node_leases": {r.rid: r.node_leases for r in self.replicas.values()},
                "replica_leases": {r.rid: r.lease for r in self.replicas.values()}}

    def _background(self, task: asyncio.Task | None) -> None:
        """A background task that fails ends the process: the benchmark sees it exit."""
        if task is None:
            return
        self.tasks.append(task)
        task.add_done_callback(_exit_on_failure)

    async def _start_replica(self, r: SimReplica) -> None:
        await asyncio.gather(*(self._start_node(r, rank) for rank in range(len(r.node_leases))))
        await self._start_generation(r)

    async def _start_node(self, r: SimReplica, rank: int) -> None:
        from ftsystem.control import keys
        async with self.limit:
            lease = await self.store.grant(self.cfg.node_lease_ttl_s)
            self._hold(lease, self.cfg.node_keepalive_s)
            record = {"node_id": f"{r.rid}-n{rank:05d}", "host": "127.0.0.1",
                      "pid": os.getpid(), "lease": lease, "generation": r.generation}
            await self.store.put_json(keys.agent(self.cfg.job, r.rid, rank), record, lease=lease)
        r.node_leases[rank] = lease

    async def _start_generation(self, r: SimReplica) -> None:
        """Node rank 0 opens a generation: the replica lease, then the registration."""
        from ftsystem.control import keys
        from ftsystem.control.membership import ReplicaState
        async with self.limit:
            r.lease = await self.store.grant(self.cfg.lease_ttl_s)
            self._hold(r.lease, self.cfg.replica_keepalive_s)
            await self._write_generation(r, running=True)
            await self.store.put(keys.replica(self.cfg.job, r.rid),
                                 self._registration(r, ReplicaState.READY), lease=r.lease)
        r.up, r.step = True, 0
        r.progress = asyncio.create_task(self._progress(r))

    async def _write_generation(self, r: SimReplica, *, running: bool) -> None:
        from ftsystem.control import keys
        await self.store.put_json(keys.generation(self.cfg.job, r.rid),
                                  {"generation": r.generation, "replica_lease": r.lease,
                                   "running": running})

    def _registration(self, r: SimReplica, state: str) -> str:
        from ftsystem.control.membership import Registration
        return Registration(replica_id=r.rid, state=state, generation=r.generation,
                            step=r.step, host="127.0.0.1", pid=os.getpid(), lease=r.lease,
                            store_addr=f"127.0.0.1:{20000 + r.index}",
                            metrics_addr=f"127.0.0.1:{40000 + r.index}").to_json()

    async def _progress(self, r: SimReplica) -> None:
        """Rank 0's rate-limited progress: the registration rewritten with the step."""
        from ftsystem.control import keys
        from ftsystem.control.membership import ReplicaState
        from ftsystem.control.store import StoreError
        while True:
            await asyncio.sleep(self.cfg.progress_s)
            r.step += 1
            try:
                await self.store.put(keys.replica(self.cfg.job, r.rid),
                                     self._registration(r, ReplicaState.MEMBER), lease=r.lease)
            except StoreError:
                return  # the replica lease was revoked under it: its agents restart it

    # --- keep-alives ---

    def _hold(self, lease: int, interval_s: float) -> None:
        # Agents start at unrelated times, so their keep-alives have independent phases: a
        # random first one (rather than all one interval after a setup that takes seconds).
        now = time.monotonic()
        self.schedule.add(lease, interval_s, self.rng.uniform(0.0, interval_s), now)
        self.stats.add(lease, now)

    def _drop(self, lease: int) -> None:
        self.schedule.remove(lease)
        self.stats.remove(lease)

    async def _keep_alive_loop(self) -> None:
        while True:
            nxt = self.schedule.next_due()
            wait = self.cfg.keepalive_tick_s if nxt is None else nxt - time.monotonic()
            # At most 0.1 s: a lease added meanwhile (a restart) may be due sooner.
            await asyncio.sleep(min(max(wait, self.cfg.keepalive_tick_s), 0.1))
            now = time.monotonic()
            leases, late = self.schedule.due(now)
            self.stats.on_sent(leases, now, late)
            if leases:
                await self.keepalives.send(leases)

    def _on_reply(self, lease: int, ttl: int) -> None:
        self.stats.on_reply(lease, ttl, time.monotonic())

    # --- the reaction ---

    async def _react(self, rid: str, start_revision: int) -> None:
        """A replica's agents watch its node records: one that disappears ends the generation."""
        from ftsystem.control import keys
        async for event in self.store.watch_prefix(keys.replica_agents(self.cfg.job, rid),
                                                   start_revision=start_revision):
            if event.kind == "DELETE":
                self.node_deletes += 1
                self._node_gone(self.replicas[rid], int(keys.last_segment(event.key)))

    def _node_gone(self, r: SimReplica, rank: int) -> None:
        self._drop(r.node_leases[rank])
        if r.up:
            r.up = False
            r.reaction = asyncio.create_task(self._end_generation(r, time.perf_counter()))

    async def _end_generation(self, r: SimReplica, seen: float) -> None:
        _cancel(r.progress)
        await self.store.revoke(r.lease)  # the decision path: the registration goes with it
        self.reaction_s.append(time.perf_counter() - seen)
        self._drop(r.lease)
        await self._write_generation(r, running=False)  # after: off the decision path

    # --- commands from the benchmark ---

    async def restart(self, rid: str, rank: int | None) -> dict:
        """The replica's next generation, with a new agent on ``rank`` if its node died."""
        r = self.replicas[rid]
        if r.reaction is not None:
            await r.reaction
            r.reaction = None
        if r.up:  # a reported failure: the replica lease was revoked from outside
            r.up = False
            _cancel(r.progress)
            self._drop(r.lease)
            await self._write_generation(r, running=False)
        if rank is not None:
            await self._start_node(r, rank)
        r.generation += 1
        await self._start_generation(r)
        return {"node_lease": r.node_leases[rank] if rank is not None else None,
                "replica_lease": r.lease}

    def report(self, reset: bool) -> dict:
        """Counters for the benchmark; ``reset`` starts a new window of keep-alive figures."""
        return {"keepalive": self.stats.snapshot(reset), "node_deletes": self.node_deletes,
                "leases_held": len(self.schedule), "cpu_s": time.process_time(),
                "reaction_s": self.reaction_s,
                "stream_restarts": getattr(self.keepalives, "restarts", 0)}


def _cancel(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()


def _exit_on_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        import traceback
        traceback.print_exception(task.exception(), file=sys.stderr)
        sys.stderr.flush()
        os._exit(3)


def node_worker_main() -> None:
    """A load-generator process: its WorkerConfig on stdin's first line, then one command a
    line (``restart``, ``report``), each answered by one JSON line on stdout; EOF ends it."""
    asyncio.run(_worker())


async def _worker() -> None:
    import json
    from ftsystem.control.store import Store
    reader = asyncio.StreamReader(limit=1 << 24)
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    cfg = WorkerConfig(**json.loads(await reader.readline()))
    async with Store(cfg.url) as store:
        agents = NodeAgents(cfg, store)
        _answer(await agents.start())
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["cmd"] == "restart":
                _answer(await agents.restart(cmd["replica"], cmd["rank"]))
            else:
                _answer(agents.report(cmd.get("reset", False)))


def _answer(reply: dict) -> None:
    import json
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


# --- the load generators, from the benchmark's side ----------------------------------------------

class LoadGenerator:
    """One load-generator process: asked one command at a time."""

    def __init__(self, proc: asyncio.subprocess.Process, replicas: list[str],
                 log_path: Path) -> None:
        self.proc, self.replicas, self.log_path = proc, replicas, log_path
        self._lock = asyncio.Lock()

    async def ask(self, cmd: dict) -> dict:
        import json
        async with self._lock:
            if cmd:
                self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
                await self.proc.stdin.drain()
            line = await self.proc.stdout.readline()
        if not line:
            raise BenchError(f"a load generator exited with {await self.proc.wait()}: "
                             f"{_tail(self.log_path)}")
        return json.loads(line)

    def check(self) -> None:
        if self.proc.returncode is not None:
            raise BenchError(f"a load generator exited with {self.proc.returncode}: "
                             f"{_tail(self.log_path)}")


class Fleet:
    """The load generators, and the leases they hold that the benchmark ends."""

    def __init__(self, generators: list[LoadGenerator]) -> None:
        self.generators = generators
        self.owner = {rid: g for g in generators for rid in g.replicas}
        self.node_leases: dict[str, list[int]] = {}
        self.replica_leases: dict[str, int] = {}

    async def ready(self) -> None:
        for reply in await asyncio.gather(*(g.ask({}) for g in self.generators)):
            self.node_leases.update(reply["node_leases"])
            self.replica_leases.update(reply["replica_leases"])

    async def restart(self, rid: str, rank: int | None) -> None:
        reply = await self.owner[rid].ask({"cmd": "restart", "replica": rid, "rank": rank})
        if rank is not None:
            self.node_leases[rid][rank] = reply["node_lease"]
        self.replica_leases[rid] = reply["replica_lease"]

    async def report(self, reset: bool = False) -> list[dict]:
        return list(await asyncio.gather(
            *(g.ask({"cmd": "report", "reset": reset}) for g in self.generators)))

    def check(self) -> None:
        for g in self.generators:
            g.check()


@asynccontextmanager
async def _fleet(cfg: NodesConfig, url: str, job: str, ids: list[str], workdir: Path
                 ) -> AsyncIterator[Fleet]:
    import json
    from dataclasses import asdict
    from ftsystem.launch.procs import die_with_parent
    generators = []
    code = "from ftsystem.benchmarks.controller_bench import node_worker_main; node_worker_main()"
    try:
        for i, group in enumerate(spread(ids, cfg.num_processes)):
            log_path = workdir / f"load-{i}.log"
            with open(log_path, "ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    *die_with_parent([sys.executable, "-c", code]), stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=log_file, limit=1 << 24)
            generators.append(LoadGenerator(proc, group, log_path))
            wcfg = WorkerConfig(
                url=url, job=job, replicas=group, nodes_per_replica=cfg.nodes_per_replica,
                lease_ttl_s=cfg.lease_ttl_s, node_lease_ttl_s=cfg.node_lease_ttl_s,
                node_keepalive_s=cfg.node_keepalive_s,
                replica_keepalive_s=cfg.replica_keepalive_s, progress_s=cfg.progress_s,
                setup_concurrency=cfg.setup_concurrency, keepalive=cfg.keepalive.value,
                keepalive_streams=cfg.keepalive_streams, keepalive_tick_s=cfg.keepalive_tick_s)
            proc.stdin.write((json.dumps(asdict(wcfg)) + "\n").encode())
        yield Fleet(generators)
    finally:
        for g in generators:  # EOF ends a generator; a stuck one is killed
            g.proc.stdin.close()
        for g in generators:
            try:
                async with asyncio.timeout(10):
                    await g.proc.wait()
            except TimeoutError:
                g.proc.kill()
                await g.proc.wait()


# --- the nodes measurement -----------------------------------------------------------------------

async def measure_nodes(cfg: NodesConfig, url: str, workdir: Path) -> dict:
    """Start the agents, measure a steady window, then end ``num_samples`` leases per kind."""
    from ftsystem.control import keys
    from ftsystem.control.store import Store
    job = f"bench-nodes-{os.getpid()}"
    ids = [f"r{i:05d}" for i in range(cfg.num_replicas)]
    async with Store(url) as store, Store(url) as watch_store:
        await store.put_json(keys.spec(job), {"replicas": cfg.num_replicas, "min_replicas": 1})
        watcher = EpochWatcher(watch_store, job)
        await watcher.start()
        try:
            async with _controller(cfg.controller, url, job, workdir) as (check, _, pid):
                async with _fleet(cfg, url, job, ids, workdir) as fleet:
                    def check_all() -> None:
                        check()
                        fleet.check()
                    return await _run_nodes(cfg, url, job, store, watcher, fleet, check_all,
                                            pid, ids)
        finally:
            await watcher.stop()
            if cfg.etcd is not None:  # the leases expire by themselves within a TTL
                await store.delete_prefix(keys.job(job) + "/")


async def _run_nodes(cfg: NodesConfig, url: str, job: str, store: Store, watcher: EpochWatcher,
                     fleet: Fleet, check: Callable[[], None], controller_pid: int | None,
                     ids: list[str]) -> dict:
    start = time.perf_counter()
    await fleet.ready()
    started = time.perf_counter()
    try:
        seen, _ = await watcher.wait_for(lambda e: frozenset(e.members) == frozenset(ids),
                                         f"all {cfg.num_replicas} members", cfg.epoch_timeout_s,
                                         check)
    except BenchError as e:
        raise BenchError(f"{e}; {await _missing_registrations(store, job, ids)}") from e
    # Warm-up: every lease renewed once, so the window sees the keep-alive cadence, not setup.
    await asyncio.sleep(cfg.node_keepalive_s + 1.0)
    steady = await _steady_window(cfg, url, fleet, controller_pid)
    before = await _sample(url, fleet, controller_pid)
    samples: dict[str, list[float]] = {kind: [] for kind in (*KINDS, "join")}
    error = None
    try:
        await _end_leases(cfg, store, watcher, fleet, check, ids, samples)
    except BenchError as e:  # replicas lost: what the machine sustained goes in the JSON
        error = str(e)
    try:
        end = await _sample(url, fleet, controller_pid)
    except BenchError:  # a process died: nothing more to measure
        if error is None:
            raise
        raise BenchError(error)
    after, reports = end[1], end[4]
    return {"startup_s": started - start, "first_epoch_s": seen - start, "steady": steady,
            # Epochs no wait wanted: skipped by a wait, or still queued after the last.
            "samples": samples, "epochs_skipped": watcher.skipped + watcher.queue.qsize(),
            "error": error, "node_revokes": samples["node_revokes"],
            "while_failing": steady_rates(before, end),
            "db_size_bytes": metric(after, "etcd_mvcc_db_total_size_in_bytes"),
            "db_in_use_bytes": metric(after, "etcd_mvcc_db_total_size_in_use_in_bytes"),
            "node_deletes": sum(r["node_deletes"] for r in reports),
            "reaction_s": [s for r in reports for s in r["reaction_s"]]}


async def _missing_registrations(store: Store, job: str, ids: list[str]) -> str:
    """Why a first epoch never came: registrations whose lease lapsed during startup."""
    from ftsystem.control import keys
    items, _ = await store.get_prefix(keys.replicas(job))
    missing = sorted(set(ids) - {keys.last_segment(k) for k in items})
    return (f"not registered: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
            "(their replica leases lapsed during startup: this machine did not sustain the load)"
            if missing else "every replica is registered")


async def _etcd_metrics_text(url: str) -> str:
    """etcd's own Prometheus metrics, from the first endpoint (metrics are per member)."""
    import httpx
    from ftsystem.control.store import parse_endpoints
    async with httpx.AsyncClient(base_url=str(parse_endpoints(url)[0]), timeout=30) as client:
        response = await client.get("/metrics")
        response.raise_for_status()
        return response.text


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat: what other
    processes take during the window shows as ``others`` (a shared machine skews the figures)."""
    fields_ = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields_[3] + fields_[4]  # idle + iowait
    return (sum(fields_) - idle) / os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int | None) -> float:
    """CPU seconds a process has used (user + system), from /proc."""
    if pid is None:
        return 0.0
    fields_ = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


async def _sample(url: str, fleet: Fleet, controller_pid: int | None) -> tuple:
    """One end of a window (see ``steady_rates``)."""
    return (time.perf_counter(), parse_prometheus(await _etcd_metrics_text(url)),
            _proc_cpu_s(controller_pid), time.process_time(), await fleet.report(reset=True),
            _machine_busy_s())


async def _steady_window(cfg: NodesConfig, url: str, fleet: Fleet,
                         controller_pid: int | None) -> dict:
    """etcd's counters, and everyone's CPU, over ``window_s`` without a failure."""
    before = await _sample(url, fleet, controller_pid)
    await asyncio.sleep(cfg.window_s)
    return steady_rates(before, await _sample(url, fleet, controller_pid))


def steady_rates(before: tuple, after: tuple) -> dict:
    """Rates over a window, from a sample at each end: (time, etcd's metrics, the controller's
    CPU seconds, ours, the load generators' reports, the machine's busy seconds); pure."""
    (t0, m0, c0, b0, r0, busy0), (t1, m1, c1, b1, r1, busy1) = before, after
    dt = t1 - t0

    def rate(name: str, label: str = "") -> float:
        return (metric(m1, name, label) - metric(m0, name, label)) / dt

    def generators(get: Callable[[dict], float]) -> float:
        return (sum(map(get, r1)) - sum(map(get, r0))) / dt
    keepalives = rate("etcd_debugging_lease_renewed_total")
    etcd_cpu = rate("process_cpu_seconds_total")
    rtts = [s for r in r1 for s in r["keepalive"]["rtt_samples"]]
    return {
        "window_s": dt,
        "writes_per_s": rate("etcd_server_proposals_committed_total"),
        "puts_per_s": rate("etcd_mvcc_put_total"), "deletes_per_s": rate("etcd_mvcc_delete_total"),
        "txns_per_s": rate("etcd_mvcc_txn_total"),
        "keepalives_per_s": keepalives,
        "keepalive_requests_per_s": rate("grpc_server_msg_received_total", "LeaseKeepAlive"),
        "keepalive_streams_per_s": rate("grpc_server_started_total", "LeaseKeepAlive"),
        "keepalives_sent_per_s": generators(lambda r: r["keepalive"]["sent"]),
        "db_growth_bytes_per_s": rate("etcd_mvcc_db_total_size_in_use_in_bytes"),
        "etcd_cpu_us_per_keepalive": 1e6 * etcd_cpu / keepalives if keepalives else None,
        "cpu_cores": _cpu_cores(etcd_cpu, (c1 - c0) / dt, generators(lambda r: r["cpu_s"]),
                                (b1 - b0) / dt, (busy1 - busy0) / dt),
        "keepalive_rtt_s": summarize(rtts) if rtts else None,
        "max_renew_gap_s": max(r["keepalive"]["max_gap_s"] for r in r1),
        "max_schedule_late_s": max(r["keepalive"]["max_late_s"] for r in r1),
        "stream_restarts": int(generators(lambda r: r["stream_restarts"]) * dt),
        "leases_held": sum(r["leases_held"] for r in r1),
    }


def _cpu_cores(etcd: float, controller: float, generators: float, bench: float,
               machine: float) -> dict[str, float]:
    ours = etcd + controller + generators + bench
    return {"etcd": etcd, "controller": controller, "load_generators": generators,
            "bench": bench, "others": max(0.0, machine - ours), "machine": machine}


async def _end_leases(cfg: NodesConfig, store: Store, watcher: EpochWatcher, fleet: Fleet,
                      check: Callable[[], None], ids: list[str], out: dict) -> None:
    """End one lease at a time, the two kinds alternating so that both see the same load;
    the latencies go into ``out`` as they are measured (kept if a later one fails)."""
    from controller.leader import LeaderConfig
    join_tick_s = LeaderConfig(job="x", instance_id="x").join_tick_s
    rng = random.Random(cfg.seed)
    out["node_revokes"] = 0
    for _ in range(cfg.num_samples):
        for kind in KINDS:
            rid, rank = rng.choice(ids), rng.randrange(cfg.nodes_per_replica)
            # Failures arrive at any phase of the leader's join tick, not just after a tick.
            await asyncio.sleep(rng.uniform(0.0, join_tick_s))
            if kind == "node_lease_end":  # a node dies: its agent's lease ends
                lease, restarted_rank = fleet.node_leases[rid][rank], rank
                out["node_revokes"] += 1
            else:  # an agent reports a failure: it revokes the replica lease
                lease, restarted_rank = fleet.replica_leases[rid], None
            out[kind].append(await _time_lease_end(cfg, store, watcher, check, rid, lease))
            t0 = time.perf_counter()
            await fleet.restart(rid, restarted_rank)
            seen, _ = await watcher.wait_for(lambda e: rid in e.members, f"{rid} rejoined",
                                             cfg.epoch_timeout_s, check)
            out["join"].append(seen - t0)


async def _time_lease_end(cfg: NodesConfig, store: Store, watcher: EpochWatcher,
                          check: Callable[[], None], rid: str, lease: int) -> float:
    t0 = time.perf_counter()
    await store.revoke(lease)
    seen, epoch = await watcher.wait_for(lambda e: rid not in e.members, f"{rid} removed",
                                         cfg.epoch_timeout_s, check)
    if len(epoch.members) != cfg.num_replicas - 1:
        raise BenchError(f"the epoch that removed {rid} has {len(epoch.members)} members, "
                         f"expected {cfg.num_replicas - 1}: other replicas were lost (leases "
                         "expired? the load may be more than this machine sustains)")
    return seen - t0


def run_nodes(cfg: NodesConfig, rounds: int = 1) -> list[dict]:
    """The nodes benchmark's JSON (without ``machine``) for each round."""
    async def one_round() -> dict:
        with _workdir(cfg.logs_dir) as workdir, _etcd(cfg.etcd, workdir) as url:
            return nodes_result(cfg, await measure_nodes(cfg, url, workdir))
    return _in_one_loop(rounds, one_round)


@contextmanager
def _workdir(keep: Path | None) -> Iterator[Path]:
    """Where etcd's data and the processes' logs go: ``keep``, or a temporary directory."""
    if keep is not None:
        if (keep / "etcd").exists():  # another run's keys would be this run's
            raise BenchError(f"{keep} already holds an etcd data directory: pick a new --logs")
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="ftsystem-bench-nodes-") as tmp:
        yield Path(tmp)


def nodes_result(cfg: NodesConfig, raw: dict) -> dict:
    """The JSON from the raw measurement (pure)."""
    steady, samples, failing = raw["steady"], raw["samples"], raw["while_failing"]
    latency = {kind: summarize_n(samples[kind]) for kind in KINDS}
    lost = raw["node_deletes"] - raw["node_revokes"]
    # Sustained: no lease ended that the benchmark did not end, and no renewal was skipped
    # (the longest gap between two renewals of a lease under two node renewal intervals).
    max_gap = max(steady["max_renew_gap_s"], failing["max_renew_gap_s"])
    sustained = lost == 0 and max_gap < 2 * cfg.node_keepalive_s and raw["error"] is None
    meets = sustained and all(v["p99"] is not None and v["p99"] <= NODES_TARGET_P99_S
                              for v in latency.values())
    num_samples = sum(len(samples[kind]) for kind in KINDS)
    return {
        "mode": "nodes",
        "config": {"nodes": cfg.num_nodes, "replicas": cfg.num_replicas,
                   "nodes_per_replica": cfg.nodes_per_replica, "processes":
                   len(spread(list(range(cfg.num_replicas)), cfg.num_processes)),
                   "keepalive": cfg.keepalive.value,
                   "keepalive_streams_per_process": cfg.keepalive_streams
                   if cfg.keepalive is KeepAliveMode.BATCHED else None,
                   "lease_ttl_s": cfg.lease_ttl_s, "node_lease_ttl_s": cfg.node_lease_ttl_s,
                   "node_keepalive_s": cfg.node_keepalive_s,
                   "replica_keepalive_s": cfg.replica_keepalive_s,
                   "progress_s": cfg.progress_s, "window_s": cfg.window_s,
                   "samples_per_kind": cfg.num_samples, "seed": cfg.seed,
                   "controller": cfg.controller.value, "etcd": cfg.etcd or "embedded",
                   # Inherited by etcd and every process here: a negative one shields the run
                   # from other work on a shared machine (see load.cpu_cores.others).
                   "nice": os.getpriority(os.PRIO_PROCESS, 0)},
        "decision_latency_s": latency,
        "join_latency_s": summarize_n(samples["join"]),
        "reaction_s": summarize_n(raw["reaction_s"]) if raw["reaction_s"] else None,
        "epochs": {"expected": 1 + 2 * cfg.num_samples * len(KINDS),
                   "seen": 1 + num_samples + len(samples["join"]),
                   "unexpected": raw["epochs_skipped"]},
        "etcd": {"writes_per_s": steady["writes_per_s"], "puts_per_s": steady["puts_per_s"],
                 "deletes_per_s": steady["deletes_per_s"], "txns_per_s": steady["txns_per_s"],
                 "keepalives_per_s": steady["keepalives_per_s"],
                 "keepalive_requests_per_s": steady["keepalive_requests_per_s"],
                 "keepalive_streams_per_s": steady["keepalive_streams_per_s"],
                 "cpu_us_per_keepalive": steady["etcd_cpu_us_per_keepalive"],
                 "db_size_bytes": raw["db_size_bytes"], "db_in_use_bytes": raw["db_in_use_bytes"],
                 "db_growth_bytes_per_s": steady["db_growth_bytes_per_s"]},
        "budget": control_plane_budget(cfg),
        "load": {"sustained": sustained, "leases_lost": lost,
                 "leases_held": steady["leases_held"],
                 "keepalives_sent_per_s": steady["keepalives_sent_per_s"],
                 "keepalive_rtt_s": steady["keepalive_rtt_s"],
                 "max_renew_gap_s": steady["max_renew_gap_s"],
                 "max_schedule_late_s": steady["max_schedule_late_s"],
                 "keepalive_stream_restarts": steady["stream_restarts"],
                 "cpu_cores": steady["cpu_cores"], "window_s": steady["window_s"],
                 "while_failing": {k: failing[k] for k in (
                     "cpu_cores", "keepalive_rtt_s", "max_renew_gap_s", "max_schedule_late_s",
                     "stream_restarts", "writes_per_s", "keepalives_per_s", "window_s")}},
        "startup_s": raw["startup_s"], "first_epoch_s": raw["first_epoch_s"],
        "target_p99_s": NODES_TARGET_P99_S, "meets_target": meets, "error": raw["error"],
    }


def _print_nodes(result: dict) -> None:
    from ftsystem.measure.report import print_table
    c, e, load = result["config"], result["etcd"], result["load"]

    def row(name: str, s: dict | None) -> tuple:
        if not s or s["p50"] is None:
            return (name, "-", "-", "-", "-", 0)
        return (name, *(1000 * s[k] for k in ("p50", "p99", "mean", "max")), s.get("n", ""))
    print_table(f"controller at node scale: {c['nodes']} node agents, {c['replicas']} replicas, "
                f"{c['processes']} load processes ({c['keepalive']} keep-alives)",
                ["measure", "p50 (ms)", "p99 (ms)", "mean (ms)", "max (ms)", "n"],
                # Short labels: a wrapped one is hard to find in the output.
                [row("node lease end", result["decision_latency_s"][KINDS[0]]),
                 row("reported failure", result["decision_latency_s"][KINDS[1]]),
                 row("agents' reaction", result["reaction_s"]),
                 row("join", result["join_latency_s"]),
                 row("keep-alive rtt", load["keepalive_rtt_s"])])
    print("lease end / reported failure: the lease revoked -> an epoch without the replica "
          "seen; agents' reaction: a node record's DELETE -> the replica lease revoked; join: "
          "registered -> an epoch with it seen; keep-alive rtt: in the steady window")
    b = result["budget"]
    print_table("etcd in steady state", ["writes/s", "(budget)", "keep-alives/s", "(budget)",
                                         "etcd us/keep-alive", "db size (MiB)", "in use (MiB)"],
                [(e["writes_per_s"], b["writes_per_s"], e["keepalives_per_s"],
                  b["keepalives_per_s"], e["cpu_us_per_keepalive"] or 0.0,
                  e["db_size_bytes"] / 2**20, e["db_in_use_bytes"] / 2**20)])
    cores = load["cpu_cores"]
    print_table("CPU (cores) in steady state", list(cores), [tuple(cores.values())])
    others = max(cores["others"], load["while_failing"]["cpu_cores"]["others"])
    if others > 0.25:
        print(f"warning: other processes took {others:.2f} cores of this machine meanwhile: "
              "the figures are skewed; run again on a quiet machine")
    verdict = "meets" if result["meets_target"] else "MISSES"
    print_table("summary", ["startup (s)", "leases lost", "sustained", "target p99 (ms)",
                            "verdict"],
                [(result["startup_s"], load["leases_lost"], str(load["sustained"]),
                  1000 * result["target_p99_s"], verdict)])
    failing = load["while_failing"]
    print(f"keep-alives: at most {max(load['max_renew_gap_s'], failing['max_renew_gap_s']):.2f} s "
          f"between renewals of a lease (node lease renewed every {c['node_keepalive_s']:g} s); "
          f"load generators at most "
          f"{max(load['max_schedule_late_s'], failing['max_schedule_late_s']) * 1000:.0f} ms "
          "late sending one")


# --- the command -------------------------------------------------------------------------------

ROUND_FIGURES = {"decision_p50_s": "decision_latency_s.p50",
                 "decision_p99_s": "decision_latency_s.p99",
                 "join_p99_s": "join_latency_s.p99"}
NODES_ROUND_FIGURES = {
    "node_lease_end_p99_s": "decision_latency_s.node_lease_end.p99",
    "reported_failure_p99_s": "decision_latency_s.reported_failure.p99",
    "keepalives_per_s": "etcd.keepalives_per_s", "writes_per_s": "etcd.writes_per_s"}
"""The headline figures reported over the rounds (dotted paths into one round's result)."""


def with_rounds(runs: list[dict], figures: dict[str, str]) -> dict:
    """The first round's result, in the shape one round gives, with each of ``figures``' median
    and min/max over every round (``over_rounds``) and the later rounds in full. One system
    runs here, so there is no order to alternate."""
    from ftsystem.measure import report
    return runs[0] | {"rounds": len(runs), "over_rounds": report.per_round(runs, figures),
                      "later_rounds": runs[1:]}


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
        nodes: Optional[int] = typer.Option(
            None, min=2, help="simulate this many node agents, each with its own lease and "
                              "keep-alives, over --replicas replicas (default "
                              f"{NODES_FULL_REPLICAS}; {NODES_QUICK_REPLICAS} with --quick), "
                              "e.g. 16384; --revokes is then per kind of failure (default "
                              f"{NODES_FULL_SAMPLES}; {NODES_QUICK_SAMPLES} with --quick)"),
        processes: int = typer.Option(DEFAULT_PROCESSES, min=1,
                                      help="with --nodes: load-generator processes (default: "
                                           "one per core, 2 to 8)"),
        window: Optional[float] = typer.Option(
            None, min=1.0, help="with --nodes: seconds of steady state over which etcd's rates "
                                f"are measured (default {NODES_FULL_WINDOW_S:g}; "
                                f"{NODES_QUICK_WINDOW_S:g} with --quick)"),
        logs: Optional[Path] = typer.Option(
            None, help="with --nodes: keep etcd's data and the logs of the controller and the "
                       "load generators in this directory"),
        rounds: int = typer.Option(1, min=1, help="run the measurement this many times; the "
                                                  "JSON gives each headline figure's median "
                                                  "and min/max over the rounds"),
        keepalive: KeepAliveMode = typer.Option(
            KeepAliveMode.BATCHED, help="with --nodes: keep-alives over one stream per process "
                                        "(batched, as Store.keep_alive keeps its stream "
                                        "open), or one stream per keep-alive (per-call, "
                                        "aetcd's refresh_lease)"),
) -> None:
    """Membership decision latency: lease revoked -> epoch without the replica seen."""
    from ftsystem.measure.report import machine, write_json
    from ftsystem.control.store import StoreError, parse_endpoints
    if etcd is not None:
        try:
            parse_endpoints(etcd)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--etcd") from e
    if nodes is not None:
        ncfg = NodesConfig(
            num_nodes=nodes,
            num_replicas=replicas or (NODES_QUICK_REPLICAS if quick else NODES_FULL_REPLICAS),
            num_samples=revokes or (NODES_QUICK_SAMPLES if quick else NODES_FULL_SAMPLES),
            etcd=etcd, controller=controller, num_processes=processes, keepalive=keepalive,
            window_s=window or (NODES_QUICK_WINDOW_S if quick else NODES_FULL_WINDOW_S),
            logs_dir=logs)
        try:
            check_nodes_config(ncfg)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--nodes") from e
        try:
            runs = run_nodes(ncfg, rounds)
        except (StoreError, RuntimeError) as e:
            raise _fail(str(e))
        result = with_rounds(runs, NODES_ROUND_FIGURES)
        result["error"] = next((r["error"] for r in runs if r["error"]), None)
        result["machine"] = machine()
        _print_nodes(result)
        write_json(json_out, result)
        if result["error"]:  # the JSON says what the machine sustained; the exit says it failed
            raise _fail(result["error"])
        return
    cfg = BenchConfig(
        num_replicas=replicas or (QUICK_REPLICAS if quick else FULL_REPLICAS),
        num_revokes=revokes or (QUICK_REVOKES if quick else FULL_REVOKES),
        etcd=etcd, controller=controller)
    try:
        result = with_rounds(run(cfg, rounds), ROUND_FIGURES)
    except (StoreError, RuntimeError) as e:  # BenchError, etcd not installed or not starting
        raise _fail(str(e))
    result["machine"] = machine()
    _print(result)
    write_json(json_out, result)


def _print(result: dict) -> None:
    from ftsystem.measure.report import print_table
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
