"""``ftsystem bench gradsum``: its pure parts, its usage errors, and a ``--quick`` run end to end
(two real rank processes, DDP and a torchft Gloo group; a tiny model, so it checks the wiring
and the JSON, not the figures)."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from ftsystem.benchmarks.gradsum import MODES, QUICK_CYCLES, default_cycles, summarize
from ftsystem.cli import app


def test_cycles_by_size_fewer_above_30m() -> None:
    assert default_cycles(10_000_000) == 12
    assert default_cycles(30_000_000) == 12
    assert default_cycles(30_000_001) == 4
    assert default_cycles(100_000_000) == 4


def test_summary_takes_medians_and_pairs_ratios_within_a_cycle() -> None:
    summary = summarize({"ddp": [0.6, 0.4, 9.0], "flat": [0.2, 0.3, 0.1], "local": [0.5, 0.8]})
    # The median ignores DDP's disturbed cycle (9.0 s); the mean does not.
    assert summary["ddp"] == {"median_s": 0.6, "min_s": 0.4, "max_s": 9.0,
                              "mean_s": pytest.approx(10 / 3), "speed_vs_ddp": 1.0,
                              "speed_vs_ddp_min": 1.0, "speed_vs_ddp_max": 1.0}
    assert summary["flat"]["median_s"] == 0.2
    # Per cycle 3.0, 1.33, 90: the median is 3x faster than DDP.
    assert summary["flat"]["speed_vs_ddp"] == pytest.approx(3.0)
    assert summary["flat"]["speed_vs_ddp_min"] == pytest.approx(0.4 / 0.3)
    assert summary["flat"]["speed_vs_ddp_max"] == pytest.approx(90.0)
    assert summary["local"]["median_s"] == pytest.approx(0.65)  # even count: middle two
    assert summary["local"]["speed_vs_ddp"] == pytest.approx((1.2 + 0.5) / 2)  # 0.6/0.5, 0.4/0.8


def test_paired_ratios_resist_load_that_hit_one_mode_more_often() -> None:
    # The mode is 10% faster than DDP in each cycle, but the machine was slow (3x) for DDP's
    # sample of cycle 3 and not for the mode's: the medians alone would say 3.3x faster.
    summary = summarize({"ddp": [1.0, 1.0, 3.0, 3.0, 3.0], "overlap": [0.9, 0.9, 0.9, 2.7, 2.7]})
    assert summary["ddp"]["median_s"] / summary["overlap"]["median_s"] == pytest.approx(10 / 3)
    assert summary["overlap"]["speed_vs_ddp"] == pytest.approx(1 / 0.9)


def test_summary_without_ddp_has_no_ratio_and_skips_empty_modes() -> None:
    assert summarize({"flat": [0.2], "overlap": []}) == {
        "flat": {"median_s": 0.2, "min_s": 0.2, "max_s": 0.2, "mean_s": 0.2,
                 "speed_vs_ddp": None, "speed_vs_ddp_min": None, "speed_vs_ddp_max": None}}


def test_a_malformed_size_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["bench", "gradsum", "--sizes", "big"])
    assert result.exit_code == 2
    assert "malformed model size" in result.output


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_run_times_every_mode(tmp_path) -> None:
    out = tmp_path / "gradsum.json"
    result = CliRunner().invoke(app, ["bench", "gradsum", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {"models", "options", "machine"} <= set(data)
    assert data["options"]["quick"] is True and len(data["models"]) == 1
    model = data["models"][0]
    assert model["cycles"] == QUICK_CYCLES and model["buckets"] >= 1
    assert set(model["modes"]) == set(MODES) == set(model["samples"])
    for mode, figures in model["modes"].items():
        assert len(model["samples"][mode]) == QUICK_CYCLES
        for key in ("median_s", "min_s", "max_s", "mean_s", "speed_vs_ddp"):
            assert math.isfinite(figures[key]) and figures[key] > 0, (mode, figures)
    assert model["modes"]["ddp"]["speed_vs_ddp"] == 1.0
    assert "gradsum: step time" in result.output
