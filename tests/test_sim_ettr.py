"""ETTR simulation (ftsystem.sim.ettr, ``ftsystem sim ettr``): hand-computed cases for the cost
arithmetic and the event simulation, the paper reproduction, and the command as users run it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from ftsystem.cli import app
from ftsystem.sim import ettr, ettr_cli
from ftsystem.sim.ettr import (Failures, Outcome, ReplicaRecovery, SyncRecovery,
                               checkpointed_progress, simulate_replicas, simulate_sync)

SYNC = SyncRecovery(restart_s=100.0, checkpoint_write_s=0.0, checkpoint_interval_s=100.0)
REPLICA = ReplicaRecovery(stall_s=10.0, relaunch_s=50.0, catchup_s=40.0, join_stall_s=5.0,
                          replica_gpus=1)
NO_FAILURES = Failures(np.array([]), np.array([]))
QUICK_COSTS = ettr.ftsystem_recovery(stall_s=5.0, catchup_s=60.0, join_stall_s=1.0)


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
    row = ettr.ettr_at_scale(ettr.PAPER_GPUS, QUICK_COSTS, failure_model="kokolis",
                             failures=2_000, seeds=2, seed=0)
    assert abs(row["sync"] - 0.44) <= 0.03
    assert abs(row["fthsdp"] - 0.80) <= 0.03
    assert row["time_based"]["fthsdp"] > row["fthsdp"]   # reduced capacity while replicas recover
    assert ettr.paper_reproduced(row)


def test_more_gpus_lower_sync_ettr() -> None:
    rows = [ettr.ettr_at_scale(g, QUICK_COSTS, failure_model="kokolis", failures=500, seeds=1,
                               seed=0) for g in ettr.SCALES]
    sync = [row["sync"] for row in rows]
    assert sync == sorted(sync, reverse=True)
    assert all(row["sync"] < row["fthsdp"] < row["ftsystem"] for row in rows[-4:])


# --- the command ---------------------------------------------------------------------------------

@pytest.fixture
def bench_files(tmp_path):
    failover = tmp_path / "failover.json"
    failover.write_text(json.dumps({"ftsystem": {"failures": 5, "stall_s": {"median": 0.5,
                                                                            "max": 1.2}}}))
    rejoin = tmp_path / "rejoin.json"
    rejoin.write_text(json.dumps({"sizes": [
        {"params": 1e6, "step_s": 0.1, "ftsystem": {"join_stall_s": 0.1, "time_to_join_s": 2.0}},
        {"params": 1e8, "step_s": 1.0, "ftsystem": {"join_stall_s": 0.2, "time_to_join_s": 9.0}},
    ]}))
    return failover, rejoin


def test_cli_quick_writes_report_and_png(tmp_path, bench_files) -> None:
    failover, rejoin = bench_files
    out, png = tmp_path / "out" / "ettr.json", tmp_path / "out" / "ettr.png"
    result = CliRunner().invoke(app, [
        "sim", "ettr", "--reproduce-paper", "--quick", "--json", str(out), "--png", str(png),
        "--failover-json", str(failover), "--rejoin-json", str(rejoin)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {"paper", "ftsystem", "assumptions", "scales", "machine"} <= report.keys()
    assert report["paper"]["reproduced"]
    assert 0.0 < report["ftsystem"]["ettr_100k"] <= 1.0
    assert [row["gpus"] for row in report["scales"]] == list(ettr.SCALES)
    assert {"gpus", "sync", "fthsdp", "ftsystem"} <= report["scales"][0].keys()
    costs = report["assumptions"]["ftsystem"]
    assert costs["measured"] == ["stall_s", "join_stall_s", "catchup_s"] and not costs["assumed"]
    assert costs["catchup_s"]["value_s"] == 9.0   # the largest model in rejoin.json
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "Paper reproduction" in result.output


def test_missing_default_benchmarks_are_assumed_and_labelled(tmp_path) -> None:
    assert ettr_cli._benchmark_file(None, tmp_path / "absent.json") is None
    costs = ettr_cli._ftsystem_assumptions(ettr_cli.ftsystem_costs(None, None))
    assert costs["assumed"] == ["stall_s", "join_stall_s", "catchup_s"] and not costs["measured"]
    assert all(costs[name]["source"].startswith("assumed") for name in costs["assumed"])


def test_cli_exits_1_when_paper_not_reproduced(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(ettr, "SCALES", (ettr.PAPER_GPUS,))
    monkeypatch.chdir(tmp_path)   # no bench/results here: costs assumed
    out = tmp_path / "ettr.json"
    result = CliRunner().invoke(app, ["sim", "ettr", "--reproduce-paper", "--quick",
                                      "--failure-model", "llama3", "--json", str(out)])
    assert result.exit_code == 1
    assert "does not reproduce" in flat(result.output)
    assert json.loads(out.read_text())["paper"]["reproduced"] is False   # the report is kept


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("{not json", "not valid JSON"),
    (json.dumps({"torchft": {}}), "has no ftsystem.stall_s"),
    (json.dumps({"ftsystem": {"stall_s": {"median": -1.0}}}), "non-negative"),
    (json.dumps({"ftsystem": {"stall_s": {"median": "fast"}}}), "non-negative"),
])
def test_cli_rejects_bad_failover_file(tmp_path, content, message) -> None:
    path = tmp_path / "failover.json"
    if content is not None:
        path.write_text(content)
    result = CliRunner().invoke(app, ["sim", "ettr", "--quick", "--failover-json", str(path)])
    assert result.exit_code == 2
    assert message in flat(result.output)
    assert isinstance(result.exception, SystemExit)   # a message, not a traceback


@pytest.mark.parametrize("content, message", [
    (json.dumps({"sizes": []}), "non-empty list"),
    (json.dumps({"sizes": [{"params": 1e6, "ftsystem": {"join_stall_s": 0.1}}]}),
     "has no ftsystem.time_to_join_s"),
    (json.dumps({"sizes": [{"params": 1e6, "ftsystem": {"join_stall_s": -2,
                                                        "time_to_join_s": 1}}]}), "non-negative"),
])
def test_cli_rejects_bad_rejoin_file(tmp_path, content, message) -> None:
    path = tmp_path / "rejoin.json"
    path.write_text(content)
    result = CliRunner().invoke(app, ["sim", "ettr", "--quick", "--rejoin-json", str(path)])
    assert result.exit_code == 2
    assert message in flat(result.output)


def test_cli_rejects_negative_seed() -> None:
    result = CliRunner().invoke(app, ["sim", "ettr", "--quick", "--seed", "-1"])
    assert result.exit_code == 2
    assert "--seed" in flat(result.output)
