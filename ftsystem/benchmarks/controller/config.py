"""The settings of the two controller benchmarks, and the figures derived from them alone (pure).

Imported when the CLI registers ``bench controller``: only the standard library and the
control plane's timeouts, so that listing the commands stays cheap."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path

from ftsystem.control.timeouts import NODE_LEASE_RENEW_S, NODE_LEASE_TTL_S, Timeouts

TARGET_P99_S = 0.1
"""The target of the replicas benchmark: p99 decision latency at most 100 ms at 2,048 replicas."""
FULL_REPLICAS, FULL_REVOKES = 2048, 50
QUICK_REPLICAS, QUICK_REVOKES = 512, 20

NODES_TARGET_P99_S = 0.05
"""The target of the nodes benchmark: p99 decision latency at most 50 ms at 16,384 node agents."""
NODES_FULL_REPLICAS, NODES_FULL_SAMPLES, NODES_FULL_WINDOW_S = 64, 50, 30.0
NODES_QUICK_REPLICAS, NODES_QUICK_SAMPLES, NODES_QUICK_WINDOW_S = 8, 10, 5.0
DEFAULT_PROCESSES = max(2, min(8, os.cpu_count() or 2))
"""One load generator per core: more only add wake-ups, stolen from etcd on a small machine
(measured on 2 cores: node-lease-end p99 36, 66, 82 ms with 2, 4, 8 processes)."""
KINDS = ("node_lease_end", "reported_failure")
"""The two ways a replica's membership ends: a node's lease ends (the node died), or its agent
revokes the replica lease (it reported a failure)."""


class ControllerMode(str, enum.Enum):
    SUBPROCESS = "subprocess"
    IN_PROCESS = "in-process"


class KeepAliveMode(str, enum.Enum):
    BATCHED = "batched"
    PER_CALL = "per-call"


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicasConfig:
    num_replicas: int
    """Simulated replicas registered before the first revoke."""
    num_revokes: int
    """Lease revocations measured, one at a time."""
    etcd: str | None
    """etcd endpoints; None starts an embedded single-node etcd."""
    controller: ControllerMode
    """How the real leader runs: a subprocess, or a task of this process."""
    lease_ttl_s: int = 300
    """Replica lease TTL: long enough that no keep-alive is needed during the run."""
    register_concurrency: int = 128
    """Registrations (grant + put) in flight at once."""
    epoch_timeout_s: float = 120.0
    """How long to wait for an expected epoch before giving up."""
    seed: int = 0
    """Seeds the choice of revoked replicas and the revoke phases relative to the tick."""
    num_scrapes: int = 20
    """Timed GETs of /v1/sd/prometheus and of /metrics (subprocess controller only)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodesConfig:
    num_nodes: int
    """Simulated node agents, each with its own lease; a multiple of ``num_replicas``."""
    num_replicas: int
    num_samples: int
    """Lease ends measured per kind (node lease end, reported failure), one at a time."""
    etcd: str | None
    controller: ControllerMode
    num_processes: int = DEFAULT_PROCESSES
    """Load-generator processes; replicas are dealt over them."""
    keepalive: KeepAliveMode = KeepAliveMode.BATCHED
    """batched: one keep-alive request per lease per interval, sent over long-lived streams
    (``Store.keep_alive`` keeps one open per lease), many requests per write. per-call: one
    stream per keep-alive, as aetcd's ``refresh_lease`` does."""
    lease_ttl_s: int = Timeouts(30.0).lease_ttl_s
    """TTL of the replica lease (``--timeout`` 30 s, the default)."""
    node_lease_ttl_s: int = NODE_LEASE_TTL_S
    node_keepalive_s: float = NODE_LEASE_RENEW_S
    replica_keepalive_s: float = 0.5
    progress_s: float = 1.0
    """Rank 0 rewrites the registration with its step this often (rate-limited, per replica)."""
    window_s: float = NODES_FULL_WINDOW_S
    """Steady state (no failure) over which etcd's write and keep-alive rates are measured."""
    setup_concurrency: int = 32
    """Lease grants and record writes in flight at once, per process."""
    keepalive_streams: int = 64
    """LeaseKeepAlive streams per process (batched): etcd renews a stream's requests in turn."""
    keepalive_tick_s: float = 0.002
    """A process sends each keep-alive when it falls due, coalescing those due within a tick.
    Independent agents' keep-alives arrive spread out: a 50 ms tick's bursts (60 requests at
    once per process) alone raised etcd's p90 write latency from 9 ms to 65 ms (measured)."""
    epoch_timeout_s: float = 120.0
    seed: int = 0
    logs_dir: Path | None = None
    """Keep etcd's data and every process's log here (default: a temporary directory)."""

    @property
    def nodes_per_replica(self) -> int:
        return self.num_nodes // self.num_replicas


def check_nodes_config(cfg: NodesConfig) -> None:
    if cfg.num_replicas < 2 or cfg.num_nodes % cfg.num_replicas:
        raise ValueError(f"--nodes {cfg.num_nodes} is not a multiple of --replicas "
                         f"{cfg.num_replicas} (at least 2): every replica has as many nodes")


def control_plane_budget(cfg: NodesConfig) -> dict[str, float]:
    """What the agents ask of etcd in steady state: keep-alives (served by the etcd leader,
    no raft proposal) and progress writes (each a raft proposal); generations are written only
    when one starts or ends, so not in steady state."""
    return {"keepalives_per_s": (cfg.num_nodes / cfg.node_keepalive_s
                                 + cfg.num_replicas / cfg.replica_keepalive_s),
            "writes_per_s": cfg.num_replicas / cfg.progress_s}


def deal(ids: list[str], num_processes: int) -> list[list[str]]:
    """Replicas dealt round-robin over the processes (whole replicas: a replica's reaction to
    its own node's end stays in one process, as it stays in one replica's agents)."""
    groups = [ids[i::num_processes] for i in range(min(num_processes, len(ids)))]
    return [g for g in groups if g]
