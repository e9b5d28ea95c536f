"""The embedded single-node etcd: ``ftsystem etcd`` and the default of ``ftsystem run``."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ftsystem.control.etcd_tls import ServerTls
from ftsystem.launch.procs import die_with_parent, wait_listening

ETCD_BIN_ENV = "FTSYSTEM_ETCD_BIN"
DEFAULT_ETCD_BIN = "/usr/bin/etcd"


class EtcdNotInstalledError(RuntimeError):
    pass


class EtcdStartError(RuntimeError):
    """etcd could not be started (port taken, bad data directory): the message says why."""


def etcd_binary() -> str:
    candidate = os.environ.get(ETCD_BIN_ENV) or shutil.which("etcd") or DEFAULT_ETCD_BIN
    if not Path(candidate).is_file():
        raise EtcdNotInstalledError(
            f"etcd binary not found at {candidate}: install it (Debian: `apt-get install "
            f"etcd-server`) or point {ETCD_BIN_ENV} at an etcd 3.4+ binary")
    return candidate


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as etcd does: TIME_WAIT is ok
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


LOWEST_PICKED_PORT = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, for a service started next.

    Picked below the kernel's ephemeral range, at random: the kernel hands out ports of that
    range as the source ports of outgoing connections, so a port it picked for us (bind to 0,
    close) can be taken by any process's next connection before the service binds it. Below
    the range only another explicit bind can take it. Never the same port twice per process.
    """
    high = _ephemeral_low()
    if high - LOWEST_PICKED_PORT < 1000:  # an unusual range: let the kernel pick
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = random.randrange(LOWEST_PICKED_PORT, high)
        if port not in _HANDED_OUT and _port_free(port):
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError(f"no free port between {LOWEST_PICKED_PORT} and {high}: is something "
                       "holding thousands of ports?")


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (Linux's default 32768)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


COMPACTION_RETENTION = "1h"
"""etcd compacts the key history older than this (``--auto-compaction-retention``, periodic).
Every progress write keeps its old revision until compacted: without it the database only
grows (about 26 KB/s at 64 replicas, ``docs/scale.md``). An hour is far longer than any watch
needs to resume after an outage, and holds about 95 MB of history at that rate."""
QUOTA_BACKEND_BYTES = 2 * 1024 ** 3
"""etcd's space quota (its default, 2 GiB, set explicitly so that every deployment sizes its
volume past it): beyond it etcd raises a NOSPACE alarm and refuses writes."""


@dataclass(kw_only=True)
class EmbeddedEtcd:
    """An etcd on loopback (and ``host``), tuned for fast failure detection (short heartbeats).

    It listens on 127.0.0.1 and on ``host`` only, never on every address: its clients and its
    peers reach it at ``host``. With ``tls`` it serves https:// to clients that present a
    certificate of ``tls.client_ca`` (and its peers likewise); without, plain http://.
    Alone it is a single-node etcd; :class:`EtcdCluster` makes several of them one cluster.
    """

    data_dir: Path | None = None
    """Where etcd keeps its data; a fresh temporary directory when None."""
    port: int = 0
    """Client port; a free one when 0."""
    name: str = "ftsystem"
    host: str = "127.0.0.1"
    """The address it advertises; it listens there and on loopback."""
    peer_port: int = 0
    """Port for its cluster peers; a free one when 0."""
    initial_cluster: str = ""
    """``name=peer-url,...`` of every member; empty: a cluster of this member alone."""
    compaction_retention: str = COMPACTION_RETENTION
    quota_bytes: int = QUOTA_BACKEND_BYTES
    tls: ServerTls | None = None
    """Certificates: serve TLS and require client certificates; None: plain http."""
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.peer_port}"

    def start(self, *, wait_s: float = 15.0) -> "EmbeddedEtcd":
        # A restart reuses the old port. No reconnecting client can hold it as a source port
        # meanwhile: free_port picks below the ephemeral range, as etcd's default 2379 is.
        self.launch()
        self.wait_ready(wait_s)
        return self

    def launch(self) -> None:
        """Start the process without waiting for it to serve (cluster members start together)."""
        binary = etcd_binary()
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="ftsystem-etcd-"))
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        if self.port and self.process is None and not _port_free(self.port):
            raise EtcdStartError(f"port {self.port} is in use (another etcd?): pick another "
                                 "with --port, or pass that etcd's URL with --etcd")
        self.port = self.port or free_port()
        self.peer_port = self.peer_port or free_port()
        with open(self.log_path, "ab") as log:  # the child keeps its own fd
            self.process = subprocess.Popen(die_with_parent(self._command(binary)),
                                            stdout=subprocess.DEVNULL, stderr=log)

    def _command(self, binary: str) -> list[str]:
        if self.host in ("0.0.0.0", "::", ""):
            raise EtcdStartError(f"host {self.host!r} would listen on every address: give the "
                                 "one address clients and peers reach this etcd at")
        listen = ",".join(dict.fromkeys([f"{self.scheme}://127.0.0.1:{self.port}", self.url]))
        return [binary, "--name", self.name, "--data-dir", str(self.data_dir),
                "--listen-client-urls", listen, "--advertise-client-urls", self.url,
                "--listen-peer-urls", self.peer_url,
                "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}",
                "--heartbeat-interval", "25", "--election-timeout", "250",
                "--auto-compaction-mode", "periodic",
                "--auto-compaction-retention", self.compaction_retention,
                "--quota-backend-bytes", str(self.quota_bytes),
                "--log-level", "error", *(self.tls.flags() if self.tls else [])]

    @property
    def log_path(self) -> Path:
        return Path(self.data_dir) / "etcd.log"

    def wait_ready(self, wait_s: float = 15.0) -> None:
        problem = wait_listening("127.0.0.1", self.port, self.process, wait_s)
        if problem is not None:
            self.stop()
            raise EtcdStartError(f"etcd {problem}: {self.log_path.read_text()[-2000:]}")

    def kill(self) -> None:
        """SIGKILL, as a crash would (the data directory stays: :meth:`launch` rejoins)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "EmbeddedEtcd":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(kw_only=True)
class EtcdCluster:
    """``size`` embedded members forming one cluster (3 survives the loss of one)."""

    size: int = 3
    data_dir: Path
    host: str = "127.0.0.1"
    tls: ServerTls | None = None
    members: list[EmbeddedEtcd] = field(default_factory=list, init=False)

    @property
    def url(self) -> str:
        """Every member's client URL, comma-separated (what ``--etcd`` takes)."""
        return ",".join(m.url for m in self.members)

    def start(self, *, wait_s: float = 20.0) -> "EtcdCluster":
        self.members = [EmbeddedEtcd(data_dir=Path(self.data_dir) / f"m{i}", name=f"m{i}",
                                     host=self.host, port=free_port(), peer_port=free_port(),
                                     tls=self.tls)
                        for i in range(self.size)]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        try:
            for member in self.members:
                member.initial_cluster = cluster
                member.launch()
            for member in self.members:
                member.wait_ready(wait_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
