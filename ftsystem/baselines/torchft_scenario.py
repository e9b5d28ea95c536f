"""The torchft 0.2.0 baseline under our failure scenarios: a lighthouse and supervised replicas.

``run_torchft_failover`` SIGKILLs one replica a few times and lets a supervisor restart it, as
torchrun would; ``run_torchft_rejoin`` adds a replica to a running job. Both return raw
timelines (kill or join times, each replica's commits); computing stalls is left to the caller.

Processes: the lighthouse runs as torchft's ``torchft_lighthouse`` binary, each replica as
``python -m ftsystem.baselines.torchft_replica`` in its own session (process group), so that
cleanup can kill whatever a replica started. Logs land in ``workdir``.

What the replicas train (``model_params``, ``batch_size``, ``lr``, ``seed``, ``sleep_per_step``)
is passed on as the replica program's options; a benchmark takes them from the run's spec
(``ftsystem.benchmarks.harness.torchft_training``), so torchft trains what the other systems do.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import ftsystem
from ftsystem.baselines import torchft_replica
from ftsystem.baselines.torchft_replica import BATCH_SIZE, LEARNING_RATE, SEED, progress_path
from ftsystem.control.etcd_server import free_port
from ftsystem.launch.netns import Host, HostNetwork
from ftsystem.launch.procs import kill_and_reap, wait_listening

# How long the lighthouse keeps counting a silent replica as alive. After a SIGKILL the
# survivors' next quorum waits for this expiry whenever the join timeout cannot cut it short
# (e.g. two replicas: one survivor is not a majority of the two heartbeating). torchft's
# default is 5 s; 1 s is 10 manager heartbeats (100 ms), low enough to be fast and high
# enough that a busy, niced process on a shared 2-core machine is not declared dead.
HEARTBEAT_TIMEOUT_MS = 1000
# How long a new quorum waits for heartbeating replicas that have not asked to join: the
# tolerance for stragglers. torchft's slurm example uses 10 s, its lighthouse tests 100 ms.
# 100 ms was tried here: with 4 replicas on 2 cores a replica often arrives later than that,
# is left out, heals from a peer on the next step, and the quorum changes (and the process
# group is rebuilt) nearly every step. At 1 s, equal to the heartbeat timeout, a dead
# replica costs the survivors no more than its heartbeat expiry either way.
JOIN_TIMEOUT_MS = 1000
# How often the lighthouse re-evaluates a pending quorum; it bounds how late a heartbeat
# expiry is noticed. torchft's default is 100 ms; the tick is cheap.
QUORUM_TICK_MS = 20
# Replicas may train alone: the baseline must keep stepping on any survivor.
MIN_REPLICAS = 1

# How many commits every replica must have before a kill: training is underway.
WARMUP_COMMITS = 3
# Steps trained together after the victim's last rejoin, when the run waits for it.
TAIL_STEPS = 3
POLL_S = 0.05
STDERR_TAIL_CHARS = 4000


@dataclass(frozen=True, kw_only=True, slots=True)
class LighthouseSettings:
    """The lighthouse's timing flags; None leaves a flag out, so the binary's default applies
    (``LighthouseSettings.torchft_defaults()``: every flag left to torchft)."""

    heartbeat_timeout_ms: Optional[int] = HEARTBEAT_TIMEOUT_MS
    join_timeout_ms: Optional[int] = JOIN_TIMEOUT_MS
    quorum_tick_ms: Optional[int] = QUORUM_TICK_MS

    @classmethod
    def torchft_defaults(cls) -> "LighthouseSettings":
        return cls(heartbeat_timeout_ms=None, join_timeout_ms=None, quorum_tick_ms=None)

    def flags(self) -> list[str]:
        return [arg for name in ("heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms")
                if (value := getattr(self, name)) is not None
                for arg in (f"--{name}", str(value))]

    def effective(self) -> dict[str, object]:
        """Each value the lighthouse runs with, and whether it is torchft's default."""
        defaults = lighthouse_defaults()
        out: dict[str, object] = {}
        for name in ("heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
            value = getattr(self, name)
            out[name] = defaults.get(name) if value is None else value
        out["min_replicas"] = MIN_REPLICAS
        out["left_to_torchft_default"] = sorted(
            name for name in ("heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms")
            if getattr(self, name) is None)
        return out


def lighthouse_defaults() -> dict[str, int]:
    """The installed ``torchft_lighthouse``'s flag defaults, read from its ``--help`` (torchft
    0.2.0: heartbeat_timeout_ms 5000, join_timeout_ms 60000, quorum_tick_ms 100)."""
    binary = lighthouse_binary()
    if binary is None:
        return {}
    text = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    # "--heartbeat_timeout_ms <heartbeat-timeout-ms>\n   How long ... [default: 5000]"
    defaults = {}
    for option in re.split(r"\n\s*(?=--)", text):
        found = re.match(r"--(\w+) <[^>]+>.*?\[default: (\d+)\]", option, re.S)
        if found:
            defaults[found.group(1)] = int(found.group(2))
    return defaults


def manager_defaults() -> dict[str, float]:
    """torchft's own ``Manager`` defaults, read from the installed constructor's signature
    (torchft 0.2.0 ``manager.py``: timeouts 60 s, heartbeat_interval 100 ms)."""
    from torchft import Manager
    params = inspect.signature(Manager.__init__).parameters
    out: dict[str, float] = {}
    for name in ("timeout", "quorum_timeout", "connect_timeout"):
        out[f"{name}_s"] = params[name].default.total_seconds()
    out["heartbeat_interval_ms"] = params["heartbeat_interval"].default.total_seconds() * 1000
    return out


def torchft_settings(lighthouse: Optional[LighthouseSettings] = None, *,
                     batch_size: int = BATCH_SIZE, lr: float = LEARNING_RATE
                     ) -> dict[str, object]:
    """Every torchft setting the baseline runs with, for the benchmark's record."""
    if lighthouse is None:
        settings = {"heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
                    "join_timeout_ms": JOIN_TIMEOUT_MS, "quorum_tick_ms": QUORUM_TICK_MS,
                    "min_replicas": MIN_REPLICAS}
    else:
        settings = lighthouse.effective()
    return {"lighthouse": settings,
            "manager": torchft_replica.manager_settings(batch_size=batch_size, lr=lr)}


def lighthouse_binary() -> Optional[str]:
    """Path of torchft's ``torchft_lighthouse``, also when the venv is not on ``PATH``."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("torchft_lighthouse", path=search)


def _replica_env(lighthouse_addr: str) -> dict[str, str]:
    """The replicas' environment: the lighthouse as torchft expects it, and our package."""
    # Replicas run with cwd=workdir; a checkout that is not pip-installed must still import.
    package_root = str(Path(ftsystem.__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse_addr, PYTHONPATH=pythonpath,
                OMP_NUM_THREADS="1")


def replica_file(workdir: Path, index: int, generation: int, suffix: str) -> Path:
    """A file of generation ``generation`` of replica ``index`` (``.log``: its output,
    ``.json``: its result)."""
    return workdir / f"replica{index}_gen{generation}{suffix}"


_REPLICA_LOG = re.compile(r"replica(\d+)_gen(\d+)\.log")


def commit_timelines(workdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Each replica's commits (by index), every generation's in turn, from the progress
    files the replicas of a run in ``workdir`` appended; a result holds its last generation's
    only."""
    generations: dict[int, list[int]] = {}
    for path in workdir.glob("replica*_gen*.log"):
        if found := _REPLICA_LOG.fullmatch(path.name):
            generations.setdefault(int(found[1]), []).append(int(found[2]))
    return {str(index): [commit for generation in sorted(started) for commit in _read_progress(
                progress_path(replica_file(workdir, index, generation, ".json")))]
            for index, started in sorted(generations.items())}


def _read_progress(path: Path) -> list[tuple[int, float]]:
    """The ``(step, unix_time)`` commits a replica has appended so far."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [(int(step), float(t)) for step, t in (line.split() for line in lines if line)]


def _stderr_tail(path: Path) -> str:
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - STDERR_TAIL_CHARS))
        return f.read().decode(errors="replace")


@dataclass(kw_only=True, slots=True)
class _Replica:
    """A supervised replica: its current process and how many times it was started."""

    index: int
    workdir: Path
    argv: list[str]
    env: dict[str, str]
    generation: int = -1
    proc: Optional[subprocess.Popen] = None
    killed_by_us: bool = False
    niceness: int = 0
    """CPU priority offset (``nice``) of this replica's processes."""
    down_until: float = 0.0
    """Unix time before which a killed replica is not restarted (its host is down)."""
    host: Optional[Host] = None
    """The emulated host (network namespace) this replica runs in; None: loopback."""
    cut: bool = False
    """Its host's link is down (a silent host death): it comes back up at the next start."""

    def path(self, suffix: str, generation: Optional[int] = None) -> Path:
        generation = self.generation if generation is None else generation
        return replica_file(self.workdir, self.index, generation, suffix)

    def start(self) -> None:
        """Start the next generation of this replica, as torchrun would after a failure."""
        self.generation += 1
        self.killed_by_us = False
        args = self.argv + ["--replica", str(self.index), "--generation", str(self.generation),
                            "--out", str(self.path(".json"))]
        if self.niceness:
            args = ["nice", "-n", str(self.niceness), *args]
        if self.host is not None:
            if self.cut:  # the host reboots: its link first
                self.host.heal()
                self.cut = False
            args = in_host(self.host, args)
        with self.path(".log").open("wb") as log:
            self.proc = subprocess.Popen(args, env=self.env, cwd=self.workdir, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def commits(self, generation: Optional[int] = None) -> list[tuple[int, float]]:
        """Commits of ``generation`` (the current one by default) so far."""
        return _read_progress(progress_path(self.path(".json", generation)))

    def rejoin_times(self) -> list[Optional[float]]:
        """Unix time of the first commit of each restarted generation (None: it never did)."""
        firsts = (self.commits(g) for g in range(1, self.generation + 1))
        return [commits[0][1] if commits else None for commits in firsts]

    def finished(self) -> bool:
        return self.proc is not None and self.proc.poll() == 0

    def result(self) -> dict:
        return json.loads(self.path(".json").read_text())


@dataclass(kw_only=True, slots=True)
class _Cluster:
    """A torchft lighthouse and supervised replica processes; closing kills them all."""

    workdir: Path
    replica_argv: list[str]
    timeout_s: float
    replicas: dict[int, _Replica] = field(default_factory=dict)
    crashed: list[dict] = field(default_factory=list)
    lighthouse: Optional[subprocess.Popen] = None
    lighthouse_addr: str = ""
    deadline: float = 0.0
    lighthouse_settings: Optional[LighthouseSettings] = None
    """The lighthouse's timing flags; None: this module's constants."""
    network: Optional[HostNetwork] = None
    """Replica ``i`` runs in ``network.hosts[i]`` (the lighthouse stays on the bridge's side);
    None: everything on loopback."""

    def __enter__(self) -> "_Cluster":
        self.deadline = time.monotonic() + self.timeout_s
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_lighthouse()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_lighthouse(self) -> None:
        binary = lighthouse_binary()
        if binary is None:
            raise FileNotFoundError("torchft_lighthouse not found: install torchft==0.2.0")
        port = free_port()
        cmd = [binary, "--bind", f"[::]:{port}", "--min_replicas", str(MIN_REPLICAS),
               *(self.lighthouse_settings or LighthouseSettings()).flags()]
        with (self.workdir / "lighthouse.log").open("wb") as log:
            self.lighthouse = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)
        problem = wait_listening("localhost", port, self.lighthouse, timeout_s=30)
        if problem is not None:
            raise RuntimeError(f"torchft_lighthouse {problem}")
        where = "localhost" if self.network is None else self.network.bridge_address
        self.lighthouse_addr = f"http://{where}:{port}"

    def add_replica(self, index: int, niceness: int = 0) -> _Replica:
        """Start replica ``index`` under supervision."""
        host = None if self.network is None else self.network.hosts[index]
        env = _replica_env(self.lighthouse_addr)
        if host is not None:
            env[torchft_replica.ENV_HOST] = host.address
        replica = _Replica(index=index, workdir=self.workdir, argv=self.replica_argv, env=env,
                           niceness=niceness, host=host)
        self.replicas[index] = replica
        replica.start()
        return replica

    def supervise(self) -> None:
        """Restart every replica that exited with an error; record those we did not kill."""
        for replica in self.replicas.values():
            code = replica.proc.poll()
            if code is None or code == 0:
                continue
            if replica.killed_by_us and time.time() < replica.down_until:
                continue  # its host is still down
            if not replica.killed_by_us:
                self.crashed.append({
                    "replica": replica.index, "generation": replica.generation,
                    "returncode": code, "time": time.time(),
                    "stderr_tail": _stderr_tail(replica.path(".log"))})
            replica.start()

    def wait_until(self, done: Callable[[], bool], what: str) -> None:
        """Supervise until ``done()``; fail at the scenario's deadline."""
        while not done():
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"torchft scenario: timed out waiting for {what} "
                                   f"(logs in {self.workdir})")
            self.supervise()
            time.sleep(POLL_S)

    def kill(self, index: int, down_s: float = 0.0) -> float:
        """SIGKILL replica ``index``'s process group (its whole process tree, at once: it leads
        its own session); it is restarted ``down_s`` later, at the earliest. In an emulated
        host, the host's link goes down first: a dead host sends no reset and no FIN, so its
        peers learn of the death from silence. Returns the unix time of the kill (the cut)."""
        replica = self.replicas[index]
        replica.killed_by_us = True
        kill_time = time.time()
        if replica.host is not None:
            replica.host.partition()
            replica.cut = True
        replica.down_until = kill_time + down_s
        kill_and_reap(replica.proc)
        return kill_time

    def all_finished(self) -> bool:
        return all(r.finished() for r in self.replicas.values())

    def results(self) -> list[dict]:
        """The result of each replica's final generation, by replica index."""
        return [self.replicas[i].result() for i in sorted(self.replicas)]

    def close(self) -> None:
        for replica in self.replicas.values():
            if replica.proc is not None:
                kill_and_reap(replica.proc)
        if self.lighthouse is not None:
            kill_and_reap(self.lighthouse)


def in_host(host: Host, cmd: list[str]) -> list[str]:
    """``cmd`` run in ``host``, under a hostname of its own: the host's address. torchft's HTTP
    checkpoint transport advertises ``socket.gethostname()``, which on an emulated host would
    resolve to loopback, as the machine's name does (pure)."""
    return host.wrap(["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                      host.address, *cmd])


def replica_command(*, steps: int, model_params: Optional[int], sleep_per_step: float,
                    batch_size: int = BATCH_SIZE, lr: float = LEARNING_RATE, seed: int = SEED,
                    last_step_file: Optional[Path] = None) -> list[str]:
    """A replica's command line but for the options its supervisor adds per start (pure)."""
    argv = [sys.executable, "-m", "ftsystem.baselines.torchft_replica", "--steps", str(steps),
            "--sleep-per-step", str(sleep_per_step), "--batch-size", str(batch_size),
            "--lr", str(lr), "--seed", str(seed)]
    if model_params is not None:
        argv += ["--model-params", str(model_params)]
    if last_step_file is not None:
        argv += ["--last-step-file", str(last_step_file)]
    return argv


def _write_last_step(path: Path, step: int) -> None:
    """Tell every replica the step to end at (atomically: none reads half a number)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(step))
    tmp.replace(path)


def _latest_step(cluster: "_Cluster") -> int:
    return max((c[-1][0] for r in cluster.replicas.values() if (c := r.commits())), default=0)


def _warmed_up(cluster: _Cluster) -> bool:
    return all(len(r.commits()) >= WARMUP_COMMITS for r in cluster.replicas.values())


def run_torchft_failover(*, num_replicas: int = 4, num_failures: int, steps: int,
                         model_params: Optional[int], workdir: Path, kill_interval_s: float,
                         victim: int = 1, sleep_per_step: float = 0.0,
                         batch_size: int = BATCH_SIZE, lr: float = LEARNING_RATE,
                         seed: int = SEED, timeout_s: float = 600.0, down_s: float = 0.0,
                         lighthouse: Optional[LighthouseSettings] = None,
                         until_rejoined: bool = False,
                         network: Optional[HostNetwork] = None) -> dict:
    """Train ``num_replicas`` torchft replicas and SIGKILL ``victim`` ``num_failures`` times.
    With ``network`` (at least ``num_replicas`` hosts), each replica runs in a host of its own
    and a kill is a silent host death (``_Cluster.kill``).

    A kill SIGKILLs the victim's whole process group at once (the replica leads its own
    session), as a host dying with it would; the victim is restarted ``down_s`` after the kill
    (0: at once, as torchrun would), as a host that reboots. ``lighthouse`` sets the
    lighthouse's timing flags (None: this module's constants;
    ``LighthouseSettings.torchft_defaults()``: torchft's own defaults).

    The first kill comes ``kill_interval_s`` after every replica has committed a few steps;
    each later one ``kill_interval_s`` after the previous kill, but never before the restarted
    victim has committed a step (it has healed and rejoined the quorum). Kills stop early if
    the victim finishes training first. With ``until_rejoined``, the replicas train on past
    ``steps`` until the victim has rejoined after its last kill, and ``TAIL_STEPS`` more: the
    run ends on that event, not on a step count that a slow restart could outlast (the
    survivors gone, the victim would train alone). Returns ``failures`` (unix kill times),
    ``rejoins`` (unix time of each restarted victim generation's first commit), ``results``
    (each replica's final-generation result), ``crashed`` (replicas that failed without being
    killed, with their output's tail) and ``settings``.
    """
    if not 0 <= victim < num_replicas:
        raise ValueError(f"victim {victim} is not one of the {num_replicas} replicas")
    failures: list[float] = []
    last_step_file = workdir / "last_step" if until_rejoined else None
    argv = replica_command(steps=steps, model_params=model_params, sleep_per_step=sleep_per_step,
                           batch_size=batch_size, lr=lr, seed=seed, last_step_file=last_step_file)
    with _Cluster(workdir=workdir, replica_argv=argv, timeout_s=timeout_s,
                  lighthouse_settings=lighthouse, network=network) as cluster:
        for index in range(num_replicas):
            cluster.add_replica(index)
        cluster.wait_until(lambda: _warmed_up(cluster), "all replicas to commit")
        target = cluster.replicas[victim]
        last = time.time()
        for _ in range(num_failures):
            cluster.wait_until(lambda: target.finished() or (
                bool(target.commits()) and time.time() >= last + kill_interval_s),
                "the victim to rejoin")
            if target.finished():
                break
            last = cluster.kill(victim, down_s)
            failures.append(last)
        if last_step_file is not None:
            killed = target.generation if failures else -1
            cluster.wait_until(lambda: target.generation > killed and bool(target.commits()),
                               "the victim to rejoin")
            _write_last_step(last_step_file, max(steps, _latest_step(cluster) + TAIL_STEPS))
        cluster.wait_until(cluster.all_finished, "all replicas to finish")
        return {"failures": failures, "rejoins": target.rejoin_times(),
                "results": cluster.results(), "crashed": cluster.crashed,
                "settings": torchft_settings(lighthouse, batch_size=batch_size, lr=lr)}


def run_torchft_rejoin(*, num_replicas: int = 2, steps: int, model_params: Optional[int],
                       workdir: Path, sleep_per_step: float = 0.0,
                       batch_size: int = BATCH_SIZE, lr: float = LEARNING_RATE, seed: int = SEED,
                       timeout_s: float = 600.0, joiner_niceness: int = 0,
                       wait_to_join: Callable[[Callable[[], list]], None] = lambda _: None
                       ) -> dict:
    """Train ``num_replicas`` torchft replicas, then start one more once
    ``wait_to_join`` returns (given a function reading replica 0's commits so far).

    The joiner (index ``num_replicas``) heals from a peer inside a quorum step, so the
    members' commits around ``join_started`` show the join stall. Returns ``join_started``
    (unix time the joiner was launched), ``time_to_join`` (seconds until its first commit),
    ``results``, ``crashed`` and ``settings``.
    """
    argv = replica_command(steps=steps, model_params=model_params, sleep_per_step=sleep_per_step,
                           batch_size=batch_size, lr=lr, seed=seed)
    with _Cluster(workdir=workdir, replica_argv=argv, timeout_s=timeout_s) as cluster:
        for index in range(num_replicas):
            cluster.add_replica(index)
        cluster.wait_until(lambda: _warmed_up(cluster), "all replicas to commit")
        wait_to_join(cluster.replicas[0].commits)
        join_started = time.time()
        joiner = cluster.add_replica(num_replicas, joiner_niceness)
        cluster.wait_until(cluster.all_finished, "all replicas to finish")
        results = cluster.results()
        first = results[joiner.index]["commits"]
        return {"join_started": join_started,
                "time_to_join": first[0][1] - join_started if first else None,
                "results": results, "crashed": cluster.crashed,
                "settings": torchft_settings(batch_size=batch_size, lr=lr)}
