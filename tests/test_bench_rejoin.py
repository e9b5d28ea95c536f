"""``ftsystem bench rejoin``: its pure summary, its usage errors, and a ``--quick`` run end to
end (real etcd, agents and torchft replicas; a 1M-parameter model, so it checks the wiring and
the JSON's shape, not the figures)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ftsystem.benchmarks.rejoin import loopback_rate, summarize
from ftsystem.cli import app


def test_summary_gives_each_figure_over_the_rounds() -> None:
    runs = {1_000_000: {"ftsystem": [{"join_stall_s": 0.1, "time_to_join_s": 5.0,
                                      "transfer_bytes_per_s": 2e9, "step_s": 0.2},
                                     {"join_stall_s": 0.3, "time_to_join_s": 4.0,
                                      "transfer_bytes_per_s": None, "step_s": 0.2}]}}
    summary = summarize([{"loopback_bytes_per_s": 3e9}, {"loopback_bytes_per_s": 5e9}], runs)
    ours = summary["sizes"][0]["ftsystem"]
    assert summary["sizes"][0]["params"] == 1_000_000
    assert ours["join_stall_s"] == {"median": pytest.approx(0.2), "min": 0.1, "max": 0.3}
    assert ours["transfer_bytes_per_s"] == {"median": 2e9, "min": 2e9, "max": 2e9}
    assert len(ours["rounds"]) == 2
    assert summary["loopback_bytes_per_s"]["median"] == 4e9


def test_loopback_rate_is_measured() -> None:
    assert loopback_rate(64 << 20, 1) > 10e6  # 10 MB/s: far below any loopback


def test_unknown_system_is_refused() -> None:
    result = CliRunner().invoke(app, ["bench", "rejoin", "--systems", "ftsystem,ray"])
    assert result.exit_code != 0 and "unknown system(s) ray" in result.output


@pytest.mark.slow
def test_quick_run_writes_every_figure(tmp_path) -> None:
    out = tmp_path / "rejoin.json"
    result = CliRunner().invoke(app, ["bench", "rejoin", "--quick", "--systems",
                                      "ftsystem,torchft", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["rounds"] == 1 and data["loopback_bytes_per_s"]["median"] > 0
    (size,) = data["sizes"]
    for name in ("ftsystem", "torchft"):
        for figure in ("join_stall_s", "time_to_join_s", "transfer_bytes_per_s", "step_s"):
            assert set(size[name][figure]) == {"median", "min", "max"}, (name, figure)
        assert size[name]["time_to_join_s"]["median"] > 0, name
        assert size[name]["transfer_bytes_per_s"]["median"] > 0, name
    assert size["ftsystem"]["rounds"][0]["catchup"]["snapshot_bytes"] > 0
