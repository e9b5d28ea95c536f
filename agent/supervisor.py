"""The node agent: launches its node's ranks of one replica, and restarts the replica with the
replica's other agents when any part of it fails.

A replica runs on ``--nodes`` nodes with one agent each (``agent.rendezvous``: the agents meet
in etcd and agree on each generation). Detection is the fast path of the design: the moment a
process of the replica exits, its watchdog fires, or a peer node falls silent
(``agent.pulse``), the agent that noticed revokes the replica's lease, which deletes its
registration and lets the controller publish the epoch without it within milliseconds. Then
every agent of the replica stops its ranks, and the replica restarts as generation + 1, with
backoff, once all its nodes are back. Children run in their own sessions with a parent-death
signal, so neither a Ctrl-C nor a SIGKILL of the agent leaves orphans.

The end: a generation whose ranks finished is marked in etcd before its agents give up their
node ranks, so a spare that takes one starts nothing. A replica still waiting for its nodes when
the job has finished without it (and the last replica holding the final state has left) gives
up with ``EXIT_MISSED_THE_END`` instead of holding its nodes forever.

An etcd outage is not a failure: ranks keep training, keep-alives keep trying, and a lease the
outage outlived is replaced (and the replica's rank 0 told through the lease file) instead of
the replica being restarted. A failure during the outage is acted on once etcd is back.

GPUs follow torchrun's convention: every rank sees the node's GPUs and rank k uses cuda:k
(``ftsystem.training.devices.local_device``). Started with ``--gpus``, the agent instead lets rank k see
only the k-th listed GPU, which that rule then makes its cuda:0.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Iterable, NoReturn, Sequence, TypeVar

from agent.chaos import replica_executor
from agent.job_settings import SpecConflict, rank_settings_env, resolve_timeout
from agent.pulse import DONE, ENDED, Pulse
from agent.rendezvous import (Generation, Layout, Rendezvous, RendezvousError, rank_env,
                              replica_env, until_present)
from agent.slot import NodeSlot, SlotTaken
from ftsystem.control import keys
from ftsystem.measure import metrics
from ftsystem.training import runtime
from ftsystem.control.etcd_server import free_port
from ftsystem.chaos.faults import FaultPoint, format_fault_points
from ftsystem.control.membership import Registration, ReplicaState
from ftsystem.launch.procs import die_with_parent, signal_group
from ftsystem.control.store import LeaseLostError, Store, StoreUnavailableError
from ftsystem.control.tokens import (ENV_TOKEN, ENV_TOKEN_FILE, AuthConfigError, load_token,
                                     state_key)
from ftsystem.control.timeouts import Timeouts

log = logging.getLogger(__name__)

T = TypeVar("T")
ENV_VISIBLE_GPUS = "CUDA_VISIBLE_DEVICES"


EXIT_HALTED = 3
"""The agent's exit status when its replica halted (``keys.halted``): a divergence with no
majority, replicas that register different objects."""
EXIT_BAD_INPUT = 2
"""The agent's exit status when its flags contradict the job or its replica (nothing ran)."""
EXIT_MISSED_THE_END = 4
"""The agent's exit status when the job finished without its replica: the replica was down
(waiting for a lost node or a spare, or started only after the end) when the last replica
holding the final state left. Training again from scratch would end in another state, and
waiting on would hold its nodes until the allocation is cancelled."""
EXIT_JOB_DELETED = 5
"""The agent's exit status when the job's spec was deleted while it ran (``ftsystem job delete
--force``): there is no job left to restart its replica into."""
EXIT_SIGNALLED_BASE = 128
"""Told to stop by signal N, the agent exits 128 + N: 143 for SIGTERM (a deleted pod, scancel,
``docker stop``), 130 for SIGINT (Ctrl-C). A shell reports a command that a signal ended so, and
Kubernetes' podFailurePolicy, Slurm and scripts read the status the same way whether the agent
handled the signal or died of it."""
STOP_ETCD_S = 5.0
"""Once told to stop, the agent exits within ``grace_s`` (its ranks' teardown) plus this: etcd
work still undone by then (revoking the replica lease, ending the generation, giving up the node
rank) is skipped and logged. Each of those only speeds up what etcd does by itself when the
leases expire, a TTL later; an agent waiting on a frozen etcd instead (its store retries a call
for ``FTSYSTEM_ETCD_RETRY_S``, then the next) would outlive its stop deadline (Kubernetes'
terminationGracePeriodSeconds, 30 s by default; Slurm's KillWait) and be SIGKILLed, its exit
status lost."""
TEARDOWN_S = 60.0
"""A rank whose interpreter is exiting (``runtime.EXITING_MARK``) gets this long to exit before
it counts as hung: destroying process groups takes seconds, a wedged NCCL destructor forever."""
CANCEL_AGAIN_S = 0.1
"""How often a task that outlived its cancellation is cancelled again (``_cancel``)."""
REPLICA_KEEPALIVE_S = 0.5
"""The replica lease is renewed this often (once per replica, not per node), so that the leader
can tell a dead replica by a lease not renewed for a second (``controller.leader``)."""


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    etcd: str
    """etcd endpoints, comma-separated."""
    job: str
    """The job the replica belongs to."""
    replica_id: str
    """The replica this agent supervises a node of."""
    command: list[str]
    """The replica's program; run once per rank of this node."""
    node_rank: int | None = 0
    """This node's place in the replica (torchrun's ``GROUP_RANK``); None for a spare, which
    takes the first node rank that falls free."""
    nodes: int = 1
    """Nodes per replica (``--nodes``)."""
    nproc_per_node: int = 1
    """Ranks on this node (``--nproc-per-node``)."""
    node_id: str = field(default_factory=socket.gethostname)
    """The machine: an agent restarted on the same one takes its node rank back at once."""
    timeout_s: float | None = None
    """The one timeout (``--timeout``); None: the job spec's. The replica lease's TTL (the slow
    path that covers what pulses and process exits do not) and the watchdog derive from it
    (``ftsystem.control.timeouts``); the node's own lease is a longer node lease
    (``ftsystem.control.timeouts.NODE_LEASE_TTL_S``). Given and unlike the spec's: refused
    (``agent.job_settings``)."""
    peer_timeout_s: float = 1.0
    """A peer node silent this long is dead or cut off: the replica restarts."""
    max_restarts: int = 20
    """Restarts before the agent gives up on the replica."""
    backoff_s: float = 0.5
    """First restart delay; doubles per consecutive fast failure, up to ``max_backoff_s``."""
    max_backoff_s: float = 10.0
    """Ceiling of the restart delay."""
    grace_s: float = 10.0
    """How long children get to exit after a forwarded SIGTERM/SIGINT."""
    kill_at: list[FaultPoint] = field(default_factory=list)
    """Fault injection: kill the replica when it reaches these steps (``--kill-at``)."""
    host: str = "127.0.0.1"
    """Address other nodes and replicas use to reach this node."""
    gpus: list[str] = field(default_factory=list)
    """One GPU per rank (``--gpus 0,1``, as ``CUDA_VISIBLE_DEVICES`` names them): rank k sees
    only ``gpus[k]``. Empty: every rank sees all of the node's GPUs and uses cuda:LOCAL_RANK."""
    insecure: bool = False
    """Run the ranks without the job's token (``--insecure``): their state servers then hand
    the weights to anyone who reaches them. Without it the agent needs ``FTSYSTEM_API_TOKEN``
    (or ``FTSYSTEM_API_TOKEN_FILE``) and hands its ranks the state key derived from it."""

    @property
    def layout(self) -> Layout:
        return Layout(self.nodes, self.nproc_per_node)

    @property
    def stop_bound_s(self) -> float:
        """The longest an agent takes to exit once told to stop: its ranks' grace, then its
        etcd work on the way out (``STOP_ETCD_S``)."""
        return self.grace_s + STOP_ETCD_S


class StopDeadlinePassed(Exception):
    """The agent was told to stop and its etcd work on the way out ran out of time."""


@dataclass(frozen=True, slots=True)
class _Stop:
    """Why the agent starts no (further) generation of its replica, and its exit status."""

    message: str
    exit_code: int

    def __str__(self) -> str:
        return self.message


@dataclass(slots=True)
class Outcome:
    success: bool
    reason: str
    last_step: int = 0
    local_rank: int | None = None
    """The rank of this node whose exit or hang ended the generation, if one did."""


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        keys.check_id("job", cfg.job)
        keys.check_id("replica", cfg.replica_id)
        if cfg.nodes < 1 or cfg.nproc_per_node < 1:
            raise ValueError("--nodes and --nproc-per-node must be at least 1")
        self.cfg = cfg
        self.token_env = job_token_env(load_token(), insecure=cfg.insecure)
        self.gpu_envs = gpu_env_per_rank(cfg.gpus, cfg.nproc_per_node)
        if len(cfg.gpus) > cfg.nproc_per_node:
            log.warning("--gpus lists %d GPUs for %d ranks: %s stay unused", len(cfg.gpus),
                        cfg.nproc_per_node, ",".join(cfg.gpus[cfg.nproc_per_node:]))
        self.uid = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.store = Store(cfg.etcd)
        self.rendezvous = Rendezvous(self.store, cfg.job, cfg.replica_id, cfg.layout)
        self.timeouts = Timeouts(resolve_timeout(cfg.timeout_s, None))
        """From the job's spec, read again before each generation (``_follow_spec``)."""
        self.pulse = Pulse(self.uid, cfg.host, cfg.peer_timeout_s,
                           startup_s=max(cfg.peer_timeout_s, self.timeouts.lease_ttl_s))
        self.stop_requested = asyncio.Event()
        self.stop_exit_code = 1
        """The exit status once told to stop; with ``stop_deadline``, written by
        ``_request_stop`` alone."""
        self.stop_deadline = math.inf
        """When etcd work on the way out is given up (``STOP_ETCD_S``), in ``time.monotonic``."""
        self.kill_at = sorted(cfg.kill_at, key=lambda p: p.step)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"ftsystem-agent-{cfg.replica_id}-"))
        self.lease_file = self.workdir / "replica-lease"
        self.children: list[asyncio.subprocess.Process] = []
        self.metrics_addr = metrics.serve(cfg.host)
        self.spec: dict | None = None
        self.slot: NodeSlot | None = None

    async def run(self) -> int:
        """Supervise until the replica finishes (0, also when it had finished before this
        agent took its node rank), gives up (1), is refused (2), halts (3), the job finishes
        without it (4), the job is deleted (5) or the agent is told to stop (143 for SIGTERM,
        130 for SIGINT: ``EXIT_SIGNALLED_BASE``)."""
        try:
            return await self._run()
        finally:  # its lease file and the ranks' heartbeats; nobody reads them any more
            shutil.rmtree(self.workdir, ignore_errors=True)

    async def _run(self) -> int:
        await self.store.connect()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, self._request_stop,
                                                          EXIT_SIGNALLED_BASE + sig)
        try:
            self._follow_spec(await self.rendezvous.check(self.cfg.node_rank))
            pulse_addr = await self.pulse.start()
            self.slot = NodeSlot(self.store, self.rendezvous, {
                "uid": self.uid, "node_id": self.cfg.node_id, "host": self.cfg.host,
                "pid": os.getpid(), "pulse_addr": pulse_addr, "metrics_addr": self.metrics_addr})
            if self.cfg.node_rank is None:
                # A spare may wait for a rank as long as the job lasts: a stop ends the wait.
                await self._unless_stopped(self.slot.claim_free())
            else:
                await self.slot.claim(self.cfg.node_rank)
        except (RendezvousError, SpecConflict) as e:
            log.error("%s", e)
            await self.store.close()
            return EXIT_BAD_INPUT
        if self.stop_requested.is_set():
            log.info("told to stop before holding a node rank: exiting")
            await self._until_etcd_back("giving up the node rank", self.slot.release)
            self.pulse.close()
            await self.store.close()
            return self.stop_exit_code
        chaos = replica_executor(self.store, self.cfg.job, self.cfg.replica_id,
                                 self._running_pids, mine=lambda: self.slot.node_rank == 0)
        hold = asyncio.create_task(self.slot.hold())
        hold.add_done_callback(self._on_slot_lost)
        background = [hold, asyncio.create_task(chaos.run())]
        try:
            return await self._supervise()
        finally:
            await chaos.stop()
            await _cancel(background)
            await self._until_etcd_back(f"giving up node rank {self.node_rank}",
                                        self.slot.release)
            self.pulse.close()
            await self.store.close()  # local: it cancels what is in flight, awaits no answer

    @property
    def node_rank(self) -> int:
        return self.slot.node_rank

    def _on_slot_lost(self, hold: asyncio.Task) -> None:
        """An etcd outage outlived the node lease and another agent (a spare) took the rank
        meanwhile: that agent serves the node now, so this one stops its ranks and exits."""
        if hold.cancelled() or not isinstance(hold.exception(), SlotTaken):
            return
        log.error("%s: stopping this node's ranks and exiting", hold.exception())
        self._request_stop(1)

    def _request_stop(self, exit_code: int) -> None:
        """Stop the ranks and exit with ``exit_code`` (the first request's), etcd work on the
        way out bounded by ``stop_deadline``."""
        if self.stop_requested.is_set():
            return
        self.stop_exit_code = exit_code
        self.stop_deadline = time.monotonic() + self.cfg.stop_bound_s
        self.stop_requested.set()

    def _running_pids(self) -> list[int]:
        return [c.pid for c in self.children if c.returncode is None]

    async def _supervise(self) -> int:
        backoff, last = self.cfg.backoff_s, -1
        for _ in range(self.cfg.max_restarts + 1):
            generation = await self._unless_stopped(self._until_etcd_back(
                "opening the next generation", lambda: self._next_generation(last)))
            if generation is None:
                return self.stop_exit_code
            if isinstance(generation, _Stop):
                (log.info if generation.exit_code == 0 else log.error)("%s", generation)
                return generation.exit_code
            last = generation.number
            started = time.monotonic()
            outcome = await self._run_generation(generation)
            if outcome.success:
                log.info("replica %s finished at step %d (generation %d)", self.cfg.replica_id,
                         outcome.last_step, generation.number)
                return 0
            if self.stop_requested.is_set():
                return self.stop_exit_code
            halted = await self._until_etcd_back("reading whether the replica halted", lambda:
                                                 self.store.get_json(keys.halted(
                                                     self.cfg.job, self.cfg.replica_id)))
            if halted is not None:  # the replica found an error no restart can fix
                log.error("replica %s halted at step %s, not restarting it: %s",
                          self.cfg.replica_id, halted.get("step"), halted.get("reason"))
                return EXIT_HALTED
            # A replica that ran a while before failing gets the short backoff again.
            backoff = self.cfg.backoff_s if time.monotonic() - started > 30 else backoff
            where = "" if outcome.local_rank is None else f" on local rank {outcome.local_rank}"
            log.warning("replica %s generation %d ended (%s%s); restarting in %.1fs",
                        self.cfg.replica_id, generation.number, outcome.reason, where, backoff)
            try:
                # Not wait_for: in Python 3.11 it can drop a cancellation (CPython gh-86296).
                async with asyncio.timeout(backoff):
                    await self.stop_requested.wait()
                return self.stop_exit_code
            except TimeoutError:
                backoff = min(backoff * 2, self.cfg.max_backoff_s)
        log.error("replica %s: giving up after %d restarts", self.cfg.replica_id,
                  self.cfg.max_restarts)
        return 1

    def _follow_spec(self, spec: dict | None) -> None:
        """Take the job's settings from its spec (raises SpecConflict against the flags)."""
        self.timeouts = Timeouts(resolve_timeout(self.cfg.timeout_s, spec))
        self.pulse.startup_s = max(self.cfg.peer_timeout_s, self.timeouts.lease_ttl_s)
        self.spec = spec

    async def _why_not_start(self) -> _Stop | None:
        """Before each generation: why the replica must not run again, or None. It finished
        (this agent has nothing left to do); the job finished without it and nobody is left to
        hand it the final state; the job's spec is gone or now contradicts this agent."""
        current, _ = await self.rendezvous.current()
        if current is not None and current.finished:
            return _Stop(f"replica {self.cfg.replica_id} finished (generation {current.number}): "
                         "not starting it again; this agent has nothing left to run", 0)
        missed, _ = await self._missed_the_end()
        if missed:
            return _Stop(missed, EXIT_MISSED_THE_END)
        return await self._reread_spec()

    async def _reread_spec(self) -> _Stop | None:
        """The spec as it is now; why not to go on, if it is gone or now contradicts this
        agent's flags."""
        spec = await self.store.get_json(keys.spec(self.cfg.job))
        if spec is None and self.spec is not None:
            return _Stop(f"job {self.cfg.job}'s spec was deleted while replica "
                         f"{self.cfg.replica_id} ran (ftsystem job delete): not restarting it; "
                         "create the job again, then start its agents", EXIT_JOB_DELETED)
        try:
            self._follow_spec(spec)
        except SpecConflict as e:
            return _Stop(f"the job's spec changed: {e}", EXIT_BAD_INPUT)
        return None

    async def _missed_the_end(self, missing: Sequence[int] = ()) -> tuple[str | None, int]:
        """Why the job finished without this replica (``missed_the_end``), or None; and the
        revision the registrations were read at."""
        job = self.cfg.job
        finished = await self.store.get_json(keys.finished(job))
        items, revision = await self.store.get_prefix(keys.replicas(job))
        if finished is None:
            return None, revision
        return missed_the_end(self.cfg.replica_id, finished,
                              {keys.last_segment(k) for k in items}, missing), revision

    async def _until_the_job_ends_without_us(self) -> _Stop:
        """While the replica waits for its nodes: returns once the job has finished and the
        last replica holding the final state has left. Until then a node may come back or a
        spare arrive, and the replica catch up and finish with the others."""
        await until_present(self.store, keys.finished(self.cfg.job))
        while True:
            held, _ = await self.rendezvous.holders()
            missed, revision = await self._missed_the_end(
                [rank for rank in range(self.cfg.nodes) if rank not in held])
            if missed:
                return _Stop(missed, EXIT_MISSED_THE_END)
            async for _ in self.store.watch_prefix(keys.replicas(self.cfg.job),
                                                   start_revision=revision + 1):
                break  # a registration changed: read again

    async def _while_the_job_lasts(self, wait: Awaitable[T]) -> T | _Stop:
        """``wait``'s result, or why to give up waiting: the job finished without us."""
        return await _first_of(wait, self._until_the_job_ends_without_us())

    async def _until_etcd_back(self, what: str, op: Callable[[], Awaitable[T]]) -> T | None:
        """``op()``, retried across an etcd outage however long. Once the agent is told to
        stop, it is tried once more, and given up at the stop deadline: then None, and
        ``what`` (it names the work) is logged as skipped."""
        while True:
            try:
                return await _first_of(op(), self._stop_deadline())
            except StopDeadlinePassed:
                log.warning("told to stop, and etcd did not answer in time: skipped %s", what)
                return None
            except StoreUnavailableError as e:
                if self.stop_requested.is_set():
                    log.warning("%s; stopping anyway, skipped %s", e, what)
                    return None
                log.warning("%s; retrying", e)
                await asyncio.sleep(1.0)

    async def _stop_deadline(self) -> NoReturn:
        """Raises :class:`StopDeadlinePassed` once the agent, told to stop, reaches its stop
        deadline; waits forever until then."""
        await self.stop_requested.wait()
        await asyncio.sleep(self.stop_deadline - time.monotonic())
        raise StopDeadlinePassed(f"stop deadline passed ({STOP_ETCD_S:g} s past the grace)")

    async def _unless_stopped(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None as soon as the agent is told to stop."""
        async def stopped() -> None:
            await self.stop_requested.wait()
        return await _first_of(work, stopped())

    # --- generations -----------------------------------------------------------------------

    async def _next_generation(self, last: int) -> Generation | _Stop:
        """Wait for all nodes, then open the next generation (node 0) or join it (others);
        or why not to (``_why_not_start``, or the job finished while waiting)."""
        if stop := await self._why_not_start():
            return stop
        while True:
            holders = await self._while_the_job_lasts(self.rendezvous.wait_full())
            if isinstance(holders, _Stop):
                return holders
            if self.node_rank != 0:
                generation = await self._while_the_job_lasts(
                    self.rendezvous.wait_opened(self.uid, after=last))
                if isinstance(generation, _Stop):
                    return generation
                # Read again: a node that came back since the wait took its rank anew (and
                # listens for pulses elsewhere).
                holders, _ = await self.rendezvous.holders()
                self.pulse.follow(generation.number, self.node_rank, holders)
                return generation
            lease = await self.store.grant(self.timeouts.lease_ttl_s)
            previous, _ = await self.rendezvous.current()
            generation = await self.rendezvous.open(lambda number: Generation(
                number=number, lease=lease, master_addr=self.cfg.host, master_port=free_port(),
                agents=tuple(holders[rank]["uid"] for rank in range(self.cfg.nodes))))
            if generation is None:
                await self.store.revoke(lease)
                continue
            if previous is not None and not previous.ended:
                await self._bury(previous)
            self.pulse.follow(generation.number, 0, holders)
            return generation

    async def _bury(self, previous: Generation) -> None:
        """The previous generation was never ended: its agents died with their host (a
        replica of one node). Record that failure now, and drop its lease if it lingers."""
        await self.store.revoke(previous.lease)
        await self._record_failure(previous.number, Outcome(
            False, "the replica's node died with its agent (found on restart)"))

    async def _run_generation(self, generation: Generation) -> Outcome:
        keep_alive = None
        try:
            if self.node_rank == 0:
                self._write_lease_file(generation.lease)
                await self.store.put(keys.replica(self.cfg.job, self.cfg.replica_id), Registration(
                    replica_id=self.cfg.replica_id, state=ReplicaState.STARTING,
                    generation=generation.number, host=self.cfg.host).to_json(),
                    lease=generation.lease)
                keep_alive = asyncio.create_task(self._hold_replica_lease(generation))
            log.info("replica %s generation %d: launching %d rank(s) of node %d (rank 0 at "
                     "%s:%d)", self.cfg.replica_id, generation.number, self.cfg.nproc_per_node,
                     self.node_rank, generation.master_addr, generation.master_port)
            heartbeats = await self._spawn(generation)
            outcome = await self._watch(generation, heartbeats, keep_alive)
        except StoreUnavailableError as e:
            outcome = Outcome(False, f"etcd unreachable while starting: {e}")
        finally:
            if keep_alive is not None:
                keep_alive.cancel()
        if outcome.success:
            self.pulse.announce(DONE)
            await self._kill_children()
            # Marked before this agent gives up its node rank: whoever takes the rank next (a
            # spare, a restarted agent) finds the replica finished and starts nothing.
            await self._until_etcd_back("marking the replica finished",
                                        lambda: self.rendezvous.finish(generation.number))
            if self.node_rank == 0:  # what the ranks registered on it goes with the replica
                await self._until_etcd_back("revoking the replica lease",
                                            lambda: self.store.revoke(generation.lease))
            return outcome
        # The revoke is started first; the ranks are stopped meanwhile, even while etcd is
        # unreachable (a node cut off from its peers fences itself at once).
        ending = asyncio.create_task(self._end(generation, outcome))
        await asyncio.sleep(0)
        await self._kill_children()
        await ending
        return outcome

    async def _end(self, generation: Generation, outcome: Outcome) -> None:
        """Take the replica out of the job at once (revoke first: the survivors' recovery
        starts when the registration disappears), then end the generation for its other
        agents; the agent that ended it records the failure (a stop is no failure)."""
        self.pulse.announce(ENDED)
        await self._until_etcd_back("revoking the replica lease (its registration goes with "
                                    "it when the lease expires)",
                                    lambda: self.store.revoke(generation.lease))
        if (silent := self.pulse.view and self.pulse.view.silent) is not None:
            await self._until_etcd_back(f"freeing node rank {silent} of a silent peer",
                                        lambda: self._free_slot(silent))
        if outcome.reason.startswith("ended by"):
            return  # another agent ended it, and records why
        won = await self._until_etcd_back(
            f"ending generation {generation.number} for the replica's other agents",
            lambda: self.rendezvous.end(generation.number, outcome.reason))
        if won and outcome.reason != "stopped":
            await self._until_etcd_back(f"recording the failure of generation "
                                        f"{generation.number}",
                                        lambda: self._record_failure(generation.number, outcome))

    async def _free_slot(self, node_rank: int) -> None:
        """A silent peer's node rank is freed at once (its lease would hold it for a TTL): the
        next generation waits for the host to come back or for a spare to take its place."""
        holder = await self.store.get_json(keys.agent(self.cfg.job, self.cfg.replica_id,
                                                      node_rank))
        if holder and holder.get("lease"):
            await self.store.revoke(int(holder["lease"]))

    async def _hold_replica_lease(self, generation: Generation) -> None:
        """Node 0 renews the replica lease; one an etcd outage outlived is replaced (unless
        the generation ended meanwhile), and rank 0 re-registers on the new one."""
        lease = generation.lease
        while True:
            try:
                await self.store.keep_alive(lease, self.timeouts.lease_ttl_s, REPLICA_KEEPALIVE_S)
            except LeaseLostError:
                current, _ = await self.rendezvous.current()
                if current is None or current.number != generation.number or current.ended:
                    return
                lease = await self.store.grant(self.timeouts.lease_ttl_s)
                await self.rendezvous.replace_lease(generation.number, lease)
                self._write_lease_file(lease)
                log.warning("replica lease lapsed during an etcd outage; replaced by %x", lease)

    def _write_lease_file(self, lease: int) -> None:
        tmp = self.lease_file.with_suffix(".tmp")
        tmp.write_text(str(lease))
        tmp.replace(self.lease_file)  # atomic: rank 0 never reads half a number

    async def _record_failure(self, generation: int, outcome: Outcome) -> None:
        metrics.REPLICA_RESTARTS.labels(self.cfg.job, self.cfg.replica_id).inc()
        await self.store.put_json(
            keys.failure(self.cfg.job, self.cfg.replica_id, generation),
            {"time": time.time(), "reason": outcome.reason, "step": outcome.last_step,
             "node_rank": self.node_rank, "local_rank": outcome.local_rank})
        # Kill points the replica has passed are spent; the restarted one gets the rest.
        self.kill_at = [p for p in self.kill_at if p.step > outcome.last_step]

    # --- ranks -----------------------------------------------------------------------------

    async def _spawn(self, generation: Generation) -> list[Path]:
        heartbeats = []
        self.children = []
        inherited = {k: v for k, v in os.environ.items() if k not in RANK_SECRET_VARIABLES}
        base = inherited | self.token_env | replica_env(self.spec, self.cfg.replica_id) | \
            rank_settings_env(self.spec, self.timeouts.timeout_s) | {
            runtime.ENV_ETCD: self.cfg.etcd, runtime.ENV_JOB: self.cfg.job,
            runtime.ENV_REPLICA: self.cfg.replica_id,
            runtime.ENV_GENERATION: str(generation.number),
            runtime.ENV_LEASE: str(generation.lease),
            runtime.ENV_LEASE_FILE: str(self.lease_file), runtime.ENV_HOST: self.cfg.host,
            runtime.ENV_NODE_ID: self.cfg.node_id,
            runtime.ENV_KILL_AT: format_fault_points(self.kill_at)}
        for local_rank in range(self.cfg.nproc_per_node):
            heartbeat = self.workdir / f"heartbeat-g{generation.number}-r{local_rank}"
            heartbeats.append(heartbeat)
            env = base | rank_env(self.cfg.layout, self.node_rank, local_rank, generation,
                                  max_restarts=self.cfg.max_restarts,
                                  run_id=f"{self.cfg.job}-{self.cfg.replica_id}") | {
                runtime.ENV_HEARTBEAT: str(heartbeat)} | self.gpu_envs[local_rank]
            self.children.append(await asyncio.create_subprocess_exec(
                *die_with_parent(self.cfg.command), env=env, start_new_session=True))
        return heartbeats

    async def _watch(self, generation: Generation, heartbeats: list[Path],
                     keep_alive: asyncio.Task | None) -> Outcome:
        """Until the ranks finish, or something ends the generation: a rank's exit or hang,
        a silent peer, another agent ending it, the replica lease lost, a stop request."""
        waits = {asyncio.create_task(c.wait()): c for c in self.children}
        watchers = {
            asyncio.create_task(self.stop_requested.wait()): lambda t: "stopped",
            asyncio.create_task(self._watchdog(heartbeats)): lambda t: t.result(),
            asyncio.create_task(self._ended_elsewhere(generation)): lambda t: t.result(),
        }
        if self.cfg.nodes > 1:
            watchers[asyncio.create_task(self.pulse.watch())] = lambda t: t.result()
        if keep_alive is not None:
            watchers[keep_alive] = lambda t: "replica lease lost"
        pending = set(waits)
        try:
            while pending:
                done, _ = await asyncio.wait(pending | set(watchers),
                                             return_when=asyncio.FIRST_COMPLETED)
                for task in done & set(watchers):
                    reason = watchers[task](task)
                    if reason == "stopped":
                        await self._forward_stop()
                    return Outcome(False, reason, _last_step(heartbeats))
                for task in done & pending:
                    pending.discard(task)
                    code = task.result()
                    rank = self.children.index(waits[task])
                    if code != 0 and _finished(heartbeats[rank]):
                        # Its work was done and recorded: a crash while tearing down does not
                        # make the replica train again (alone, after the others left).
                        log.warning("replica %s local rank %d finished, then %s while tearing "
                                    "down", self.cfg.replica_id, rank, _describe_exit(code))
                    elif code != 0:
                        return Outcome(False, _describe_exit(code), _last_step(heartbeats),
                                       local_rank=rank)
            return Outcome(True, "finished", _last_step(heartbeats))
        finally:
            for task in (*pending, *watchers):
                if task is not keep_alive:
                    task.cancel()

    async def _ended_elsewhere(self, generation: Generation) -> str:
        """Returns when another agent of the replica ended the generation (seen in etcd)."""
        key = keys.generation(self.cfg.job, self.cfg.replica_id)
        while True:
            current, revision = await self.rendezvous.current()
            if current is None or current.number != generation.number or current.ended:
                return f"ended by another node: {current.ended if current else 'gone'}"
            async for _ in self.store.watch_prefix(key, start_revision=revision + 1):
                break

    async def _watchdog(self, heartbeats: list[Path]) -> str:
        """Returns (ends the generation) when a started rank stops beating."""
        while True:
            await asyncio.sleep(min(1.0, self.timeouts.watchdog_s / 4))
            now = time.time()
            for rank, path in enumerate(heartbeats):
                try:
                    age = now - path.stat().st_mtime
                except FileNotFoundError:
                    continue  # not started beating yet (importing, loading)
                hang = hang_reason(rank, age, _mark(path), self.timeouts.watchdog_s)
                if hang:
                    await self._dump_stacks(rank)
                    return hang

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
            async with asyncio.timeout(self.cfg.grace_s):
                await asyncio.gather(*(c.wait() for c in self.children))
        except TimeoutError:
            pass

    async def _kill_children(self) -> None:
        for child in self.children:
            signal_group(child.pid, signal.SIGKILL)
        await asyncio.gather(*(c.wait() for c in self.children))


async def _first_of(*works: Awaitable[T]) -> T:
    """The result of the first of ``works`` to finish (of several finished at once, the first
    listed); the others are cancelled."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        return next(task for task in tasks if task.done()).result()
    finally:
        await _cancel(tasks)


async def _cancel(tasks: Iterable[asyncio.Future]) -> None:
    """Cancel ``tasks`` and wait until they have ended, also if the caller is cancelled
    meanwhile (then re-raised after). One still running is cancelled again: in Python 3.11
    ``asyncio.wait_for`` can drop a cancellation (CPython gh-86296), and aetcd creates every
    watch through it, so a task cancelled while its watch was being created would go on
    watching, and the agent never exit."""
    pending, interrupted = set(tasks), None
    while pending:
        for task in pending:
            task.cancel()
        try:
            _, pending = await asyncio.wait(pending, timeout=CANCEL_AGAIN_S)
        except asyncio.CancelledError as e:
            interrupted = e
    if interrupted is not None:
        raise interrupted


def parse_gpus(text: str) -> list[str]:
    """The GPUs of ``--gpus 0,1,2,3`` (indices or UUIDs, as ``CUDA_VISIBLE_DEVICES`` takes them);
    empty for an empty text."""
    gpus = [gpu.strip() for gpu in text.split(",")] if text.strip() else []
    if any(not gpu for gpu in gpus):
        raise ValueError(f"--gpus {text!r} has an empty entry: give GPUs separated by commas, "
                         "like 0,1,2,3")
    return gpus


RANK_SECRET_VARIABLES = (runtime.ENV_STATE_KEY, runtime.ENV_INSECURE, ENV_TOKEN,
                         ENV_TOKEN_FILE)
"""Never inherited from the agent's own environment: the ranks get the state servers' key (or
the insecure mark) from the agent alone, and never the job's token, which opens the API."""


def job_token_env(token: str | None, *, insecure: bool) -> dict[str, str]:
    """What the ranks learn of the job's token (pure): the state servers' key derived from it,
    from which each replica's token follows. Closed by default: no token and no
    ``--insecure`` is refused."""
    if token is not None:
        if insecure:
            log.warning("--insecure has no effect: the job's token is set, and the ranks' state "
                        "servers require replica tokens made from it")
        return {runtime.ENV_STATE_KEY: state_key(token)}
    if not insecure:
        raise AuthConfigError(
            f"no job token: set {ENV_TOKEN} (or {ENV_TOKEN_FILE} to a file holding it) to the "
            "job's token, the one its controllers have; the replica's state servers require it "
            "of every fetch. Or pass --insecure to let anyone who reaches them read the "
            "weights and optimizer state")
    log.warning("--insecure: the replica's state servers hand its weights and optimizer state "
                "to anyone who reaches them")
    return {runtime.ENV_INSECURE: "1"}


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


def missed_the_end(replica_id: str, finished: dict, registered: set[str],
                   missing: Sequence[int] = ()) -> str | None:
    """Why the replica must not (re)start, or None (pure): the job ``finished`` and no other
    replica is registered, so none is left to hand it the final state. (A finished replica
    stays registered while it waits for replicas that are restarting: they catch up from it.)
    ``missing``: the node ranks the replica was waiting for, if it was."""
    if registered - {replica_id}:
        return None
    waiting = f" (waiting for node rank(s) {', '.join(map(str, missing))}: neither its node " \
        "nor a spare came back)" if missing else ""
    return (f"replica {replica_id}: the job finished at step {finished.get('step')} (first "
            f"reached by {finished.get('replica')}) while this replica was down{waiting}, and "
            "every replica holding the final state has left: not starting it again, which would "
            "train from scratch to another state. Take the final state from the finished "
            "replicas' outputs or checkpoints; to run the job again, delete it first "
            "(ftsystem job delete)")


def hang_reason(rank: int, age: float, mark: str | None, watchdog_s: float) -> str | None:
    """Why a rank whose heartbeat is ``age`` seconds old counts as hung, or None (pure).

    A rank that is tearing down (its work done, or its interpreter exiting on an error) is not
    hanging: its exit code will tell what happened. It only gets ``TEARDOWN_S`` to exit."""
    if mark in (runtime.DONE_MARK, runtime.EXITING_MARK):
        if age > TEARDOWN_S:
            return f"local rank {rank} hung while exiting: no heartbeat for {age:.0f}s"
        return None
    if age > watchdog_s:
        return f"local rank {rank} hung: no heartbeat for {age:.0f}s"
    return None


def _finished(heartbeat: Path) -> bool:
    """Whether the rank marked its work done (``runtime.Heartbeat.done``)."""
    return _mark(heartbeat) == runtime.DONE_MARK


def _mark(heartbeat: Path) -> str | None:
    try:
        words = heartbeat.read_text().split()
    except FileNotFoundError:
        return None
    return words[1] if len(words) > 1 else None


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
