"""The torchft 0.2.0 baseline runs our failover scenario with real processes and a real kill.

Observed here (with ``Manager.allreduce`` per gradient, and again with one flat buffer): the survivors record the failed
all-reduce (Gloo "Connection closed by peer"), drop that step, wait for the lighthouse to
drop the dead replica (about its 1 s heartbeat timeout) and go on; the restarted replica heals
from a peer over HTTP and rejoins. No survivor crashes, so the test asserts that none did.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.futures

from ftsystem.example import train
from ftsystem.baselines.torchft_replica import (
    BATCH_SIZE,
    LEARNING_RATE,
    average_gradients,
    manager_settings,
)
from ftsystem.baselines.torchft_scenario import lighthouse_binary, run_torchft_failover

RESULT_KEYS = {"replica", "generation", "commits", "final_loss", "state_hash", "num_params"}
STEPS = 60
VICTIM = 1

needs_lighthouse = pytest.mark.skipif(
    lighthouse_binary() is None, reason="torchft's torchft_lighthouse binary is not installed")


@needs_lighthouse
@pytest.mark.timeout(300)
def test_survivors_keep_committing_after_a_kill(tmp_path: Path) -> None:
    # The bound only ends a stuck run: on a loaded 2-core machine the victim's restart alone
    # (imports) can outlast the survivors' run, and it then trains its 60 steps by itself.
    out = run_torchft_failover(num_replicas=3, num_failures=1, steps=STEPS, model_params=None,
                               workdir=tmp_path, kill_interval_s=1.0, victim=VICTIM,
                               sleep_per_step=0.15, timeout_s=240)

    assert len(out["failures"]) == 1
    kill_time = out["failures"][0]
    assert out["crashed"] == [], "a survivor crashed: " + repr(out["crashed"])
    assert out["settings"]["lighthouse"]["heartbeat_timeout_ms"] > 0
    assert len(out["rejoins"]) == 1 and out["rejoins"][0] > kill_time

    results = {r["replica"]: r for r in out["results"]}
    assert sorted(results) == [0, 1, 2]
    for index, result in results.items():
        assert set(result) >= RESULT_KEYS
        assert result["commits"][-1][0] == STEPS, f"replica {index} stopped early"
        assert len(result["state_hash"]) == 64 and result["num_params"] > 0
    assert results[VICTIM]["generation"] == 1
    for index in set(results) - {VICTIM}:
        assert results[index]["generation"] == 0
        assert any(t > kill_time for _, t in results[index]["commits"])


class _HalvingManager:
    """Stands in for two replicas' all-reduce (pure arithmetic): the average of this gradient
    and zeros; counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        self.calls += 1
        tensor.div_(2)
        done = torch.futures.Future()
        done.set_result(tensor)
        return done


def test_gradients_go_as_one_flat_all_reduce_and_come_back_in_place() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    for i, param in enumerate(model.parameters()):
        param.grad = torch.full_like(param, float(i + 1))
    manager = _HalvingManager()
    average_gradients(manager, model)
    assert manager.calls == 1
    for i, param in enumerate(model.parameters()):
        assert torch.equal(param.grad, torch.full_like(param, (i + 1) / 2))


def test_torchft_trains_what_ftsystem_trains() -> None:
    ours = train.parse_args([])
    assert (BATCH_SIZE, LEARNING_RATE) == (ours.batch_size, ours.lr)
    assert manager_settings()["batch_size"] == ours.batch_size
