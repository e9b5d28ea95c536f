"""``ftsystem bench soak``: what a long job leaves in etcd.

A real ``ftsystem run`` (2 replicas, 10,000 steps by default) against an etcd configured as every
ftsystem deployment configures it (``ftsystem.control.etcd_server``: periodic compaction of the history
older than ``COMPACTION_RETENTION``, a ``QUOTA_BACKEND_BYTES`` quota). etcd's own metrics are read
every few seconds during the run and after it: the database's size on disk and in use, and the
revision (one per write). What etcd keeps is bounded when the database in use stops growing with
steps: progress is rate-limited (``PROGRESS_INTERVAL_S``, once a second per replica), and the
history older than the retention is compacted. The JSON states the bound it checks
(``bound_bytes``) and projects the steady state: writes per second x bytes per write x retention.
"""

from __future__ import annotations

import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional

import typer

from ftsystem.measure import report
from ftsystem.cli import bench_app
from ftsystem.control.etcd_server import COMPACTION_RETENTION, QUOTA_BACKEND_BYTES, EmbeddedEtcd
from ftsystem.launch.launcher import RunConfig, run_job

MODEL_PARAMS = 100_000
"""A small model: etcd sees rate-limited progress (per second, not per step) and epochs, so the
model only sets how long 10,000 steps take."""
BOUND_BYTES = 16 * 1024 ** 2
"""What 2 replicas x 10,000 steps may leave in etcd's database (in use): 0.8 % of the quota."""
SAMPLE_S = 5.0
METRICS = {"db_bytes": "etcd_mvcc_db_total_size_in_bytes",
           "db_in_use_bytes": "etcd_mvcc_db_total_size_in_use_in_bytes",
           "revision": "etcd_debugging_mvcc_current_revision",
           "compacted_revision": "etcd_debugging_mvcc_compact_revision"}


def read_metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                  if line and not line.startswith("#"))
    return {name: float(values.get(metric, "nan")) for name, metric in METRICS.items()}


def retention_s(retention: str) -> float:
    """etcd's periodic retention (``1h``, ``30m``, ``10s``; a bare number is hours)."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0}
    if retention[-1:] in units:
        return float(retention[:-1]) * units[retention[-1]]
    return float(retention) * 3600.0


def summarize(samples: list[dict], *, steps: int, replicas: int, wall_s: float,
              retention: str) -> dict:
    """The JSON from the samples (pure)."""
    first, last = samples[0], samples[-1]
    writes = last["revision"] - first["revision"]
    span = last["t"] - first["t"]
    writes_per_s = writes / span if span > 0 else 0.0
    bytes_per_write = ((last["db_in_use_bytes"] - first["db_in_use_bytes"]) / writes
                       if writes > 0 else 0.0)
    peak = max(s["db_in_use_bytes"] for s in samples)
    return {"replicas": replicas, "steps": steps, "wall_s": wall_s,
            "compaction_retention": retention, "quota_bytes": QUOTA_BACKEND_BYTES,
            "writes": writes, "writes_per_s": writes_per_s,
            "writes_per_step": writes / steps if steps else None,
            "bytes_per_write": bytes_per_write,
            "db_bytes": last["db_bytes"], "db_in_use_bytes": last["db_in_use_bytes"],
            "db_in_use_peak_bytes": peak,
            "steady_state_in_use_bytes": max(bytes_per_write, 0.0) * writes_per_s
            * retention_s(retention),
            "bound_bytes": BOUND_BYTES, "within_bound": peak <= BOUND_BYTES,
            "samples": samples}


def soak(*, replicas: int, steps: int, retention: str, workdir: Path) -> dict:
    server = EmbeddedEtcd(data_dir=workdir / "etcd", compaction_retention=retention).start()
    samples: list[dict] = []
    done = threading.Event()

    def sample() -> None:
        samples.append({"t": time.time(), **read_metrics(server.url)})

    def sample_until_done() -> None:
        while not done.wait(SAMPLE_S):
            sample()
    try:
        sample()
        sampler = threading.Thread(target=sample_until_done, daemon=True)
        sampler.start()
        started = time.time()
        summary = run_job(RunConfig(num_replicas=replicas, num_steps=steps, etcd=server.url,
                                    out_dir=workdir / "run", show_progress=False,
                                    train_args=["--sleep-per-step", "0", "--model-params",
                                                str(MODEL_PARAMS)]))
        wall = time.time() - started
        done.set()
        sampler.join()
        sample()
    finally:
        done.set()
        server.stop()
    if not summary["bitwise_identical"] or summary["steps"] != steps:
        raise RuntimeError(f"the soak run did not finish cleanly: {summary}")
    return summarize(samples, steps=steps, replicas=replicas, wall_s=wall, retention=retention)


@bench_app.command("soak")
def soak_bench(
        replicas: int = typer.Option(2, min=2, help="replicas of the run"),
        steps: int = typer.Option(10_000, min=10, help="steps of the run (1,000 with --quick)"),
        quick: bool = typer.Option(False, help="1,000 steps"),
        retention: str = typer.Option(COMPACTION_RETENTION,
                                      help="etcd's --auto-compaction-retention (periodic)"),
        json_path: Optional[Path] = typer.Option(None, "--json", help="write the results here"),
) -> None:
    """etcd's database after a long run: its size, the writes, the steady state it tends to."""
    steps = 1_000 if quick else steps
    with tempfile.TemporaryDirectory(prefix="ftsystem-soak-") as tmp:
        result = soak(replicas=replicas, steps=steps, retention=retention, workdir=Path(tmp))
    result["machine"] = report.machine()
    mib = 1024 ** 2
    report.print_table(f"soak: {replicas} replicas x {steps} steps, compaction {retention}",
                       ["wall (s)", "writes", "writes/s", "bytes/write", "db (MiB)",
                        "in use (MiB)", "peak in use (MiB)", "steady state (MiB)",
                        "bound (MiB)"],
                       [(result["wall_s"], result["writes"], result["writes_per_s"],
                         result["bytes_per_write"], result["db_bytes"] / mib,
                         result["db_in_use_bytes"] / mib, result["db_in_use_peak_bytes"] / mib,
                         result["steady_state_in_use_bytes"] / mib, BOUND_BYTES / mib)])
    report.write_json(json_path, result)
    if not result["within_bound"]:
        raise typer.Exit(1)
