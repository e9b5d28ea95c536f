"""etcd's rates and everyone's CPU over a window, from a sample taken at each end: etcd's own
Prometheus metrics, the controller's and this process's CPU time, the load generators' reports
and the whole machine's busy time (what other processes take skews the figures)."""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from ftsystem.benchmarks.controller.stats import summarize
from ftsystem.control.store import parse_endpoints


@dataclass(frozen=True, slots=True)
class Sample:
    """One end of a window."""

    at: float
    etcd: dict[str, float]
    """etcd's metrics (``parse_prometheus``)."""
    controller_cpu_s: float
    bench_cpu_s: float
    reports: list[dict]
    """Each load generator's report (``NodeAgents.report``)."""
    machine_busy_s: float


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition: each sample (name with labels) and its value."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def metric(samples: dict[str, float], name: str, label: str = "") -> float:
    """The sum of ``name``'s samples whose labels contain ``label``."""
    return sum(v for k, v in samples.items()
               if (k == name or k.startswith(name + "{")) and label in k)


async def etcd_metrics(url: str) -> dict[str, float]:
    """etcd's own Prometheus metrics, from the first endpoint (metrics are per member)."""
    async with httpx.AsyncClient(base_url=str(parse_endpoints(url)[0]), timeout=30) as client:
        response = await client.get("/metrics")
        response.raise_for_status()
        return parse_prometheus(response.text)


async def sample(url: str, reports: Callable[[], Awaitable[list[dict]]],
                 controller_pid: int | None) -> Sample:
    """etcd's metrics, the CPU times and the load generators' ``reports()``, now."""
    return Sample(time.perf_counter(), await etcd_metrics(url), _proc_cpu_s(controller_pid),
                  time.process_time(), await reports(), _machine_busy_s())


def _machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int | None) -> float:
    """CPU seconds a process has used (user + system), from /proc."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rates(before: Sample, after: Sample) -> dict:
    """Rates over the window between two samples (pure)."""
    dt = after.at - before.at

    def rate(name: str, label: str = "") -> float:
        return (metric(after.etcd, name, label) - metric(before.etcd, name, label)) / dt

    def generators(get: Callable[[dict], float]) -> float:
        return (sum(map(get, after.reports)) - sum(map(get, before.reports))) / dt
    keepalives = rate("etcd_debugging_lease_renewed_total")
    etcd_cpu = rate("process_cpu_seconds_total")
    rtts = [s for r in after.reports for s in r["keepalive"]["rtt_samples"]]
    return {
        "window_s": dt,
        "writes_per_s": rate("etcd_server_proposals_committed_total"),
        "puts_per_s": rate("etcd_mvcc_put_total"), "deletes_per_s": rate("etcd_mvcc_delete_total"),
        "txns_per_s": rate("etcd_mvcc_txn_total"),
        "keepalives_per_s": keepalives,
        "keepalive_requests_per_s": rate("grpc_server_msg_received_total", "LeaseKeepAlive"),
        "keepalive_streams_per_s": rate("grpc_server_started_total", "LeaseKeepAlive"),
        "keepalives_sent_per_s": generators(lambda r: r["keepalive"]["sent"]),
        "db_growth_bytes_per_s": rate("etcd_mvcc_db_total_size_in_use_in_bytes"),
        "etcd_cpu_us_per_keepalive": 1e6 * etcd_cpu / keepalives if keepalives else None,
        "cpu_cores": _cpu_cores(
            etcd=etcd_cpu, controller=(after.controller_cpu_s - before.controller_cpu_s) / dt,
            generators=generators(lambda r: r["cpu_s"]),
            bench=(after.bench_cpu_s - before.bench_cpu_s) / dt,
            machine=(after.machine_busy_s - before.machine_busy_s) / dt),
        "keepalive_rtt_s": summarize(rtts) if rtts else None,
        "max_renew_gap_s": max(r["keepalive"]["max_gap_s"] for r in after.reports),
        "max_schedule_late_s": max(r["keepalive"]["max_late_s"] for r in after.reports),
        "stream_restarts": int(generators(lambda r: r["stream_restarts"]) * dt),
        "leases_held": sum(r["leases_held"] for r in after.reports),
    }


def _cpu_cores(*, etcd: float, controller: float, generators: float, bench: float,
               machine: float) -> dict[str, float]:
    ours = etcd + controller + generators + bench
    return {"etcd": etcd, "controller": controller, "load_generators": generators,
            "bench": bench, "others": max(0.0, machine - ours), "machine": machine}
