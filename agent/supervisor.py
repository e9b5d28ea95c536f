"""The node agent: launches one replica's processes, holds its lease, restarts it on failure.

Detection is the fast path of the design: the moment any process of the replica exits (or its
step watchdog fires) the agent revokes the replica's lease, which deletes its registration and
lets the controller publish the epoch without it within milliseconds. Then it kills the rest of
the replica and restarts it with backoff as generation + 1. Children run in their own sessions
with a parent-death signal, so neither a Ctrl-C nor a SIGKILL of the agent leaves orphans.

GPUs follow torchrun's convention: every rank sees the node's GPUs and rank k uses cuda:k
(``ftsystem.devices.local_device``). Started with ``--gpus``, the agent instead lets rank k see
only the k-th listed GPU, which that rule then makes its cuda:0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from agent.chaos import replica_executor
from ftsystem import keys, metrics, runtime
from ftsystem.etcd_server import free_port
from ftsystem.faults import FaultPoint, format_fault_points
from ftsystem.membership import Registration, ReplicaState
from ftsystem.procs import die_with_parent, signal_group
from ftsystem.runtime import DEFAULT_TIMEOUT_S
from ftsystem.store import HeldKey, Store, StoreError
from ftsystem.timeouts import Timeouts

log = logging.getLogger(__name__)

ENV_VISIBLE_GPUS = "CUDA_VISIBLE_DEVICES"


EXIT_HALTED = 3
"""The agent's exit status when its replica halted (``keys.halted``): a divergence with no
majority, replicas that register different objects."""


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    etcd: str
    """etcd endpoints, comma-separated."""
    job: str
    """The job the replica belongs to."""
    replica_id: str
    """The replica this agent supervises."""
    command: list[str]
    """The replica's program; run once per rank."""
    num_procs: int = 1
    """Ranks per replica (``--nproc-per-replica``)."""
    lease_ttl_s: int = Timeouts(DEFAULT_TIMEOUT_S).lease_ttl_s
    """Replica lease TTL: the slow path that covers a dead host or a partition (the CLI
    derives it from ``--timeout``, see ``ftsystem.timeouts``)."""
    max_restarts: int = 20
    """Restarts before the agent gives up on the replica."""
    backoff_s: float = 0.5
    """First restart delay; doubles per consecutive fast failure, up to ``max_backoff_s``."""
    max_backoff_s: float = 10.0
    """Ceiling of the restart delay."""
    watchdog_s: float = Timeouts(DEFAULT_TIMEOUT_S).watchdog_s
    """A rank whose heartbeat is older than this is considered hung and the replica restarted
    (derived from ``--timeout`` like the lease TTL)."""
    grace_s: float = 10.0
    """How long children get to exit after a forwarded SIGTERM/SIGINT."""
    kill_at: list[FaultPoint] = field(default_factory=list)
    """Fault injection: kill the replica when it reaches these steps (``--kill-at``)."""
    host: str = "127.0.0.1"
    """Address other replicas use to reach this one."""
    gpus: list[str] = field(default_factory=list)
    """One GPU per rank (``--gpus 0,1``, as ``CUDA_VISIBLE_DEVICES`` names them): rank k sees
    only ``gpus[k]``. Empty: every rank sees all of the node's GPUs and uses cuda:LOCAL_RANK."""


@dataclass(slots=True)
class Outcome:
    success: bool
    reason: str
    last_step: int = 0


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        keys.check_id("job", cfg.job)
        keys.check_id("replica", cfg.replica_id)
        self.cfg = cfg
        self.gpu_envs = gpu_env_per_rank(cfg.gpus, cfg.num_procs)
        if len(cfg.gpus) > cfg.num_procs:
            log.warning("--gpus lists %d GPUs for %d ranks: %s stay unused", len(cfg.gpus),
                        cfg.num_procs, ",".join(cfg.gpus[cfg.num_procs:]))
        self.store = Store(cfg.etcd)
        self.stop_requested = asyncio.Event()
        self.kill_at = sorted(cfg.kill_at, key=lambda p: p.step)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"ftsystem-agent-{cfg.replica_id}-"))
        self.children: list[asyncio.subprocess.Process] = []
        self.generation = 0
        self.record = HeldKey(self.store, keys.agent(cfg.job, cfg.replica_id), cfg.lease_ttl_s)
        self.metrics_addr = metrics.serve(cfg.host)

    async def run(self) -> int:
        """Supervise until the replica finishes (0), gives up (1) or is told to stop (130)."""
        await self.store.connect()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, self.stop_requested.set)
        await self.record.set(self._record_value())
        chaos = replica_executor(self.store, self.cfg.job, self.cfg.replica_id, self._running_pids)
        background = [asyncio.create_task(self.record.hold()), asyncio.create_task(chaos.run())]
        try:
            return await self._supervise()
        finally:
            await chaos.stop()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.store.close()

    def _running_pids(self) -> list[int]:
        return [c.pid for c in self.children if c.returncode is None]

    def _record_value(self) -> dict:
        return {"host": self.cfg.host, "pid": os.getpid(), "generation": self.generation,
                "metrics_addr": self.metrics_addr}

    async def _supervise(self) -> int:
        backoff = self.cfg.backoff_s
        for generation in range(self.cfg.max_restarts + 1):
            self.generation = generation
            await self.record.set(self._record_value())
            started = time.monotonic()
            outcome = await self._run_generation(generation)
            if outcome.success:
                return 0
            if self.stop_requested.is_set():
                return 130
            await self._record_failure(generation, outcome)
            halted = await self.store.get_json(keys.halted(self.cfg.job, self.cfg.replica_id))
            if halted is not None:  # the replica found an error no restart can fix
                log.error("replica %s halted at step %s, not restarting it: %s",
                          self.cfg.replica_id, halted.get("step"), halted.get("reason"))
                return EXIT_HALTED
            # A replica that ran a while before failing gets the short backoff again.
            backoff = self.cfg.backoff_s if time.monotonic() - started > 30 else backoff
            log.warning("replica %s generation %d failed (%s); restarting in %.1fs",
                        self.cfg.replica_id, generation, outcome.reason, backoff)
            try:
                await asyncio.wait_for(self.stop_requested.wait(), backoff)
                return 130
            except asyncio.TimeoutError:
                backoff = min(backoff * 2, self.cfg.max_backoff_s)
        log.error("replica %s: giving up after %d restarts", self.cfg.replica_id,
                  self.cfg.max_restarts)
        return 1

    async def _record_failure(self, generation: int, outcome: Outcome) -> None:
        metrics.REPLICA_RESTARTS.labels(self.cfg.job, self.cfg.replica_id).inc()
        await self.store.put_json(
            keys.failure(self.cfg.job, self.cfg.replica_id, generation),
            {"time": time.time(), "reason": outcome.reason, "step": outcome.last_step})
        # Kill points the replica has passed are spent; the restarted one gets the rest.
        self.kill_at = [p for p in self.kill_at if p.step > outcome.last_step]

    async def _run_generation(self, generation: int) -> Outcome:
        lease = await self.store.grant(self.cfg.lease_ttl_s)
        keep_alive = asyncio.create_task(self.store.keep_alive(lease, self.cfg.lease_ttl_s))
        try:
            await self.store.put(keys.replica(self.cfg.job, self.cfg.replica_id), Registration(
                replica_id=self.cfg.replica_id, state=ReplicaState.STARTING,
                generation=generation, host=self.cfg.host).to_json(), lease=lease)
            heartbeats = await self._spawn(generation, lease)
            outcome = await self._watch_children(heartbeats, keep_alive)
        finally:
            keep_alive.cancel()
            # Revoke first: the survivors' recovery starts when the registration disappears.
            await self._revoke_quietly(lease)
            await self._kill_children()
        return outcome

    async def _revoke_quietly(self, lease: int) -> None:
        try:
            await self.store.revoke(lease)
        except StoreError as e:
            log.warning("could not revoke lease %x (%s); it expires in %ds", lease, e,
                        self.cfg.lease_ttl_s)

    async def _spawn(self, generation: int, lease: int) -> list[Path]:
        master_port = free_port()
        heartbeats = []
        self.children = []
        for rank in range(self.cfg.num_procs):
            heartbeat = self.workdir / f"heartbeat-g{generation}-r{rank}"
            heartbeats.append(heartbeat)
            env = os.environ | {
                "RANK": str(rank), "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.cfg.num_procs),
                "LOCAL_WORLD_SIZE": str(self.cfg.num_procs),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port),
                runtime.ENV_ETCD: self.cfg.etcd, runtime.ENV_JOB: self.cfg.job,
                runtime.ENV_REPLICA: self.cfg.replica_id,
                runtime.ENV_GENERATION: str(generation), runtime.ENV_LEASE: str(lease),
                runtime.ENV_HEARTBEAT: str(heartbeat), runtime.ENV_HOST: self.cfg.host,
                runtime.ENV_KILL_AT: format_fault_points(self.kill_at),
            } | self.gpu_envs[rank]
            self.children.append(await asyncio.create_subprocess_exec(
                *die_with_parent(self.cfg.command), env=env, start_new_session=True))
        return heartbeats

    async def _watch_children(self, heartbeats: list[Path], keep_alive: asyncio.Task) -> Outcome:
        waits = {asyncio.create_task(c.wait()): c for c in self.children}
        stop = asyncio.create_task(self.stop_requested.wait())
        watchdog = asyncio.create_task(self._watchdog(heartbeats))
        pending = set(waits)
        try:
            while pending:
                done, _ = await asyncio.wait(pending | {stop, watchdog, keep_alive},
                                             return_when=asyncio.FIRST_COMPLETED)
                if keep_alive in done:  # the job has dropped this replica: restart it
                    return Outcome(False, f"lease lost: {keep_alive.exception()}",
                                   _last_step(heartbeats))
                if stop in done:
                    await self._forward_stop()
                    return Outcome(False, "stopped", _last_step(heartbeats))
                if watchdog in done:
                    return Outcome(False, watchdog.result(), _last_step(heartbeats))
                for task in done & pending:
                    pending.discard(task)
                    code = task.result()
                    rank = self.children.index(waits[task])
                    if code != 0 and _finished(heartbeats[rank]):
                        # Its work was done and recorded: a crash while tearing down does not
                        # make the replica train again (alone, after the others left).
                        log.warning("replica %s rank %d finished, then %s while tearing down",
                                    self.cfg.replica_id, rank, _describe_exit(code))
                    elif code != 0:
                        return Outcome(False, _describe_exit(code), _last_step(heartbeats))
            return Outcome(True, "finished", _last_step(heartbeats))
        finally:
            for task in (*pending, stop, watchdog):
                task.cancel()

    async def _watchdog(self, heartbeats: list[Path]) -> str:
        """Returns (ends the generation) when a started rank stops beating."""
        while True:
            await asyncio.sleep(min(1.0, self.cfg.watchdog_s / 4))
            now = time.time()
            for rank, path in enumerate(heartbeats):
                try:
                    age = now - path.stat().st_mtime
                except FileNotFoundError:
                    continue  # not started beating yet (importing, loading)
                if _finished(path):
                    continue  # tearing down is not hanging
                if age > self.cfg.watchdog_s:
                    await self._dump_stacks(rank)
                    return f"rank {rank} hung: no heartbeat for {age:.0f}s"

    async def _dump_stacks(self, rank: int) -> None:
        """Ask the hung rank for its Python stacks (SIGUSR1, see ``runtime.Heartbeat``)."""
        try:
            os.kill(self.children[rank].pid, signal.SIGUSR1)
        except (ProcessLookupError, IndexError):
            return
        await asyncio.sleep(0.5)

    async def _forward_stop(self) -> None:
        for child in self.children:
            if child.returncode is None:
                signal_group(child.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.gather(*(c.wait() for c in self.children)),
                                   self.cfg.grace_s)
        except asyncio.TimeoutError:
            pass

    async def _kill_children(self) -> None:
        for child in self.children:
            signal_group(child.pid, signal.SIGKILL)
        await asyncio.gather(*(c.wait() for c in self.children))


def parse_gpus(text: str) -> list[str]:
    """The GPUs of ``--gpus 0,1,2,3`` (indices or UUIDs, as ``CUDA_VISIBLE_DEVICES`` takes them);
    empty for an empty text."""
    gpus = [gpu.strip() for gpu in text.split(",")] if text.strip() else []
    if any(not gpu for gpu in gpus):
        raise ValueError(f"--gpus {text!r} has an empty entry: give GPUs separated by commas, "
                         "like 0,1,2,3")
    return gpus


def gpu_env_per_rank(gpus: list[str], num_procs: int) -> list[dict[str, str]]:
    """What each rank's environment adds to choose its GPU: nothing without ``--gpus`` (the
    rank picks cuda:LOCAL_RANK), else only the rank's own GPU made visible."""
    if not gpus:
        return [{} for _ in range(num_procs)]
    if len(gpus) < num_procs:
        raise ValueError(f"--gpus lists {len(gpus)} GPU(s) ({','.join(gpus)}) for "
                         f"{num_procs} ranks per replica: list one GPU per rank, or leave "
                         "--gpus out to give rank k the node's GPU k")
    return [{ENV_VISIBLE_GPUS: gpu} for gpu in gpus[:num_procs]]


def _finished(heartbeat: Path) -> bool:
    """Whether the rank marked its work done (``runtime.Heartbeat.done``)."""
    try:
        return runtime.DONE_MARK in heartbeat.read_text()
    except FileNotFoundError:
        return False


def _last_step(heartbeats: list[Path]) -> int:
    steps = []
    for path in heartbeats:
        try:
            steps.append(int(path.read_text().split()[0]))
        except (FileNotFoundError, IndexError, ValueError):
            pass
    return max(steps, default=0)


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
