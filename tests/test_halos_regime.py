"""The tuned regime of ``ftsystem bench halos``: the tuning grid and its choice, the targets,
the run cache, the noise-scale probe, the time-model check's retiming, and the bench's JSON (a
smoke run on a two-worker setup)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from conftest import write_two_region_setup
from typer.testing import CliRunner

from ftsystem.cli import app
from ftsystem.halos import experiment, regime
from ftsystem.halos.config import load_setup
from ftsystem.halos.experiment import Variant
from ftsystem.halos.runcache import RunCache
from ftsystem.halos.simulator import METHODS, Curve, simulate

torch.set_num_threads(1)


@pytest.fixture
def two_regions(tmp_path):
    return write_two_region_setup(tmp_path, worker_speeds=[[1.0], [0.5]], num_lps=2)


def tiny_regime(**kw) -> regime.RegimeConfig:
    return regime.RegimeConfig(model="tiny", iters=8, eval_points=4, eval_sequences=8,
                               seeds=[0], **kw)


def test_the_grid_scales_the_papers_outer_lrs_and_tries_each_inner_lr():
    setup, cfg = load_setup(), regime.RegimeConfig()
    assert regime.grid(setup, "sync", cfg) == [{"lr": 1e-3}, {"lr": 2e-3}, {"lr": 4e-3}]
    halos = regime.grid(setup, "halos", cfg, [1e-3, 4e-3])
    assert len(halos) == 2 * 4 * 4
    assert {(p["lps_lr"], p["gps_lr"]) for p in halos} == {
        (lps, gps) for lps in (0.05, 0.1, 0.2, 0.4) for gps in (0.0375, 0.075, 0.15, 0.3)}
    assert [p["outer_lr"] for p in regime.grid(setup, "diloco", cfg, [1e-3])] == [
        0.175, 0.35, 0.7, 1.4]
    assert regime.paper_hyperparameters(setup, "async_local_sgd") == {"inner_lr": 1e-3,
                                                                      "server_lr": 0.05}


def test_apply_sets_each_methods_own_hyperparameters():
    setup = load_setup()
    halos = regime.apply(setup, "halos", {"inner_lr": 4e-3, "lps_lr": 0.4, "gps_lr": 0.3})
    assert (halos.worker.lr, halos.halos.lps.lr, halos.halos.gps.lr) == (4e-3, 0.4, 0.3)
    assert halos.halos.lps.beta == setup.halos.lps.beta and halos.diloco == setup.diloco
    assert regime.apply(setup, "diloco", {"inner_lr": 2e-3, "outer_lr": 1.4}).diloco.outer.lr \
        == 1.4
    single = regime.apply(setup, regime.SINGLE, {"lr": 2e-3})
    assert single.network.speeds == [1.0] and single.worker.lr == 2e-3
    with pytest.raises(ValueError, match="sync has no hyperparameters"):
        regime.apply(setup, "sync", {"outer_lr": 1.0})


def test_the_choice_is_the_lowest_final_loss_and_a_diverged_run_is_never_chosen():
    tuned = regime.Tuned(points=[{"lr": 1}, {"lr": 2}, {"lr": 3}], curves=[
        Curve(method="a", loss=[3.0, 2.0]), Curve(method="b", loss=[3.0, math.nan]),
        Curve(method="c", loss=[3.0, 1.9])])
    assert tuned.choice == {"lr": 3}


def test_targets_come_from_the_weakest_tuned_method_with_a_margin():
    def tuned(low):
        return regime.Tuned(points=[{}], curves=[Curve(method="x", loss=[4.0, low, low + .1])])
    runs = {"sync": tuned(1.41), "halos": tuned(1.83), "diloco": tuned(1.90),
            regime.SINGLE: tuned(2.5)}  # a single worker sets no target
    assert regime.targets_from(runs) == [2.25, 2.05, 1.95]  # 1.90 + 0.05, rounded up


def test_expected_exchanges_follow_speeds_h_and_k():
    setup = load_setup()
    # 98,304 local steps of the paper's run, each worker's share in pushes of ceil(8 * speed),
    # one exchange per 32 pushes of an LPS's 4 workers.
    assert regime.exchanges_per_lps(setup, 6144) == pytest.approx(136.8, abs=0.05)
    assert regime.exchanges_per_lps(setup, 1536) == pytest.approx(136.8 / 4, abs=0.05)


def test_noise_scale_recovers_a_known_scale():
    # |G|^2 = 1 and tr(Sigma) = 100: a batch of b sequences has E|g_b|^2 = 1 + 100 / b.
    probes = [[s, 1 + 100 / 8, 1 + 100 / 128] for s in range(0, 100, 10)]
    curve = Curve(method="sync", local_steps=[0, 100], loss=[3.0, 2.0], noise=probes)
    out = regime.noise_scale([curve], small=8, big=128, windows=2)
    assert [w["b_simple_sequences"] for w in out] == pytest.approx([100.0, 100.0])
    assert [w["probes"] for w in out] == [5, 5]


def test_the_noise_probe_leaves_syncs_run_unchanged():
    setup, cfg = load_setup(), tiny_regime(noise_every=2)
    sim = cfg.sim("test")
    seen = simulate(setup, sim, "sync")
    plain = simulate(setup, replace(sim, noise_every=0), "sync")
    assert seen.loss == plain.loss and seen.time_s == plain.time_s
    assert [p[0] for p in seen.noise] == [16 * i for i in (1, 3, 5, 7)]
    assert all(small > big > 0 for _, small, big in seen.noise)  # 16 batches average out noise


def test_a_synchronous_method_retimed_is_the_same_run_under_the_other_time_model():
    setup, cfg = load_setup(), tiny_regime()
    sim = cfg.sim("test")
    own = regime.own_time_model(setup, cfg, step_s=0.01)
    assert own.time_model.num_params == 5376
    for method in ("diloco_dynupd", "sync"):
        run = simulate(own, sim, method)
        factor = regime._round_s(own, method) / regime._round_s(setup, method)
        retimed = regime.retimed(simulate(setup, sim, method), factor)
        assert retimed.loss == run.loss
        assert retimed.time_s == pytest.approx(run.time_s, rel=1e-12)


def test_the_cache_runs_each_task_once(tmp_path):
    setup, sim = load_setup(), tiny_regime().sim("validation")
    tasks = [(setup, sim, Variant(name="h", method="halos"), s) for s in (0, 1)]
    ran = []
    cache = RunCache(tmp_path)
    first = experiment.run_all(tasks, 1, lambda c, s: ran.append(s), cache)
    again = experiment.run_all(tasks, 1, lambda c, s: ran.append(s), cache)
    assert ran == [0, 1] and len(list(tmp_path.glob("*.json"))) == 2
    assert [c.loss for c in again] == [c.loss for c in first] and again[0].method == "h"
    other = replace(sim, total_iters=9)  # any other input is another run
    experiment.run_all([(setup, other, tasks[0][2], 0)], 1, lambda c, s: ran.append(s), cache)
    assert ran == [0, 1, 0]
    assert cache.measured("x", lambda: 0.5) == 0.5 and cache.measured("x", lambda: 9.0) == 0.5


def test_bench_halos_tunes_fixes_targets_and_measures(two_regions, tmp_path):
    # --quick on a 2-worker setup with 16 iterations: every stage of the bench in seconds.
    out = tmp_path / "bench.json"
    args = ["bench", "halos", "--quick", "--iters", "16", "--setup", str(two_regions[0]),
            "--trace", str(two_regions[1]), "--cache", str(tmp_path / "runs")]
    result = CliRunner().invoke(app, args + ["--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["model_params"] == 5376 and data["iterations"] == 16
    assert data["seeds"] == [0, 1, 2] and "King James" in data["corpus"]["name"]
    tuned = data["tuned"]["methods"]
    assert set(tuned) == set(METHODS) | {regime.SINGLE}
    assert len(tuned["sync"]["sweep"]) == 3 and len(tuned["halos"]["sweep"]) in (4, 8)
    for m, t in tuned.items():
        best = min(s["final_loss"] for s in t["sweep"])
        assert next(s for s in t["sweep"] if s["hyperparameters"] == t["hyperparameters"])[
            "final_loss"] == best
    losses = [t["loss"] for t in data["targets"]]
    assert losses == data["tuned"]["targets"] and losses == sorted(losses, reverse=True)
    for t, r in zip(data["targets"], data["ratios_vs_halos"]):
        assert set(t["time_to_loss_s"]) == set(METHODS) == set(r["time"])
        assert set(t["tokens_to_loss"]["sync"]) == {"median", "min", "max", "reached"}
        assert r["loss"] == t["loss"]
    assert list(data["ablation"]["steps"]) == list(experiment.ABLATION)
    assert data["ablation"]["paper_tokens_to_loss_B"]["fedah"] == 38.1
    assert data["k_sweep"]["values"] == [8, 16, 32]
    assert set(data["k_sweep"]["final_loss"]) == {"K=8", "K=16", "K=32"}
    check = data["time_model_check"]
    assert check["time_model"]["num_params"] == 5376 and check["time_model"][
        "local_step_time_s"] > 0
    assert check["rerun"] == ["halos", "async_local_sgd"]
    assert all(sorted(t["ranking"]) == sorted(METHODS) for t in check["targets"])
    assert data["regime"]["tokens_per_run"] == 16 * 2 * 8 * 64
    assert data["regime"]["gradient_noise_scale"]
    assert data["paper"]["time_to_loss_vs_halos"] == {"diloco": 7.2}
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    # A second invocation finds every run in the cache and writes the same figures.
    again = tmp_path / "again.json"
    result = CliRunner().invoke(app, args + ["--json", str(again)])
    assert result.exit_code == 0, result.output
    assert json.loads(again.read_text())["targets"] == data["targets"]
    assert "virtual h (" not in result.output  # no run was run again (each prints its time)


def test_bench_halos_tune_only_writes_the_tuning(two_regions, tmp_path):
    out = tmp_path / "sweep.json"
    result = CliRunner().invoke(app, [
        "bench", "halos", "--quick", "--iters", "8", "--tune-only", "--no-cache",
        "--setup", str(two_regions[0]), "--trace", str(two_regions[1]), "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert set(data["methods"]) == set(METHODS) | {regime.SINGLE} and len(data["targets"]) == 3
    assert "ratios_vs_halos" not in data


def test_bench_halos_rejects_bad_input(two_regions):
    result = CliRunner().invoke(app, ["bench", "halos", "--json", "x.json", "--model", "huge",
                                      "--quick", "--no-cache"])
    assert result.exit_code == 2 and "unknown model 'huge'" in result.output
    result = CliRunner().invoke(app, ["bench", "halos", "--json", "x.json", "--seeds", "100",
                                      "--quick", "--no-cache"])
    assert result.exit_code == 2 and "tuning seed 100" in result.output
