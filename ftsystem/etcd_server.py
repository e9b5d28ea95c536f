"""The embedded single-node etcd: ``ftsystem etcd`` and the default of ``ftsystem run``."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ftsystem.procs import die_with_parent, wait_listening

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(kw_only=True)
class EmbeddedEtcd:
    """A single-node etcd on loopback, tuned for fast failure detection (short heartbeats)."""

    data_dir: Path | None = None
    """Where etcd keeps its data; a fresh temporary directory when None."""
    port: int = 0
    """Client port; a free one when 0."""
    name: str = "ftsystem"
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, wait_s: float = 15.0) -> "EmbeddedEtcd":
        binary = etcd_binary()
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="ftsystem-etcd-"))
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        if self.port and not _port_free(self.port):
            raise EtcdStartError(f"port {self.port} is in use (another etcd?): pick another "
                                 "with --port, or pass that etcd's URL with --etcd")
        self.port = self.port or free_port()
        peer = free_port()
        cmd = [binary, "--name", self.name, "--data-dir", str(self.data_dir),
               "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
               "--listen-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
               "--initial-cluster", f"{self.name}=http://127.0.0.1:{peer}",
               "--heartbeat-interval", "25", "--election-timeout", "250",
               "--log-level", "error"]
        log_path = Path(self.data_dir) / "etcd.log"
        with open(log_path, "ab") as log:  # the child keeps its own fd
            self.process = subprocess.Popen(die_with_parent(cmd), stdout=subprocess.DEVNULL,
                                            stderr=log)
        self._wait_ready(wait_s, log_path)
        return self

    def _wait_ready(self, wait_s: float, log_path: Path) -> None:
        problem = wait_listening("127.0.0.1", self.port, self.process, wait_s)
        if problem is not None:
            self.stop()
            raise EtcdStartError(f"etcd {problem}: {log_path.read_text()[-2000:]}")

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
