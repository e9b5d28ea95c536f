"""``ftsystem bench fingerprint``: its pairing of step and digest times, and a quick run end to
end in-process (a tiny model and one round, so it checks the wiring and the JSON, not the
figures)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from ftsystem.benchmarks.fingerprint import summarize
from ftsystem.cli import app
from ftsystem.training.settings import DEFAULT_FINGERPRINT_EVERY


def test_cost_pairs_each_rounds_digest_with_its_own_steps() -> None:
    # Round 2 ran on a machine twice as loaded: steps and digest alike took twice as long.
    rounds = [{"step_s": [1.0, 1.2, 0.8], "digest_s": [0.1]},
              {"step_s": [2.0, 2.4, 1.6], "digest_s": [0.2]}]
    summary = summarize(rounds, [10, 100])
    assert summary["step_s"] == {"median": pytest.approx(1.4), "min": 0.8, "max": 2.4}
    assert summary["digest_s"]["min"] == 0.1 and summary["digest_s"]["max"] == 0.2
    # The load cancels within each round: 0.1 / (10 * 1.0) both times, no spread.
    assert summary["cost_fraction"]["10"] == {"median": pytest.approx(0.01),
                                              "min": pytest.approx(0.01),
                                              "max": pytest.approx(0.01)}
    assert summary["cost_fraction"]["100"]["median"] == pytest.approx(0.001)


def test_a_malformed_size_is_a_usage_error(tmp_path) -> None:
    result = CliRunner().invoke(app, ["bench", "fingerprint", "--sizes", "big",
                                      "--out", str(tmp_path / "f.json")])
    assert result.exit_code == 2
    assert "malformed model size" in result.output


@pytest.mark.timeout(120)
def test_quick_run_writes_positive_figures(tmp_path) -> None:
    out = tmp_path / "fingerprint.json"
    threads = torch.get_num_threads()
    result = CliRunner().invoke(app, ["bench", "fingerprint", "--sizes", "200K", "--rounds", "1",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert torch.get_num_threads() == threads  # the bench's one thread does not leak out
    data = json.loads(out.read_text())
    assert "no communication" in data["measured"] and data["machine"]
    assert data["default_every"] == DEFAULT_FINGERPRINT_EVERY in data["everies"]
    [model] = data["models"]
    assert model["params"] == 200_000 and model["num_params"] > 0
    # Parameters and AdamW's two slots, 4 bytes each: the optimizer had stepped.
    assert model["digest_bytes"] >= 3 * 4 * model["num_params"]
    assert len(model["rounds"]) == 1
    figures = [model["step_s"], model["digest_s"],
               *(model["cost_fraction"][str(every)] for every in data["everies"])]
    for spread in figures:
        assert set(spread) == {"median", "min", "max"}
        assert all(math.isfinite(v) and v > 0 for v in spread.values()), spread
        assert spread["min"] <= spread["median"] <= spread["max"]
    fraction = model["cost_fraction"]
    assert fraction["10"]["median"] > fraction["100"]["median"] > fraction["1000"]["median"]
    assert "fingerprint: state digest vs step time" in result.output
