"""Replicas of several ranks (FSDP2 inside each replica, FTAR per shard index), end to end:
2 replicas x 2 ranks on CPU under real agents, a real etcd and controller, real Gloo groups."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import wait_for
from ftsystem.chaos.faults import FaultPoint
from ftsystem.control.etcd_server import free_port
from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job
from ftsystem.measure import metrics


def test_a_killed_rank_restarts_its_replica_which_catches_up_shard_by_shard(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("FTSYSTEM_WARM_UP", "1")  # the GPU's default, asked for on the CPU
    # --kill-at hits the last rank of a replica only: rank 1 of r1 dies at step 15, the agent
    # takes down rank 0 and restarts both. Later a failed all-reduce on one rank of r0 makes
    # the replica's vote fail: neither of its shards may commit that step.
    controller = free_port()
    cfg = RunConfig(num_replicas=2, nproc_per_node=2, num_steps=80, out_dir=tmp_path / "run",
                    kills=[ReplicaKill(1, FaultPoint(15)),
                           ReplicaKill(0, FaultPoint(60, "fail-allreduce"))],
                    train_args=["--sleep-per-step", "0.1"], timeout_s=12, show_progress=False,
                    controller_ports=[controller])
    summaries: list[dict] = []
    runner = threading.Thread(target=lambda: summaries.append(run_job(cfg)))
    runner.start()
    try:
        # While r0 trains: what Prometheus would find and scrape of its two ranks.
        found = wait_for(lambda: _scrape_ranks(f"http://127.0.0.1:{controller}", cfg.out_dir,
                                               "r0"), 120, "r0's ranks to serve a step")
    finally:
        runner.join(240)
    assert summaries, "the job did not end in time"
    summary = summaries[0]
    results = {p.stem: json.loads(p.read_text()) for p in (cfg.out_dir / "results").glob("*.json")}

    assert [(f["replica"], f["step"]) for f in summary["failures"]] == [("r1", 15)]
    assert results["r1"]["generation"] == 1  # rank 0 was not killed, yet restarted with rank 1
    assert summary["steps"] == 80 and summary["agents_ok"]
    # Each rank of the restarted replica loaded its own shard from the same rank of the donor,
    # while the donor trained on (a snapshot plus logged updates), before joining; its ranks
    # first computed a warm-up step together, thrown away.
    for rank, stats in enumerate(results["r1"]["shard_catchup"]):
        assert stats["donors"] == ["r0"], (rank, stats)
        assert stats["bytes"] > 0 and stats["snapshot_step"] >= 15, (rank, stats)
        assert stats["warm_up_s"] > 0, (rank, stats)
    joined = [e for e in results["r1"]["epochs"] if e["reason"] == "join"]
    assert joined and joined[0]["members"] == ["r0", "r1"]
    # The vote: r0's failed all-reduce at step 60 asked for a new epoch, nobody committed
    # step 61 twice or diverged.
    assert any(e["reason"] == "resync" for e in results["r0"]["epochs"]), results["r0"]["epochs"]
    shards = [results[r]["shard_hashes"] for r in ("r0", "r1")]
    assert shards[0] == shards[1] and len(set(shards[0])) == 2, shards
    assert summary["bitwise_identical"]

    # The replica's series come once, from its rank 0; each rank exports its own rank-level
    # ones; no creation timestamps. Both ranks and their agent carry their machine as `host`.
    labels, texts = found
    replica_level = {f.name for f in metrics.REPLICA_LEVEL.collect()}
    rank_level = {m.describe()[0].name for m in metrics.RANK_LEVEL}
    exported = {rank: _exported(text) for rank, text in texts.items()}
    assert replica_level | rank_level <= exported["0"]
    assert rank_level <= exported["1"] and not replica_level & exported["1"]
    assert not any("_created" in text for text in texts.values())
    machine = f"{cfg.job}-r0-n0"  # the --node-id ftsystem run gives r0's only node
    assert [label["host"] for label in labels] == [machine] * 3, labels


def _scrape_ranks(base: str, out_dir: Path, replica: str
                  ) -> tuple[list[dict], dict[str, str]] | None:
    """The discovery labels of ``replica``'s agent and two ranks, and the ranks' /metrics, once
    its rank 0 committed a step; None before."""
    try:
        token = (out_dir / "api-token").read_text().strip()
        discovery = httpx.get(f"{base}/v1/sd/prometheus", timeout=5,
                              headers={"Authorization": f"Bearer {token}"})
        groups = discovery.raise_for_status().json()
        mine = sorted((g for g in groups if g["labels"].get("replica") == replica),
                      key=lambda g: (g["labels"]["component"], g["labels"].get("rank", "")))
        ranks = {g["labels"]["rank"]: g["targets"][0] for g in mine
                 if g["labels"]["component"] == "replica"}
        if sorted(ranks) != ["0", "1"]:
            return None
        texts = {rank: httpx.get(f"http://{addr}/metrics", timeout=5).text
                 for rank, addr in ranks.items()}
    except (OSError, httpx.HTTPError, ValueError):  # not started yet, or restarting
        return None
    steps = [s.value for f in text_string_to_metric_families(texts["0"])
             if f.name == "ftsystem_steps_committed" for s in f.samples]
    return ([g["labels"] for g in mine], texts) if steps and steps[0] >= 1 else None


def _exported(text: str) -> set[str]:
    """The metric families of a /metrics text that have samples."""
    return {f.name for f in text_string_to_metric_families(text) if f.samples}
