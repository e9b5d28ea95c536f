"""OverlappedGradSum: bucket planning, sums equal to the plain flat all-reduce over a real Gloo
group of two processes, issue during backward, and the failures that void a step."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from ftsystem.control.etcd_server import free_port
from ftsystem.chaos.faults import FaultPoint
from ftsystem.training.gradient_sum import MIN_CPU_OVERLAP_BUCKETS, overlap_by_default
from ftsystem.training.settings import ENV_BUCKET_BYTES, ReplicaSettings
from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job
from ftsystem.training.overlap import OverlapInvalid, OverlappedGradSum, plan_buckets
from ftsystem.training.flat import FlatLayout

SMALL_CAP = 1024
"""Bytes: one 16x16 float weight per bucket, so the model below has several buckets."""


# --- plan_buckets ---------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(0, 300), max_size=30), element_size=st.sampled_from([2, 4]),
       cap=st.integers(1, 1000))
def test_plan_buckets_contiguous_covering_and_capped(numels, element_size, cap):
    buckets = plan_buckets(numels, element_size, cap)
    assert [i for b in buckets for i in b] == list(range(len(numels)))
    for bucket in buckets:
        assert len(bucket) > 0
        nbytes = sum(numels[i] * element_size for i in bucket)
        assert nbytes <= cap or len(bucket) == 1  # only a single big parameter exceeds it
    for first, second in zip(buckets, buckets[1:]):  # greedy: the next one did not fit
        assert sum(numels[i] for i in first) * element_size + \
            numels[second.start] * element_size > cap


def test_plan_buckets_examples():
    assert plan_buckets([], 4, 100) == []
    assert plan_buckets([10, 10, 10], 4, 80) == [range(0, 2), range(2, 3)]
    assert plan_buckets([5, 100, 5], 4, 40) == [range(0, 1), range(1, 2), range(2, 3)]


# --- a real two-replica Gloo group ----------------------------------------------------------

class Net(nn.Module):
    """Several buckets. ``extra``, in the middle of the issue order, is used only when asked:
    a replica without it must hold the buckets after it until finish(). ``unused`` never gets
    a gradient."""

    def __init__(self, unused_last: bool) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same parameters on every rank
        self.head = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.extra = nn.Linear(16, 16)
        self.tail = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        if unused_last:
            self.unused = nn.Linear(3, 3)  # a submodule: last in parameter order, issued first

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        hidden = self.head(x)
        return self.tail(hidden + self.extra(hidden) if use_extra else hidden)


def reference_sum(params: list[nn.Parameter]) -> torch.Tensor:
    """What FTReplica.commit does without overlap: one flat buffer (zeros for no gradient,
    then whether each parameter had one), one sum."""
    flat = FlatLayout(params).pack()
    dist.all_reduce(flat)
    return flat


def run_step(model: Net, rank: int, events: list[str]) -> None:
    params = [p for p in model.parameters()]
    overlap = OverlappedGradSum(FlatLayout(params), bucket_cap_bytes=SMALL_CAP)
    assert overlap.num_buckets >= 4
    model.head[0].weight.register_post_accumulate_grad_hook(
        lambda _: events.append("first-layer-grad"))

    def issue(piece: torch.Tensor) -> torch.futures.Future:
        events.append("issue")
        return dist.all_reduce(piece, async_op=True).get_future()

    torch.manual_seed(100 + rank)  # different data on every rank
    buffer = torch.full((FlatLayout(params).numel,), float("nan"))
    overlap.arm(buffer, issue)
    # Only rank 0 uses ``extra``: rank 1 issues its bucket, and those after it, in finish().
    model(torch.randn(32, 8), use_extra=rank == 0).square().mean().backward()
    events.append("backward-done")
    grads_before = [None if p.grad is None else (p.grad, p.grad.clone()) for p in params]
    summed = overlap.finish(lambda future: future.wait())
    overlap.remove()

    assert summed is buffer
    assert events.count("issue") == overlap.num_buckets + 1  # and the tail of counts
    assert torch.equal(summed, reference_sum(params))
    for p, before in zip(params, grads_before):
        assert (p.grad is None) if before is None else \
            (p.grad is before[0] and torch.equal(p.grad, before[1]))


def two_replicas(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=30))
    try:
        events: list[str] = []
        run_step(Net(unused_last=False), rank, events)
        # The last layers' buckets went out while the first layer's gradient was still to come.
        assert events.index("issue") < events.index("first-layer-grad")

        events = []
        model = Net(unused_last=True)
        run_step(model, rank, events)
        assert model.unused.weight.grad is None
        # The first bucket in issue order holds ``unused``: nothing can go before finish().
        assert events.index("backward-done") < events.index("issue")
    finally:
        dist.destroy_process_group()


def test_sum_over_two_gloo_replicas_equals_flat_allreduce():
    mp.spawn(two_replicas, args=(free_port(),), nprocs=2, join=True)


# --- failures that void a step (one process: no collective is needed to reach them) -------

def completed(piece: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(piece)
    return future


def small_model() -> tuple[nn.Module, list[nn.Parameter], torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 2))
    params = list(model.parameters())
    return model, params, FlatLayout(params).empty()


def backward(model: nn.Module) -> None:
    model(torch.randn(4, 16)).sum().backward()


def test_hook_fired_twice_voids_the_step():
    model, params, buffer = small_model()
    overlap = OverlappedGradSum(FlatLayout(params), bucket_cap_bytes=SMALL_CAP)
    overlap.arm(buffer, completed)
    backward(model)
    backward(model)  # gradient accumulation while armed: issued buckets hold the first only
    with pytest.raises(OverlapInvalid, match="twice"):
        overlap.finish(lambda future: future.wait())


def test_issue_error_is_recorded_not_raised_into_backward():
    model, params, buffer = small_model()
    overlap = OverlappedGradSum(FlatLayout(params), bucket_cap_bytes=SMALL_CAP)
    calls = []

    def issue(piece: torch.Tensor) -> torch.futures.Future:
        calls.append(piece.numel())
        if len(calls) == 2:
            raise RuntimeError("peer gone")
        return completed(piece)

    overlap.arm(buffer, issue)
    backward(model)  # must not raise
    assert len(calls) == 2 < overlap.num_buckets  # stopped issuing after the error
    with pytest.raises(OverlapInvalid, match="peer gone") as raised:
        overlap.finish(lambda future: future.wait())
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert all(p.grad is not None for p in params)  # left for the fallback


def test_issue_error_in_finish_voids_the_step():
    model, params, buffer = small_model()
    overlap = OverlappedGradSum(FlatLayout(params), bucket_cap_bytes=SMALL_CAP)
    overlap.arm(buffer, lambda piece: (_ for _ in ()).throw(RuntimeError("peer gone")))
    with pytest.raises(OverlapInvalid, match="remaining buckets"):
        overlap.finish(lambda future: future.wait())  # no backward: finish issues all


def test_wait_error_propagates_and_disarms():
    model, params, buffer = small_model()
    overlap = OverlappedGradSum(FlatLayout(params), bucket_cap_bytes=SMALL_CAP)
    overlap.arm(buffer, completed)
    backward(model)

    def wait(future: torch.futures.Future) -> None:
        raise TimeoutError("collective timed out")

    with pytest.raises(TimeoutError):
        overlap.finish(wait)
    with pytest.raises(OverlapInvalid, match="without arm"):
        overlap.finish(lambda future: future.wait())


def test_hooks_idle_unless_armed_and_after_remove():
    model, params, buffer = small_model()
    overlap = OverlappedGradSum(FlatLayout(params), bucket_cap_bytes=SMALL_CAP)
    calls = []
    backward(model)  # not armed: nothing happens
    overlap.arm(buffer, lambda piece: calls.append(piece) or completed(piece))
    overlap.disarm()
    backward(model)
    assert calls == []
    with pytest.raises(OverlapInvalid, match="without arm"):
        overlap.finish(lambda future: future.wait())
    overlap.remove()
    overlap.arm(buffer, lambda piece: calls.append(piece) or completed(piece))
    backward(model)
    assert calls == []  # hooks removed: only finish() would issue


def test_arm_rejects_a_buffer_of_the_wrong_size():
    _, params, buffer = small_model()
    with pytest.raises(ValueError, match="elements"):
        OverlappedGradSum(FlatLayout(params)).arm(buffer[:-1], completed)


# --- in a job -------------------------------------------------------------------------------

def test_a_job_with_the_overlap_on_survives_a_kill_and_a_failed_allreduce(
        etcd, job_id, tmp_path, monkeypatch):
    """The pairing rule under faults: r1 is killed while its buckets are on the wire, r2's
    all-reduce fails after the data arrived; the others go on and every replica ends equal."""
    monkeypatch.setenv("FTSYSTEM_BUCKET_BYTES", str(64 << 10))  # the small model: 6 buckets
    cfg = RunConfig(num_replicas=3, num_steps=120, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    kills=[ReplicaKill(1, FaultPoint(30, "allreduce")),
                           ReplicaKill(2, FaultPoint(70, "fail-allreduce"))],
                    train_args=["--overlap", "on", "--sleep-per-step", "0.02"],
                    show_progress=False)
    summary = run_job(cfg)
    assert [f["replica"] for f in summary["failures"]] == ["r1"]
    assert summary["steps"] == 120 and summary["bitwise_identical"] and summary["agents_ok"]
    results = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "results").glob("*.json")}
    # Most commits of the replicas that ran throughout went out in buckets; the first on each
    # new group is one flat buffer. (The restarted r1 may rejoin as late as the last step.)
    for rid in ("r0", "r2"):
        assert results[rid]["overlapped_commits"] > len(results[rid]["commits"]) // 2, rid


def test_a_malformed_size_in_the_environment_names_the_variable():
    with pytest.raises(ValueError, match="FTSYSTEM_BUCKET_BYTES='25MB': expected a positive"):
        ReplicaSettings.from_env({ENV_BUCKET_BYTES: "25MB"})
    assert ReplicaSettings.from_env({ENV_BUCKET_BYTES: "4096"}).bucket_bytes == 4096


def test_cpu_gradients_overlap_by_default_only_when_they_span_several_buckets():
    params = list(nn.Linear(100, 10).parameters())  # 1010 float32: 4040 bytes
    assert not overlap_by_default(params, bucket_cap_bytes=4040 // MIN_CPU_OVERLAP_BUCKETS + 1)
    assert overlap_by_default(params, bucket_cap_bytes=4040 // MIN_CPU_OVERLAP_BUCKETS)
    assert not overlap_by_default([], bucket_cap_bytes=1)
    assert not overlap_by_default(params, bucket_cap_bytes=1, setting=False)
    assert overlap_by_default(params, bucket_cap_bytes=10**9, setting=True)
    assert ReplicaSettings.from_env({"FTSYSTEM_OVERLAP": "0"}).overlap is False
    assert ReplicaSettings.from_env({}).overlap is None
