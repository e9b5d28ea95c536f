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
QUICK_COSTS = ReplicaRecovery(stall_s=5.0, relaunch_s=358.0, catchup_s=60.0, join_stall_s=1.0,
                              replica_gpus=8_192)


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


def test_per_step_costs_lower_work_not_time() -> None:
    slowed = replace(REPLICA, throughput=0.9)
    assert simulate_replicas(slowed, 4, NO_FAILURES, 1000.0) == Outcome(1.0, 0.9)
    out = simulate_replicas(slowed, 4, trace((100.0, 0.1)), 1000.0)
    assert math.isclose(out.time, 0.985)
    assert math.isclose(out.work, 0.9 * (100 + 90 * 0.75 + 795) / 1000)
    for bad in (0.0, 1.1):
        with pytest.raises(ValueError, match="throughput"):
            replace(REPLICA, throughput=bad)


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

def _fthsdp(gpus: int) -> ReplicaRecovery:
    """FT-HSDP with the relaunch model shared with ftsystem (EVIDENCE does not enter it)."""
    return si.fthsdp_recovery(si.components(EVIDENCE, gpus), gpus)


def test_reproduces_paper_at_100k() -> None:
    row = ettr.ettr_at_scale(ettr.PAPER_GPUS, lambda _: QUICK_COSTS, _fthsdp,
                             failure_model="kokolis", failures=2_000, seeds=2, seed=0)
    assert abs(row["sync"] - 0.44) <= 0.03
    assert abs(row["fthsdp"] - 0.80) <= 0.03
    assert row["time_based"]["fthsdp"] > row["fthsdp"]   # reduced capacity while replicas recover
    assert ettr.paper_reproduced(row)


def test_more_gpus_lower_sync_ettr() -> None:
    rows = [ettr.ettr_at_scale(g, lambda _: QUICK_COSTS, _fthsdp, failure_model="kokolis",
                               failures=500, seeds=1, seed=0) for g in ettr.SCALES]
    sync = [row["sync"] for row in rows]
    assert sync == sorted(sync, reverse=True)
    assert all(row["sync"] < row["fthsdp"] < row["ftsystem"] for row in rows[-4:])


# --- ftsystem's inputs at scale ----------------------------------------------------------------

EVIDENCE = si.Evidence(
    host_stall=si.host_stall_input({1: {"median": 0.7, "max": 1.1}, 2: {"median": 1.0,
                                                                          "max": 1.2}},
                                   "failover_host.json", timeout_s=30.0),
    decision=si.decision_input(0.01, 0.03, "controller_nodes.json"), decision_nodes=16_384,
    time_to_join=si.time_to_join_input(si.Spread(median=30.0, low=28.0, high=33.0),
                                       "rejoin.json"),
    join_stall=si.join_stall_input(si.Spread(median=5.0, low=4.0, high=6.0), "rejoin.json",
                                   at_join_step=3.0))
PARTS = si.components(EVIDENCE, ettr.PAPER_GPUS)
NAMES = ["host_stall_s", "hang_fraction", "step_s", "decision_s", "nccl_reinit_s",
         "store_connect_s", "store_request_s", "host_wait_s", "replica_nccl_init_s",
         "time_to_join_s", "join_stall_s", "vote_hop_s"]


def with_values(parts: dict[str, si.Input], **values: float) -> dict[str, si.Input]:
    return {**parts, **{name: replace(parts[name], value=v) for name, v in values.items()}}


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


def test_store_rendezvous_counts_connections_and_requests() -> None:
    # Two connections and 3 + 11 requests per rank, served one after another.
    assert math.isclose(si.store_rendezvous_s(100, 12, 1e-3, 1e-5), 100 * (2e-3 + 14e-5))
    assert si.store_rendezvous_s(0, 1, 1e-3, 1e-5) == 0.0
    assert si.store_rendezvous_s(100, 1, 0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="members"):
        si.store_rendezvous_s(100, 0, 1e-3, 1e-5)
    # The published point: 98,304 ranks connecting once each take the store 100 s.
    assert math.isclose(si.STORE_CONNECT_S * si.STORE_INIT[0], 100.0)


def test_votes_are_a_ring_over_the_replica_and_a_share_of_the_step() -> None:
    assert si.vote_s(1, 1.0) == 0.0                       # a replica of one rank has no group
    assert math.isclose(si.vote_s(2, 20e-6), 2 * 20e-6)
    assert math.isclose(si.vote_s(8_192, 20e-6), 2 * 8_191 * 20e-6)
    assert si.vote_loss(6.0, 0.0) == 0.0
    assert math.isclose(si.vote_loss(6.0, 0.5), 1.0 / 7.0)   # two votes of 0.5 s on a 6 s step
    assert si.vote_loss(1.0, 0.5) > si.vote_loss(6.0, 0.5)   # shorter steps lose more


def test_hang_detection_follows_the_straggler_bound() -> None:
    assert si.hang_detection_s(0.1) == 2.0      # the floor
    assert si.hang_detection_s(1.0) == 4.0      # 4 x the step
    assert si.hang_detection_s(si.STEP_S) == 10.0   # the watchdog's third of the 30 s timeout
    assert math.isclose(si.STEP_S, 6 * 405e9 * 16e6 / (16_384 * 400e12))
    t = si.terms(PARTS, ettr.PAPER_GPUS)
    assert math.isclose(t["detection_s"], 0.7 * 1.0 + 0.3 * 10.0)
    assert si.terms(with_values(PARTS, hang_fraction=0.0), ettr.PAPER_GPUS)["detection_s"] == 1.0
    with pytest.raises(ValueError, match="fraction"):
        replace(PARTS["hang_fraction"], value=1.5)


def test_inputs_carry_their_provenance() -> None:
    with pytest.raises(ValueError, match="kind"):
        si.Input(value=1.0, kind="guessed", source="x")
    with pytest.raises(ValueError, match="unit"):
        si.Input(value=1.0, kind=si.ASSUMED, source="x", unit="hours")
    with pytest.raises(ValueError, match="non-negative"):
        si.Input(value=1.0, kind=si.ASSUMED, source="x", sweep=(-1.0,))
    part = si.Input(value=2.0, kind=si.ASSUMED, source="x", sweep=(3.0, 1.0, 2.0))
    assert part.points() == (1.0, 2.0, 3.0) and part.range() == (1.0, 3.0)
    assert list(PARTS) == NAMES
    kinds = {name: part.kind for name, part in PARTS.items()}
    assert kinds == {"host_stall_s": si.MEASURED, "hang_fraction": si.ASSUMED,
                     "step_s": si.MODEL, "decision_s": si.MEASURED, "nccl_reinit_s": si.MODEL,
                     "store_connect_s": si.PUBLISHED, "store_request_s": si.ASSUMED,
                     "host_wait_s": si.ASSUMED, "replica_nccl_init_s": si.MODEL,
                     "time_to_join_s": si.MEASURED, "join_stall_s": si.MEASURED,
                     "vote_hop_s": si.ASSUMED}
    assert "arXiv 2510.20171" in PARTS["nccl_reinit_s"].source
    assert "failover_host.json" in PARTS["host_stall_s"].source
    assert "TCPStore" in PARTS["store_connect_s"].source
    assert "gloo#158" in PARTS["vote_hop_s"].source
    for name, part in PARTS.items():   # every input has a range to sweep
        assert part.range()[0] < part.range()[1], name


def test_measured_spreads_enter_the_sweeps() -> None:
    assert EVIDENCE.time_to_join.points() == (15.0, 28.0, 30.0, 33.0, 60.0, 120.0)
    assert EVIDENCE.join_stall.points() == (0.0, 3.0, 4.0, 5.0, 6.0, 10.0, 20.0)


def test_host_stall_takes_the_multi_node_layout_and_falls_back_to_the_timeout() -> None:
    measured = EVIDENCE.host_stall
    assert measured.value == 1.0 and measured.kind == si.MEASURED
    assert measured.points() == (0.7, 1.0, 1.2, 10.0, 30.0)   # ..., lease TTL, timeout
    assumed = si.host_stall_input(None, "", timeout_s=30.0)
    assert assumed.value == 30.0 and assumed.kind == si.ASSUMED
    assert "timeout" in assumed.source
    from ftsystem.training.runtime import DEFAULT_TIMEOUT_S
    assert si.DEFAULT_TIMEOUT_S == DEFAULT_TIMEOUT_S


def test_components_scale_with_the_job() -> None:
    at_98k, at_196k = (si.components(EVIDENCE, g) for g in (ettr.PAPER_GPUS, 196_608))
    # 12,288 hosts: fewer than the 16,384 node agents measured; 24,576: 1.5 times as many.
    assert at_98k["decision_s"].value == 0.03
    assert math.isclose(at_196k["decision_s"].value, 0.045)
    assert at_98k["nccl_reinit_s"].value == si.nccl_init_s(12)     # one rank per replica
    assert at_196k["nccl_reinit_s"].value == si.nccl_init_s(24)
    assert at_98k["replica_nccl_init_s"].value == si.nccl_init_s(8_192)
    small = si.components(EVIDENCE, 1_024)   # eight replicas of 128 GPUs
    assert small["replica_nccl_init_s"].value == si.nccl_init_s(128)
    unmeasured = replace(EVIDENCE, decision=si.decision_input(None, None, ""), decision_nodes=None)
    assert si.components(unmeasured, 196_608)["decision_s"].value == 1.0   # not scaled
    # The rendezvous grows with the ranks; the votes with a replica's ranks.
    t_small, t_98k, t_196k = (si.terms(si.components(EVIDENCE, g), g)
                              for g in (1_024, ettr.PAPER_GPUS, 196_608))
    assert t_small["rendezvous_join_s"] < t_98k["rendezvous_join_s"] < t_196k["rendezvous_join_s"]
    assert t_small["vote_s"] < t_98k["vote_s"] == t_196k["vote_s"]


def test_recovery_adds_its_components() -> None:
    rec = si.recovery(PARTS, ettr.PAPER_GPUS)
    reconfigure = 0.03 + si.nccl_init_s(12)
    connect, request = si.STORE_CONNECT_S, si.STORE_REQUEST_S
    survivors = 11 * 8_192 * (2 * connect + 13 * request)   # 11 members: 3 + 10 requests
    everyone = 12 * 8_192 * (2 * connect + 14 * request)
    assert math.isclose(rec.stall_s, 0.7 * 1.0 + 0.3 * 10.0 + reconfigure + survivors)
    assert math.isclose(rec.relaunch_s, si.HOST_WAIT_S + si.nccl_init_s(8_192))
    assert rec.catchup_s == 30.0
    assert math.isclose(rec.join_stall_s, 5.0 + reconfigure + everyone)
    assert rec.replica_gpus == 8_192
    votes = 2 * 2 * 8_191 * si.VOTE_HOP_S
    assert math.isclose(rec.throughput, 1 - votes / (si.STEP_S + votes))
    assert si.HOST_WAIT_S == 335.0


def test_fthsdp_and_ftsystem_share_the_relaunch() -> None:
    for parts in (PARTS, with_values(PARTS, host_wait_s=0.0, replica_nccl_init_s=265.0)):
        fthsdp, ftsystem = (f(parts, ettr.PAPER_GPUS) for f in (si.fthsdp_recovery, si.recovery))
        assert fthsdp.relaunch_s == ftsystem.relaunch_s == si.relaunch_s(parts)
        assert fthsdp.relaunch_s == parts["host_wait_s"].value + parts["replica_nccl_init_s"].value
        assert (fthsdp.stall_s, fthsdp.catchup_s, fthsdp.join_stall_s) == (180.0, 0.0, 0.0)
        assert fthsdp.throughput == 1.0
    # The measured inputs move ftsystem only.
    changed = with_values(PARTS, time_to_join_s=99.0, join_stall_s=9.0, host_stall_s=3.0)
    assert si.fthsdp_recovery(changed, ettr.PAPER_GPUS) == si.fthsdp_recovery(PARTS,
                                                                              ettr.PAPER_GPUS)
    assert si.recovery(changed, ettr.PAPER_GPUS) != si.recovery(PARTS, ettr.PAPER_GPUS)


def test_baseline_inputs_state_their_provenance() -> None:
    base = si.baseline_inputs("kokolis")
    assert base["sync_restart_s"].value == 600.0 and base["sync_restart_s"].kind == si.PUBLISHED
    assert base["fthsdp_stall_s"].value == 180.0 and base["fthsdp_stall_s"].kind == si.PUBLISHED
    assert base["checkpoint_write_s"].kind == si.ASSUMED
    assert base["replica_gpus"].range() == (4_096.0, 16_384.0)
    assert base["mttf_s"].range() == (ettr.kokolis_mttf_s(ettr.PAPER_GPUS),
                                      ettr.llama3_mttf_s(ettr.PAPER_GPUS))


def _arithmetic_ettr(rec: ReplicaRecovery) -> dict:
    """Paper-style ETTR at 98K: each failure costs the job-wide stalls plus its replica's time
    out, shared over 12 replicas; the votes take their share of the work."""
    rate = 1 / ettr.kokolis_mttf_s(ettr.PAPER_GPUS)
    out = rec.stall_s + rec.relaunch_s + rec.catchup_s + rec.join_stall_s
    return {"work": rec.throughput * (1 - rate * (rec.stall_s + rec.join_stall_s + out / 12)),
            "time": 1 - rate * (rec.stall_s + rec.join_stall_s)}


def test_replica_simulation_matches_the_arithmetic_when_recoveries_rarely_overlap() -> None:
    """With connections to the store kept across epochs, ftsystem's job-wide stalls at 98K are
    short against the MTTF (about 30 s out of 1,114), so the simulated ETTR must come close to
    the per-failure arithmetic: a check of the replica dynamics that the paper's 3-minute stalls
    (which queue) cannot give."""
    rec = si.recovery(with_values(PARTS, store_connect_s=0.0), ettr.PAPER_GPUS)
    assert rec.stall_s + rec.join_stall_s < 40
    simulated = ettr.mean_ettr(rec, ettr.PAPER_GPUS, failure_model="kokolis", failures=2_000,
                               seeds=1, seed=0)
    expected = _arithmetic_ettr(rec)
    assert simulated["work"] == pytest.approx(expected["work"], abs=0.006)
    assert simulated["time"] == pytest.approx(expected["time"], abs=0.003)


def test_sensitivity_rows_cover_every_input_and_rank_by_swing() -> None:
    rows = si.sensitivity(PARTS, ettr.PAPER_GPUS, _arithmetic_ettr)
    assert sorted(row["input"] for row in rows) == sorted(PARTS)
    swings = [row["swing"] for row in rows]
    assert swings == sorted(swings, reverse=True)
    for row in rows:
        values = [p["value"] for p in row["points"]]
        assert values == list(PARTS[row["input"]].points()) and row["base"] in values
        at_base = next(p for p in row["points"] if p["value"] == row["base"])
        assert at_base == {"value": row["base"],
                           **_arithmetic_ettr(si.recovery(PARTS, ettr.PAPER_GPUS))}
        work = [p["work"] for p in row["points"]]
        assert math.isclose(row["swing"], max(work) - min(work))
    # In this arithmetic the store's connections move the result most, the decision least.
    assert rows[0]["input"] == "store_connect_s" and rows[-1]["input"] == "decision_s"


def test_simulated_ettr_falls_as_each_input_grows() -> None:
    rows = si.sensitivity(PARTS, ettr.PAPER_GPUS, lambda rec: ettr.mean_ettr(
        rec, ettr.PAPER_GPUS, failure_model="kokolis", failures=400, seeds=1, seed=0))
    for row in rows:
        work = [p["work"] for p in row["points"]]
        if row["input"] == "step_s":   # longer steps spread the votes over more work
            assert work == sorted(work), work
            continue
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
REJOIN = {"rounds": 3, "sizes": [
    {"params": 1e6, "ftsystem": {"join_stall_s": 0.1, "time_to_join_s": 2.0}},
    {"params": 1e8,     # figures of several rounds give their medians, their extremes the sweep
     "ftsystem": {"join_stall_s": {"median": 0.2, "min": 0.1, "max": 0.3},
                  "join_step_stall_s": {"median": 0.15, "min": 0.1, "max": 0.2},
                  "time_to_join_s": {"median": 9.0, "min": 8.0, "max": 11.0},
                  "step_s": {"median": 10.0, "min": 9.9, "max": 10.4}}},
]}


@pytest.fixture
def bench_files(tmp_path):
    host = tmp_path / "failover_host.json"
    host.write_text(json.dumps(HOST_FAILOVER))
    controller = tmp_path / "controller_nodes.json"
    controller.write_text(json.dumps(CONTROLLER))
    rejoin = tmp_path / "rejoin.json"
    rejoin.write_text(json.dumps(REJOIN))
    return host, controller, rejoin


def test_rejoin_reader_takes_the_current_fields(bench_files) -> None:
    read = ettr_cli._rejoin(bench_files[2])
    assert read.time_to_join == si.Spread(median=9.0, low=8.0, high=11.0)
    assert read.join_stall == si.Spread(median=0.2, low=0.1, high=0.3)
    assert read.join_step_stall == 0.15
    assert "100,000,000 params" in read.source and "3 rounds" in read.source


def test_default_rejoin_file_has_the_fields_the_reader_takes() -> None:
    path = ettr_cli.DEFAULT_REJOIN_JSON
    if not path.is_file():
        pytest.skip("run from the repository root")
    read = ettr_cli._rejoin(path)
    assert read.time_to_join.low <= read.time_to_join.median <= read.time_to_join.high
    assert read.join_stall.low <= read.join_stall.median <= read.join_stall.high
    assert read.join_step_stall is not None


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
    assert {"gpus", "sync", "fthsdp", "ftsystem", "ftsystem_recovery_s", "ftsystem_throughput",
            "fthsdp_relaunch_s"} <= report["scales"][0].keys()
    at_98k = report["scales"][-1]
    assert at_98k["fthsdp_relaunch_s"] == at_98k["ftsystem_recovery_s"]["relaunch"]
    inputs = report["assumptions"]["ftsystem"]
    assert inputs["missing"] == []
    assert inputs["by_kind"][si.MEASURED] == ["host_stall_s", "decision_s", "time_to_join_s",
                                              "join_stall_s"]
    assert inputs["inputs"]["host_stall_s"]["value"] == 1.0      # the 2-node layout
    assert inputs["inputs"]["decision_s"]["value"] == 0.034      # the slower kind's p99
    assert inputs["inputs"]["time_to_join_s"]["value"] == 9.0    # the largest model
    assert inputs["inputs"]["time_to_join_s"]["range"] == [4.5, 36.0]
    assert inputs["inputs"]["join_stall_s"]["value"] == 0.2
    assert 0.15 in inputs["inputs"]["join_stall_s"]["sweep"]
    terms = inputs["terms"]
    assert math.isclose(inputs["recovery"]["stall_s"],
                        terms["detection_s"] + 0.034 + si.nccl_init_s(12)
                        + terms["rendezvous_failure_s"])
    assert math.isclose(inputs["recovery"]["throughput"], 1 - terms["vote_loss"])
    every = report["assumptions"]["inputs"]   # every input of every model, in one form
    assert set(inputs["inputs"]) < set(every)
    for name, entry in every.items():
        assert {"value", "unit", "kind", "source", "range", "used_by"} <= entry.keys(), name
        assert entry["kind"] in si.KINDS and entry["range"][0] <= entry["value"] \
            <= entry["range"][1], name
    assert every["host_wait_s"]["used_by"] == ["fthsdp", "ftsystem"]
    assert every["sync_restart_s"]["used_by"] == ["sync"]
    rows = report["sensitivity"]["rows"]
    assert sorted(r["input"] for r in rows) == sorted(inputs["inputs"])
    assert [r["swing"] for r in rows] == sorted((r["swing"] for r in rows), reverse=True)
    assert all(len(r["points"]) >= 3 for r in rows)
    assert png.read_bytes().startswith(b"\x89PNG")
    for title in ("Paper reproduction", "Sensitivity", "Every input at 98,304", "largest swing"):
        assert title in flat(result.output)


def test_missing_default_benchmarks_are_assumed_and_labelled(tmp_path) -> None:
    assert ettr_cli._benchmark_file(None, tmp_path / "absent.json") is None
    evidence = ettr_cli.read_evidence(None, None, None)
    parts = si.components(evidence, ettr.PAPER_GPUS)
    assumed = [name for name, part in parts.items() if part.kind == si.ASSUMED]
    assert assumed == ["host_stall_s", "hang_fraction", "decision_s", "store_request_s",
                       "host_wait_s", "time_to_join_s", "join_stall_s", "vote_hop_s"]
    assert parts["host_stall_s"].value == 30.0   # the default timeout
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
    ("--rejoin-json", "rejoin.json",
     {"sizes": [{"params": 1e6, "ftsystem": {"join_stall_s": {"median": 1, "max": -1},
                                             "time_to_join_s": 1}}]},
     "join_stall_s.max"),
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
