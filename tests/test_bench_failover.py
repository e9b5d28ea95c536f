"""``ftsystem bench failover`` (the default, process scenario) end to end, shortened: one kill
per system (ftsystem, torchft at its defaults and at 1 s), the JSON's shape."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from ftsystem.baselines.torchft_scenario import lighthouse_binary
from ftsystem.cli import app


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(lighthouse_binary() is None,
                    reason="torchft's torchft_lighthouse binary is not installed")
def test_one_kill_per_system_is_measured_from_its_instant(tmp_path) -> None:
    out = tmp_path / "failover.json"
    result = CliRunner().invoke(app, ["bench", "failover", "--quick", "--failures", "1",
                                      "--kill-interval", "3", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["scenario"]["rounds"] == 1 and data["scenario"]["num_failures"] == 1
    for name in ("ftsystem", "torchft", "torchft_1s"):
        system = data[name]
        assert system["errors"] == [], (name, system["errors"])
        assert system["failures"] == 1, name
        [stall] = system["per_failure_stall_s"]
        assert math.isfinite(stall) and stall >= 0
        assert system["per_round_median_stall_s"] == [stall]
        assert set(system["stall_s"]) >= {"median", "min", "max"}
        assert system["bitwise_identical"], name
    # torchft's two settings differ in the lighthouse's heartbeat timeout.
    defaults = data["torchft"]["settings"]["lighthouse"]
    assert defaults["heartbeat_timeout_ms"] > data["torchft_1s"]["settings"]["lighthouse"][
        "heartbeat_timeout_ms"] == 1000
    assert data["torchft"]["settings"]["manager"]["gradient_averaging"].startswith(
        "Manager.allreduce of one flat buffer")
    ratio = data["median_stall_ratio_torchft_1s_over_ftsystem"]
    assert ratio is None or set(ratio) >= {"value", "per_round", "min", "max"}
    assert "survivor stall per crash" in result.output
