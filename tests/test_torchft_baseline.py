"""The torchft 0.2.0 baseline runs our failover scenario with real processes and a real kill.

Observed here with ``Manager.allreduce`` per gradient: the survivors record the failed
all-reduce (Gloo "Connection closed by peer"), drop that step, wait for the lighthouse to
drop the dead replica (about its 1 s heartbeat timeout) and go on; the restarted replica heals
from a peer over HTTP and rejoins. No survivor crashes, so the test asserts that none did.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ftsystem.baselines.torchft_scenario import lighthouse_binary, run_torchft_failover

RESULT_KEYS = {"replica", "generation", "commits", "final_loss", "state_hash", "num_params"}
STEPS = 60
VICTIM = 1

pytestmark = pytest.mark.skipif(lighthouse_binary() is None,
                                reason="torchft's torchft_lighthouse binary is not installed")


@pytest.mark.timeout(120)
def test_survivors_keep_committing_after_a_kill(tmp_path: Path) -> None:
    out = run_torchft_failover(num_replicas=3, num_failures=1, steps=STEPS, model_params=None,
                               workdir=tmp_path, kill_interval_s=1.0, victim=VICTIM,
                               sleep_per_step=0.15, timeout_s=100)

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
