"""The synchronous restart-all baseline: torchrun elastic, c10d rendezvous, checkpoint reload.

What most jobs run today, under the same chaos orders as ftsystem: one torchrun agent per node
(``python -m torch.distributed.run --nnodes 1:N --rdzv-backend c10d --max-restarts M``), one
process per node training plain DDP over Gloo (``restart_all_worker``). When any worker fails,
every agent tears its workers down and the whole group meets again in a new rendezvous round;
the new workers reload the last checkpoint, so the steps after it are computed again.

Failure injection, from :class:`ftsystem.chaos.spec.Order` s naming replicas ``r0..rN-1`` (node i):

- ``kill``: SIGKILL the node's worker; its agent and then all others restart the group;
- ``hang``: SIGSTOP the worker for the order's duration, then SIGCONT; the peers notice through
  the Gloo collective timeout of the training group, the only detector there is, which gets the
  detection budget ftsystem's one timeout gives its own detectors (``collective_timeout_s``);
- ``partition`` (``netns=True``): each node is a host in its own network namespace and its link
  goes down for the duration, without a TCP reset;
- ``host-kill``: every process of the node at once (its torchrun agent and worker; with
  ``netns``, its link goes down first and then all of its namespace dies, so that no socket's
  reset or FIN tells the peers), and after the order's duration its torchrun agent starts
  again, as a rebooted host's would (a scheduler's restart of the node, as ftsystem's
  ``host-kill`` restarts the node's agent); the others wait for it in the next rendezvous round.

The c10d rendezvous store is served from this process on the bridge (or loopback) address, as a
rendezvous service separate from the nodes would be, so that cutting off a node never takes the
rendezvous with it. Processes: every agent leads its own session and dies with this process
(``die_with_parent``); every worker dies with its agent, so nothing outlives a run, and a run
that does not end by ``deadline_s`` (a hang inside ``init_process_group``, say) is killed and
reported as such.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Self

import ftsystem
from ftsystem.measure import ettr, stall
from ftsystem.baselines import restart_all_worker as worker
from ftsystem.chaos.spec import ChaosSpec, Order, expand
from ftsystem.launch.launcher import replica_id
from ftsystem.launch.netns import IFACE, Host, HostNetwork, namespace_pids, unique_network_name
from ftsystem.launch.procs import die_with_parent, kill_and_reap
from ftsystem.measure.stall import Timeline, read_timeline
from ftsystem.control.timeouts import Timeouts

POLL_S = 0.2
# torchrun agents leave together (an exit barrier); one still running this long after another
# left is stuck (a node whose torchrun gave up leaves the others in a rendezvous that cannot
# complete, a worker stuck at exit holds its agent), and the run is declared failed.
EXIT_GRACE_S = 30.0
# How long agents wait for a rendezvous round to fill; a node cut off for longer is lost.
RDZV_JOIN_TIMEOUT_S = 300
RDZV_READ_TIMEOUT_S = 120  # a partitioned agent's store calls must outlive the partition


@dataclass(kw_only=True, slots=True)
class RestartAllConfig:
    out_dir: Path
    """Checkpoint, commit logs, results and torchrun logs go here."""
    num_nodes: int = 4
    """torchrun agents ("nodes"), one worker each: as many as ftsystem has replicas."""
    min_nodes: int = 1
    """torchrun elastic's minimum (``--nnodes min:max``): a rendezvous round goes on without a
    node that does not come within its last call, and the node joins at the next round; 1,
    as ftsystem's ``--min-replicas`` default."""
    num_steps: int = 300
    """Steps to train."""
    duration_s: float = 0.0
    """Stop training this long after launch (0: when ``num_steps`` are done)."""
    checkpoint_every: int = 20
    """Steps between checkpoints; a restart recomputes the steps since the last one."""
    max_restarts: int = 100
    """torchrun ``--max-restarts``: worker-group restarts before the job fails."""
    timeout_s: float = 30.0
    """The one timeout, as ftsystem's ``--timeout`` (``ftsystem.control.timeouts``): the longest a hung
    or cut-off peer may stall the group."""
    startup_timeout_s: float = 120.0
    """How long ranks wait for each other when a generation starts (imports, checkpoint)."""
    deadline_s: float = 900.0
    """The whole run is killed and reported as timed out after this."""
    netns: bool = False
    """Run each node as a host in its own network namespace (needed for ``partition``)."""
    train_args: list[str] = field(default_factory=list)
    """Extra worker arguments (``--sleep-per-step``, ``--model-params``, ...)."""
    job: str = "restart-all"
    """The rendezvous id."""

    def collective_timeout_s(self) -> float:
        """The Gloo collective timeout, the baseline's only detector of a hung or cut-off peer:
        the time ftsystem's watchdog and lease give theirs (a third of the one timeout), so
        that both systems get the same detection budget."""
        return Timeouts(self.timeout_s).watchdog_s


def torchrun_command(cfg: RestartAllConfig, *, endpoint: str, local_addr: str,
                     until: float = 0.0) -> list[str]:
    """The torchrun command line of one node (pure)."""
    rdzv_conf = (f"is_host=false,join_timeout={RDZV_JOIN_TIMEOUT_S},"
                 f"read_timeout={RDZV_READ_TIMEOUT_S}")
    train = [sys.executable, "-m", worker.__name__, "--workdir", str(cfg.out_dir),
             "--steps", str(cfg.num_steps), "--checkpoint-every", str(cfg.checkpoint_every),
             "--timeout", str(cfg.collective_timeout_s()), "--startup-timeout", str(cfg.startup_timeout_s),
             "--until", f"{until:.3f}", *cfg.train_args]
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", f"{cfg.min_nodes}:{cfg.num_nodes}",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-id", cfg.job, "--rdzv-conf", rdzv_conf,
            "--max-restarts", str(cfg.max_restarts), "--local-addr", local_addr,
            # --no-python: the entry point is setpriv, so each worker dies with its agent.
            "--no-python", *die_with_parent(train)]


def node_env(name: str, *, iface: str) -> dict[str, str]:
    """A node's environment: its name for the worker's files, Gloo's interface, our package."""
    package_root = str(Path(ftsystem.__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, **{worker.ENV_NODE: name}, PYTHONPATH=pythonpath,
                OMP_NUM_THREADS="1", LOGLEVEL="INFO",
                # Gloo binds to the address of the hostname unless told an interface; inside a
                # namespace that address does not exist.
                GLOO_SOCKET_IFNAME=iface,
                # By default the workers share the rank-0 agent's store, under a key prefix
                # made of the agent's restart count. Agents count restarts differently (a
                # failed worker counts, a peer's failure does not), so after a restart ranks
                # read each other's addresses from different rounds, and init_process_group
                # fails connecting to dead workers, over and over (seen here). Unshared, rank 0
                # serves a fresh store every round.
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


@dataclass(kw_only=True, slots=True)
class Node:
    """One torchrun agent, on its own emulated host when the run uses namespaces."""

    name: str
    address: str
    host: Host | None = None
    """Its emulated host, or None on loopback."""
    agent: subprocess.Popen | None = None
    down: bool = False
    """Hit by a ``host-kill`` and not started again yet: its exit is no end of the job."""
    rebooted: bool = False
    """Its host is back: ``wait`` starts its agent."""

    def worker_pidfd(self, workdir: Path) -> int | None:
        """A pidfd of this node's live worker, or None between generations.

        The pid file may name a worker that is gone (and its pid reused): the process must
        still be a child of this node's agent, checked after the pidfd pins it.
        """
        try:
            pid = int((workdir / f"{self.name}.pid").read_text())
            fd = os.pidfd_open(pid)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None
        if _parent_pid(pid) != self.agent.pid:
            os.close(fd)
            return None
        return fd


def _parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"


class ChaosActionError(RuntimeError):
    """An order could not be carried out; the message becomes its recorded outcome."""


class RestartAllJob:
    """A running baseline job: the rendezvous store, the nodes, and chaos executed on them.

    Use as a context manager; leaving it kills every process it started and removes the
    namespaces, whatever happened.
    """

    def __init__(self, cfg: RestartAllConfig) -> None:
        self.cfg = cfg
        self.nodes: list[Node] = []
        self.launched = 0.0
        self.records: list[dict] = []
        self._stack = contextlib.ExitStack()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._store = None
        self._endpoint, self._until = "", 0.0

    def __enter__(self) -> Self:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        self.cfg.out_dir.mkdir(parents=True, exist_ok=True)
        bind, places = self._places()
        store = _rendezvous_store(bind)
        self._store = store  # it serves as long as this job holds it
        self.nodes = [Node(name=replica_id(i), address=address, host=host)
                      for i, (address, host) in enumerate(places)]
        self.launched = time.time()
        self._endpoint = f"{bind}:{store.port}"
        self._until = self.launched + self.cfg.duration_s if self.cfg.duration_s else 0.0
        for node in self.nodes:
            self._launch(node)

    def _places(self) -> tuple[str, list[tuple[str, Host | None]]]:
        """Where the rendezvous listens, and each node's (address, host)."""
        if not self.cfg.netns:
            return "127.0.0.1", [("127.0.0.1", None)] * self.cfg.num_nodes
        network = HostNetwork(self.cfg.num_nodes, name=unique_network_name("ra"))
        net = self._stack.enter_context(network)
        return net.bridge_address, [(host.address, host) for host in net.hosts]

    def _launch(self, node: Node) -> None:
        cmd = torchrun_command(self.cfg, endpoint=self._endpoint, local_addr=node.address,
                               until=self._until)
        iface = "lo"
        if node.host is not None:
            cmd, iface = node.host.wrap(cmd), IFACE
        with open(self.cfg.out_dir / f"{node.name}.log", "ab") as log:  # the child keeps its fd
            node.agent = subprocess.Popen(die_with_parent(cmd), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          env=node_env(node.name, iface=iface))

    # --- failure injection ---

    def schedule(self, orders: Sequence[Order]) -> None:
        """Execute each order at its time, in the background; outcomes go to ``records``."""
        for order in orders:
            thread = threading.Thread(target=self._fire, args=(order,), daemon=True,
                                      name=f"chaos-{order.id}")
            thread.start()
            self._threads.append(thread)

    def _fire(self, order: Order) -> None:
        if self._stop.wait(max(0.0, order.at - time.time())):
            return  # the job ended first
        executed_at = time.time()
        try:
            state, outcome = "done", self.inject(order)
        except ChaosActionError as e:
            state, outcome = "failed", str(e)
        with self._lock:
            self.records.append({"id": order.id, "action": order.action,
                                 "replica": order.replica, "at": order.at,
                                 "duration_s": order.duration_s, "executed_at": executed_at,
                                 "state": state, "outcome": outcome})

    def inject(self, order: Order) -> str:
        """Carry out ``order`` now (blocking for its duration); returns what was done."""
        node = self._node(order.replica)
        if order.action == "partition":
            return self._partition(node, order.duration_s)
        if order.action == "host-kill":
            return self._reboot(node, order.duration_s)
        if order.action not in ("kill", "hang"):
            raise ChaosActionError(f"the restart-all baseline does not do {order.action!r}")
        fd = node.worker_pidfd(self.cfg.out_dir)
        if fd is None:
            raise ChaosActionError(f"{node.name} has no worker running (between restarts)")
        try:
            return self._signal(fd, order)
        finally:
            os.close(fd)

    def _signal(self, fd: int, order: Order) -> str:
        # A pidfd, not a pid: the SIGCONT after a hang must not reach a reused pid.
        if order.action == "kill":
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            return "SIGKILL to the worker"
        signal.pidfd_send_signal(fd, signal.SIGSTOP)
        self._stop.wait(order.duration_s)
        with contextlib.suppress(ProcessLookupError):  # its agent may have killed it meanwhile
            signal.pidfd_send_signal(fd, signal.SIGCONT)
        return f"SIGSTOP to the worker, SIGCONT after {order.duration_s:g} s"

    def _partition(self, node: Node, duration_s: float) -> str:
        if node.host is None:
            raise ChaosActionError("partition needs the nodes in network namespaces (netns)")
        node.host.partition()
        try:
            self._stop.wait(duration_s)
        finally:
            node.host.heal()
        return f"link down for {duration_s:g} s"

    def _reboot(self, node: Node, down_s: float) -> str:
        with self._lock:
            node.down = True
            if node.host is not None:  # silent, as ftsystem's host-kill: no reset, no FIN
                node.host.partition()
            pids = namespace_pids(node.host.name) if node.host is not None else []
            for pid in pids:  # the whole host at once, as ftsystem's host-kill does
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            kill_and_reap(node.agent)  # its worker follows (parent-death signal)
        if self._stop.wait(down_s):
            return "SIGKILL to the node's processes; the job ended before its reboot"
        with self._lock:
            node.rebooted = True
        return f"SIGKILL to the node's processes; torchrun started again after {down_s:g} s"

    def _start_rebooted(self) -> None:
        """Start the agents of hosts that are back. From ``wait``'s thread, not the chaos
        thread's: a parent-death signal fires when the thread that started the child ends."""
        with self._lock:
            for node in self.nodes:
                if node.rebooted:
                    if node.host is not None:
                        node.host.heal()
                    self._launch(node)
                    node.down = node.rebooted = False

    def _node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ChaosActionError(f"no node {name!r} (nodes: "
                               f"{', '.join(n.name for n in self.nodes)})")

    # --- waiting and reading ---

    def wait(self) -> str:
        """Wait for the job to end: ``finished``, ``failed: ...`` or ``timed out ...``."""
        deadline = self.launched + self.cfg.deadline_s
        first_exit = None
        while time.time() < deadline:
            self._start_rebooted()
            with self._lock:
                codes = {n.name: None if n.down else n.agent.poll() for n in self.nodes}
            running = [name for name, code in codes.items() if code is None]
            if not running:
                failed = {name: code for name, code in codes.items() if code}
                return f"failed: torchrun exited with {failed}" if failed else "finished"
            if len(running) < len(codes):  # agents leave together (torchrun's exit barrier)
                first_exit = first_exit or time.time()
                if time.time() - first_exit > EXIT_GRACE_S:
                    return (f"failed: {', '.join(running)} still running {EXIT_GRACE_S:g} s "
                            f"after the other nodes' torchrun exited ({codes})")
            time.sleep(POLL_S)
        return f"timed out after {self.cfg.deadline_s:g} s; every process was killed"

    def commits(self) -> dict[str, list[tuple[int, float]]]:
        """Every node's commits so far, over all generations, in order."""
        return {n.name: read_timeline(self.cfg.out_dir / f"{n.name}.commits")
                for n in self.nodes}

    def starts(self) -> dict[str, list[dict]]:
        """Every node's generation starts so far (restart count, rank, resumed step, time)."""
        return {n.name: _read_json_lines(self.cfg.out_dir / f"{n.name}.starts")
                for n in self.nodes}

    def results(self) -> dict[str, dict]:
        paths = {n.name: self.cfg.out_dir / f"{n.name}.json" for n in self.nodes}
        return {name: json.loads(p.read_text()) for name, p in paths.items() if p.exists()}

    def close(self) -> None:
        """Stop the chaos (healing and continuing what it cut or stopped), then every process."""
        self._stop.set()
        for thread in self._threads:
            thread.join()
        for node in self.nodes:
            if node.agent is not None:
                kill_and_reap(node.agent)  # its worker follows (parent-death signal)
        self._stack.close()
        self._store = None  # stops serving the rendezvous


def _rendezvous_store(host: str):
    """The c10d rendezvous's TCPStore, served by this process (agents join as clients)."""
    from torch.distributed import TCPStore
    return TCPStore(host, 0, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=RDZV_READ_TIMEOUT_S))


def _read_json_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


# --- pure summary ---


def final_lineage(commits: Timeline) -> list[tuple[int, float]]:
    """The commits that survived: for each step the last time it was committed.

    A restart rolls back to the checkpoint and commits the later steps again; the earlier
    commits of those steps were lost work and must not count (in step order).
    """
    last: dict[int, float] = {}
    for step, t in commits:
        last[int(step)] = t
    return sorted(last.items())


def restart_rounds(starts: dict[str, list[dict]], commits: dict[str, Timeline]) -> list[dict]:
    """One entry per worker-group start after the first (rank 0 starts once per round)."""
    rounds = sorted((s for node in starts.values() for s in node if s["rank"] == 0),
                    key=lambda s: s["time"])[1:]
    everything = [c for node in commits.values() for c in node]
    out = []
    for r in rounds:
        reached = max((int(step) for step, t in everything if t < r["time"]), default=0)
        out.append({"time": r["time"], "resumed_from": r["resumed_from"],
                    "recomputed_steps": max(0, reached - r["resumed_from"])})
    return out


def summarize(*, commits: dict[str, Timeline], starts: dict[str, list[dict]],
              results: dict[str, dict], records: list[dict], outcome: str,
              num_nodes: int, wall_s: float) -> dict:
    """The baseline run's summary, in the shape of ``ftsystem run``'s where they overlap;
    stalls measured from each fault's instant (``stall.faults``), as ftsystem's are."""
    timelines = {name: final_lineage(c) for name, c in commits.items()}
    rounds = restart_rounds(starts, commits)
    faults = stall.faults([], records)
    for fault in faults:
        down = stall.down_at(timelines, faults, fault["time"])  # as ftsystem run's summary
        fault |= stall.stall_fields(stall.fault_stall(timelines, fault["time"],
                                                      [fault["replica"], *down]))
    return {
        "outcome": outcome,
        "finished": outcome == "finished",
        "steps": max((r["step"] for r in results.values()), default=0),
        "failures": sorted(records, key=lambda r: r["at"]),
        "faults": faults,
        "stall_s": stall.distribution([f["stall_s"] for f in faults
                                       if f["stall_s"] is not None]),
        "restarts": len(rounds),
        "restart_rounds": rounds,
        "recomputed_steps": sum(r["recomputed_steps"] for r in rounds),
        "eval_loss": sorted({r["eval_loss"] for r in results.values()} - {None}),
        "wall_s": wall_s,
        **ettr.ettr(timelines, num_nodes),
    }


def run_restart_all(cfg: RestartAllConfig, chaos: ChaosSpec | None = None) -> dict:
    """Run the baseline to the end under ``chaos`` (expanded from launch); returns the summary.

    Orders name replicas ``r0..rN-1``, as ftsystem's do, so one spec drives both systems.
    """
    with RestartAllJob(cfg) as job:
        orders = expand(chaos, [n.name for n in job.nodes], now=job.launched,
                        name="restart-all") if chaos else []
        job.schedule(orders)
        outcome = job.wait()
        wall_s = time.time() - job.launched
    summary = summarize(commits=job.commits(), starts=job.starts(), results=job.results(),
                        records=job.records, outcome=outcome, num_nodes=cfg.num_nodes,
                        wall_s=wall_s) | {"launched": job.launched}
    (cfg.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary

