"""Launching children that can never outlive the process that supervises them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time


def die_with_parent(cmd: list[str]) -> list[str]:
    """``cmd`` wrapped so that the kernel SIGKILLs it when its parent dies.

    ``setpriv --pdeathsig`` (util-linux) sets the signal in the child itself, so no Python runs
    between fork and exec: a ``preexec_fn`` would force a plain fork(), whose gRPC fork
    handlers abort the child when the parent's etcd client has threads running.
    """
    return ["setpriv", "--pdeathsig", "KILL", "--", *cmd]


def signal_group(pid: int, sig: int) -> None:
    """Signal a child that leads its own session, and so its descendants too."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass



def wait_listening(host: str, port: int, proc: subprocess.Popen, timeout_s: float) -> str | None:
    """Wait until ``proc`` accepts connections on ``port``; None, or why it did not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return None
        except OSError:
            time.sleep(0.05)
    return f"did not listen on {host}:{port} within {timeout_s:.0f} s"


def kill_and_reap(proc: subprocess.Popen) -> None:
    """SIGKILL a child that leads its own session, with its descendants, and reap it."""
    if proc.poll() is None:
        signal_group(proc.pid, signal.SIGKILL)
    proc.wait()
