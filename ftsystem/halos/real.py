"""``ftsystem halos run``: a HALoS run in real mode on this machine, with failure injection.

Starts etcd (embedded unless one is given), writes the run's ``RealConfig``, and starts one
``ftsystem agent`` per node (the GPS, one LPS per region, the workers), each supervising
``python -m ftsystem.halos.<role>`` and restarting it with backoff when it dies. ``--kill-at
UPDATE:NODE`` SIGKILLs a node's process once the GPS has applied UPDATE global updates. When
every agent has exited, the counters the nodes left in etcd and the agents' failure records make
the summary, which :func:`check` tests for consistency.
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
from ftsystem.halos.realconfig import GPS, RealConfig, lps_name, worker_name
from ftsystem.launch.launcher import ProcessGroup
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


def node_command(name: str) -> list[str]:
    """The command an agent runs for node ``name`` (gps, lps<R>, w<I>)."""
    for prefix, module in ROLE_MODULES.items():
        rest = name[len(prefix):]
        if name.startswith(prefix) and (rest.isdigit() or prefix == name):
            flag = {"lps": ["--region", rest], "w": ["--worker", rest]}.get(prefix, [])
            return [sys.executable, "-m", module, *flag]
    raise ValueError(f"no HALoS node is called {name!r}")


def agent_command(cfg: LaunchConfig, etcd: str, name: str) -> list[str]:
    return [sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", etcd, "--job", cfg.job,
            "--replica-id", name, "--timeout", str(cfg.agent_timeout_s), "--max-restarts",
            str(cfg.max_restarts), "--", *node_command(name)]


def run(cfg: LaunchConfig) -> dict:
    """Run to the end of the global-update budget; the summary (also in ``summary.json``)."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    state_dir = cfg.out_dir / "state"
    state_dir.mkdir(exist_ok=True)
    for old in state_dir.glob("*.pt"):  # checkpoints of an earlier run: not ours
        old.unlink()
    real = dataclasses.replace(cfg.real, state_dir=str(state_dir.resolve()))
    procs = ProcessGroup(cfg.out_dir)
    with _etcd(cfg.etcd, cfg.out_dir / "etcd") as etcd:
        asyncio.run(_prepare(etcd, cfg.job, real))
        started = time.time()
        # The agents are closed by default: they need the job's token to start their nodes.
        env = os.environ | {ENV_TOKEN: secrets.token_hex(16)}
        try:
            agents = {name: procs.start(f"agent-{name}", agent_command(cfg, etcd, name), env)
                      for name in real.node_names()}
            summary = asyncio.run(_watch(etcd, cfg, real, agents, started))
        finally:
            procs.stop_all()
    (cfg.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


@contextlib.contextmanager
def _etcd(url: str | None, data_dir: Path) -> Iterator[str]:
    """The given endpoints, or an embedded etcd's for the duration of the block."""
    if url:
        yield url
        return
    with EmbeddedEtcd(data_dir=data_dir) as etcd:
        yield etcd.url


async def _prepare(etcd: str, job: str, real: RealConfig) -> None:
    async with Store(etcd) as store:
        await store.delete_prefix(keys.job(job) + "/")
        await store.put(keys.halos_config(job), real.to_json())


async def _watch(etcd: str, cfg: LaunchConfig, real: RealConfig, agents: dict, started: float
                 ) -> dict:
    """Follow the run, inject the kills, and summarize once every agent has exited."""
    pending, done_kills, last = sorted(cfg.kills, key=lambda k: k.at_update), [], -1
    async with Store(etcd) as store:
        while any(a.poll() is None for a in agents.values()):
            if time.time() - started > cfg.deadline_s:
                raise RunTimeoutError(f"the run did not end within {cfg.deadline_s:.0f} s; see "
                                      f"the agents' logs in {cfg.out_dir}")
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
                     wall_s=time.time() - started)


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
              wall_s: float) -> dict:
    """Pure: the run's summary from the nodes' counters and the agents' failure records."""
    loss = stats.get(GPS, {}).get("loss", [])
    restarts = Counter(f["node"] for f in failures)
    summary = {
        "updates": stats.get(GPS, {}).get("updates", 0),
        "num_updates": real.num_updates,
        "initial_loss": loss[0][1] if loss else None,
        "final_loss": loss[-1][1] if loss else None,
        "loss_curve": [[u, v] for u, v, _ in loss],
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
