"""The nodes benchmark's JSON, from its raw measurement (pure), and its tables."""

from __future__ import annotations

import os

from ftsystem.benchmarks.controller.config import (
    KINDS, NODES_TARGET_P99_S, KeepAliveMode, NodesConfig, control_plane_budget, deal)
from ftsystem.benchmarks.controller.stats import summarize_n
from ftsystem.measure.report import print_table

WHILE_FAILING = ("cpu_cores", "keepalive_rtt_s", "max_renew_gap_s", "max_schedule_late_s",
                 "stream_restarts", "writes_per_s", "keepalives_per_s", "window_s")
"""The figures of the window in which leases end that the JSON keeps."""


def nodes_result(cfg: NodesConfig, raw: dict) -> dict:
    """The JSON from the raw measurement (``nodes.measure_nodes``)."""
    steady, samples, failing = raw["steady"], raw["samples"], raw["while_failing"]
    latency = {kind: summarize_n(samples[kind]) for kind in KINDS}
    lost = raw["node_deletes"] - raw["node_revokes"]
    # Sustained: no lease ended that the benchmark did not end, and no renewal was skipped
    # (the longest gap between two renewals of a lease under two node renewal intervals).
    max_gap = max(steady["max_renew_gap_s"], failing["max_renew_gap_s"])
    sustained = lost == 0 and max_gap < 2 * cfg.node_keepalive_s and raw["error"] is None
    meets = sustained and all(v["p99"] is not None and v["p99"] <= NODES_TARGET_P99_S
                              for v in latency.values())
    num_samples = sum(len(samples[kind]) for kind in KINDS)
    return {
        "mode": "nodes",
        "config": _config(cfg),
        "decision_latency_s": latency,
        "join_latency_s": summarize_n(samples["join"]),
        "reaction_s": summarize_n(raw["reaction_s"]) if raw["reaction_s"] else None,
        "epochs": {"expected": 1 + 2 * cfg.num_samples * len(KINDS),
                   "seen": 1 + num_samples + len(samples["join"]),
                   "unexpected": raw["epochs_skipped"]},
        "etcd": {"writes_per_s": steady["writes_per_s"], "puts_per_s": steady["puts_per_s"],
                 "deletes_per_s": steady["deletes_per_s"], "txns_per_s": steady["txns_per_s"],
                 "keepalives_per_s": steady["keepalives_per_s"],
                 "keepalive_requests_per_s": steady["keepalive_requests_per_s"],
                 "keepalive_streams_per_s": steady["keepalive_streams_per_s"],
                 "cpu_us_per_keepalive": steady["etcd_cpu_us_per_keepalive"],
                 "db_size_bytes": raw["db_size_bytes"], "db_in_use_bytes": raw["db_in_use_bytes"],
                 "db_growth_bytes_per_s": steady["db_growth_bytes_per_s"]},
        "budget": control_plane_budget(cfg),
        "load": {"sustained": sustained, "leases_lost": lost,
                 "leases_held": steady["leases_held"],
                 "keepalives_sent_per_s": steady["keepalives_sent_per_s"],
                 "keepalive_rtt_s": steady["keepalive_rtt_s"],
                 "max_renew_gap_s": steady["max_renew_gap_s"],
                 "max_schedule_late_s": steady["max_schedule_late_s"],
                 "keepalive_stream_restarts": steady["stream_restarts"],
                 "cpu_cores": steady["cpu_cores"], "window_s": steady["window_s"],
                 "while_failing": {k: failing[k] for k in WHILE_FAILING}},
        "startup_s": raw["startup_s"], "first_epoch_s": raw["first_epoch_s"],
        "target_p99_s": NODES_TARGET_P99_S, "meets_target": meets, "error": raw["error"],
    }


def _config(cfg: NodesConfig) -> dict:
    return {"nodes": cfg.num_nodes, "replicas": cfg.num_replicas,
            "nodes_per_replica": cfg.nodes_per_replica,
            "processes": len(deal(list(range(cfg.num_replicas)), cfg.num_processes)),
            "keepalive": cfg.keepalive.value,
            "keepalive_streams_per_process": cfg.keepalive_streams
            if cfg.keepalive is KeepAliveMode.BATCHED else None,
            "lease_ttl_s": cfg.lease_ttl_s, "node_lease_ttl_s": cfg.node_lease_ttl_s,
            "node_keepalive_s": cfg.node_keepalive_s,
            "replica_keepalive_s": cfg.replica_keepalive_s,
            "progress_s": cfg.progress_s, "window_s": cfg.window_s,
            "samples_per_kind": cfg.num_samples, "seed": cfg.seed,
            "controller": cfg.controller.value, "etcd": cfg.etcd or "embedded",
            # Inherited by etcd and every process here: a negative one shields the run
            # from other work on a shared machine (see load.cpu_cores.others).
            "nice": os.getpriority(os.PRIO_PROCESS, 0)}


def print_nodes(result: dict) -> None:
    c, e, load = result["config"], result["etcd"], result["load"]

    def row(name: str, s: dict | None) -> tuple:
        if not s or s["p50"] is None:
            return (name, "-", "-", "-", "-", 0)
        return (name, *(1000 * s[k] for k in ("p50", "p99", "mean", "max")), s.get("n", ""))
    print_table(f"controller at node scale: {c['nodes']} node agents, {c['replicas']} replicas, "
                f"{c['processes']} load processes ({c['keepalive']} keep-alives)",
                ["measure", "p50 (ms)", "p99 (ms)", "mean (ms)", "max (ms)", "n"],
                # Short labels: a wrapped one is hard to find in the output.
                [row("node lease end", result["decision_latency_s"][KINDS[0]]),
                 row("reported failure", result["decision_latency_s"][KINDS[1]]),
                 row("agents' reaction", result["reaction_s"]),
                 row("join", result["join_latency_s"]),
                 row("keep-alive rtt", load["keepalive_rtt_s"])])
    print("lease end / reported failure: the lease revoked -> an epoch without the replica "
          "seen; agents' reaction: a node record's DELETE -> the replica lease revoked; join: "
          "registered -> an epoch with it seen; keep-alive rtt: in the steady window")
    b = result["budget"]
    print_table("etcd in steady state", ["writes/s", "(budget)", "keep-alives/s", "(budget)",
                                         "etcd us/keep-alive", "db size (MiB)", "in use (MiB)"],
                [(e["writes_per_s"], b["writes_per_s"], e["keepalives_per_s"],
                  b["keepalives_per_s"], e["cpu_us_per_keepalive"] or 0.0,
                  e["db_size_bytes"] / 2**20, e["db_in_use_bytes"] / 2**20)])
    cores = load["cpu_cores"]
    print_table("CPU (cores) in steady state", list(cores), [tuple(cores.values())])
    others = max(cores["others"], load["while_failing"]["cpu_cores"]["others"])
    if others > 0.25:
        print(f"warning: other processes took {others:.2f} cores of this machine meanwhile: "
              "the figures are skewed; run again on a quiet machine")
    verdict = "meets" if result["meets_target"] else "MISSES"
    print_table("summary", ["startup (s)", "leases lost", "sustained", "target p99 (ms)",
                            "verdict"],
                [(result["startup_s"], load["leases_lost"], str(load["sustained"]),
                  1000 * result["target_p99_s"], verdict)])
    failing = load["while_failing"]
    print(f"keep-alives: at most {max(load['max_renew_gap_s'], failing['max_renew_gap_s']):.2f} s "
          f"between renewals of a lease (node lease renewed every {c['node_keepalive_s']:g} s); "
          f"load generators at most "
          f"{max(load['max_schedule_late_s'], failing['max_schedule_late_s']) * 1000:.0f} ms "
          "late sending one")
