"""``ftsystem bench failover --scenario host`` in small: one host of replica r1 dies with
everything on it (its agent included), ftsystem only, and the JSON says what it cost."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from ftsystem.cli import app
from ftsystem.launch.netns import netns_supported

NETNS = netns_supported()  # None, or why namespaces cannot be made here


@pytest.mark.skipif(NETNS is not None, reason=str(NETNS))
@pytest.mark.timeout(300)
def test_one_host_failure_is_measured_from_its_instant(tmp_path) -> None:
    out = tmp_path / "failover_host.json"
    # The failure fires once the job reached its warm-up step (the short interval only lets it
    # fire as early as that); the victim then restarts after the survivors have finished, and
    # catches up from one of them while they linger.
    result = CliRunner().invoke(app, [
        "bench", "failover", "--scenario", "host", "--failures", "1", "--rounds", "1",
        "--kill-interval", "2", "--systems", "ftsystem", "--replicas", "2", "--steps", "40",
        "--json", str(out), "--workdir", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())

    assert data["scenario"] == "host" and data["nodes_per_replica"] == 1
    assert data["torchft"] is None and data["torchft_1s"] is None
    assert data["setup"]["ftsystem_timeout_s"] == 30.0  # the default timeout
    assert data["setup"]["num_replicas"] == 2
    ours = data["ftsystem"]
    assert set(ours["stall_s"]) >= {"median", "max"}
    [run] = ours["rounds"]
    assert run["orders_not_executed"] == [], run["orders_not_executed"]
    [fault] = run["faults"]
    assert "SIGKILL to all" in fault["outcome"] and fault["victim_was_training"], fault
    # One failure measured, from the fault's instant, with a finite stall.
    assert ours["failures"] == 1
    stall = ours["stall_s"]["median"]
    # A dead host costs the survivors less than the one timeout allows a silent peer.
    assert stall is not None and math.isfinite(stall) and 0 <= stall < 30.0, stall
    assert ours["per_failure_stall_s"] == [stall]
    # The victim came back and the run ended with every replica in the same state.
    assert ours["bitwise_identical"] and run["agents_ok"]
    assert any(f["replica"] == "r1" for f in run["replica_failures"])
    assert data["targets"]["ftsystem_median_stall_at_most_2s"] in (True, False)
    assert data["layouts"] == {}
