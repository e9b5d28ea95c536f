"""``ftsystem run``: a whole fault-tolerant job on this machine, with failure injection.

Starts etcd (embedded unless ``--etcd`` is given), a controller and one agent per replica, each
as its own process group with a parent-death signal; shows progress; and on the way out (the
end, an error or Ctrl-C) stops them in reverse order, so nothing is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ftsystem.control import jobs, keys

from ftsystem.measure import ettr, stall, timeline
from ftsystem.chaos.spec import ChaosSpec, submit
from ftsystem.control.etcd_server import EtcdCluster, free_port
from ftsystem.control.etcd_tls import ENV_NAMES, ClientTls
from ftsystem.chaos.faults import FaultPoint, parse_fault_point
from ftsystem.launch.netns import Host, HostNetwork
from ftsystem.launch.procs import die_with_parent, wait_listening
from ftsystem.chaos.services import ServiceChaos
from ftsystem.control.store import Store, StoreError
from ftsystem.control.tokens import ENV_TOKEN as ENV_API_TOKEN


@dataclass(frozen=True, slots=True)
class ReplicaKill:
    """``--kill-at STEP:REPLICA[:PHASE]``: REPLICA is an index (0-based) into the replicas."""

    replica: int
    point: FaultPoint


def parse_replica_kill(text: str, num_replicas: int) -> ReplicaKill:
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[:2]):
        raise ValueError(f"malformed --kill-at {text!r}: expected STEP:REPLICA[:PHASE], "
                         "e.g. 100:1 or 100:1:allreduce")
    step, replica = int(parts[0]), int(parts[1])
    if replica >= num_replicas:
        raise ValueError(f"--kill-at {text!r}: replica {replica} does not exist "
                         f"(replicas are 0..{num_replicas - 1})")
    phase = parts[2] if len(parts) == 3 else "step"
    return ReplicaKill(replica, parse_fault_point(f"{step}:{phase}"))


@dataclass(kw_only=True, slots=True)
class RunConfig:
    num_replicas: int = 4
    """Data-parallel replicas (one agent each)."""
    num_steps: int = 300
    """Committed steps to train."""
    nodes_per_replica: int = 1
    """Nodes per replica, one agent each (in its own network namespace with ``netns``)."""
    nproc_per_node: int = 1
    """Ranks per node: the model is sharded over every rank of a replica (FSDP2); a rank's
    death restarts its replica."""
    min_replicas: int = 1
    """The job pauses below this many replicas."""
    etcd: str | None = None
    """etcd endpoints; None starts an embedded single-node etcd."""
    job: str = "job"
    """Job id (etcd key segment)."""
    kills: list[ReplicaKill] = field(default_factory=list)
    """Failure injection (``--kill-at``)."""
    out_dir: Path = Path("runs/latest")
    """Where results, logs and the summary go."""
    program: tuple[str, ...] = ("-m", "ftsystem.example.train")
    """What every rank runs, after the Python interpreter: a module (``-m NAME``) or a script.
    It takes the example's arguments (``--steps``, ``--data-shard``, ``--out``) and writes its
    result in ``--out`` as ``ftsystem.example.train`` does."""
    train_args: list[str] = field(default_factory=list)
    """Extra arguments for the program."""
    replica_args: dict[int, list[str]] = field(default_factory=dict)
    """More arguments for the program of one replica (by index), after ``train_args``."""
    controller_ports: list[int] = field(default_factory=lambda: [0])
    """One controller instance per entry, on that REST port (0: a free one)."""
    timeout_s: float = 30.0
    """FTSYSTEM_TIMEOUT_S for the replicas."""
    show_progress: bool = True
    chaos: ChaosSpec | list[ChaosSpec] | None = None
    """Failure injection by specs (``--chaos FILE`` or ``--mtbf``), executed by the agents
    (replica actions) and by this run (service actions)."""
    etcd_members: int = 1
    """Members of the embedded etcd (3 lets ``etcd-member-kill`` kill one)."""
    netns: bool = False
    """Run each node's agent in its own network namespace, so ``partition`` and the host
    actions can hit it."""
    checkpoint_every: int = 0
    """Disk checkpoints every this many steps in ``out_dir/checkpoints`` (0: none); the job
    resumes from the newest complete one when every replica has died."""


PROGRESS_STOP_S = 5.0
"""How long the progress display may take to finish its last read of etcd."""
CONTROLLER_START_S = 60.0
"""How long a controller may take to listen (imports on a loaded machine take seconds)."""


def replica_id(index: int) -> str:
    return f"r{index}"


class ProcessGroup:
    """Child processes that die with us, stopped together."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as log:  # the child keeps its own fd
            proc = subprocess.Popen(die_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop_all(self, grace_s: float = 15.0) -> None:
        """SIGTERM to all at once, SIGKILL to those still running ``grace_s`` later: each
        agent gives its ranks a grace of its own, and one after the other those added up
        (a Ctrl-C once took over a minute on a loaded machine)."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in reversed(self.procs):
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def etcd_endpoint(cfg: RunConfig, host: str) -> Iterator[tuple[str, EtcdCluster | None]]:
    """The given endpoints, or an embedded etcd's (reachable at ``host``) for the block."""
    if cfg.etcd:
        yield cfg.etcd, None
        return
    with EtcdCluster(size=cfg.etcd_members, data_dir=cfg.out_dir / "etcd", host=host) as etcd:
        yield etcd.url, etcd


_networks = 0


@contextlib.contextmanager
def hosts(cfg: RunConfig) -> Iterator[list[Host | None]]:
    """Where each node's agent runs (replica-major): its own network namespace, or (None)
    this one."""
    count = cfg.num_replicas * cfg.nodes_per_replica
    if not cfg.netns:
        yield [None] * count
        return
    global _networks
    _networks += 1  # names unique per run, also for runs in one process
    with HostNetwork(count, name=f"f{os.getpid() % 10000}n{_networks % 100}") as net:
        yield net.hosts


class NodeAgents:
    """The agent of every node of the job; a node's agent can be started again (a host
    that comes back after a ``host-kill``)."""

    def __init__(self, cfg: RunConfig, etcd: str, node_hosts: list[Host | None],
                 procs: ProcessGroup, env: dict[str, str]) -> None:
        self.cfg, self.etcd, self.node_hosts, self.procs, self.env = cfg, etcd, node_hosts, \
            procs, env
        self.current: dict[tuple[int, int], subprocess.Popen] = {}

    def nodes(self) -> list[tuple[int, int]]:
        return [(i, k) for i in range(self.cfg.num_replicas)
                for k in range(self.cfg.nodes_per_replica)]

    def host(self, index: int, node_rank: int) -> Host | None:
        return self.node_hosts[index * self.cfg.nodes_per_replica + node_rank]

    def start(self, index: int, node_rank: int) -> None:
        host = self.host(index, node_rank)
        name = f"agent-{replica_id(index)}" + (
            f"-n{node_rank}" if self.cfg.nodes_per_replica > 1 else "")
        self.current[(index, node_rank)] = self.procs.start(name, _on_host(host, agent_command(
            self.cfg, self.etcd, index, node_rank=node_rank,
            host=host.address if host else "127.0.0.1",
            node_id=host.name if host else f"{self.cfg.job}-{replica_id(index)}-n{node_rank}")),
            env=self.env)

    def start_all(self) -> None:
        for index, node_rank in self.nodes():
            self.start(index, node_rank)

    def running(self) -> bool:
        return any(proc.poll() is None for proc in self.current.values())

    def wait(self) -> None:
        while self.running():
            time.sleep(0.2)

    def exit_codes(self) -> list[int | None]:
        return [proc.returncode for proc in self.current.values()]


def run_job(cfg: RunConfig) -> dict:
    """Run the job to the end; returns the summary (also written to ``out_dir``)."""
    check_chaos_fits(cfg)
    check_etcd_fits(cfg)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    _clear_results(cfg)
    procs = ProcessGroup(cfg.out_dir)
    with hosts(cfg) as node_hosts, etcd_endpoint(cfg, _service_address(node_hosts)) as (
            etcd, cluster):
        asyncio.run(_reset_job(etcd, cfg))
        services = ServiceChaos(etcd, cfg.job, cluster)
        try:
            ports = [port or free_port() for port in cfg.controller_ports]
            token = _api_token(cfg.out_dir)
            for i, port in enumerate(ports):
                services.add_controller(f"c{i}", functools.partial(
                    start_controller, procs, etcd, cfg.job, port, i, token))
            # The agents hand the job's token to their ranks: their state servers require it.
            # The timeout and the checkpoint policy reach them through the job's spec.
            _clear_checkpoints(cfg)
            agents = NodeAgents(cfg, etcd, node_hosts, procs, os.environ | {ENV_API_TOKEN: token})
            for index, node_rank in agents.nodes():
                if (host := agents.host(index, node_rank)) is not None:
                    services.add_node(replica_id(index), node_rank, host, functools.partial(
                        agents.start, index, node_rank))
            services.start()
            agents.start_all()
            if cfg.chaos:
                asyncio.run(_submit_chaos(etcd, cfg))
            started = time.time()
            status_page = f"http://127.0.0.1:{ports[0]}/" if ports else None
            _wait_with_progress(cfg, etcd, agents, status_page)
            summary = asyncio.run(_summarize(cfg, etcd, agents, time.time() - started))
            summary["controllers"] = [f"http://127.0.0.1:{port}" for port in ports]
        finally:
            services.stop()
            procs.stop_all()
    (cfg.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def start_controller(procs: ProcessGroup, etcd: str, job: str, port: int, index: int,
                     token: str) -> subprocess.Popen:
    """Controller ``c<index>`` of ``job`` on loopback ``port``."""
    return procs.start(f"controller{index}", _cli(
        "controller", "--etcd", etcd, "--job", job, "--port", str(port),
        "--instance-id", f"c{index}", "--bind", "127.0.0.1", "--advertise-address", "127.0.0.1"),
        env=os.environ | {ENV_API_TOKEN: token})


@contextlib.contextmanager
def idle_control_plane(out_dir: Path, job: str = "idle") -> Iterator[str]:
    """An embedded etcd and a controller of a job that never starts, for the block (yields
    the controller's address): what a job's control plane costs the machine while nothing
    happens, for a baseline that trains beside it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = ProcessGroup(out_dir)
    with EtcdCluster(size=1, data_dir=out_dir / "etcd", host="127.0.0.1") as etcd:
        try:
            port = free_port()
            proc = start_controller(procs, etcd.url, job, port, 0, secrets.token_hex(16))
            if (error := wait_listening("127.0.0.1", port, proc, CONTROLLER_START_S)) is not None:
                raise RuntimeError(f"the idle control plane's controller did not start: {error}; "
                                   f"see {out_dir / 'controller0.log'}")
            yield f"http://127.0.0.1:{port}"
        finally:
            procs.stop_all()


def _api_token(out_dir: Path) -> str:
    """A fresh token for this run (its controllers, its agents and their ranks' state servers),
    also in ``OUT/api-token`` (owner-only) for whoever posts chaos to the API while it lasts."""
    token = secrets.token_hex(16)
    path = out_dir / "api-token"
    path.unlink(missing_ok=True)
    path.touch(mode=0o600)
    path.write_text(token)
    return token


def _clear_results(cfg: RunConfig) -> None:
    """A run starts clean, like its etcd keys: an earlier run's result left in the directory
    would count as this run's, and its commit timeline would be appended to."""
    shutil.rmtree(_results_dir(cfg), ignore_errors=True)
    _results_dir(cfg).mkdir()


def _results_dir(cfg: RunConfig) -> Path:
    return cfg.out_dir / "results"


def _clear_checkpoints(cfg: RunConfig) -> None:
    """A run starts clean, like its etcd keys."""
    if cfg.checkpoint_every:
        shutil.rmtree(_checkpoint_dir(cfg), ignore_errors=True)


def _checkpoint_dir(cfg: RunConfig) -> Path:
    return cfg.out_dir / "checkpoints"


def chaos_specs(cfg: RunConfig) -> list[ChaosSpec]:
    return [cfg.chaos] if isinstance(cfg.chaos, ChaosSpec) else list(cfg.chaos or [])


def check_chaos_fits(cfg: RunConfig) -> None:
    """Refuse, before anything starts, chaos this run could not carry out."""
    actions = {a for spec in chaos_specs(cfg) for a in spec.actions}
    if needing := sorted(actions & {"partition", "host-kill", "host-partition"}):
        if not cfg.netns:
            raise ValueError(f"the {needing[0]} action needs nodes in network namespaces: "
                             "add --netns (as root)")
    if "etcd-pause" in actions and cfg.etcd:
        raise ValueError("etcd-pause stops the embedded etcd: leave out --etcd")
    if "etcd-member-kill" in actions and (cfg.etcd or cfg.etcd_members < 3):
        raise ValueError("etcd-member-kill needs an embedded etcd of 3 members or more: "
                         "add --etcd-members 3 (and no --etcd)")


def check_etcd_fits(cfg: RunConfig) -> None:
    """Refuse etcd certificates for the embedded etcd, which serves plain http on loopback."""
    if not cfg.etcd and ClientTls.from_env() is not None:
        raise ValueError(f"etcd certificates are set ({', '.join(ENV_NAMES)}) but no --etcd: "
                         "the embedded etcd serves plain http on loopback. For TLS, start one "
                         "with certificates (`ftsystem etcd --cert ... --key ... --client-ca "
                         "...`) and pass its https:// URL with --etcd")


def _service_address(node_hosts: list[Host | None]) -> str:
    """Where services listen so that every node reaches them: the bridge, or loopback."""
    host = node_hosts[0] if node_hosts else None
    return host.gateway if host is not None else "127.0.0.1"


def _on_host(host: Host | None, cmd: list[str]) -> list[str]:
    return host.wrap(cmd) if host is not None else cmd


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ftsystem.cli", *args]


def agent_command(cfg: RunConfig, etcd: str, index: int, *, node_rank: int = 0,
                  host: str = "127.0.0.1", node_id: str = "") -> list[str]:
    """The ``ftsystem agent`` command line of node ``node_rank`` of replica ``index``, training
    with ``cfg.program`` (``--kill-at`` goes to every node: the replica's last rank acts on it)."""
    kills = [f"--kill-at={k.point}" for k in cfg.kills if k.replica == index]
    train = [sys.executable, *cfg.program, "--steps", str(cfg.num_steps),
             "--data-shard", str(index), "--out", str(_results_dir(cfg)), *cfg.train_args,
             *cfg.replica_args.get(index, [])]
    node = ["--node-id", node_id] if node_id else []
    return _cli("agent", "--etcd", etcd, "--job", cfg.job, "--replica-id", replica_id(index),
                "--node-rank", str(node_rank), "--nodes", str(cfg.nodes_per_replica),
                "--nproc-per-node", str(cfg.nproc_per_node), *node,
                "--host", host, *kills, "--", *train)  # the timeout: the job spec's


async def _submit_chaos(etcd: str, cfg: RunConfig) -> None:
    """Once every agent is up (orders name replicas), expand and store the chaos spec."""
    async with Store(etcd) as store:
        nodes = cfg.num_replicas * cfg.nodes_per_replica
        while len((await store.get_prefix(keys.agents(cfg.job)))[0]) < nodes:
            await asyncio.sleep(0.1)
        await submit(store, cfg.job, chaos_specs(cfg), "run", now=time.time())


async def _reset_job(etcd: str, cfg: RunConfig) -> None:
    """A fresh job: drop what a previous run of the same job id left, create it."""
    async with Store(etcd) as store:
        with contextlib.suppress(jobs.JobNotFoundError):
            await jobs.delete_job(store, cfg.job, force=True)
        await jobs.create_job(store, cfg.job, job_spec(cfg), now=time.time())


def job_spec(cfg: RunConfig) -> jobs.JobSpec:
    checkpoint = jobs.CheckpointPolicy(
        every_steps=cfg.checkpoint_every,
        dir=str(_checkpoint_dir(cfg).resolve()) if cfg.checkpoint_every else "")
    return jobs.JobSpec(replicas=cfg.num_replicas, min_replicas=cfg.min_replicas,
                        nodes_per_replica=cfg.nodes_per_replica,
                        nproc_per_node=cfg.nproc_per_node, timeout_s=cfg.timeout_s,
                        checkpoint=checkpoint, num_steps=cfg.num_steps,
                        replica_ids=tuple(replica_id(i) for i in range(cfg.num_replicas)))


def _wait_with_progress(cfg: RunConfig, etcd: str, agents: NodeAgents,
                        status_page: str | None) -> None:
    if not cfg.show_progress:  # nothing to show: reading etcd would only take CPU from training
        agents.wait()
        return
    if status_page:
        print(f"status page: {status_page}  (it asks for the job's token: "
              f"{cfg.out_dir / 'api-token'}; logs, results and summary: {cfg.out_dir}/)",
              flush=True)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(),
               TextColumn("step {task.completed:.0f}/{task.total:.0f} {task.fields[info]}"),
               TimeElapsedColumn())
    with Progress(*columns) as progress:
        task = progress.add_task(cfg.job, total=cfg.num_steps, info="")
        stop = threading.Event()
        # The main thread only waits: a Ctrl-C raises KeyboardInterrupt there and the job's
        # `finally` stops it, with no asyncio cancellation (which an etcd call could swallow)
        # on the way.
        follower = threading.Thread(target=asyncio.run, daemon=True, name="progress", args=(
            _follow_progress(cfg.job, etcd, stop, lambda view: progress.update(
                task, completed=max(view["step"], progress.tasks[0].completed),
                info=view["info"])),))
        follower.start()
        try:
            agents.wait()
        finally:
            stop.set()
            follower.join(PROGRESS_STOP_S)


async def _follow_progress(job: str, etcd: str, stop: threading.Event,
                           show: Callable[[dict], None]) -> None:
    """Show the job's progress every half second, over one etcd connection, until ``stop``."""
    async with Store(etcd) as store:
        while not stop.is_set():
            try:
                show(await _peek(store, job))
            except StoreError as e:  # the job rides out etcd outages; so does its progress bar
                show({"step": 0, "info": f"etcd unreachable: {e}"})
            await asyncio.sleep(0.5)


async def _peek(store: Store, job: str) -> dict:
    items, _ = await store.get_prefix(keys.job(job) + "/")
    regs = [json.loads(v) for k, v in items.items() if k.startswith(keys.replicas(job))]
    failures = sum(1 for k in items if k.startswith(keys.failures(job)))
    epoch = json.loads(items.get(keys.epoch(job), b'{"number": 0, "members": []}'))
    members = len(epoch["members"])
    return {"step": max((r["step"] for r in regs), default=0),
            "info": f"epoch {epoch['number']} members {members} failures {failures}"}


async def _summarize(cfg: RunConfig, etcd: str, agents: NodeAgents,
                     wall_s: float) -> dict:
    async with Store(etcd) as store:
        items, _ = await store.get_prefix(keys.failures(cfg.job))
        orders, _ = await store.get_prefix(keys.chaos_orders(cfg.job))
    failures = sorted(({"replica": k[len(keys.failures(cfg.job)):].split("/")[0],
                        **json.loads(v)} for k, v in items.items()), key=lambda f: f["time"])
    results = {}
    for path in sorted(_results_dir(cfg).glob("*.json")):
        result = json.loads(path.read_text())
        # Every generation's commits (the result holds the last generation's only).
        result["commits"] = stall.read_timeline(path.with_suffix(".commits")) or result["commits"]
        results[result["replica"]] = result
    timeline.draw(results, failures, cfg.out_dir / "timeline.png")
    chaos = sorted((json.loads(v) for v in orders.values()), key=lambda o: o["at"])
    return summarize(results, failures, wall_s=wall_s, num_replicas=cfg.num_replicas,
                     agent_exit_codes=agents.exit_codes(), orders=chaos) | {"chaos": chaos}


def summarize(results: dict[str, dict], failures: list[dict], *, wall_s: float,
              num_replicas: int, agent_exit_codes: list[int],
              orders: Sequence[dict] = ()) -> dict:
    """Pure: the run's summary from replica results, the failure history and the chaos orders
    carried out. Stalls are measured from each fault's instant (``stall.faults``)."""
    timelines = {rid: r["commits"] for rid, r in results.items()}
    faults = stall.faults(failures, orders)
    for fault in faults:
        down = stall.down_at(timelines, [*faults, *failures], fault["time"])
        fault |= stall.stall_fields(stall.fault_stall(timelines, fault["time"],
                                                      [fault["replica"], *down]))
        for i in fault["explains"]:
            failures[i] |= {"fault_time": fault["time"],
                            **{k: fault[k] for k in stall.STALL_FIELDS}}
    hashes = {r["state_hash"] for r in results.values()}
    steps = {r["step"] for r in results.values()}
    stalls = [f["stall_s"] for f in faults if f["stall_s"] is not None]
    return {
        "steps": max(steps, default=0),
        "replicas_finished": len(results),
        "agents_ok": all(code == 0 for code in agent_exit_codes),
        "failures": failures,
        "faults": faults,
        "stall_s": stall.distribution(stalls),
        "step_time_s": stall.distribution([stall.normal_step_time(t) for t in timelines.values()
                                           if len(t) > 1]),
        "eval_loss": sorted({r["eval_loss"] for r in results.values()}),
        "train_loss": {rid: r["train_loss"] for rid, r in results.items()},
        "bitwise_identical": len(hashes) == 1 and len(steps) == 1 and bool(results),
        "wall_s": wall_s,
        **ettr.ettr(timelines, num_replicas),
    }
