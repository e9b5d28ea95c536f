"""``ftsystem bench rejoin``: its pure summary, its usage errors, and a ``--quick`` run end to
end (real etcd, controller and agents; a 1M-parameter model, so it checks the wiring and
the JSON's shape, not the figures)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ftsystem.benchmarks import rejoin
from ftsystem.benchmarks.rejoin import _torchft_fetch_s, loopback_rate, parse_sizes, summarize
from ftsystem.cli import app


def test_summary_gives_each_figure_over_the_rounds() -> None:
    runs = {(1_000_000, "ftsystem"): [{"join_stall_s": 0.1, "time_to_join_s": 5.0,
                                       "transfer_bytes_per_s": 2e9, "step_s": 0.2},
                                      {"join_stall_s": 0.3, "time_to_join_s": 4.0,
                                       "transfer_bytes_per_s": None, "step_s": 0.2}],
            (1_000_000, "torchft"): [{"join_stall_s": 0.5}, {"join_stall_s": 0.7}]}
    log = [{"round": 0, "loopback_bytes_per_s": 3e9}, {"round": 1, "loopback_bytes_per_s": 5e9}]
    summary = summarize(log, runs)
    (size,) = summary["sizes"]
    ours = size["ftsystem"]
    assert size["params"] == 1_000_000
    assert size["torchft"]["join_stall_s"] == {"median": pytest.approx(0.6), "min": 0.5,
                                               "max": 0.7}
    assert ours["join_stall_s"] == {"median": pytest.approx(0.2), "min": 0.1, "max": 0.3}
    assert ours["transfer_bytes_per_s"] == {"median": 2e9, "min": 2e9, "max": 2e9}
    assert len(ours["rounds"]) == 2
    assert summary["loopback_bytes_per_s"]["median"] == 4e9 and summary["round_log"] == log


def test_every_size_trains_the_same_spec_on_every_system() -> None:
    spec = rejoin.plan_spec(10_000_000, rejoin.PLANS[10_000_000])
    assert (spec.num_replicas, spec.model_params, spec.steps) == (2, 10_000_000, 60)
    # The example program's defaults, which the torchft baseline's own are.
    assert (spec.batch_size, spec.lr) == (16, 3e-3)


def test_the_join_step_stall_is_the_members_gap_at_the_joiners_first_commit() -> None:
    # Members step every 0.2 s; the start of the joiner slows step 3 (0.5 s), the join at
    # step 5 takes 0.3 s; the joiner commits step 5 first.
    member = [(1, 0.0), (2, 0.2), (3, 0.7), (4, 0.9), (5, 1.2), (6, 1.4), (7, 1.6)]
    measured = rejoin._measure({"r0": member}, [(5, 1.2), (6, 1.4)], launched=0.1)
    assert measured["join_stall_s"] == pytest.approx(0.3)  # the window's worst: step 3
    assert measured["join_step_stall_s"] == pytest.approx(0.1)  # the join's own
    assert rejoin._measure({"r0": member}, [(9, 2.0)], 0.1)["join_step_stall_s"] is None


def test_the_window_takes_in_the_joiners_first_computed_step() -> None:
    # The joiner's commit of step 5 (with zeros) is stamped a hair before the members'; its
    # first forward and backward (a fresh process) holds step 6 up to 0.45 s: part of the
    # join's cost, which a window ending at its first commit would miss.
    member = [(1, 0.0), (2, 0.2), (3, 0.4), (4, 0.6), (5, 0.8), (6, 1.25), (7, 1.45)]
    measured = rejoin._measure({"r0": member}, [(5, 0.7999), (6, 1.25)], launched=0.1)
    assert measured["join_stall_s"] == pytest.approx(0.25)
    # A joiner that commits once (it joined at the last step): the window ends there.
    assert rejoin._measure({"r0": member}, [(5, 0.7999)], 0.1)["join_stall_s"] == \
        pytest.approx(0.0)


def test_loopback_rate_is_measured() -> None:
    assert loopback_rate(64 << 20, 1) > 10e6  # 10 MB/s: far below any loopback


def test_torchft_transfer_time_comes_from_its_transport_log(tmp_path) -> None:
    # What torchft 0.2.0's HTTPTransport logs around its fetch, and the Manager's line before
    # it (which must not be taken for it).
    (tmp_path / "replica2_gen1.log").write_text(
        "2026-12-01 14:00:00,000 INFO torchft.manager: [replica_2/0 - step 7] fetching "
        "checkpoint from recover_src_replica_rank=0 with checkpoint_metadata='http://h:1/'\n"
        "2026-12-01 14:00:02,000 INFO torchft.checkpointing.http_transport: fetching "
        "checkpoint from http://h:1/checkpoint/7/full took 1.75s\n")
    assert _torchft_fetch_s(tmp_path) == 1.75
    assert _torchft_fetch_s(tmp_path / "elsewhere") is None


def test_rounds_launch_the_joiner_evenly_over_the_members_step() -> None:
    assert [rejoin.launch_phase(r, 3) for r in range(3)] == pytest.approx([1 / 6, 0.5, 5 / 6])
    assert rejoin.launch_phase(0, 1) == 0.5


def test_unknown_system_is_refused() -> None:
    result = CliRunner().invoke(app, ["bench", "rejoin", "--systems", "ftsystem,ray"])
    assert result.exit_code != 0 and "unknown system(s) ray" in result.output


def test_a_failed_run_is_recorded_without_figures_and_the_bench_goes_on(monkeypatch,
                                                                       tmp_path) -> None:
    def fail(*_, **__):
        raise TimeoutError("torchft scenario: timed out waiting for all replicas to finish")
    monkeypatch.setattr(rejoin, "run_torchft", fail)
    spec = rejoin.plan_spec(1_000_000, (1, 0.0))
    run = rejoin.run_system("torchft", spec, workdir=tmp_path)
    assert run["join_stall_s"] is None and run["transfer_bytes_per_s"] is None
    assert "timed out" in run["error"]
    assert run["system"] == "torchft" and run["spec"]["model_params"] == 1_000_000


def test_sizes_are_picked_by_name_and_unknown_ones_refused() -> None:
    assert list(parse_sizes("100M")) == [100_000_000]
    assert list(parse_sizes("1M, 10000000")) == [1_000_000, 10_000_000]
    result = CliRunner().invoke(app, ["bench", "rejoin", "--sizes", "1M,3M"])
    assert result.exit_code != 0 and "unknown size 3M" in result.output


@pytest.mark.slow
def test_quick_run_writes_every_figure(tmp_path) -> None:
    out = tmp_path / "rejoin.json"
    # ftsystem only: torchft's run is the baseline's own test (test_torchft_baseline.py), its
    # transfer time the test above; both would take this past a minute.
    result = CliRunner().invoke(app, ["bench", "rejoin", "--quick", "--systems", "ftsystem",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["rounds"] == 1 and data["loopback_bytes_per_s"]["median"] > 0
    (size,) = data["sizes"]
    ours = size["ftsystem"]
    for figure in ("join_stall_s", "join_step_stall_s", "time_to_join_s",
                   "transfer_bytes_per_s", "step_s"):
        assert set(ours[figure]) == {"median", "min", "max"}, figure
    assert ours["time_to_join_s"]["median"] > 0 and ours["transfer_bytes_per_s"]["median"] > 0
    assert ours["rounds"][0]["catchup"]["snapshot_bytes"] > 0
    assert data["launch_phases"] == [0.5] and ours["rounds"][0]["launch_phase"] == 0.5
    run = ours["rounds"][0]
    assert run["system"] == "ftsystem"
    assert (run["spec"]["batch_size"], run["spec"]["lr"]) == (16, 3e-3)
    assert data["round_log"][0]["load_1m_before"] >= 0
