"""Replicas of several ranks (FSDP2 inside each replica, FTAR per shard index), end to end:
2 replicas x 2 ranks on CPU under real agents, a real etcd and controller, real Gloo groups."""

from __future__ import annotations

import json

from ftsystem.chaos.faults import FaultPoint
from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job


def test_a_killed_rank_restarts_its_replica_which_catches_up_shard_by_shard(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("FTSYSTEM_WARM_UP", "1")  # the GPU's default, asked for on the CPU
    # --kill-at hits the last rank of a replica only: rank 1 of r1 dies at step 15, the agent
    # takes down rank 0 and restarts both. Later a failed all-reduce on one rank of r0 makes
    # the replica's vote fail: neither of its shards may commit that step.
    cfg = RunConfig(num_replicas=2, nproc_per_node=2, num_steps=80, out_dir=tmp_path / "run",
                    kills=[ReplicaKill(1, FaultPoint(15)),
                           ReplicaKill(0, FaultPoint(60, "fail-allreduce"))],
                    train_args=["--sleep-per-step", "0.1"], timeout_s=12, show_progress=False)
    summary = run_job(cfg)
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
