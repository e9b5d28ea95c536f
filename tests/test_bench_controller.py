"""``ftsystem bench controller`` as users run it: a real etcd, a real controller leader, real
lease revocations; small numbers so that it stays a test, not a timed benchmark."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from ftsystem.benchmarks.controller_bench import TARGET_P99_S, summarize
from ftsystem.cli import app

STATS = {"p50", "p99", "mean", "max"}


def test_summarize_hand_case() -> None:
    stats = summarize([0.3, 0.1, 0.2])
    assert stats["p50"] == pytest.approx(0.2)
    assert stats["mean"] == pytest.approx(0.2)
    assert stats["max"] == pytest.approx(0.3)
    assert 0.29 < stats["p99"] <= 0.3


def test_malformed_etcd_url_says_what_to_pass() -> None:
    result = CliRunner().invoke(app, ["bench", "controller", "--etcd", "nonsense"])
    assert result.exit_code == 2
    assert "host:port" in result.output


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("controller", ["subprocess", "in-process"])
def test_bench_controller_writes_its_json(tmp_path, controller: str) -> None:
    out = tmp_path / "controller.json"
    result = CliRunner().invoke(app, ["bench", "controller", "--replicas", "32", "--revokes", "5",
                                      "--controller", controller, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {"replicas", "revokes", "decision_latency_s", "target_p99_s", "registration_s",
            "controller", "machine"} <= set(data)
    assert data["replicas"] == 32 and data["revokes"] == 5
    assert data["controller"] == controller and data["target_p99_s"] == TARGET_P99_S
    for measure in ("decision_latency_s", "join_latency_s"):
        assert set(data[measure]) == STATS
        assert all(math.isfinite(v) and v > 0 for v in data[measure].values())
        assert data[measure]["p50"] <= data[measure]["p99"] <= data[measure]["max"]
    assert math.isfinite(data["registration_s"]) and data["registration_s"] > 0
    assert "removal: revoke -> epoch seen" in result.output
