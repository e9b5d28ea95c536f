"""``ftsystem bench soak``: the pure summary, and a short real run through the CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ftsystem.benchmarks.soak import BOUND_BYTES, retention_s, summarize
from ftsystem.cli import app


def test_retention_units_follow_etcd():
    assert retention_s("1h") == 3600 and retention_s("30m") == 1800 and retention_s("2") == 7200


def test_the_summary_projects_the_steady_state_from_the_growth_per_write():
    samples = [{"t": 0.0, "revision": 100, "db_bytes": 2e6, "db_in_use_bytes": 1e6},
               {"t": 50.0, "revision": 200, "db_bytes": 2e6, "db_in_use_bytes": 1.05e6}]
    result = summarize(samples, steps=1000, replicas=2, wall_s=50.0, retention="1h")
    assert result["writes"] == 100 and result["writes_per_s"] == 2.0
    assert result["bytes_per_write"] == 500.0  # 50 KB over 100 writes
    assert result["steady_state_in_use_bytes"] == 500.0 * 2.0 * 3600
    assert result["within_bound"] and result["bound_bytes"] == BOUND_BYTES


@pytest.mark.timeout(300)
def test_bench_soak_runs_and_writes_its_json(tmp_path):
    out = tmp_path / "soak.json"
    result = CliRunner().invoke(app, ["bench", "soak", "--steps", "60", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["steps"] == 60 and data["replicas"] == 2 and data["writes"] > 0
    assert 0 < data["db_in_use_bytes"] <= data["db_bytes"] and data["within_bound"]
    assert data["compaction_retention"] == "1h" and "machine" in data
