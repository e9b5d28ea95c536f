"""Nothing a job starts listens on every address of the machine (docs/security.md, "What
listens where"): a real job of 2 replicas x 2 ranks, every listening socket of its processes
read with ``ss`` while it trains."""

from __future__ import annotations

import os
import re
import subprocess
import threading
from pathlib import Path

import pytest

from conftest import descendants
from ftsystem.launch.launcher import RunConfig, run_job

WILDCARDS = ("*", "0.0.0.0", "[::]", "::")
LISTENER = re.compile(r"^\S+\s+\d+\s+\d+\s+(?P<addr>\S+):(?P<port>\d+)\s+\S+\s+users:(?P<users>.*)$")


def _is_rank(pid: int) -> bool:
    """Whether ``pid`` is a training rank (an agent gives each its ``MASTER_PORT``)."""
    try:
        return b"\0MASTER_PORT=" in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _listeners(pids: set[int]) -> set[tuple[str, int, int]]:
    """(address, port, pid) of the TCP sockets ``pids`` listen on."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        if not (m := LISTENER.match(line)):
            continue
        for pid in map(int, re.findall(r"pid=(\d+)", m["users"])):
            if pid in pids:
                found.add((m["addr"], int(m["port"]), pid))
    return found


@pytest.mark.slow
def test_a_jobs_processes_listen_on_their_advertised_address_only(tmp_path):
    cfg = RunConfig(num_replicas=2, nproc_per_node=2, num_steps=60, out_dir=tmp_path / "run",
                    train_args=["--sleep-per-step", "0.1"], show_progress=False)
    summaries: list[dict] = []
    runner = threading.Thread(target=lambda: summaries.append(run_job(cfg)))
    runner.start()
    seen: set[tuple[str, int, int]] = set()
    ranks: set[int] = set()
    while runner.is_alive():  # sampled all run long: ranks open their stores as they start
        found = _listeners(descendants(os.getpid()))
        ranks |= {pid for _, _, pid in found if _is_rank(pid)}
        seen |= found
        runner.join(0.2)
    assert summaries and summaries[0]["bitwise_identical"], summaries
    addresses = {addr for addr, _, _ in seen}
    assert not addresses & set(WILDCARDS), sorted(seen)
    # The sampling saw every rank listening (its state server; rank 0 also the replica's group
    # store and the epochs' rendezvous store), not only etcd, the controllers and the agents.
    assert len(ranks) == 4, sorted(seen)
