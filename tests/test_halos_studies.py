"""HALoS studies: link sharing in the time model, LPS groups of any size, heterogeneous regions,
the sweeps' variants, and a smoke run of ``ftsystem bench halos-studies``."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import simpy
import torch
import yaml

from conftest import write_two_region_setup
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ftsystem.cli import app
from ftsystem.halos import studies
from ftsystem.halos.config import (DEFAULT_SETUP, SetupError, heterogeneous_network, load_setup,
                                   lps_groups)
from ftsystem.halos.simulator import SimConfig, simulate
from ftsystem.halos.timemodel import SharedLink, transfer_s
from ftsystem.halos.workload import WorkloadConfig
from ftsystem.example.workload import ModelConfig

torch.set_num_threads(1)

TINY_MODEL = ModelConfig(vocab_size=32, seq_len=8, d_model=16, num_layers=1, num_heads=1)
GBIT = 1e9 / 8  # bytes in one Gbit: one second on a 1 Gbit/s link


def finish_times(transfers: list[tuple[float, float]], gbps: float = 1.0) -> list[float]:
    """When each (start s, bytes) transfer on one shared link ends."""
    env = simpy.Environment()
    link, done = SharedLink(env, gbps), [0.0] * len(transfers)

    def go(i: int, start: float, num_bytes: float):
        yield env.timeout(start)
        yield link.transfer(num_bytes)
        done[i] = env.now

    for i, (start, num_bytes) in enumerate(transfers):
        env.process(go(i, start, num_bytes))
    env.run()
    return done


def test_a_transfer_alone_takes_the_whole_link():
    assert finish_times([(0.0, 281_706_496)], 0.127) == pytest.approx(
        [transfer_s(281_706_496, 0.127)])


def test_concurrent_transfers_share_the_link():
    assert finish_times([(0, GBIT), (0, GBIT)]) == pytest.approx([2.0, 2.0])
    # 1 Gbit and 3 Gbit together: half rate each until the first ends at 2 s, then full rate.
    assert finish_times([(0, GBIT), (0, 3 * GBIT)]) == pytest.approx([2.0, 4.0])
    # the second starts when the first has 1 Gbit left: both end at 3 s.
    assert finish_times([(0, 2 * GBIT), (1, GBIT)]) == pytest.approx([3.0, 3.0])
    # no overlap: each as if alone.
    assert finish_times([(0, GBIT), (5, GBIT)]) == pytest.approx([1.0, 6.0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(1e6, 1e9)), min_size=1, max_size=6))
def test_sharing_never_beats_the_link_and_loses_no_capacity(transfers):
    done = finish_times(transfers)
    for (start, num_bytes), end in zip(transfers, done):
        assert end >= start + transfer_s(num_bytes, 1.0) - 1e-9   # never faster than alone
    # Work conservation: the link is never idle while a transfer waits, so the last transfer
    # ends when the busy periods, taken in order of start, have moved every byte.
    busy_until = 0.0
    for start, num_bytes in sorted(transfers):
        busy_until = max(busy_until, start) + transfer_s(num_bytes, 1.0)
    assert max(done) == pytest.approx(busy_until, rel=1e-9, abs=1e-9)


def shared_setup(tmp_path, *, link_sharing: bool, speeds=((1.0,), (1.0, 1.0))):
    """Region 0 with one worker, region 1 with two; 1 Gbit/s between them, a 1-Gbit model,
    1 s per local step; H = 2 for everyone; K = 1."""
    doc = yaml.safe_load(DEFAULT_SETUP.read_text())
    doc.update(num_regions=2, network_bandwidth_gbps=[[100.0, 1.0], [1.0, 100.0]],
               worker_speeds=[list(s) for s in speeds])
    doc["pythia_70m"]["local_step_time_ms"] = 1000.0
    n = sum(len(s) for s in speeds)
    doc["halos"].update(num_lps=n, workers_per_lps=1, local_steps_H=2, accumulation_K=1)
    doc["async_local_sgd"]["local_steps_H"] = 2
    setup_path, trace_path = tmp_path / "setup.yaml", tmp_path / "trace.json"
    setup_path.write_text(yaml.safe_dump(doc))
    trace_path.write_text(json.dumps({"models": {"pythia-70m": {"params": 31_250_000}}}))
    setup = load_setup(setup_path, trace=trace_path)
    setup.time_model.link_sharing = link_sharing
    return setup


def tiny(iters: int, eval_points: int) -> SimConfig:
    return SimConfig(total_iters=iters, eval_points=eval_points, workload=WorkloadConfig(
        model=TINY_MODEL, local_batch=2, branching=2, eval_sequences=8))


def test_async_workers_of_a_region_share_its_link_to_the_server(tmp_path):
    # Without sharing, the two region-1 workers' jobs take 1 + 2 + 1 s: their first pushes at
    # 4 s. With it, both fetch at once (2 s), compute 2 s, send at once (2 s): at 6 s. The
    # region-0 worker (alone on its link) pushes at 2.02 s either way.
    off = simulate(shared_setup(tmp_path, link_sharing=False), tiny(2, 6), "async_local_sgd")
    on = simulate(shared_setup(tmp_path, link_sharing=True), tiny(2, 6), "async_local_sgd")
    assert off.time_s[1] == pytest.approx(2.02) and on.time_s[1] == pytest.approx(2.02)
    assert any(t == pytest.approx(4.0) for t in off.time_s)
    assert not any(t == pytest.approx(4.0) for t in on.time_s)
    assert any(t == pytest.approx(6.0) for t in on.time_s)


def test_halos_shares_only_the_links_it_uses_at_once(tmp_path):
    # One worker per region, K = 1 (test_halos_sim's timings without sharing). With sharing,
    # region 0's inside link carries LPS 0's delta to the GPS (also in region 0) while worker
    # 0 fetches its next model: both .02 s instead of .01, so the GPS updates at 2.04 and
    # 4.07; region 1's delta goes over the inter-region link, which nothing else uses then.
    times = [simulate(shared_setup(tmp_path, link_sharing=s, speeds=((1.0,), (1.0,))),
                      tiny(4, 8), "halos").time_s for s in (False, True)]
    assert times[0] == pytest.approx([0, 2.03, 3.02, 4.05, 5.04])
    assert times[1] == pytest.approx([0, 2.04, 3.02, 4.07, 5.04])


def test_lps_groups_of_any_size_within_a_region():
    setup = load_setup()
    net = heterogeneous_network(setup.network, [2, 4, 4, 6])
    assert [len(r) for r in net.worker_speeds] == [2, 4, 4, 6]
    assert net.worker_speeds[0] == [0.232, 0.907]                              # the first two
    assert net.worker_speeds[3] == [0.827, 0.515, 0.527, 0.788, 0.827, 0.515]  # repeated
    groups = [[0, 1], [2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13, 14, 15]]
    assert lps_groups(replace(setup.halos, lps_groups=groups), net) == groups
    assert studies.region_groups(net) == groups
    with pytest.raises(SetupError, match="spans regions"):
        lps_groups(replace(setup.halos, lps_groups=[[0, 1, 2], [3, 4, 5]] + groups[2:]), net)
    with pytest.raises(SetupError, match="exactly once"):
        lps_groups(replace(setup.halos, lps_groups=groups[1:]), net)
    with pytest.raises(SetupError, match="one count >= 1"):
        heterogeneous_network(setup.network, [2, 4, 4])


def test_consistent_grouping_pairs_workers_of_similar_speed():
    net = heterogeneous_network(load_setup().network, [2, 4, 4, 6])
    consistent = studies.speed_groups(net, 2)
    naive = studies.index_groups(net, 2)
    assert naive == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    # region 2 = workers 6-9, speeds .852, .132, .896, .107: slow pair and fast pair.
    assert [6, 8] in consistent and [7, 9] in consistent
    assert sorted(len(g) for g in consistent) == [2] * 8
    spread_of = lambda gs: max(max(net.speeds[w] for w in g) - min(net.speeds[w] for w in g)  # noqa: E731
                               for g in gs)
    assert spread_of(consistent) < spread_of(naive)


def test_sweep_variants_change_one_parameter():
    setup = load_setup()
    h = setup.halos
    assert studies.with_param(h, "K", 8).accumulation_k == 8
    assert studies.with_param(h, "beta_g", 0.0).gps.beta == 0.0
    assert studies.with_param(h, "beta_l", 0.95).lps == replace(h.lps, beta=0.95)
    assert studies.with_param(h, "alpha", 0.5).merge_alpha == 0.5
    assert studies.sweep_name(h, "K", 32) == "halos" and studies.sweep_name(h, "K", 8) == "K=8"
    with pytest.raises(ValueError, match="unknown parameter"):
        studies.with_param(h, "gamma", 1.0)
    cfg = studies.StudiesConfig(studies=list(studies.STUDIES), seeds=[0])
    rows = studies.study_rows(setup, cfg)
    names = [r.variant.name for rs in rows.values() for r in rs]
    assert len(set(names)) == 1 + 3 + sum(len(v) - 1 for v in studies.SWEEP.values()) + 2 + 3
    with pytest.raises(ValueError, match="unknown studies"):
        studies.StudiesConfig(studies=["grouping", "nope"], seeds=[0])


@pytest.fixture
def two_regions(tmp_path):
    """Two regions (one worker, two workers): the studies' smoke run takes seconds."""
    return write_two_region_setup(tmp_path, worker_speeds=[[1.0], [0.5, 0.9]], num_lps=3)


def test_bench_halos_studies_json_shape(two_regions, tmp_path):
    out = tmp_path / "studies.json"
    result = CliRunner().invoke(app, [
        "bench", "halos-studies", "--quick", "--json", str(out), "--iters", "2",
        "--seeds", "0", "--workers-per-region", "1,3",
        "--setup", str(two_regions[0]), "--trace", str(two_regions[1])])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["model_params"] == 5376 and data["seeds"] == [0] and data["machine"]
    assert [t["name"] for t in data["targets"]] == ["sync_50pct", "sync_90pct"]
    assert list(data["studies"]) == list(studies.STUDIES)
    for entry in data["studies"].values():
        for row in entry["rows"]:
            assert set(row["final_loss"]) == {"median", "min", "max", "reached"}
            assert 0 < row["final_accuracy"]["median"] < 1
            assert set(row["time_to_loss_s"]) == {"sync_50pct", "sync_90pct"}
    grouping = data["studies"]["grouping"]
    assert grouping["workers_per_region"] == [1, 3] and grouping["speeds"][1] == [0.5, 0.9, 0.5]
    assert grouping["groups"]["1-3, by region"] == [[0], [1, 2, 3]]
    assert set(grouping["naive_vs_consistent_time"]) == {"sync_50pct", "sync_90pct"}
    assert "1.7x" in grouping["paper"] and "46.9%" in data["studies"]["non-iid"]["paper"]
    assert set(data["studies"]["non-iid"]["momentum_accuracy_points"]) == {"non_iid", "iid"}
    assert set(data["studies"]["link-sharing"]["shared_vs_not_time"]) == {"halos",
                                                                          "async_local_sgd"}
    assert data["studies"]["sweep"]["paper_values"] == {"K": 2, "alpha": 0.25, "beta_l": 0.9,
                                                        "beta_g": 0.5}
    assert all(len(runs) == 1 for runs in data["curves"].values())


def test_bench_halos_studies_rejects_bad_input(two_regions):
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "halos-studies", "--json", "x.json", "--study",
                                 "grouping,bogus"])
    assert result.exit_code == 2 and "unknown studies" in result.output
    result = runner.invoke(app, ["bench", "halos-studies", "--json", "x.json",
                                 "--setup", str(two_regions[0]), "--trace", str(two_regions[1]),
                                 "--workers-per-region", "2,x"])
    assert result.exit_code == 2 and "'2,x'" in result.output
    result = runner.invoke(app, ["bench", "halos-studies", "--json", "x.json",
                                 "--workers-per-region", "2,4,4"])
    assert result.exit_code == 2 and "one count >= 1" in result.output
