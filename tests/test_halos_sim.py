"""The HALoS simulator, its time model, and the CLI on very small configurations."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ftsystem.cli import app
from ftsystem.halos.config import DEFAULT_SETUP, SetupError, load_setup
from ftsystem.halos.simulator import METHODS, SimConfig, simulate
from ftsystem.halos.workload import Workload, WorkloadConfig
from ftsystem.example.workload import ModelConfig

torch.set_num_threads(1)

TINY_MODEL = ModelConfig(vocab_size=32, seq_len=8, d_model=16, num_layers=1, num_heads=1)


def tiny(iters: int, eval_points: int = 4) -> SimConfig:
    return SimConfig(total_iters=iters, eval_points=eval_points,
                     workload=WorkloadConfig(model=TINY_MODEL, local_batch=4, branching=2,
                                             eval_sequences=64))


@pytest.fixture
def two_regions(tmp_path):
    """Two regions of one worker each, 1 Gbit/s between them, a model of exactly 1 Gbit.

    So a transfer takes 1 s between the regions and .01 s inside one; a local step takes 1 s.
    """
    doc = yaml.safe_load(DEFAULT_SETUP.read_text())
    doc.update(num_regions=2, network_bandwidth_gbps=[[100.0, 1.0], [1.0, 100.0]],
               worker_speeds=[[1.0], [1.0]])
    doc["pythia_70m"]["local_step_time_ms"] = 1000.0
    doc["halos"].update(num_lps=2, workers_per_lps=1, local_steps_H=2, accumulation_K=1)
    setup_path, trace_path = tmp_path / "setup.yaml", tmp_path / "trace.json"
    setup_path.write_text(yaml.safe_dump(doc))
    trace_path.write_text(json.dumps({"models": {"pythia-70m": {"params": 31_250_000}}}))
    return setup_path, trace_path


def test_every_method_lowers_the_loss():
    setup = load_setup()
    setup.worker.lr = 1e-2  # a tiny budget needs a larger step to show learning
    for method in METHODS:
        curve = simulate(setup, tiny(8), method)
        assert curve.final_loss < curve.loss[0] - 0.01, method
        assert curve.local_steps[-1] >= 8 * 16


def test_sync_and_diloco_rounds_follow_the_time_model():
    # Slowest worker: speed .107/.907 = .11797. Ring all-reduce of 70,426,624 fp32 parameters
    # among 16 workers at .127 Gbit/s: 30 * (281,706,496 * 8 / 16) / .127e9 = 33.272 s.
    # Sync step: .238391 / .11797 + 33.272 = 35.293 s; DiLoCo round (H = 32): 64.665 + 33.272.
    setup = load_setup()
    sync = simulate(setup, tiny(3, eval_points=3), "sync")
    assert sync.time_s == pytest.approx([0, 35.293, 70.586, 105.879], abs=2e-3)
    diloco = simulate(setup, tiny(32, eval_points=1), "diloco")
    assert diloco.time_s == pytest.approx([0, 97.937], abs=2e-3)


def test_async_local_sgd_first_update_arrives_after_the_fastest_job():
    # The fastest worker (region 0, speed 1, H = 32): 2 * 281.7 MB over 100 Gbit/s + 32 steps.
    setup = load_setup()
    curve = simulate(setup, tiny(2, eval_points=32), "async_local_sgd")
    assert curve.time_s[1] == pytest.approx(2 * 0.0225365 + 32 * 0.238391, abs=1e-4)


def test_halos_exchanges_follow_the_time_model(two_regions):
    # Each worker's job: 2 * .01 s to/from its LPS + 2 steps of 1 s = 2.02 s; K = 1, so each
    # update goes to the GPS in region 0: .01 s from LPS 0, 1 s from LPS 1. GPS updates at
    # 2.03 (LPS 0), 3.02 (LPS 1), then 4.05 and 5.04 for the second jobs.
    setup = load_setup(two_regions[0], trace=two_regions[1])
    curve = simulate(setup, tiny(4, eval_points=8), "halos")
    assert curve.time_s == pytest.approx([0, 2.03, 3.02, 4.05, 5.04])
    assert curve.local_steps == [0, 2, 4, 6, 8]


def test_non_iid_gives_each_region_its_own_language():
    setup = load_setup()
    regions = setup.network.worker_regions
    iid = Workload(WorkloadConfig(model=TINY_MODEL), regions, setup.worker)
    shifted = Workload(WorkloadConfig(model=TINY_MODEL, non_iid=True), regions, setup.worker)
    assert torch.equal(iid.batches(0, 1)[0], shifted.batches(0, 1)[0])        # region 0: seed
    assert not torch.equal(iid.batches(4, 1)[0], shifted.batches(4, 1)[0])    # region 1: seed+1


runner = CliRunner()


def test_cli_sim_writes_json_and_png(two_regions, tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    result = runner.invoke(app, [
        "sim", "halos", "--setup", str(two_regions[0]), "--trace", str(two_regions[1]),
        "--iters", "16", "--eval-points", "4", "--data", "markov", "--non-iid",
        "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    for target in data["targets"]:
        assert set(target["time_to_loss_s"]) == set(METHODS)
    assert data["seeds"] == [0] and "ablation" not in data
    assert data["config"]["non_iid"] and data["config"]["data"] == "markov" and data["machine"]
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("text,needle", [
    ("num_regions: [1, 2\n", "not valid YAML"),
    ("just a string\n", "expected a mapping"),
    ("num_regions: 4\n", "missing entry 'network_bandwidth_gbps'"),
])
def test_cli_rejects_a_malformed_setup(tmp_path, text, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    result = runner.invoke(app, ["sim", "halos", "--setup", str(bad), "--iters", "1"])
    assert result.exit_code == 2
    assert needle in result.output and str(bad) in result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


def test_setup_errors_name_the_problem(tmp_path):
    doc = yaml.safe_load(DEFAULT_SETUP.read_text())
    doc["network_bandwidth_gbps"] = [[1.0, 2.0]]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(SetupError, match="4 x 4 matrix"):
        load_setup(bad)
    with pytest.raises(SetupError, match="cannot read the setup file"):
        load_setup(tmp_path / "missing.yaml")
    doc = yaml.safe_load(DEFAULT_SETUP.read_text())
    doc["halos"]["workers_per_lps"], doc["halos"]["num_lps"] = 8, 2
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(SetupError, match="spans regions"):
        load_setup(bad)


def test_cli_rejects_unknown_methods():
    result = runner.invoke(app, ["sim", "halos", "--methods", "halos,fedavg", "--iters", "1"])
    assert result.exit_code == 2 and "fedavg" in result.output
