"""Every system a bench compares trains the same spec.

The spec's translation into each system's launch is checked as pure logic: each command line is
read back by the program it starts (its own argument parser), and what that program would train
must be the spec, for every system alike. Then each bench's command runs end to end with its
systems' launches replaced by stand-ins: every system must have been handed the same spec, and
the JSON must record it for each.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ftsystem.baselines import restart_all_worker, torchft_replica
from ftsystem.baselines.restart_all import torchrun_command
from ftsystem.baselines.torchft_scenario import replica_command
from ftsystem.benchmarks import failover, harness, overhead, rejoin
from ftsystem.benchmarks.harness import RunSpec, spec_mismatches
from ftsystem.cli import app
from ftsystem.control.timeouts import Timeouts
from ftsystem.example import train
from ftsystem.launch.launcher import agent_command, job_spec

TRAINED = ("num_replicas", "model_params", "batch_size", "lr", "seed", "sleep_per_step",
           "steps")
"""What a training program must take from the spec."""


def _after(argv: list[str], program: str) -> list[str]:
    """The arguments of ``python -m program`` in ``argv``."""
    return argv[argv.index(program) + 1:]


def _typer_params(main, argv: list[str]) -> dict:
    """The parameters a typer program ``main`` would run with, parsed from ``argv``."""
    program = typer.Typer()
    program.command()(main)
    return typer.main.get_command(program).make_context("program", argv).params


def ftsystem_trains(spec: RunSpec, tmp_path: Path) -> dict:
    cfg = harness.ftsystem_config(spec, out_dir=tmp_path, job="spec")
    argv = agent_command(cfg, "http://127.0.0.1:2379", 1)
    args = train.parse_args(_after(argv, "ftsystem.example.train"))
    assert args.loop == "plain"  # the loop every baseline runs
    assert job_spec(cfg).timeout_s == spec.timeout_s  # how the agents get the timeout
    return {"num_replicas": cfg.num_replicas, "model_params": args.model_params,
            "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
            "sleep_per_step": args.sleep_per_step, "steps": args.steps}


def torchft_trains(spec: RunSpec, tmp_path: Path) -> dict:
    training = harness.torchft_training(spec)
    num_replicas = training.pop("num_replicas")
    argv = [*replica_command(**training), "--replica", "0", "--out", str(tmp_path / "r.json")]
    params = _typer_params(torchft_replica.main,
                           _after(argv, "ftsystem.baselines.torchft_replica"))
    return {"num_replicas": num_replicas} | {name: params[name] for name in (
        "model_params", "batch_size", "lr", "seed", "sleep_per_step", "steps")}


def ddp_trains(spec: RunSpec, tmp_path: Path) -> dict:
    params = _typer_params(overhead._ddp_main,
                           _after(harness.ddp_rank_command(spec, 0, tmp_path),
                                  harness.DDP_PROGRAM))
    return {"num_replicas": params["world_size"]} | {name: params[name] for name in (
        "model_params", "batch_size", "lr", "seed", "sleep_per_step", "steps")}


def restart_all_trains(spec: RunSpec, tmp_path: Path) -> dict:
    cfg = harness.restart_all_config(spec, out_dir=tmp_path)
    argv = torchrun_command(cfg, endpoint="127.0.0.1:1", local_addr="127.0.0.1")
    args = restart_all_worker.parse_args(_after(argv, restart_all_worker.__name__))
    # The only detector it has gets ftsystem's detection budget.
    assert args.timeout == Timeouts(spec.timeout_s).watchdog_s
    return {"num_replicas": int(argv[argv.index("--nnodes") + 1].split(":")[-1]),
            "model_params": args.model_params, "batch_size": args.batch_size, "lr": args.lr,
            "seed": args.seed, "sleep_per_step": args.sleep_per_step, "steps": args.steps}


SYSTEMS = {"ftsystem": ftsystem_trains, "torchft": torchft_trains, "ddp": ddp_trains,
           "restart_all": restart_all_trains}

specs = st.builds(RunSpec, num_replicas=st.integers(1, 8),
                  model_params=st.sampled_from([0, 100_000, 10_000_000]),
                  batch_size=st.integers(1, 64),
                  lr=st.floats(1e-6, 1.0, allow_nan=False, allow_infinity=False),
                  seed=st.integers(0, 2**31), steps=st.integers(1, 10_000),
                  sleep_per_step=st.sampled_from([0.0, 0.05, 0.1]),
                  timeout_s=st.sampled_from([6.0, 30.0, 120.0]))


@settings(max_examples=30, deadline=None)
@given(spec=specs)
def test_every_system_trains_the_spec_it_is_given(spec: RunSpec, tmp_path_factory) -> None:
    tmp_path = tmp_path_factory.mktemp("spec")
    expected = {name: getattr(spec, name) for name in TRAINED}
    trained = {system: trains(spec, tmp_path) for system, trains in SYSTEMS.items()}
    for system, what in trained.items():
        assert what == expected, system


def test_the_defaults_are_the_example_program_s() -> None:
    spec, ours = RunSpec(num_replicas=2, steps=10), train.parse_args([])
    assert (spec.batch_size, spec.lr, spec.seed) == (ours.batch_size, ours.lr, ours.seed)
    assert spec.timeout_s == harness.ftsystem_config(spec).timeout_s


def test_a_spec_of_a_duration_is_what_each_system_can_train(tmp_path) -> None:
    spec = RunSpec(num_replicas=4, duration_s=60.0, sleep_per_step=0.1)
    # restart-all stops at the duration; ftsystem trains the steps that fit in it, with margin.
    cfg = harness.restart_all_config(spec, out_dir=tmp_path)
    assert cfg.duration_s == 60.0 and cfg.num_steps == harness.UNLIMITED_STEPS
    assert harness.ftsystem_steps(spec) == math.ceil(harness.DURATION_STEP_MARGIN * 600)
    assert harness.ftsystem_config(spec, step_s=0.2).num_steps == math.ceil(
        harness.DURATION_STEP_MARGIN * 300)
    for refused in (harness.torchft_training, lambda s: harness.ddp_rank_command(s, 0, tmp_path)):
        with pytest.raises(ValueError, match="step count, not a duration"):
            refused(spec)
    with pytest.raises(ValueError, match="step time"):
        harness.ftsystem_steps(dataclasses.replace(spec, sleep_per_step=0.0))


@pytest.mark.parametrize("fields, message", [
    ({"steps": 0}, "exactly one"), ({"steps": 5, "duration_s": 5.0}, "exactly one"),
    ({"steps": 5, "batch_size": 0}, "batch_size must be at least 1"),
    ({"steps": 5, "model_params": -1}, "model_params must not be negative"),
    ({"steps": 5, "lr": 0.0}, "lr and timeout_s must be positive")])
def test_a_spec_that_cannot_be_trained_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunSpec(num_replicas=2, **fields)


def test_the_real_loop_reaches_ftsystem_and_ddp_and_the_others_refuse_it(tmp_path) -> None:
    spec = RunSpec(num_replicas=2, steps=10, loop="real")
    cfg = harness.ftsystem_config(spec, out_dir=tmp_path, job="spec")
    ours = train.parse_args(_after(agent_command(cfg, "http://127.0.0.1:2379", 0),
                                   "ftsystem.example.train"))
    ddp = _typer_params(overhead._ddp_main, _after(harness.ddp_rank_command(spec, 0, tmp_path),
                                                   harness.DDP_PROGRAM))
    assert ours.loop == ddp["loop"] == "real"
    for refused in (harness.torchft_training,
                    lambda s: harness.restart_all_config(s, out_dir=tmp_path)):
        with pytest.raises(ValueError, match="plain loop only, not --loop real"):
            refused(spec)
    with pytest.raises(ValueError, match="loop must be one of plain, real"):
        RunSpec(num_replicas=2, steps=10, loop="fancy")


def test_a_spec_mismatch_names_the_system_and_the_field() -> None:
    ours = RunSpec(num_replicas=2, steps=100)
    runs = [harness.ran_with("ftsystem", ours),
            harness.ran_with("torchft", dataclasses.replace(ours, batch_size=8, lr=1e-3)),
            harness.ran_with("blocking", ours)]
    assert spec_mismatches(runs) == ["torchft ran batch_size=8, ftsystem batch_size=16",
                                     "torchft ran lr=0.001, ftsystem lr=0.003"]
    assert spec_mismatches(runs[::2]) == [] and spec_mismatches([]) == []


# --- each bench's command, its systems' launches replaced -------------------------------------

def _recorded_runs(runs_by_system: dict[str, list[dict]]) -> list[dict]:
    return [run for runs in runs_by_system.values() for run in runs]


def test_bench_rejoin_hands_every_system_one_spec(monkeypatch, tmp_path) -> None:
    handed = []

    def launch(spec: RunSpec, **_) -> dict:
        handed.append(spec)
        return {"join_stall_s": 0.1, "time_to_join_s": 5.0, "step_s": 0.2,
                "join_step_stall_s": 0.0, "transfer_bytes_per_s": 1e9}
    monkeypatch.setattr(rejoin, "run_ftsystem", launch)
    monkeypatch.setattr(rejoin, "run_torchft", launch)
    def loopback(*_) -> float:
        return 3e9
    loopback.__doc__ = rejoin.loopback_rate.__doc__  # the JSON describes the method from it
    monkeypatch.setattr(rejoin, "loopback_rate", loopback)
    out = tmp_path / "rejoin.json"
    result = CliRunner().invoke(app, ["bench", "rejoin", "--sizes", "1M,10M", "--rounds", "2",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert len(handed) == 2 * 2 * len(rejoin.SYSTEMS)
    for size in data["sizes"]:
        runs = _recorded_runs({name: size[name]["rounds"] for name in rejoin.SYSTEMS})
        assert sorted({run["system"] for run in runs}) == sorted(rejoin.SYSTEMS)
        assert spec_mismatches(runs) == [], spec_mismatches(runs)
        assert (runs[0]["spec"]["batch_size"], runs[0]["spec"]["lr"]) == (16, 3e-3)
        assert all(dataclasses.asdict(spec) == runs[0]["spec"]
                   for spec in handed if spec.model_params == size["params"])
    assert [entry["round"] for entry in data["round_log"]] == [0, 1]


def test_bench_failover_hands_every_system_one_spec(monkeypatch, tmp_path) -> None:
    handed = []

    def launch(spec: RunSpec, **_) -> dict:
        handed.append(spec)
        return {"failures": 1, "stall_s": {"median": 0.1}, "per_failure_stall_s": [0.1],
                "step_s": {"median": 0.05}, "bitwise_identical": True, "settings": {}}
    monkeypatch.setattr(failover, "run_ftsystem", launch)
    monkeypatch.setattr(failover, "run_torchft", launch)
    out = tmp_path / "failover.json"
    result = CliRunner().invoke(app, ["bench", "failover", "--rounds", "2", "--steps", "40",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    runs = _recorded_runs({name: data[name]["rounds"] for name in failover.SYSTEMS})
    assert sorted(run["system"] for run in runs) == sorted(failover.SYSTEMS * 2)
    assert spec_mismatches(runs) == [] and runs[0]["spec"] == data["spec"]
    assert set(handed) == {RunSpec(**data["spec"])}
    assert data["spec"]["steps"] == data["scenario"]["steps"] == 40


def test_bench_overhead_hands_every_system_one_spec(monkeypatch, tmp_path) -> None:
    handed = []

    def launch(spec: RunSpec, workdir: Path) -> dict:
        handed.append(spec)
        return {"r0": [(step, 0.1 * step) for step in range(1, spec.steps + 1)]}
    for name in overhead.SYSTEMS:
        monkeypatch.setitem(overhead.RUNNERS, name, launch)
    out = tmp_path / "overhead.json"
    result = CliRunner().invoke(app, ["bench", "overhead", "--quick", "--rounds", "2",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    [model] = json.loads(out.read_text())["models"]
    runs = _recorded_runs(model["runs"])
    assert sorted(run["system"] for run in runs) == sorted(overhead.SYSTEMS * 2)
    assert spec_mismatches(runs) == [] and len(set(handed)) == 1
    assert model["steps_per_s"]["torchft"] == pytest.approx(10.0)
    assert model["ratio_vs_ddp_spread"]["ftsystem"]["per_round"] == [1.0, 1.0]
