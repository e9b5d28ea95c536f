"""``ftsystem bench ettr`` end to end, shortened (the wiring and the JSON's shape, not the
figures): both systems under the same kill and hang, two rounds in alternating order; and its
pure pieces."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from ftsystem.benchmarks.ettr_bench import SYSTEMS, aggregate, stall_summary
from ftsystem.benchmarks.harness import spec_mismatches
from ftsystem.cli import app


def test_stall_summary_counts_the_faults_in_the_window_per_action() -> None:
    faults = [{"time": 1.0, "action": "kill", "replica": "r0", "stall_s": 9.0},  # before
              {"time": 12.0, "action": "kill", "replica": "r1", "stall_s": 1.0},
              {"time": 15.0, "action": "hang", "replica": "r2", "stall_s": 4.0},
              {"time": 16.0, "action": "hang", "replica": "r3", "stall_s": None},  # no survivor
              {"time": 18.0, "action": "hang", "replica": "r0", "stall_s": 2.0}]
    summary = stall_summary(faults, start=10.0, end=20.0)
    assert summary["stall_s"]["median"] == 2.0 and summary["stall_total_s"] == 7.0
    assert summary["stall_by_action"] == {
        "hang": {"n": 2, "median": 3.0, "min": 2.0, "max": 4.0, "total_s": 6.0},
        "kill": {"n": 1, "median": 1.0, "min": 1.0, "max": 1.0, "total_s": 1.0}}
    assert [f["time"] for f in summary["faults"]] == [12.0, 15.0, 18.0]


def test_aggregate_spreads_each_figure_over_the_rounds() -> None:
    runs = [{"ettr_time": t, "ettr_work": t, "stall_s": {"median": s}, "stall_total_s": s,
             "failures": 1, "step_s": 0.1,
             "faults": [{"time": 1.0, "action": "kill", "replica": "r1", "stall_s": s}]}
            for t, s in ((0.9, 2.0), (0.8, 4.0), (0.95, 1.0))]
    out = aggregate(runs)
    assert out["ettr_time"] == {"median": 0.9, "min": 0.8, "max": 0.95}
    assert out["median_stall_s"] == {"median": 2.0, "min": 1.0, "max": 4.0}
    assert out["stall_by_action"]["kill"]["n"] == 3 and out["rounds"] == runs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_run_of_both_systems_writes_the_json(tmp_path) -> None:
    out = tmp_path / "ettr.json"
    result = CliRunner().invoke(app, [
        # The window opens when the agents are up: on a loaded machine the ranks' start-up
        # (imports, and a kill or two among them) took over 15 s of it.
        "bench", "ettr", "--duration", "20", "--mtbf", "8s", "--seed", "11",  # a hang, a kill
        "--actions", "kill,hang",
        "--fault-duration", "2s", "--timeout", "6", "--replicas", "2", "--rounds", "1",
        "--fault-free", "12", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    # One round: the rounds' order and aggregation are checked without processes below.
    assert data["settings"]["rounds"] == 1 and data["settings"]["timeout_s"] == 6.0
    assert {"ratio", "target", "machine", "schedule", "warnings"} <= set(data)
    for name in SYSTEMS:
        system = data[name]
        assert [r["round"] for r in system["rounds"]] == [0]
        for figure in ("ettr_time", "ettr_work", "fault_free_ettr_time"):
            spread = system[figure]
            if spread["median"] is None:  # no commit within 20 s (a slow start on a busy machine)
                assert name != "ftsystem" and spread == {"median": None, "min": None,
                                                         "max": None}, (name, spread)
                continue
            assert 0 < spread["min"] <= spread["median"] <= spread["max"] <= 1, (name, spread)
        for run in system["rounds"]:  # every stall from a fault's instant, none negative
            # beyond the measure's resolution (the excess over a normal step is not clipped)
            assert all(math.isfinite(f["time"]) for f in run["faults"])
            assert all(f["stall_s"] >= -f["resolution_s"] for f in run["faults"]
                       if f["stall_s"] is not None), run["faults"]
    # The baseline's only detector gets ftsystem's detection budget: a third of the timeout.
    assert data["restart_all"]["rounds"][0]["collective_timeout_s"] == 2.0
    assert set(data["ratio"]["ettr_time"]) >= {"median", "min", "max", "per_round"}
    for name in SYSTEMS:  # each chaos run held to the pace of its own run free of faults
        run = data[name]["rounds"][0]
        if run["fault_free"]["mean_step_s"] is None:  # torchrun not up within 12 s (loaded)
            assert name == "restart_all" and run["ettr_net"] is None, (name, run)
            continue
        assert run["fault_free"]["mean_step_s"] > 0, (name, run["fault_free"])
        assert run["fault_free"]["spread_bound_s"] >= run["fault_free"]["step_s"] > 0, run
        assert run["ettr_net"] is None or run["ettr_time"] <= run["ettr_net"] <= 1, (name, run)
        assert run["ettr_paced"] is None or 0 < run["ettr_paced"] < 1.5, (name, run)
    runs = [data[name]["rounds"][0] for name in SYSTEMS]
    assert spec_mismatches(runs) == [] and runs[0]["spec"]["timeout_s"] == 6.0
    assert "ETTR over 20 s" in result.output


def test_the_command_alternates_the_systems_and_aggregates_the_rounds(tmp_path,
                                                                      monkeypatch) -> None:
    """The command's own logic, the two systems' runs replaced by hand-made rounds."""
    from ftsystem.benchmarks import ettr_bench

    calls = []

    def fake(name: str, ettr_time: float):
        def run(spec, *, chaos, workdir, **_) -> dict:
            calls.append(name if chaos else f"{name} fault-free")
            if chaos is None:  # 100 steps in 10 s: a pace of 0.1 s
                return {"ettr_time": 0.97, "interval_s": 10.0, "_mean_step_s": 0.1,
                        "_spread_bound_s": 0.15, "step_s": 0.09, "steps_advanced": 100,
                        "window_start_s": 1.0}
            faults = [{"time": 5.0, "action": "kill", "replica": "r1", "stall_s": 1.0 - ettr_time}]
            return {"ettr_time": ettr_time, "ettr_work": ettr_time, "interval_s": 10.0,
                    "steps_advanced": round(100 * ettr_time), "_mean_step_s": 0.2,
                    # one stall of 1 s past a 0.1 s step, and jitter under the bound
                    "_gaps_s": [0.1, 0.14, 1.1, 0.12], "_step_s": 0.1,
                    "window_start_s": 1.0, "failures": 1, "history": "all generations",
                    "step_s": 0.1, **stall_summary(faults, start=0.0, end=10.0)}
        return run

    monkeypatch.setattr(ettr_bench, "run_baseline", fake("restart_all", 0.5))
    monkeypatch.setattr(ettr_bench, "run_ftsystem", fake("ftsystem", 0.9))
    out = tmp_path / "ettr.json"
    result = CliRunner().invoke(app, ["bench", "ettr", "--duration", "10", "--actions", "kill",
                                      "--rounds", "3", "--workdir", str(tmp_path / "runs"),
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    # Each system's chaos run right after its own fault-free run; the systems alternate.
    pairs = [calls[i + 1] for i in range(0, len(calls), 2)]
    assert all(calls[i] == f"{calls[i + 1]} fault-free" for i in range(0, len(calls), 2))
    assert pairs == ["restart_all", "ftsystem", "ftsystem", "restart_all", "restart_all",
                     "ftsystem"]
    data = json.loads(out.read_text())
    assert data["ftsystem"]["ettr_time"] == {"median": 0.9, "min": 0.9, "max": 0.9}
    assert data["ratio"]["ettr_time"]["per_round"] == [pytest.approx(1.8)] * 3
    # Paced: the chaos run's 90 steps at the fault-free pace (0.1 s) over its 10 s window.
    assert data["ftsystem"]["ettr_paced"]["median"] == pytest.approx(0.9)
    # Net: only the gap past the fault-free bound (0.15 s) is lost, by 1 s of 10.
    assert data["ftsystem"]["ettr_net"]["median"] == pytest.approx(0.9)
    assert not [k for k in data["ftsystem"]["rounds"][0] if k.startswith("_")]
    assert data["ftsystem"]["fault_free_step_s"]["median"] == pytest.approx(0.1)
    assert data["ftsystem"]["fault_free_ettr_time"]["median"] == pytest.approx(0.97)
    assert data["restart_all"]["stall_by_action"]["kill"]["n"] == 3
    assert (tmp_path / "runs" / "round2" / "ftsystem" / "round.json").exists()
    # Both systems trained one spec in every round, and each round says so.
    runs = data["ftsystem"]["rounds"] + data["restart_all"]["rounds"]
    assert spec_mismatches(runs) == [] and runs[0]["spec"] == data["spec"]
    assert data["spec"]["duration_s"] == 10.0
    assert data["ftsystem"]["rounds"][0]["fault_free"]["spec"]["duration_s"] == 60.0
    assert [entry["order"] for entry in data["round_log"]] == [
        ["restart_all", "ftsystem"], ["ftsystem", "restart_all"], ["restart_all", "ftsystem"]]


def test_remeasure_takes_the_fault_free_figures_again_from_the_kept_commit_files(tmp_path) -> None:
    """``bench ettr-remeasure`` on a hand-made kept run: the commit files each system leaves."""
    def write(path, timeline) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{s} {t}\n" for s, t in timeline))

    steady = [(s, 0.1 * s) for s in range(101)]  # 0.1 s a step for 10 s
    stalled = [(s, 0.1 * s + (2.0 if s > 50 else 0.0)) for s in range(101)]  # one 2 s stall
    root, rounds = tmp_path / "runs", {}
    for name in SYSTEMS:
        where = root / "round0" / name
        if name == "ftsystem":  # a result JSON per replica, its commits beside it
            for sub, timeline in ((where, stalled), (where / "fault_free", steady)):
                (sub / "results").mkdir(parents=True, exist_ok=True)
                (sub / "results" / "r0.json").write_text(json.dumps(
                    {"replica": "r0", "commits": []}))
                write(sub / "results" / "r0.commits", timeline)
        else:
            write(where / "r0.commits", stalled)
            write(where / "fault_free" / "r0.commits", steady)
        rounds[name] = {"round": 0, "window_end": stalled[-1][1], "ettr_time": 0.8,
                        "ettr_work": 0.8, "faults": [], "fault_free": {"ettr_time": 0.99}}
    out = tmp_path / "ettr.json"
    out.write_text(json.dumps({name: {"rounds": [rounds[name]]} for name in SYSTEMS}
                              | {"settings": {"duration_s": 12.0, "mtbf": "5s", "seed": 0,
                                              "rounds": 1, "timeout_s": 30.0},
                                 "warnings": [], "machine": "test"}))
    result = CliRunner().invoke(app, ["bench", "ettr-remeasure", str(out), str(root)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    for name in SYSTEMS:  # 2 s lost of 12 s; the fault-free run's other figures kept
        assert data[name]["ettr_net"]["median"] == pytest.approx(1 - 2.0 / 12.0), name
        assert data[name]["rounds"][0]["fault_free"]["ettr_time"] == 0.99
        assert data[name]["fault_free_step_s"]["median"] == pytest.approx(0.1)
    assert data["ratio"]["ettr_net"]["median"] == pytest.approx(1.0)
    bad = CliRunner().invoke(app, ["bench", "ettr-remeasure", str(out), str(tmp_path / "none")])
    assert bad.exit_code == 2 and "--workdir" in bad.output
