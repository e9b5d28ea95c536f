"""ETTR simulation (ftsystem.sim.ettr, ``ftsystem sim ettr``): hand-computed cases for the cost
arithmetic and the event simulation, the paper reproduction, and the command as users run it."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from ftsystem.cli import app
from ftsystem.sim import ettr, ettr_cli
from ftsystem.sim import scale_inputs as si
from ftsystem.sim.ettr import (Failures, Outcome, ReplicaRecovery, SyncRecovery,
                               checkpointed_progress, simulate_replicas, simulate_sync)

SYNC = SyncRecovery(restart_s=100.0, checkpoint_write_s=0.0, checkpoint_interval_s=100.0)
REPLICA = ReplicaRecovery(stall_s=10.0, relaunch_s=50.0, catchup_s=40.0, join_stall_s=5.0,
                          replica_gpus=1)
NO_FAILURES = Failures(np.array([]), np.array([]))
QUICK_COSTS = replace(ettr.FTHSDP, stall_s=5.0, catchup_s=60.0, join_stall_s=1.0)


def trace(*failures: tuple[float, float]) -> Failures:
    """Failures at (time, where) pairs."""
    return Failures(np.array([t for t, _ in failures]), np.array([w for _, w in failures]))


def flat(output: str) -> str:
    """CLI output with rich's box drawing and line wrapping removed."""
    return " ".join(output.replace("│", " ").split())


# --- cost arithmetic ---------------------------------------------------------------------------

def test_checkpointed_progress_hand_cases() -> None:
    rec = SyncRecovery(restart_s=0.0, checkpoint_write_s=10.0, checkpoint_interval_s=100.0)
    assert checkpointed_progress(0.0, rec) == (0.0, 0.0)
    assert checkpointed_progress(50.0, rec) == (0.0, 50.0)
    assert checkpointed_progress(105.0, rec) == (0.0, 100.0)   # write not finished: not saved
    assert checkpointed_progress(110.0, rec) == (100.0, 0.0)
    assert checkpointed_progress(235.0, rec) == (200.0, 15.0)


@given(st.floats(0, 1e6), st.floats(1e-3, 1e4), st.floats(0, 1e3))
def test_checkpointed_progress_properties(elapsed: float, interval: float, write: float) -> None:
    rec = SyncRecovery(restart_s=0.0, checkpoint_write_s=write, checkpoint_interval_s=interval)
    saved, in_flight = checkpointed_progress(elapsed, rec)
    assert 0.0 <= in_flight <= interval
    assert saved + in_flight <= elapsed * (1 + 1e-9) + 1e-9
    assert math.isclose(saved / interval, round(saved / interval), abs_tol=1e-6)


def test_young_daly_and_layout() -> None:
    assert ettr.young_daly_interval_s(2.0, 100.0) == 20.0
    assert ettr.num_replicas(1_024, 8_192) == ettr.MIN_REPLICAS
    assert ettr.num_replicas(ettr.PAPER_GPUS, 8_192) == 12
    assert ettr.num_replicas(196_608, 8_192) == 24


def test_failure_models_match_published_points() -> None:
    for gpus, mttf_s in ettr.KOKOLIS_MTTF_S:
        assert math.isclose(ettr.kokolis_mttf_s(gpus), mttf_s)
    assert math.isclose(ettr.llama3_mttf_s(16_384), 54 * 24 * 3600 / 419)
    for model in ettr.FAILURE_MODELS.values():
        mttfs = [model(g) for g in ettr.SCALES]
        assert mttfs == sorted(mttfs, reverse=True)


# --- event simulation, hand-computed -------------------------------------------------------------

def test_no_failures_means_full_ettr() -> None:
    assert simulate_sync(SYNC, NO_FAILURES, 1000.0) == Outcome(1.0, 1.0)
    assert simulate_replicas(REPLICA, 4, NO_FAILURES, 1000.0) == Outcome(1.0, 1.0)


def test_sync_checkpoint_writes_cost_their_time() -> None:
    rec = SyncRecovery(restart_s=0.0, checkpoint_write_s=10.0, checkpoint_interval_s=90.0)
    assert simulate_sync(rec, NO_FAILURES, 1000.0) == Outcome(0.9, 0.9)


def test_sync_single_failure() -> None:
    # Checkpoints at 100 and 200; the failure at 250 loses 50; restart until 350; 650 more.
    assert simulate_sync(SYNC, trace((250.0, 0.0)), 1000.0) == Outcome(0.85, 0.85)


def test_sync_failure_during_restart_costs_another_restart() -> None:
    # The failure at 300 waits for the restart 250..350, then restarts again 350..450.
    assert simulate_sync(SYNC, trace((250.0, 0.0), (300.0, 0.0)), 1000.0) == Outcome(0.75, 0.75)


def test_replica_single_failure() -> None:
    # Stall 100..110; replica 0 out until 200 (3/4 capacity 110..200); join stall 200..205.
    out = simulate_replicas(REPLICA, 4, trace((100.0, 0.1)), 1000.0)
    assert math.isclose(out.time, 0.985)
    assert math.isclose(out.work, (100 + 90 * 0.75 + 795) / 1000)


def test_replica_failure_in_recovering_replica_costs_nothing_more() -> None:
    out = simulate_replicas(REPLICA, 4, trace((100.0, 0.1), (150.0, 0.2)), 1000.0)
    assert math.isclose(out.time, 0.985)


def test_replica_stalls_do_not_overlap() -> None:
    # Replica 1 fails at 105: its stall waits until 110 (110..120), it rejoins after replica 0.
    out = simulate_replicas(REPLICA, 4, trace((100.0, 0.1), (105.0, 0.3)), 1000.0)
    assert math.isclose(out.time, 0.97)
    assert math.isclose(out.work, (100 + 80 * 0.5 + 5 * 0.75 + 785) / 1000)


def test_sync_simulation_matches_closed_form() -> None:
    """Queued restarts take a fraction R/M of the time; each training stretch is Exp(M) and keeps
    C per completed checkpoint period: ETTR = (1 - R/M) (C/M) q/(1-q), q = exp(-(C+W)/M)."""
    mttf, rec = 1000.0, SyncRecovery(restart_s=200.0, checkpoint_write_s=5.0,
                                     checkpoint_interval_s=100.0)
    q = math.exp(-(rec.checkpoint_interval_s + rec.checkpoint_write_s) / mttf)
    expected = (1 - rec.restart_s / mttf) * rec.checkpoint_interval_s / mttf * q / (1 - q)
    horizon = 20_000 * mttf
    failures = ettr.poisson_failures(mttf, horizon, np.random.default_rng(1))
    assert simulate_sync(rec, failures, horizon).work == pytest.approx(expected, abs=0.01)


# --- paper reproduction and scaling --------------------------------------------------------------

def test_reproduces_paper_at_100k() -> None:
    row = ettr.ettr_at_scale(ettr.PAPER_GPUS, lambda _: QUICK_COSTS, failure_model="kokolis",
                             failures=2_000, seeds=2, seed=0)
    assert abs(row["sync"] - 0.44) <= 0.03
    assert abs(row["fthsdp"] - 0.80) <= 0.03
    assert row["time_based"]["fthsdp"] > row["fthsdp"]   # reduced capacity while replicas recover
    assert ettr.paper_reproduced(row)


def test_more_gpus_lower_sync_ettr() -> None:
    rows = [ettr.ettr_at_scale(g, lambda _: QUICK_COSTS, failure_model="kokolis", failures=500,
                               seeds=1, seed=0) for g in ettr.SCALES]
    sync = [row["sync"] for row in rows]
    assert sync == sorted(sync, reverse=True)
    assert all(row["sync"] < row["fthsdp"] < row["ftsystem"] for row in rows[-4:])


# --- ftsystem's inputs at scale ----------------------------------------------------------------

EVIDENCE = si.Evidence(
    host_stall=si.host_stall_input({1: {"median": 0.7, "max": 1.1}, 2: {"median": 1.0,
                                                                          "max": 1.2}},
                                   "failover_host.json", timeout_s=30.0),
    decision=si.decision_input(0.01, 0.03, "controller_nodes.json"), decision_nodes=16_384,
    time_to_join=si.time_to_join_input(30.0, "rejoin.json"),
    join_stall=si.join_stall_input(5.0, "rejoin.json"))


def test_nccl_init_model_goes_through_the_published_points() -> None:
    for ranks, seconds in (si.NCCL_INIT_SMALL, si.NCCL_INIT_LARGE):
        assert math.isclose(si.nccl_init_s(ranks), seconds)
    assert si.nccl_init_s(2) == si.nccl_init_s(16)     # fixed costs below the small point
    sizes = [1, 12, 24, 1_024, 8_192, 98_304, 196_608]
    times = [si.nccl_init_s(n) for n in sizes]
    assert times == sorted(times) and times[-1] > times[-2]
    with pytest.raises(ValueError, match="at least one rank"):
        si.nccl_init_s(0)


@given(st.integers(16, 98_304), st.floats(1.0, 3.0))
def test_nccl_line_bounds_any_convex_curve_through_the_points(ranks: int, power: float) -> None:
    """The reason for a straight line: NCCL's init grows super-linearly (NCCLX), and any convex
    curve through the two published points stays below their chord between them."""
    (n0, t0), (n1, t1) = si.NCCL_INIT_SMALL, si.NCCL_INIT_LARGE
    convex = t0 + (t1 - t0) * ((ranks - n0) / (n1 - n0)) ** power
    assert convex <= si.nccl_init_s(ranks) + 1e-9


def test_inputs_carry_their_provenance() -> None:
    with pytest.raises(ValueError, match="kind"):
        si.Input(value_s=1.0, kind="guessed", source="x")
    with pytest.raises(ValueError, match="non-negative"):
        si.Input(value_s=1.0, kind=si.ASSUMED, source="x", sweep_s=(-1.0,))
    assert si.Input(value_s=2.0, kind=si.ASSUMED, source="x",
                    sweep_s=(3.0, 1.0, 2.0)).points() == (1.0, 2.0, 3.0)
    parts = si.components(EVIDENCE, ettr.PAPER_GPUS)
    assert list(parts) == ["host_stall_s", "decision_s", "nccl_reinit_s", "host_wait_s",
                           "replica_nccl_init_s", "time_to_join_s", "join_stall_s"]
    kinds = {name: part.kind for name, part in parts.items()}
    assert kinds == {"host_stall_s": si.MEASURED, "decision_s": si.MEASURED,
                     "nccl_reinit_s": si.MODEL, "host_wait_s": si.ASSUMED,
                     "replica_nccl_init_s": si.MODEL, "time_to_join_s": si.MEASURED,
                     "join_stall_s": si.MEASURED}
    assert "arXiv 2510.20171" in parts["nccl_reinit_s"].source
    assert "failover_host.json" in parts["host_stall_s"].source


def test_host_stall_takes_the_multi_node_layout_and_falls_back_to_the_timeout() -> None:
    measured = EVIDENCE.host_stall
    assert measured.value_s == 1.0 and measured.kind == si.MEASURED
    assert measured.points() == (0.7, 1.0, 1.2, 10.0, 30.0)   # ..., lease TTL, timeout
    assumed = si.host_stall_input(None, "", timeout_s=30.0)
    assert assumed.value_s == 30.0 and assumed.kind == si.ASSUMED
    assert "timeout" in assumed.source
    from ftsystem.training.runtime import DEFAULT_TIMEOUT_S
    assert si.DEFAULT_TIMEOUT_S == DEFAULT_TIMEOUT_S


def test_components_scale_with_the_job() -> None:
    at_98k, at_196k = (si.components(EVIDENCE, g) for g in (ettr.PAPER_GPUS, 196_608))
    # 12,288 hosts: fewer than the 16,384 node agents measured; 24,576: 1.5 times as many.
    assert at_98k["decision_s"].value_s == 0.03
    assert math.isclose(at_196k["decision_s"].value_s, 0.045)
    assert at_98k["nccl_reinit_s"].value_s == si.nccl_init_s(12)     # one rank per replica
    assert at_196k["nccl_reinit_s"].value_s == si.nccl_init_s(24)
    assert at_98k["replica_nccl_init_s"].value_s == si.nccl_init_s(8_192)
    small = si.components(EVIDENCE, 1_024)   # eight replicas of 128 GPUs
    assert small["replica_nccl_init_s"].value_s == si.nccl_init_s(128)
    unmeasured = replace(EVIDENCE, decision=si.decision_input(None, None, ""), decision_nodes=None)
    assert si.components(unmeasured, 196_608)["decision_s"].value_s == 1.0   # not scaled


def test_recovery_adds_its_components() -> None:
    parts = si.components(EVIDENCE, ettr.PAPER_GPUS)
    rec = si.recovery(parts, ettr.PAPER_GPUS)
    reinit, replica_init = si.nccl_init_s(12), si.nccl_init_s(8_192)
    assert math.isclose(rec.stall_s, 1.0 + 0.03 + reinit)
    assert math.isclose(rec.relaunch_s, si.HOST_WAIT_S + replica_init)
    assert rec.catchup_s == 30.0
    assert math.isclose(rec.join_stall_s, 5.0 + 0.03 + reinit)
    assert rec.replica_gpus == 8_192
    assert si.HOST_WAIT_S == 335.0


def _arithmetic_ettr(rec: ReplicaRecovery) -> dict:
    """Paper-style ETTR at 98K: each failure costs the job-wide stalls plus its replica's time
    out, shared over 12 replicas."""
    rate = 1 / ettr.kokolis_mttf_s(ettr.PAPER_GPUS)
    out = rec.stall_s + rec.relaunch_s + rec.catchup_s + rec.join_stall_s
    return {"work": 1 - rate * (rec.stall_s + rec.join_stall_s + out / 12),
            "time": 1 - rate * (rec.stall_s + rec.join_stall_s)}


def test_replica_simulation_matches_the_arithmetic_when_recoveries_rarely_overlap() -> None:
    """ftsystem's recoveries at 98K are short against the MTTF (about 400 s out of 1,114), so
    the simulated ETTR must come close to the per-failure arithmetic: a check of the replica
    dynamics that the paper's 3-minute stalls (which queue) cannot give."""
    rec = si.recovery(si.components(EVIDENCE, ettr.PAPER_GPUS), ettr.PAPER_GPUS)
    simulated = ettr.mean_ettr(rec, ettr.PAPER_GPUS, failure_model="kokolis", failures=2_000,
                               seeds=1, seed=0)
    expected = _arithmetic_ettr(rec)
    assert simulated["work"] == pytest.approx(expected["work"], abs=0.004)
    assert simulated["time"] == pytest.approx(expected["time"], abs=0.002)


def test_sensitivity_rows_cover_every_input_and_point() -> None:
    parts = si.components(EVIDENCE, ettr.PAPER_GPUS)
    rows = si.sensitivity(parts, ettr.PAPER_GPUS, _arithmetic_ettr)
    assert [row["input"] for row in rows] == list(parts)
    for row in rows:
        values = [p["value_s"] for p in row["points"]]
        assert values == list(parts[row["input"]].points()) and row["base_s"] in values
        at_base = next(p for p in row["points"] if p["value_s"] == row["base_s"])
        assert at_base == {"value_s": row["base_s"],
                           **_arithmetic_ettr(si.recovery(parts, ettr.PAPER_GPUS))}


def test_simulated_ettr_falls_as_each_input_grows() -> None:
    parts = si.components(EVIDENCE, ettr.PAPER_GPUS)
    rows = si.sensitivity(parts, ettr.PAPER_GPUS, lambda rec: ettr.mean_ettr(
        rec, ettr.PAPER_GPUS, failure_model="kokolis", failures=400, seeds=1, seed=0))
    for row in rows:
        work = [p["work"] for p in row["points"]]
        assert all(b <= a + 1e-3 for a, b in zip(work, work[1:])), (row["input"], work)
        assert work[-1] < work[0], row["input"]   # every input matters over its range


# --- the command ---------------------------------------------------------------------------------

HOST_FAILOVER = {"nodes_per_replica": 1, "setup": {"ftsystem_timeout_s": 30.0},
                 "ftsystem": {"failures": 8, "stall_s": {"median": 0.7, "max": 1.1}},
                 "layouts": {"nodes_per_replica_2": {"ftsystem": {
                     "failures": 3, "nodes_per_replica": 2,
                     "stall_s": {"median": 1.0, "max": 1.2}}}}}
CONTROLLER = {"config": {"nodes": 16_384}, "decision_latency_s": {
    "node_lease_end": {"p50": 0.012, "p99": 0.034},
    "reported_failure": {"p50": 0.009, "p99": 0.030}}}


@pytest.fixture
def bench_files(tmp_path):
    host = tmp_path / "failover_host.json"
    host.write_text(json.dumps(HOST_FAILOVER))
    controller = tmp_path / "controller_nodes.json"
    controller.write_text(json.dumps(CONTROLLER))
    rejoin = tmp_path / "rejoin.json"
    rejoin.write_text(json.dumps({"sizes": [
        {"params": 1e6, "step_s": 0.1, "ftsystem": {"join_stall_s": 0.1, "time_to_join_s": 2.0}},
        {"params": 1e8, "step_s": 1.0,     # a figure of several rounds gives its median
         "ftsystem": {"join_stall_s": {"median": 0.2, "min": 0.1, "max": 0.3},
                      "time_to_join_s": 9.0}},
    ]}))
    return host, controller, rejoin


def test_cli_quick_writes_report_and_png(tmp_path, bench_files, monkeypatch) -> None:
    monkeypatch.setattr(ettr, "SCALES", (1_024, ettr.PAPER_GPUS))   # the sweep is tested above
    host, controller, rejoin = bench_files
    out, png = tmp_path / "out" / "ettr.json", tmp_path / "out" / "ettr.png"
    result = CliRunner().invoke(app, [
        "sim", "ettr", "--reproduce-paper", "--quick", "--json", str(out), "--png", str(png),
        "--host-failover-json", str(host), "--controller-json", str(controller),
        "--rejoin-json", str(rejoin)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {"paper", "ftsystem", "sensitivity", "assumptions", "scales", "machine"} \
        <= report.keys()
    assert report["paper"]["reproduced"]
    fts = report["ftsystem"]
    assert fts["seeds_min"] <= fts["ettr_100k"] <= fts["seeds_max"] <= 1.0
    assert [row["gpus"] for row in report["scales"]] == list(ettr.SCALES)
    assert {"gpus", "sync", "fthsdp", "ftsystem", "ftsystem_recovery_s"} \
        <= report["scales"][0].keys()
    inputs = report["assumptions"]["ftsystem"]
    assert inputs["missing"] == []
    assert inputs["by_kind"][si.MEASURED] == ["host_stall_s", "decision_s", "time_to_join_s",
                                              "join_stall_s"]
    assert inputs["inputs"]["host_stall_s"]["value_s"] == 1.0      # the 2-node layout
    assert inputs["inputs"]["decision_s"]["value_s"] == 0.034      # the slower kind's p99
    assert inputs["inputs"]["time_to_join_s"]["value_s"] == 9.0    # the largest model
    assert inputs["inputs"]["join_stall_s"]["value_s"] == 0.2
    assert math.isclose(inputs["recovery"]["stall_s"], 1.0 + 0.034 + si.nccl_init_s(12))
    rows = report["sensitivity"]["rows"]
    assert [r["input"] for r in rows] == list(inputs["inputs"])
    assert all(len(r["points"]) >= 3 for r in rows)
    assert png.read_bytes().startswith(b"\x89PNG")
    for title in ("Paper reproduction", "Sensitivity", "inputs at 98,304"):
        assert title in flat(result.output)


def test_missing_default_benchmarks_are_assumed_and_labelled(tmp_path) -> None:
    assert ettr_cli._benchmark_file(None, tmp_path / "absent.json") is None
    evidence = ettr_cli.read_evidence(None, None, None)
    parts = si.components(evidence, ettr.PAPER_GPUS)
    assumed = [name for name, part in parts.items() if part.kind == si.ASSUMED]
    assert assumed == ["host_stall_s", "decision_s", "host_wait_s", "time_to_join_s",
                       "join_stall_s"]
    assert parts["host_stall_s"].value_s == 30.0   # the default timeout
    assert all(parts[name].source.startswith("assumed") for name in assumed)


def test_cli_exits_1_when_paper_not_reproduced(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(ettr, "SCALES", (ettr.PAPER_GPUS,))
    monkeypatch.chdir(tmp_path)   # no bench/results here: costs assumed
    out = tmp_path / "ettr.json"
    result = CliRunner().invoke(app, ["sim", "ettr", "--reproduce-paper", "--quick",
                                      "--no-sensitivity", "--failure-model", "llama3",
                                      "--json", str(out)])
    assert result.exit_code == 1
    assert "does not reproduce" in flat(result.output)
    assert json.loads(out.read_text())["paper"]["reproduced"] is False   # the report is kept


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("{not json", "not valid JSON"),
    (json.dumps({"torchft": {}}), "has no ftsystem.stall_s"),
    (json.dumps({"ftsystem": {"stall_s": {"median": -1.0, "max": 1.0}}}), "non-negative"),
    (json.dumps({"ftsystem": {"stall_s": {"median": "fast", "max": 1.0}}}), "non-negative"),
])
def test_cli_rejects_bad_host_failover_file(tmp_path, content, message) -> None:
    path = tmp_path / "failover_host.json"
    if content is not None:
        path.write_text(content)
    result = CliRunner().invoke(app, ["sim", "ettr", "--quick", "--host-failover-json",
                                      str(path)])
    assert result.exit_code == 2
    assert message in flat(result.output)
    assert isinstance(result.exception, SystemExit)   # a message, not a traceback


@pytest.mark.parametrize("option, name, content, message", [
    ("--controller-json", "controller_nodes.json", {"decision_latency_s": {}},
     "has no config.nodes"),
    ("--controller-json", "controller_nodes.json",
     {"config": {"nodes": 4}, "decision_latency_s": {}}, "at least one kind"),
    ("--controller-json", "controller_nodes.json",
     {"config": {"nodes": 4}, "decision_latency_s": {"k": {"p50": 0.1}}}, "has no p99"),
    ("--rejoin-json", "rejoin.json", {"sizes": []}, "non-empty list"),
    ("--rejoin-json", "rejoin.json",
     {"sizes": [{"params": 1e6, "ftsystem": {"join_stall_s": 0.1}}]},
     "has no ftsystem.time_to_join_s"),
    ("--rejoin-json", "rejoin.json",
     {"sizes": [{"params": 1e6, "ftsystem": {"join_stall_s": -2, "time_to_join_s": 1}}]},
     "non-negative"),
])
def test_cli_rejects_bad_benchmark_files(tmp_path, option, name, content, message) -> None:
    path = tmp_path / name
    path.write_text(json.dumps(content))
    result = CliRunner().invoke(app, ["sim", "ettr", "--quick", option, str(path)])
    assert result.exit_code == 2
    assert message in flat(result.output)


def test_cli_rejects_negative_seed() -> None:
    result = CliRunner().invoke(app, ["sim", "ettr", "--quick", "--seed", "-1"])
    assert result.exit_code == 2
    assert "--seed" in flat(result.output)
