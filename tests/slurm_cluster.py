"""A real Slurm cluster on this machine, for the tests of docker/slurm/.

slurmctld and munged run in one network namespace ("ctl"), and each slurmd in a namespace of
its own (a node, ``n1`` .. ``nN``), all joined by a bridge (``ftsystem.launch.netns``). Each
daemon also gets its own UTS and mount namespaces: its hostname is its node's name, and its
``/etc/hosts`` maps every node's name to its address. Jobs run on the nodes as on a cluster
(the batch script on the first node of the allocation, srun's tasks on every node), and a node
dies as a host does: its link goes down (no TCP reset reaches anyone), then every process in it
is killed.

Needs root, iproute2, util-linux (nsenter, unshare) and Debian's slurm-wlm, slurmctld, slurmd,
slurm-client and munge (``scripts/install.sh --test``). Nothing is read from /etc/slurm or
/etc/munge: the cluster's configuration, munge key and state live in a scratch directory. Every
daemon is started and stopped by its PID; whatever a crashed run left behind (its namespaces,
bridge and scratch directory, named after the PID of the process that made them) is removed
before a new cluster is made.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from ftsystem.launch.netns import Host, HostNetwork, namespace_pids, unique_network_name

NETWORK_PREFIX = "qs"
"""Of the cluster's namespaces and interfaces; no other network of the project starts with q,
so a name with it and a dead creator's PID is a leftover of this module."""
SCRATCH_PREFIX = "ftsystem-slurm-"
"""Of the scratch directory in the temp dir, followed by the network's name."""
COMMANDS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client",
            "scontrol": "slurm-client", "munged": "munge", "nsenter": "util-linux",
            "unshare": "util-linux", "ip": "iproute2"}
"""What the cluster runs, and the Debian package of each."""
START_S = 60.0
"""How long the daemons get to come up and the nodes to register (seconds)."""
STOP_S = 10.0
"""How long a daemon gets to exit after SIGTERM before SIGKILL."""
SLURMD_TIMEOUT_S = 10
"""Slurm marks a node that stops answering DOWN after this (slurm.conf ``SlurmdTimeout``)."""
KILL_WAIT_S = 30
"""A job's processes get this long between SIGTERM and SIGKILL (``KillWait``, Slurm's default):
more than an agent's stop bound (15 s: docs/operations.md, "Stopping an agent")."""

SLURM_CONF = """\
ClusterName=ftsystem-test
SlurmctldHost=ctl({ctl_address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
SlurmctldTimeout=30
MessageTimeout=10
KillWait={kill_wait}
InactiveLimit=0
MpiDefault=none
SwitchType=switch/none
{nodes}
PartitionName=debug Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""
NODE_LINE = "NodeName={name} NodeAddr={address} CPUs={cpus} RealMemory=1000 Gres=gpu:1 State=UNKNOWN"


def missing_commands() -> list[str]:
    """The commands of ``COMMANDS`` not on PATH, each with its package."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [f"{cmd} ({pkg})" for cmd, pkg in COMMANDS.items() if not shutil.which(cmd, path=path)]


def remove_stale_clusters() -> list[str]:
    """Remove what clusters of processes that no longer run left behind: their namespaces (with
    every process in them), interfaces and scratch directories. Returns their network names."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = {m[1] for line in listed.splitlines()
             if (m := re.match(rf"({NETWORK_PREFIX}[0-9a-z]+)-h\d+\b", line))}
    scratch = Path(tempfile.gettempdir())
    names |= {p.name.removeprefix(SCRATCH_PREFIX) for p in scratch.glob(SCRATCH_PREFIX + "*")}
    stale = sorted(name for name in names if not _alive(_creator(name)))
    for name in stale:
        HostNetwork(0, name=name).destroy()
        shutil.rmtree(scratch / f"{SCRATCH_PREFIX}{name}", ignore_errors=True)
    return stale


def _creator(network: str) -> int:
    """The PID in a name of ``unique_network_name``: prefix, PID in base 36, one serial digit."""
    try:
        return int(network[len(NETWORK_PREFIX):-1], 36)
    except ValueError:
        return 0


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class SlurmCluster:
    """munged, slurmctld and ``num_nodes`` slurmd (``n1`` ..), each node with ``cpus`` CPUs and
    one GPU (a stand-in device file: no GPU is used), in one partition. A context manager: on
    exit every daemon is stopped, every process of a job killed, and the namespaces, the bridge
    and the scratch directory removed."""

    def __init__(self, num_nodes: int, *, cpus: int = 2) -> None:
        self.num_nodes, self.cpus = num_nodes, cpus
        self.network = HostNetwork(num_nodes + 1, name=unique_network_name(NETWORK_PREFIX))
        self.root = Path(tempfile.gettempdir()) / f"{SCRATCH_PREFIX}{self.network.name}"
        self.daemons: dict[str, subprocess.Popen] = {}
        """By node name ("ctl-munged", "ctl-slurmctld", "n1" ..): every daemon, by PID."""

    # --- names and addresses ---------------------------------------------------------------

    @property
    def nodes(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.num_nodes + 1)]

    def host(self, node: str) -> Host:
        """The namespace of ``node`` ("ctl" or "n1" ..)."""
        return self.network.hosts[0 if node == "ctl" else int(node.removeprefix("n"))]

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What Slurm's commands need here (and pass on to the jobs they submit)."""
        return {"SLURM_CONF": str(self.conf)}

    @property
    def munge_socket(self) -> Path:
        return self.root / "munge" / "munge.socket"

    # --- life cycle ------------------------------------------------------------------------

    def __enter__(self) -> "SlurmCluster":
        remove_stale_clusters()
        self.network.__enter__()
        try:
            self._write_files()
            self._start("ctl-munged", "ctl", [
                "munged", "--foreground", f"--socket={self.munge_socket}",
                f"--key-file={self.root / 'munge' / 'munge.key'}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
                f"--log-file={self.root / 'log' / 'munged.log'}"])
            self._wait(self.munge_socket.exists, "munged's socket")
            self._start("ctl-slurmctld", "ctl", ["slurmctld", "-D", "-f", str(self.conf)])
            for node in self.nodes:
                self.start_node(node)
            self.wait_idle()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in reversed(list(self.daemons)):  # the nodes, slurmctld, munged
            self._stop(self.daemons.pop(name))
        self.network.destroy()  # kills what jobs left in the namespaces
        shutil.rmtree(self.root, ignore_errors=True)

    def start_node(self, node: str) -> None:
        """(Re)start ``node``'s slurmd; with ``ReturnToService=2`` a DOWN node comes back as
        soon as it registers."""
        (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)
        self._start(node, node, ["slurmd", "-D", "-f", str(self.conf), "-N", node])

    def kill_node(self, node: str) -> None:
        """``node`` dies as a host dies: its link goes down first (its peers get no TCP reset,
        only silence), then every process in it is killed at once."""
        host = self.host(node)
        host.partition()
        for pid in namespace_pids(host.name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.daemons.pop(node).wait(STOP_S)

    def revive_node(self, node: str) -> None:
        """A killed node comes back: its link up, its slurmd started again."""
        self.host(node).heal()
        self.start_node(node)

    def reset(self, timeout: float = 120.0) -> None:
        """Every job cancelled and every node back and idle: what a test starts from, whatever
        the one before it did."""
        for node in self.nodes:
            if node not in self.daemons:
                self.revive_node(node)
        jobs = self.run("squeue", "--noheader", "--format=%i").stdout.split()
        if jobs:
            self.run("scancel", *jobs)
        self.wait_idle(timeout)

    def wait_idle(self, timeout: float = START_S) -> None:
        def idle() -> bool:
            states = self.node_states()
            return len(states) == self.num_nodes and set(states.values()) == {"idle"}
        self._wait(idle, f"nodes {', '.join(self.nodes)} idle", timeout)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False).stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    # --- jobs ------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm command (sinfo, sbatch, scontrol, scancel ...) against this cluster."""
        env = kwargs.pop("env", None) or os.environ
        done = subprocess.run(argv, env={**env, **self.env}, capture_output=True, text=True,
                              timeout=60, **kwargs)
        if check and done.returncode != 0:
            raise AssertionError(f"`{shlex.join(argv)}` exited {done.returncode}:\n"
                                 f"{done.stdout}{done.stderr}")
        return done

    def sbatch(self, *argv: str, env: dict[str, str], cwd: Path) -> int:
        """Submit a batch job; its id."""
        return int(self.run("sbatch", "--parsable", *argv, env=env, cwd=cwd)
                   .stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, BatchHost, NodeList, Comment ..)."""
        out = self.run("scontrol", "show", "job", "--oneliner", str(job_id)).stdout.strip()
        # "Key=value Key2=value with spaces Key3=..": a key is a word before '=' after a space.
        fields = re.split(r" (?=[A-Za-z:/]+=)", out)
        return dict(field.split("=", 1) for field in fields if "=" in field)

    def wait_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """The job's fields once it has ended (left RUNNING, PENDING and COMPLETING)."""
        ended: dict[str, str] = {}

        def done() -> bool:
            ended.update(self.job(job_id))
            return ended["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")
        self._wait(done, f"job {job_id} to end", timeout, poll=0.5)
        return ended

    # --- internals -------------------------------------------------------------------------

    def _write_files(self) -> None:
        for sub in ("etc", "state", "run", "log", "spool", "dev", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged wants the path to its socket open to all
        (self.root / "munge").chmod(0o755)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        addresses = {"ctl": self.host("ctl").address} | {n: self.host(n).address
                                                          for n in self.nodes}
        (self.root / "etc" / "hosts").write_text(
            "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in addresses.items()))
        # No DNS in the namespaces: a lookup gives up at once instead of waiting on one.
        (self.root / "etc" / "resolv.conf").write_text(
            "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        # A GPU as a device file (/dev/null's numbers): with a count-only gres.conf entry the
        # nodes report no GPU and jobs that ask for --gpus-per-node cannot run.
        gpu = self.root / "dev" / "nvidia0"
        subprocess.run(["mknod", str(gpu), "c", "1", "3"], check=True)
        (self.root / "etc" / "gres.conf").write_text(
            "".join(f"NodeName={n} Name=gpu File={gpu}\n" for n in self.nodes))
        self.conf.write_text(SLURM_CONF.format(
            root=self.root, ctl_address=addresses["ctl"], munge_socket=self.munge_socket,
            slurmd_timeout=SLURMD_TIMEOUT_S, kill_wait=KILL_WAIT_S,
            node_list=",".join(self.nodes),
            nodes="\n".join(NODE_LINE.format(name=n, address=addresses[n], cpus=self.cpus)
                            for n in self.nodes)))

    def _start(self, name: str, node: str, argv: list[str]) -> None:
        """``argv`` in ``node``'s namespaces, in the foreground (its PID is the daemon's):
        nsenter joins the node's network namespace, unshare makes its UTS and mount ones (not
        ``ip netns exec``, which remounts /sys, where slurmd then finds no cgroup mount)."""
        setup = (f"hostname {node} && mount --bind {self.root}/etc/hosts /etc/hosts && "
                 f"mount --bind {self.root}/etc/resolv.conf /etc/resolv.conf && exec \"$@\"")
        with open(self.root / "log" / f"{name}.out", "ab") as out:
            self.daemons[name] = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.host(node).name}", "unshare", "--uts",
                 "--mount", "--propagation", "private", "sh", "-c", setup, node, *argv],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_S)

    def _wait(self, predicate, what: str, timeout: float = START_S, poll: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            crashed = [n for n, p in self.daemons.items() if p.poll() is not None]
            if crashed:
                raise RuntimeError(f"{', '.join(crashed)} exited while waiting for {what}; "
                                   f"see {self.root / 'log'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}; "
                                   f"see {self.root / 'log'}")
            time.sleep(poll)
