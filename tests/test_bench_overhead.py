"""``ftsystem bench overhead --quick`` end to end: real DDP ranks (one process each), a real
``ftsystem run`` (etcd, controller, agents) and real torchft replicas with their lighthouse;
a tiny model and few steps, so it checks the wiring and the JSON, not the figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ftsystem.benchmarks.harness import RunSpec, ddp_rank_command, spec_mismatches
from ftsystem.benchmarks.overhead import (
    DDP_TIMEOUT_S,
    QUICK_STEPS,
    SYSTEMS,
    _wait_all,
    job_rate,
    parse_sizes,
    parse_systems,
    ratios,
    run_ddp,
    run_ranks,
    steady_rate,
    warmup_steps,
)
from ftsystem.cli import app


def test_sizes_parse_with_suffixes_and_refuse_nonsense() -> None:
    assert parse_sizes("10M, 100M") == [10_000_000, 100_000_000]
    assert parse_sizes("1.5k,2000") == [1500, 2000]
    for text in ("", "ten", "0", "10M,-1M"):
        with pytest.raises(ValueError, match="e.g. 10M,100M"):
            parse_sizes(text)


def test_rates_leave_out_the_warmup() -> None:
    # Steps 1-2 are slow (start-up); from step 3 on, one step every 0.5 s.
    timeline = [(1, 10.0), (2, 15.0), (3, 16.0), (4, 16.5), (5, 17.0)]
    assert steady_rate(timeline, warmup=2) == pytest.approx(2.0)
    assert steady_rate(timeline, warmup=4) is None
    assert job_rate([timeline, [(3, 0.0), (5, 2.0)]], warmup=2) == pytest.approx(1.5)
    assert ratios({"ddp": 2.0, "ftsystem": 1.9, "torchft": None}) == {
        "ddp": 1.0, "ftsystem": pytest.approx(0.95), "torchft": None}
    assert warmup_steps(20) == 4 and warmup_steps(5) == 2


def test_systems_parse_with_ddp_always_first_and_refuse_unknown_ones() -> None:
    assert parse_systems("torchft, ftsystem") == ["ddp", "ftsystem", "torchft"]
    assert parse_systems(",".join(SYSTEMS)) == list(SYSTEMS)
    with pytest.raises(ValueError, match="unknown system.*'horovod'.*choose from ddp"):
        parse_systems("ftsystem,horovod")


def test_a_malformed_size_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["bench", "overhead", "--sizes", "big"])
    assert result.exit_code == 2
    assert "malformed model size" in result.output


def test_the_real_loop_without_torchft_s_replica_is_a_usage_error() -> None:
    result = CliRunner().invoke(app, ["bench", "overhead", "--loop", "real"])
    assert result.exit_code == 2 and "plain loop only" in result.output
    result = CliRunner().invoke(app, ["bench", "overhead", "--loop", "fancy"])
    assert result.exit_code == 2 and "loop must be one of plain, real" in result.output


@pytest.mark.slow
# 53 s alone; with two CPU-bound jobs beside it on 2 cores, torchft's part ran past 240 s.
@pytest.mark.timeout(480)
def test_quick_run_writes_positive_throughputs(tmp_path) -> None:
    out = tmp_path / "overhead.json"
    # ftsystem's variants (--overlap on, digests every 10 steps) launch as ftsystem does.
    systems = ("ddp", "ddp-control-plane", "ftsystem", "torchft")
    result = CliRunner().invoke(app, ["bench", "overhead", "--quick", "--json", str(out),
                                      "--systems", ",".join(systems)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {"models", "replicas", "machine"} <= set(data)
    assert data["replicas"] == 2 and len(data["models"]) == 1
    model = data["models"][0]
    assert model["params"] > 0 and model["steps"] == QUICK_STEPS
    for key in ("steps_per_s", "ratio_vs_ddp", "median_step_s"):
        assert set(model[key]) == set(systems)
        assert all(math.isfinite(v) and v > 0 for v in model[key].values()), model[key]
    assert model["ratio_vs_ddp"]["ddp"] == 1.0
    for key in ("steps_per_s_spread", "ratio_vs_ddp_spread"):  # one round: min = median = max
        spread = model[key]["ftsystem"]
        assert spread["min"] == spread["median"] == spread["max"] > 0, model[key]
    # Every system trained one spec, and each run says so.
    runs = [run for system_runs in model["runs"].values() for run in system_runs]
    assert sorted(run["system"] for run in runs) == sorted(systems)
    assert spec_mismatches(runs) == [] and runs[0]["spec"]["steps"] == QUICK_STEPS
    assert [entry["order"] for entry in model["round_log"]] == [list(systems)]
    # The parts of commit() after the start-up commits, and those apart.
    run = model["runs"]["ftsystem"][0]
    assert run["commit_ms"]["allreduce"] > 0 and run["start_up_commit_ms"]["pack"] > 0
    assert "overhead: steady-state throughput" in result.output


@pytest.mark.slow
def test_ddp_trains_the_real_loop(tmp_path) -> None:
    # Two real ranks run the example program's loop (schedule, scaler, clipping, dropout,
    # the shuffling loader) through DDP: every step commits on both.
    timelines = run_ddp(RunSpec(num_replicas=2, steps=3, loop="real"), tmp_path)
    assert sorted(len(tl) for tl in timelines.values()) == [3, 3], timelines


@pytest.mark.slow
def test_a_failing_ddp_rank_ends_the_baseline_with_its_log(tmp_path) -> None:
    # A negative learning rate (the last --lr counts) fails in each rank's optimizer, after the
    # imports and the rendezvous: real processes, and the peer that would otherwise wait for it
    # is stopped.
    spec = RunSpec(num_replicas=2, steps=2)
    with pytest.raises(RuntimeError, match=r"DDP rank \d exited with 1; its log ends:(.|\n)*"
                                           r"Invalid learning rate"):
        run_ranks("DDP", lambda rank: [*ddp_rank_command(spec, rank, tmp_path), "--lr", "-1"],
                  world_size=2, workdir=tmp_path, timeout_s=DDP_TIMEOUT_S)


def test_ranks_with_results_written_are_not_waited_for_while_tearing_down() -> None:
    # One rank exited 0; the other wrote its results but hangs tearing down (a sleep here).
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert _wait_all([done, stuck], 120, finished=lambda index: True, teardown_s=1) is None
        assert stuck.poll() is None  # left to the caller to stop
        # Without its results it is waited for, here until the timeout: (its index, None).
        assert _wait_all([done, stuck], 1) == (1, None)
    finally:
        stuck.kill()
        stuck.wait()


def test_a_rank_that_crashes_after_writing_its_results_fails_nothing() -> None:
    # gloo's threads once aborted a DDP rank's exit (SIGABRT) after its results were on disk.
    crashed = subprocess.Popen([sys.executable, "-c", "import os; os.abort()"])
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    crashed.wait()
    done.wait()
    assert _wait_all([crashed, done], 30, finished=lambda index: True) is None
    # Before its results are written, the same crash is the run's failure.
    assert _wait_all([crashed, done], 30) == (0, crashed.returncode)
