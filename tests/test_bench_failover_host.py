"""``ftsystem bench failover --scenario host`` in small: one host of replica r1 dies with
everything on it (its agent included), ftsystem only, and the JSON says what it cost."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ftsystem.cli import app
from ftsystem.control.timeouts import Timeouts
from ftsystem.launch.netns import netns_supported

NETNS = netns_supported()  # None, or why namespaces cannot be made here
TIMEOUT_S = 30.0  # the bench's default --timeout


@pytest.mark.skipif(NETNS is not None, reason=str(NETNS))
@pytest.mark.timeout(300)
def test_one_host_failure_is_measured_from_its_instant(tmp_path) -> None:
    out = tmp_path / "failover_host.json"
    # The failure fires once the job reached its warm-up step (the short interval only lets it
    # fire as early as that); the victim then restarts after the survivors have finished, and
    # catches up from one of them while they linger.
    result = CliRunner().invoke(app, [
        "bench", "failover", "--scenario", "host", "--failures", "1", "--rounds", "1",
        "--kill-interval", "2", "--down", "2", "--systems", "ftsystem", "--replicas", "2",
        "--steps", "40",
        "--json", str(out), "--workdir", str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output + repr(result.exception)
    data = json.loads(out.read_text())

    assert data["scenario"] == "host" and data["nodes_per_replica"] == 1
    assert data["torchft"] is None and data["torchft_1s"] is None
    assert data["setup"]["ftsystem_timeout_s"] == TIMEOUT_S  # the default timeout
    assert data["setup"]["num_replicas"] == 2
    ours = data["ftsystem"]
    assert set(ours["stall_s"]) >= {"median", "max"}
    [run] = ours["rounds"]
    assert run["orders_not_executed"] == [], run["orders_not_executed"]
    [fault] = run["faults"]
    # Silent: the link went down before the kill, so no reset told the survivors.
    assert fault["outcome"].startswith("link down, then SIGKILL to all"), fault
    assert fault["victim_was_training"], fault
    # One failure measured, from the fault's instant, with a finite stall.
    assert ours["failures"] == 1
    stall = ours["stall_s"]["median"]
    # A silent dead host costs the survivors under a second: its beats stand still while they
    # wait for it at the all-reduce (the suite's silence is 2 s, the default 0.6 s; the
    # benchmark's figures are in bench/results/failover_host.json). Half the lease's TTL, 5 s,
    # leaves 3 s for a busy CI machine; waiting for the lease to expire (10 s) or for the
    # collective timeout (30 s) fails.
    assert stall is not None and 0 <= stall < Timeouts(TIMEOUT_S).lease_ttl_s / 2, stall
    assert ours["per_failure_stall_s"] == [stall]
    # The victim came back and the run ended with every replica in the same state.
    assert ours["bitwise_identical"] and run["agents_ok"]
    assert any(f["replica"] == "r1" for f in run["replica_failures"])
    # The target reports the median it was measured on (here the one failure's stall).
    assert data["targets"]["ftsystem_median_stall_at_most_1s"] == (stall <= 1.0), data["targets"]
    assert data["targets"]["ftsystem_median_below_torchft_1s"] is None  # torchft not run
    assert data["layouts"] == {}
    assert run["system"] == "ftsystem_1" and run["spec"] == data["setup"]["spec"]
    assert run["spec"]["steps"] == data["setup"]["steps"] == 40
