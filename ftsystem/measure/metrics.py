"""Every Prometheus metric of ftsystem, in one module (``ftsystem_`` prefix, base units).

Each process exposes the metrics it updates; the others stay at zero. Each process also creates
its labelled series at start (``init_*``): a counter that appears only with its first event
hides that event from ``increase()``, so an alert on the first failure would never fire.

A replica of several ranks exports each of its series once: the replica-level ones (its steps,
stall, loss, epoch changes, catch-up, divergences), which every rank of the replica would count
alike, come from its rank 0 alone (``REPLICA_LEVEL``); the rank-level ones (the rank's own
all-reduce, digest, catch-up bytes and samples) from every rank. No ``_created`` series: a
timestamp per labelled counter and histogram would add as many series as they have, which
neither the dashboards nor the alerts read.
"""

from __future__ import annotations

import functools
import os
from typing import Iterable

from prometheus_client import (REGISTRY, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, start_http_server)
from prometheus_client.metrics_core import Metric

disable_created_metrics()

ENV_METRICS_PORT = "FTSYSTEM_METRICS_PORT"
"""A fixed metrics port for a node: its agent serves on it, the rank of ``LOCAL_RANK`` k on
port + 1 + k (for firewalls and static scrape configs). Unset: free ports, found by discovery."""
ENV_BIND = "FTSYSTEM_BIND"
"""The address metrics endpoints listen on (e.g. 0.0.0.0); unset: the advertised address."""

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                    300.0, 600.0)
"""0.01 s to 600 s: past the 30 s default timeout, so a step or stall that hit it is counted in
a bucket of its own instead of only in +Inf."""

REPLICA_LEVEL = CollectorRegistry(auto_describe=True)
"""The series of a replica that each of its ranks would export alike: only the replica's rank 0
adds them to what its process exposes (``init_replica``). The other ranks still update theirs,
which nobody reads: each call site stays the same on every rank."""

# --- controller ---
REPLICAS = Gauge("ftsystem_replicas", "Registered replicas by state", ["job", "state"])
EPOCH = Gauge("ftsystem_epoch", "Current membership epoch number", ["job"])
EPOCH_MEMBERS = Gauge("ftsystem_epoch_members", "Members of the current epoch", ["job"])
MEMBERSHIP_CHANGES = Counter("ftsystem_membership_changes_total",
                             "Epochs published, by reason", ["job", "reason"])
DECISION_LATENCY = Histogram("ftsystem_membership_decision_seconds",
                             "From a registration change seen to its epoch published",
                             ["job"], buckets=_LATENCY_BUCKETS)
ETTR = Gauge("ftsystem_ettr_ratio", "Effective training time ratio (0 to 1) since this "
             "controller leads, time-based (kind=time) or work-based (kind=work)", ["job", "kind"])
REPLICA_STEP = Gauge("ftsystem_replica_step", "The last step each replica reported to etcd "
                     "(progress is rate-limited: a few seconds behind)", ["job", "replica"])
IS_LEADER = Gauge("ftsystem_controller_is_leader", "1 on the leading controller", ["job"])
MALFORMED_RECORDS = Counter("ftsystem_malformed_records_total",
                            "etcd records skipped because they are not what their writer writes "
                            "(the key is in the reader's log), by job and kind of key",
                            ["job", "kind"])

# --- agent ---
FAILURES_INJECTED = Counter("ftsystem_failures_injected_total",
                            "Chaos orders executed, by action and state", ["job", "action", "state"])
REPLICA_RESTARTS = Counter("ftsystem_replica_restarts_total", "Replica restarts by the agent",
                           ["job", "replica"])

# --- training process: replica-level, from the replica's rank 0 ---
STEPS = Counter("ftsystem_steps_committed_total", "Committed training steps", ["job", "replica"],
                registry=REPLICA_LEVEL)
STEP_DURATION = Histogram("ftsystem_step_duration_seconds", "Wall time per committed step",
                          ["job", "replica"], buckets=_LATENCY_BUCKETS, registry=REPLICA_LEVEL)
FTAR_OVERLAPPED = Counter("ftsystem_ftar_overlapped_steps_total",
                          "Committed steps whose gradients were sent in buckets during backward",
                          ["job", "replica"], registry=REPLICA_LEVEL)
FTAR_FAILURES = Counter("ftsystem_ftar_failures_total",
                        "All-reduce attempts that failed (the replica's vote)",
                        ["job", "replica"], registry=REPLICA_LEVEL)
STALL = Counter("ftsystem_stall_seconds_total",
                "Seconds spent reconfiguring or waiting for an epoch", ["job", "replica"],
                registry=REPLICA_LEVEL)
LOSS = Gauge("ftsystem_training_loss", "Last training loss (rank 0's)", ["job", "replica"],
             registry=REPLICA_LEVEL)
DIVERGENCES = Counter("ftsystem_divergences_total",
                      "Times this replica's state differed from the job's (state digest or "
                      "commit chain), by how it was found", ["job", "replica", "found_by"],
                      registry=REPLICA_LEVEL)
EPOCH_CHANGE = Histogram("ftsystem_epoch_change_seconds",
                         "A member's time to enter a new epoch (reconfigure + state sync)",
                         ["job", "replica", "reason"], buckets=_LATENCY_BUCKETS,
                         registry=REPLICA_LEVEL)
CATCHUP_DURATION = Histogram("ftsystem_catchup_duration_seconds",
                             "From a joiner's start of catch-up to ready", ["job", "replica"],
                             buckets=_LATENCY_BUCKETS, registry=REPLICA_LEVEL)
CATCHUP_STEPS = Counter("ftsystem_catchup_steps_replayed_total",
                        "Logged updates a replica replayed", ["job", "replica"],
                        registry=REPLICA_LEVEL)

# --- training process: rank-level, from every rank ---
FTAR_DURATION = Histogram("ftsystem_ftar_duration_seconds",
                          "Fault-tolerant all-reduce time of this rank's shard",
                          ["job", "replica"], buckets=_LATENCY_BUCKETS)
FINGERPRINT_DURATION = Histogram("ftsystem_fingerprint_seconds",
                                 "Digest of this rank's replicated state and its comparison",
                                 ["job", "replica"], buckets=_LATENCY_BUCKETS)
CATCHUP_BYTES = Counter("ftsystem_catchup_bytes_total",
                        "Bytes this rank of a joiner fetched from donors", ["job", "replica"])
SAMPLES = Counter("ftsystem_samples_total",
                  "Training samples committed, as this rank's commit(samples=) counts them",
                  ["job", "replica"])
RANK_LEVEL = (FTAR_DURATION, FINGERPRINT_DURATION, CATCHUP_BYTES, SAMPLES)

# --- renamed metrics, under their old names too for one release ---
ALIASES_REMOVED_IN = "0.3.0"
"""The release that stops exporting renamed metrics under their old names (docs/operations.md,
"Renamed metrics"); a test fails once ``ftsystem.__version__`` reaches it."""


class _OldName:
    """A collector: ``metric``'s samples again under ``old``, its name before a rename, so that
    dashboards and rules written for the old name keep working until ``ALIASES_REMOVED_IN``."""

    def __init__(self, old: str, metric: Counter | Gauge | Histogram,
                 registry: CollectorRegistry) -> None:
        (family,) = metric.describe()
        self.old, self.metric = old, metric
        self.new = family.name + ("_total" if family.type == "counter" else "")
        self._old_family = old.removesuffix("_total") if family.type == "counter" else old
        registry.register(self)

    def collect(self) -> Iterable[Metric]:
        for family in self.metric.collect():
            alias = Metric(self._old_family, f"Renamed {self.new}, this name goes in "
                           f"{ALIASES_REMOVED_IN}: {family.documentation}", family.type)
            alias.samples = [s._replace(name=self._old_family + s.name.removeprefix(family.name))
                             for s in family.samples]
            yield alias


RENAMED = {alias.old: alias.new for alias in (
    _OldName("ftsystem_ettr", ETTR, REGISTRY),  # a ratio: _ratio
    _OldName("ftsystem_divergence_total", DIVERGENCES, REPLICA_LEVEL),  # a count: plural noun
    _OldName("ftsystem_ftar_overlapped_total", FTAR_OVERLAPPED, REPLICA_LEVEL))}  # of what
"""Old name -> new name of each renamed metric; both are exported until ``ALIASES_REMOVED_IN``."""


def serve(host: str) -> str:
    """Expose this process's metrics (on ``ENV_BIND`` if set, else ``host``; on the port
    ``ENV_METRICS_PORT`` assigns it, else a free one); returns ``host:port`` to advertise."""
    server, _ = start_http_server(metrics_port(os.environ), addr=os.environ.get(ENV_BIND) or host)
    return f"{host}:{server.server_port}"


def metrics_port(env: dict[str, str] | os._Environ) -> int:
    """Pure: this process's metrics port from the node's fixed port, or 0 (a free one)."""
    if not (base := env.get(ENV_METRICS_PORT)):
        return 0
    try:
        port = int(base)
    except ValueError:
        raise ValueError(f"{ENV_METRICS_PORT}={base!r}: expected a port number") from None
    return port + 1 + int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else port


CHAOS_STATES = ("done", "failed")
"""The outcomes an agent records for a chaos order (``ftsystem.chaos.executor``)."""
EPOCH_REASONS = ("start", "join", "removal", "resync")
"""Why an epoch was published (``ftsystem.control.membership``)."""
DIVERGENCE_FINDERS = ("state-digest", "commit-chain")
"""How a divergence was found (``ftsystem.training.integrity``)."""


def init_controller(job: str) -> None:
    """Create the controller's series at zero."""
    from ftsystem.control.membership import ReplicaState
    for state in [s.value for s in ReplicaState] + ["restarting", "down"]:
        REPLICAS.labels(job, state)
    for reason in EPOCH_REASONS:
        MEMBERSHIP_CHANGES.labels(job, reason)
    for kind in ("time", "work"):
        ETTR.labels(job, kind)
    for metric in (EPOCH, EPOCH_MEMBERS, DECISION_LATENCY, IS_LEADER):
        metric.labels(job)


def init_agent(job: str, replica: str) -> None:
    """Create an agent's series at zero."""
    from ftsystem.chaos.spec import ACTIONS
    for action in ACTIONS:
        for state in CHAOS_STATES:
            FAILURES_INJECTED.labels(job, action, state)
    REPLICA_RESTARTS.labels(job, replica)


def init_replica(job: str, replica: str, *, speaks_for_replica: bool) -> None:
    """Create a training process's series at zero: the rank-level ones on every rank, the
    replica-level ones, and their export, on the rank that ``speaks_for_replica`` (rank 0)."""
    for metric in RANK_LEVEL:
        metric.labels(job, replica)
    if not speaks_for_replica:
        return
    for metric in (STEPS, STEP_DURATION, FTAR_OVERLAPPED, FTAR_FAILURES, STALL, LOSS,
                   CATCHUP_DURATION, CATCHUP_STEPS):
        metric.labels(job, replica)
    for found_by in DIVERGENCE_FINDERS:
        DIVERGENCES.labels(job, replica, found_by)
    for reason in EPOCH_REASONS:
        EPOCH_CHANGE.labels(job, replica, reason)
    _export_replica_level()


@functools.cache
def _export_replica_level() -> None:
    """Once per process (a test process may start several replicas)."""
    REGISTRY.register(REPLICA_LEVEL)


# --- HALoS real mode (ftsystem/halos/): served by the GPS, each LPS and each worker ---
_STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
HALOS_UPDATES = Counter("ftsystem_halos_updates_applied_total",
                        "Updates a HALoS server applied: worker pseudo-gradients at an LPS, "
                        "LPS deltas at the GPS", ["job", "server"])
HALOS_MERGES = Counter("ftsystem_halos_merges_total", "Global models an LPS merged",
                       ["job", "server"])
HALOS_EXCHANGE = Histogram("ftsystem_halos_exchange_seconds",
                           "LPS -> GPS round trip: delta sent, global model back",
                           ["job", "server"], buckets=_LATENCY_BUCKETS)
HALOS_STALENESS = Histogram("ftsystem_halos_staleness_updates",
                            "LPS updates between the model a worker started from and the one "
                            "its pseudo-gradient was applied to", ["job", "server"],
                            buckets=_STALENESS_BUCKETS)
HALOS_BYTES = Counter("ftsystem_halos_bytes_total",
                      "Tensor bytes a HALoS node received or sent over HTTP",
                      ["job", "node", "direction"])
HALOS_GLOBAL_LOSS = Gauge("ftsystem_halos_global_loss", "Held-out loss of the global model",
                          ["job"])
HALOS_GLOBAL_UPDATES = Gauge("ftsystem_halos_global_updates",
                             "Global updates applied by the GPS so far", ["job"])
HALOS_WORKER_LOSS = Gauge("ftsystem_halos_worker_loss", "Mean loss of a worker's last local steps",
                          ["job", "worker"])
HALOS_WORKER_PUSHES = Counter("ftsystem_halos_worker_pushes_total",
                              "Pseudo-gradients a worker's LPS acknowledged", ["job", "worker"])
