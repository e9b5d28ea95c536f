"""Which GPU each rank of a replica uses: the agent's ``--gpus`` mapping and the rank's own
``local_device()`` rule, as pure logic (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from agent.supervisor import ENV_VISIBLE_GPUS, gpu_env_per_rank, parse_gpus
from ftsystem.training.devices import cuda_device_of, device_index, local_device, use_device


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_without_gpus_every_rank_sees_all_and_rank_k_uses_gpu_k(monkeypatch):
    assert gpu_env_per_rank([], 4) == [{}, {}, {}, {}]
    fake_gpus(monkeypatch, 4)
    for rank in range(4):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert local_device() == torch.device("cuda", rank)


def test_with_gpus_rank_k_sees_the_kth_listed_and_uses_it_as_cuda_0(monkeypatch):
    envs = gpu_env_per_rank(parse_gpus("4,5,6,7"), 4)
    assert [env[ENV_VISIBLE_GPUS] for env in envs] == ["4", "5", "6", "7"]
    for rank, env in enumerate(envs):
        fake_gpus(monkeypatch, len(env[ENV_VISIBLE_GPUS].split(",")))
        monkeypatch.setenv("LOCAL_RANK", str(rank))  # still the rank in its replica
        assert local_device() == torch.device("cuda", 0)


def test_more_gpus_than_ranks_leaves_the_rest_unused():
    assert gpu_env_per_rank(["0", "1", "2"], 2) == [{ENV_VISIBLE_GPUS: "0"},
                                                    {ENV_VISIBLE_GPUS: "1"}]


def test_fewer_gpus_than_ranks_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match=r"lists 2 GPU\(s\) \(0,1\) for 4 ranks per replica: "
                                         "list one GPU per rank"):
        gpu_env_per_rank(["0", "1"], 4)


def test_parse_gpus():
    assert parse_gpus("") == []
    assert parse_gpus(" 0, 1,GPU-8d3a ") == ["0", "1", "GPU-8d3a"]
    with pytest.raises(ValueError, match="empty entry"):
        parse_gpus("0,,1")


@given(rank=st.integers(0, 63), visible=st.integers(1, 16))
def test_device_index_is_a_visible_gpu_and_rank_k_gets_k_when_enough(rank, visible):
    index = device_index(rank, visible)
    assert 0 <= index < visible
    assert rank >= visible or index == rank


def test_cpu_machine(monkeypatch):
    fake_gpus(monkeypatch, 0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_device() == torch.device("cpu")
    use_device(torch.device("cpu"))  # nothing to set
    use_device(None)
    assert cuda_device_of([torch.ones(1)]) is None


def test_use_device_refuses_a_cuda_device_without_index():
    with pytest.raises(ValueError, match="has no index"):
        use_device(torch.device("cuda"))
