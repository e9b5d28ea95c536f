"""``ftsystem bench failover`` (the default, process scenario) end to end, shortened: one kill
per system (ftsystem and torchft at its 1 s heartbeat timeout, 2 replicas, a few steps), the
JSON's shape; the choice of systems and torchft's lighthouse settings without processes."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from ftsystem.baselines.torchft_replica import QUORUM_TIMEOUT
from ftsystem.baselines.torchft_scenario import lighthouse_binary
from ftsystem.benchmarks.failover import _lighthouse, _systems
from ftsystem.benchmarks.harness import spec_mismatches
from ftsystem.cli import app
from ftsystem.launch.launcher import RunConfig


def test_systems_keep_their_order_and_always_include_ftsystem() -> None:
    assert _systems("torchft_1s, ftsystem", skip_torchft=False) == ["ftsystem", "torchft_1s"]
    assert _systems("ftsystem,torchft,torchft_1s", skip_torchft=True) == ["ftsystem"]
    result = CliRunner().invoke(app, ["bench", "failover", "--systems", "torchft"])
    assert result.exit_code == 2 and "include ftsystem" in result.output
    result = CliRunner().invoke(app, ["bench", "failover", "--systems", "ftsystem,ray"])
    assert result.exit_code == 2 and "unknown system(s) ray" in result.output


def test_torchft_at_its_defaults_leaves_every_lighthouse_flag_out() -> None:
    assert _lighthouse("torchft").flags() == []
    assert ["--heartbeat_timeout_ms", "1000"] == _lighthouse("torchft_1s").flags()[:2]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(lighthouse_binary() is None,
                    reason="torchft's torchft_lighthouse binary is not installed")
def test_one_kill_per_system_is_measured_from_its_instant(tmp_path) -> None:
    out = tmp_path / "failover.json"
    # 40 steps: ftsystem's victim is killed after step 20 and catches up from the survivor
    # even if it has finished; torchft's survivor trains on until the victim has rejoined.
    result = CliRunner().invoke(app, ["bench", "failover", "--quick", "--failures", "1",
                                      "--kill-interval", "1", "--replicas", "2",
                                      "--steps", "40", "--systems", "ftsystem,torchft_1s",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["scenario"]["rounds"] == 1 and data["scenario"]["num_failures"] == 1
    assert data["scenario"]["num_replicas"] == 2 and data["scenario"]["steps"] == 40
    # A kill costs less than what either system allows a silent peer: ftsystem's one timeout,
    # torchft's quorum timeout.
    bounds = {"ftsystem": RunConfig().timeout_s, "torchft_1s": QUORUM_TIMEOUT.total_seconds()}
    for name, bound in bounds.items():
        system = data[name]
        assert system["errors"] == [], (name, system["errors"])
        assert system["failures"] == 1, name
        [stall] = system["per_failure_stall_s"]
        assert math.isfinite(stall) and 0 <= stall < bound, (name, stall)
        assert system["per_round_median_stall_s"] == [stall]
        assert set(system["stall_s"]) >= {"median", "min", "max"}
        assert system["bitwise_identical"], name
    assert data["torchft"] is None and data["median_stall_ratio_torchft_over_ftsystem"] is None
    # The 1 s setting differs from torchft's defaults (read from its binary) in the heartbeat.
    assert data["torchft_defaults"]["lighthouse"]["heartbeat_timeout_ms"] > data["torchft_1s"][
        "settings"]["lighthouse"]["heartbeat_timeout_ms"] == 1000
    assert data["torchft_1s"]["settings"]["manager"]["gradient_averaging"].startswith(
        "Manager.allreduce of one flat buffer")
    ratio = data["median_stall_ratio_torchft_1s_over_ftsystem"]
    assert ratio is None or set(ratio) >= {"value", "per_round", "min", "max"}
    # Both systems trained one spec, and each run says so.
    runs = data["ftsystem"]["rounds"] + data["torchft_1s"]["rounds"]
    assert [run["system"] for run in runs] == ["ftsystem", "torchft_1s"]
    assert spec_mismatches(runs) == [] and data["spec"] == runs[0]["spec"]
    assert "survivor stall per crash" in result.output
