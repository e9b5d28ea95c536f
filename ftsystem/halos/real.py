"""``ftsystem halos run``: a HALoS run in real mode on this machine, with failure injection.

Starts etcd (embedded unless one is given), writes the run's ``RealConfig``, and starts one
``ftsystem agent`` per node (the GPS, one LPS per region, the workers), each supervising
``python -m ftsystem.halos.<role>`` and restarting it with backoff when it dies. With
``LaunchConfig.netns`` every agent (and so its node) runs in its own network namespace, and
when the config has bandwidths each namespace's egress is shaped (``shaping``). Once every node
has registered the launcher writes ``keys.halos_start``: the workers start then, and the run's
clock with them. ``--kill-at UPDATE:NODE`` SIGKILLs a node's process once the GPS has applied
UPDATE global updates. When every agent has exited, the counters the nodes left in etcd and the
agents' failure records make the summary, which :func:`check` tests for consistency.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ftsystem.control import keys
from ftsystem.control.etcd_server import EmbeddedEtcd
from ftsystem.halos import shaping
from ftsystem.halos.realconfig import GPS, RealConfig, lps_name, worker_name
from ftsystem.launch.launcher import ProcessGroup
from ftsystem.launch.netns import IFACE, Host, HostNetwork
from ftsystem.control.store import Store
from ftsystem.control.tokens import ENV_TOKEN

ROLE_MODULES = {"gps": "ftsystem.halos.gps", "lps": "ftsystem.halos.lps",
                "w": "ftsystem.halos.worker"}


class RunTimeoutError(RuntimeError):
    """The run did not end before its deadline."""


@dataclass(frozen=True, slots=True)
class Kill:
    """``--kill-at UPDATE:NODE``."""

    at_update: int
    node: str

    def __str__(self) -> str:
        return f"{self.at_update}:{self.node}"


def parse_kill(text: str, cfg: RealConfig) -> Kill:
    update, _, node = text.partition(":")
    if not update.isdigit() or node not in cfg.node_names():
        raise ValueError(f"malformed --kill-at {text!r}: expected UPDATE:NODE with NODE one of "
                         f"{', '.join(cfg.node_names())}, e.g. 3:w1")
    return Kill(int(update), node)


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """Where and how to run a ``RealConfig``."""

    real: RealConfig
    """The run itself."""
    etcd: str | None = None
    """etcd endpoints; None starts an embedded single-node etcd."""
    job: str = "halos"
    """Job id (etcd key segment); what an earlier run of it left in etcd is deleted."""
    out_dir: Path = Path("runs/halos")
    """Logs (one per agent), the GPS checkpoint and ``summary.json``."""
    kills: list[Kill] = field(default_factory=list)
    """Failure injection."""
    deadline_s: float = 600.0
    """The whole run's limit: past it everything is stopped and the run fails."""
    agent_timeout_s: float = 30.0
    """The agents' ``--timeout``: a node silent for a third of it is restarted as hung."""
    max_restarts: int = 20
    """Restarts per node before its agent gives up."""
    progress: Callable[[str], None] = lambda _: None
    """Told about each global update and each kill."""
    netns: bool = False
    """Run every node in its own network namespace (root, ``ip``): needed to shape the links
    (``real.bandwidth_bps``). The embedded etcd then listens on the namespaces' bridge."""
    prometheus_sd: Path | None = None
    """Keep a Prometheus file-discovery list of the run's metrics endpoints here (the nodes
    and their agents), rewritten as they come and go (``file_sd_configs``)."""

    def __post_init__(self) -> None:
        if self.real.bandwidth_bps and not self.netns:
            raise ValueError("shaped links need every node in its own network namespace "
                             "(netns=True)")
        if self.netns and self.etcd and _is_loopback(self.etcd):
            raise ValueError(f"etcd at {self.etcd} is on loopback, which the nodes' network "
                             "namespaces cannot reach: leave out --etcd (an embedded etcd "
                             "listens on their bridge) or give an address they reach")


def node_command(name: str) -> list[str]:
    """The command an agent runs for node ``name`` (gps, lps<R>, w<I>)."""
    for prefix, module in ROLE_MODULES.items():
        rest = name[len(prefix):]
        if name.startswith(prefix) and (rest.isdigit() or prefix == name):
            flag = {"lps": ["--region", rest], "w": ["--worker", rest]}.get(prefix, [])
            return [sys.executable, "-m", module, *flag]
    raise ValueError(f"no HALoS node is called {name!r}")


def agent_command(cfg: LaunchConfig, etcd: str, name: str, host: Host | None = None
                  ) -> list[str]:
    """The ``ftsystem agent`` that runs node ``name`` (inside ``host`` if given)."""
    where = ["--host", host.address, "--node-id", host.name] if host else []
    cmd = [sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", etcd, "--job", cfg.job,
           "--replica-id", name, "--timeout", str(cfg.agent_timeout_s), "--max-restarts",
           str(cfg.max_restarts), *where, "--", *node_command(name)]
    return host.wrap(cmd) if host else cmd


def run(cfg: LaunchConfig) -> dict:
    """Run to the end of the global-update budget; the summary (also in ``summary.json``)."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    state_dir = cfg.out_dir / "state"
    state_dir.mkdir(exist_ok=True)
    for old in state_dir.glob("*.pt"):  # checkpoints of an earlier run: not ours
        old.unlink()
    real = dataclasses.replace(cfg.real, state_dir=str(state_dir.resolve()))
    procs = ProcessGroup(cfg.out_dir)
    with _hosts(cfg, real) as hosts, _etcd(cfg.etcd, cfg.out_dir / "etcd", hosts) as etcd:
        links = _shape(real, hosts) if real.bandwidth_bps else []
        asyncio.run(_prepare(etcd, cfg.job, real))
        started = time.time()
        # The agents are closed by default: they need the job's token to start their nodes.
        env = os.environ | {ENV_TOKEN: secrets.token_hex(16)}
        try:
            agents = {name: procs.start(f"agent-{name}",
                                        agent_command(cfg, etcd, name, hosts.get(name)), env)
                      for name in real.node_names()}
            summary = asyncio.run(_watch(etcd, cfg, real, agents, started))
        finally:
            procs.stop_all()
        if links:
            summary["shaping"] = _shaping_summary(real, hosts, links)
    (cfg.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


_networks = 0


@contextlib.contextmanager
def _hosts(cfg: LaunchConfig, real: RealConfig) -> Iterator[dict[str, Host]]:
    """Each node's network namespace (``cfg.netns``), or none: everything in this one."""
    if not cfg.netns:
        yield {}
        return
    global _networks
    _networks += 1  # a name per run: a deleted namespace's veth can linger a while
    names = real.node_names()
    with HostNetwork(len(names), name=f"h{os.getpid() % 10000}n{_networks % 100}") as net:
        yield dict(zip(names, net.hosts))


@contextlib.contextmanager
def _etcd(url: str | None, data_dir: Path, hosts: dict[str, Host]) -> Iterator[str]:
    """The given endpoints, or an embedded etcd's for the duration of the block (on the
    namespaces' bridge when the nodes run in namespaces)."""
    if url:
        yield url
        return
    host = next(iter(hosts.values())).gateway if hosts else "127.0.0.1"
    with EmbeddedEtcd(data_dir=data_dir, host=host) as etcd:
        yield etcd.url


def _is_loopback(url: str) -> bool:
    return any(h.partition("//")[2].split(":")[0] in ("127.0.0.1", "localhost", "[::1]")
               for h in url.split(","))


def _shape(real: RealConfig, hosts: dict[str, Host]) -> list[tuple[str, str, float]]:
    """Shape every node's egress to its peers; the (sender, receiver, bit/s) of each."""
    links = []
    for name, peers in shaping.egress_plan(real).items():
        host = hosts[name]
        shaping.apply(host.name, IFACE, [(hosts[peer].address, bps) for peer, bps in peers])
        links += [(name, peer, bps) for peer, bps in peers]
    return links


def _shaping_summary(real: RealConfig, hosts: dict[str, Host],
                     links: list[tuple[str, str, float]]) -> dict:
    """The shaped links with what a model transfer costs on each, and the bytes each class
    carried (read before the namespaces go)."""
    model_bytes = real.model_bytes
    sent = {name: shaping.class_bytes(host.name, IFACE) for name, host in hosts.items()}
    by_sender: dict[str, int] = {}
    rows = []
    for sender, receiver, bps in links:
        k = by_sender[sender] = by_sender.get(sender, -1) + 1
        rows.append({"from": sender, "to": receiver, "bps": round(bps, 1),
                     "model_transfer_s": round(shaping.transfer_s(model_bytes, bps), 6),
                     "bytes_sent": sent[sender].get(f"1:{shaping.FIRST_PEER_CLASS + k}")})
    return {"model_bytes": model_bytes, "links": rows,
            "unshaped_bytes": {n: s.get(f"1:{shaping.DEFAULT_CLASS}") for n, s in sent.items()}}


async def _prepare(etcd: str, job: str, real: RealConfig) -> None:
    async with Store(etcd) as store:
        await store.delete_prefix(keys.job(job) + "/")
        await store.put(keys.halos_config(job), real.to_json())


async def _watch(etcd: str, cfg: LaunchConfig, real: RealConfig, agents: dict, started: float
                 ) -> dict:
    """Follow the run, start it once every node is registered, inject the kills, keep the
    Prometheus discovery file, and summarize once every agent has exited."""
    pending, done_kills, last = sorted(cfg.kills, key=lambda k: k.at_update), [], -1
    clock, targets = None, None
    async with Store(etcd) as store:
        while any(a.poll() is None for a in agents.values()):
            if time.time() - started > cfg.deadline_s:
                raise RunTimeoutError(f"the run did not end within {cfg.deadline_s:.0f} s; see "
                                      f"the agents' logs in {cfg.out_dir}")
            if clock is None or cfg.prometheus_sd:
                registered = (await store.get_prefix(keys.halos_nodes(cfg.job)))[0]
                if clock is None and len(registered) == len(real.node_names()):
                    clock = time.time()
                    await store.put_json(keys.halos_start(cfg.job), {"time": clock})
                    cfg.progress(f"every node is up after {clock - started:.1f} s: started")
                if cfg.prometheus_sd:
                    agent_items = (await store.get_prefix(keys.agents(cfg.job)))[0]
                    targets = _write_targets(cfg.prometheus_sd, targets, prometheus_targets(
                        cfg.job, registered, agent_items))
            gps = await store.get_json(keys.halos_stat(cfg.job, GPS)) or {}
            updates = gps.get("updates", 0)
            if updates != last and gps.get("loss"):
                last = updates
                cfg.progress(f"global update {updates}/{real.num_updates}: held-out loss "
                             f"{gps['loss'][-1][1]:.4f}")
            while pending and pending[0].at_update <= updates:
                record = await _kill(store, cfg.job, pending[0], updates)
                if record is None:
                    break  # not registered yet (starting, restarting): next time
                done_kills.append(record)
                cfg.progress(f"killed {record['node']} (pid {record['pid']}) at global update "
                             f"{updates}")
                pending.pop(0)
            await asyncio.sleep(0.1)
        stats = {keys.last_segment(k): json.loads(v) for k, v in
                 (await store.get_prefix(keys.halos_stats(cfg.job)))[0].items()}
        failures = (await store.get_prefix(keys.failures(cfg.job)))[0]
    return summarize(real, stats, _failure_records(cfg.job, failures), kills=done_kills,
                     missed=[str(k) for k in pending],
                     exit_codes={n: a.returncode for n, a in agents.items()},
                     wall_s=time.time() - started, launched=started, clock=clock)


def prometheus_targets(job: str, nodes: dict[str, bytes], agents: dict[str, bytes]
                       ) -> list[dict]:
    """Pure: Prometheus file-discovery groups for the nodes' and their agents' endpoints.

    Labelled like the controller's discovery of an FT-HSDP job (``job``, ``component``,
    ``instance_id``, and ``host``: the machine its agent records, ``--node-id``), so the same
    scrape config (``honor_labels: true``) serves both."""
    machines = {key: json.loads(value).get("node_id") for key, value in agents.items()}
    groups = []

    def add(addr: str | None, component: str, instance_id: str, machine: str | None) -> None:
        if addr:
            groups.append({"targets": [addr], "labels": {
                "job": job, "component": component, "instance_id": instance_id,
                **({"host": machine} if machine else {})}})

    for key, value in sorted(nodes.items()):
        record, name = json.loads(value), keys.last_segment(key)
        add(record.get("metrics") or record.get("url", "").removeprefix("http://"),
            record.get("role", "halos"), name, machines.get(keys.agent(job, name, 0)))
    for key, value in sorted(agents.items()):
        add(json.loads(value).get("metrics_addr"), "agent", key[len(keys.agents(job)):],
            machines[key])
    return groups


def _write_targets(path: Path, previous: list[dict] | None, groups: list[dict]) -> list[dict]:
    """Replace the discovery file when its groups changed (atomically: Prometheus watches it)."""
    if groups != previous:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups, indent=1))
        os.replace(tmp, path)
    return groups


async def _kill(store: Store, job: str, kill: Kill, updates: int) -> dict | None:
    """SIGKILL the registered process of ``kill.node``; None if it has none now."""
    registration = await store.get_json(keys.halos_node(job, kill.node))
    if registration is None:
        return None
    try:
        os.kill(registration["pid"], signal.SIGKILL)
    except ProcessLookupError:
        return None
    return {"node": kill.node, "at_update": kill.at_update, "gps_updates": updates,
            "pid": registration["pid"], "generation": registration["generation"],
            "time": time.time()}


def _failure_records(job: str, items: dict[str, bytes]) -> list[dict]:
    """The agents' failure history: ``failures/<node>/<generation>``."""
    records = []
    for key, value in items.items():
        node, generation = key[len(keys.failures(job)):].split("/")
        records.append({"node": node, "generation": int(generation), **json.loads(value)})
    return sorted(records, key=lambda r: r["time"])


def summarize(real: RealConfig, stats: dict[str, dict], failures: list[dict], *,
              kills: list[dict], missed: list[str], exit_codes: dict[str, int | None],
              wall_s: float, launched: float = 0.0, clock: float | None = None) -> dict:
    """Pure: the run's summary from the nodes' counters and the agents' failure records.

    ``clock`` is when the run started (every node up, ``keys.halos_start``): the loss curve's
    seconds count from it (the initial model's evaluation, before it, at 0)."""
    loss = stats.get(GPS, {}).get("loss", [])
    restarts = Counter(f["node"] for f in failures)
    summary = {
        "updates": stats.get(GPS, {}).get("updates", 0),
        "num_updates": real.num_updates,
        "initial_loss": loss[0][1] if loss else None,
        "final_loss": loss[-1][1] if loss else None,
        "loss_curve": [[u, v] for u, v, _ in loss],
        "loss_curve_s": [[u, v, round(max(0.0, t - clock), 3)] for u, v, t in loss]
        if clock is not None else [],
        "startup_s": round(clock - launched, 2) if clock is not None else None,
        "restarts": {name: restarts[name] for name in real.node_names()},
        "failures": failures,
        "kills": kills,
        "kills_missed": missed,
        "agent_exit_codes": exit_codes,
        "wall_s": round(wall_s, 2),
        "gps": stats.get(GPS, {}),
        "lps": {lps_name(r): stats.get(lps_name(r), {}) for r in range(real.num_regions)},
        "workers": {worker_name(i): stats.get(worker_name(i), {})
                    for i in range(real.num_workers)},
        "config": json.loads(real.to_json()),
    }
    summary["problems"] = check(real, stats, restarts, exit_codes) + \
        [f"kill {k} not executed: the run ended first" for k in missed]
    return summary


def check(real: RealConfig, stats: dict[str, dict], restarts: Counter,
          exit_codes: dict[str, int | None]) -> list[str]:
    """What is inconsistent in a finished run's counters (empty: nothing).

    Nodes count before they acknowledge, so an acknowledged update is always counted; a node
    that dies can leave one update counted but not acknowledged (the sender then retries), so
    each restart of either end allows one more such update.
    """
    gps = stats.get(GPS, {})
    problems = [f"agent of {n} exited with {c}" for n, c in exit_codes.items() if c != 0]
    per_lps = gps.get("per_lps", {})
    if gps.get("updates") != real.num_updates:
        problems.append(f"GPS applied {gps.get('updates')} updates, not {real.num_updates}")
    if sum(per_lps.values()) != gps.get("updates"):
        problems.append(f"GPS per-LPS counts {per_lps} do not add up to {gps.get('updates')}")
    for region in range(real.num_regions):
        problems += _check_lps(real, region, stats, per_lps, restarts)
    loss = gps.get("loss", [])
    if not loss or loss[-1][1] >= loss[0][1]:
        problems.append(f"the global loss did not decrease: {loss[:1]} -> {loss[-1:]}")
    return problems


def _check_lps(real: RealConfig, region: int, stats: dict[str, dict], per_lps: dict[str, int],
               restarts: Counter) -> list[str]:
    name, problems = lps_name(region), []
    lps = stats.get(name, {})
    pushes, merges = lps.get("pushes", 0), lps.get("merges", 0)
    if not 0 <= per_lps.get(name, 0) - merges <= restarts[name]:
        problems.append(f"GPS applied {per_lps.get(name, 0)} deltas of {name}, which merged "
                        f"{merges} ({restarts[name]} restarts)")
    if pushes < real.accumulation_k * merges:
        problems.append(f"{name} merged {merges} times after only {pushes} pushes "
                        f"(K = {real.accumulation_k})")
    per_worker = lps.get("per_worker", {})
    if sum(per_worker.values()) != pushes:
        problems.append(f"{name}: per-worker counts {per_worker} do not add up to {pushes}")
    for index in range(real.num_workers):
        if real.worker_regions[index] != region:
            continue
        worker = worker_name(index)
        acked, applied = stats.get(worker, {}).get("pushes", 0), per_worker.get(worker, 0)
        slack = restarts[worker] + restarts[name]
        if not 0 <= applied - acked <= slack:
            problems.append(f"{name} applied {applied} pushes of {worker}, which counts {acked} "
                            f"acknowledged ({slack} restarts of either)")
    return problems
