"""Replicas that use tensor parallelism inside: each replica's ranks form a (dp_shard, tp) mesh,
passed to FTReplica; the replicas are the data-parallel dimension across meshes.

The job runs 2 replicas x 2 ranks on CPU under real agents, a real etcd and controller, real Gloo
groups and a real SIGKILL; the two-process test checks, on real Gloo ranks, what makes it work:
tensor parallelism's gradients placed as their parameters before they cross replicas, and the
refusal of a mesh that is not the replica's own ranks in rank order."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial

from ftsystem.example.tensor_parallel import TinyDecoder, parallelize
from ftsystem.example.workload import ModelConfig
from ftsystem.training.replica_group import check_mesh
from ftsystem.training.shards import align_grads


# The spawned ranks import this module: it imports nothing that loads gRPC (the launcher, etcd),
# since gRPC's threads and DTensor's Gloo collectives now and then abort a process at exit
# ("terminate called without an active exception") after the test body has passed.
def _rank(rank: int, world: int, rendezvous: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp_shard", "tp"))
        check_mesh(mesh, world)  # the replica's own ranks in rank order: accepted
        with pytest.raises(ValueError, match="in rank order"):
            check_mesh(DeviceMesh("cpu", list(reversed(range(world)))), world)
        with pytest.raises(ValueError, match="WORLD_SIZE"):  # a replica of more ranks
            check_mesh(mesh, 2 * world)
        model = TinyDecoder(ModelConfig())
        parallelize(model, mesh["tp"])
        model.loss(torch.randint(64, (4, 33))).backward()
        params = dict(model.named_parameters())
        partial = [n for n, p in params.items() if any(isinstance(x, Partial)
                                                        for x in p.grad.placements)]
        assert "norm.weight" in partial and params["tok.weight"].grad.placements != \
            params["tok.weight"].placements, partial  # what sequence parallelism leaves
        expected = {n: p.grad.full_tensor() for n, p in params.items()}
        align_grads(list(params.values()))
        for name, param in params.items():
            assert isinstance(param.grad, DTensor) and param.grad.placements == \
                param.placements, name
            assert param.grad.to_local().shape == param.to_local().shape, name
            assert torch.equal(param.grad.full_tensor(), expected[name]), name
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_gradients_are_placed_as_their_parameters(tmp_path):
    mp.spawn(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}"), nprocs=2)


@pytest.mark.slow
def test_tensor_parallel_replicas_survive_a_kill_bitwise_identical(tmp_path):
    from ftsystem.chaos.faults import FaultPoint
    from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job

    # Rank 1 of r1 is SIGKILLed at step 8; the agent restarts both ranks, each catches up its
    # tensor-parallel slice from the same rank of r0 while r0 trains on, and joins.
    cfg = RunConfig(num_replicas=2, nproc_per_node=2, num_steps=60, out_dir=tmp_path / "run",
                    kills=[ReplicaKill(1, FaultPoint(8))],
                    train_args=["--tp", "2", "--sleep-per-step", "0.15"],
                    timeout_s=12, show_progress=False)
    summary = run_job(cfg)
    results = {p.stem: json.loads(p.read_text()) for p in (cfg.out_dir / "results").glob("*.json")}

    assert [(f["replica"], f["step"]) for f in summary["failures"]] == [("r1", 8)]
    assert results["r1"]["generation"] == 1 and summary["steps"] == 60 and summary["agents_ok"]
    for rank, stats in enumerate(results["r1"]["shard_catchup"]):
        assert stats["donors"] == ["r0"] and stats["bytes"] > 0, (rank, stats)
    shards = [results[r]["shard_hashes"] for r in ("r0", "r1")]
    # Each rank holds its own slice (the hashes differ between ranks), equal across replicas.
    assert shards[0] == shards[1] and len(set(shards[0])) == 2, shards
    assert summary["bitwise_identical"]
