"""A replica that holds the others back at the all-reduce is taken out before the watchdog's
third of the timeout: a silent one (frozen, dead or cut off: its beats stand still) within a
second of the survivors' wait, a live one that is merely late within the straggler bound (a
multiple of the observed step time)."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from ftsystem.measure import stall
from ftsystem.chaos.spec import parse_specs
from ftsystem.launch.launcher import RunConfig, run_job
from ftsystem.control.timeouts import StragglerBound, Timeouts
from ftsystem.training.replica import STEP_TIMES_KEPT

TIMEOUT_S = 60.0  # the watchdog would restart a hung replica after 20 s


def _run(tmp_path, *, steps: int, order: str = "", replica_args: dict | None = None
         ) -> tuple[RunConfig, dict, list[tuple[float, float]]]:
    """The job, and r0's commit gaps: (seconds, unix time of the commit that ended it)."""
    cfg = RunConfig(num_replicas=2, num_steps=steps, out_dir=tmp_path / "run",
                    train_args=["--sleep-per-step", "0.05"], timeout_s=TIMEOUT_S,
                    show_progress=False, replica_args=replica_args or {},
                    chaos=parse_specs(textwrap.dedent(order)) if order else None)
    summary = run_job(cfg)
    r0 = _r0(cfg)
    return cfg, summary, [(b - a, b) for (_, a), (_, b) in zip(r0, r0[1:])]


def _r0(cfg: RunConfig) -> list[tuple[int, float]]:
    return stall.read_timeline(cfg.out_dir / "results" / "r0.commits")


def _came_back(cfg: RunConfig, summary: dict) -> None:
    """r1 came back (its agent restarted it when it woke up out of the epoch) and caught up."""
    result = json.loads((cfg.out_dir / "results" / "r1.json").read_text())
    assert result["generation"] >= 1 and result["step"] == cfg.num_steps
    assert summary["bitwise_identical"] and summary["agents_ok"]


@pytest.mark.timeout(600)
def test_a_hung_replica_is_taken_out_by_its_silence_within_a_second(tmp_path, monkeypatch):
    # r1's processes stop (SIGSTOP) for 12 s: its agent and lease stay healthy, and the
    # watchdog (20 s) does not fire, so only the survivors' wait at the all-reduce can tell.
    # Its beats stand still: r0 reads them 0.1 s into its wait and again 0.6 s later, and
    # names it. The straggler bound is raised to 6 s so that the bound cannot be what fired.
    # r0 alone needs more than 12 s for its last 220 steps (0.05 s of sleep each), so the
    # hang ends, and its order is marked done, before the job does.
    monkeypatch.setenv("FTSYSTEM_STRAGGLER_FLOOR_S", "6")
    monkeypatch.delenv("FTSYSTEM_STRAGGLER_SILENCE_S", raising=False)  # the default, 0.6 s
    cfg, summary, gaps = _run(tmp_path, steps=250, order="""
        action: hang
        selector: {replicas: [r1]}
        duration: 12s
        after_step: 30
    """)
    [hang] = summary["chaos"]
    assert hang["state"] == "done", hang
    longest_gap = max(gap for gap, at in gaps if at > hang["executed_at"])
    # 0.1 + 0.6 s of reads, then r0's report, the leader's decision and the next epoch (0.1 s
    # on 2 cores): about 0.8 s; 3 s of margin for a busy CI machine, below the 6 s bound.
    assert longest_gap < 4.0, longest_gap
    controller_log = (cfg.out_dir / "controller0.log").read_text()
    assert "removing r1: named at the all-reduce of epoch" in controller_log
    assert "stopped beating" in (cfg.out_dir / "agent-r0.log").read_text()
    _came_back(cfg, summary)


@pytest.mark.timeout(600)
def test_a_late_replica_is_taken_out_within_the_straggler_bound(tmp_path, monkeypatch):
    # r1 sleeps 8 s before the all-reduce of step 40, once (the example's --straggle): alive,
    # beating, not hung (its watchdog would wait 20 s), only late. The bound: 4 x the median
    # step time, at least the 2 s floor.
    monkeypatch.delenv("FTSYSTEM_STRAGGLER_FLOOR_S", raising=False)  # the default floor
    monkeypatch.delenv("FTSYSTEM_STRAGGLER_SILENCE_S", raising=False)
    # 150 steps: r1, restarted once it woke up, catches up from r0 while r0 lingers.
    cfg, summary, gaps = _run(tmp_path, steps=150, replica_args={1: ["--straggle", "40:8"]})
    late_from = next(at for (_, at), (step, _) in zip(gaps, _r0(cfg)[1:]) if step == 40)
    bound = StragglerBound.from_env(os.environ, Timeouts(TIMEOUT_S)).bound_s(
        [gap for gap, at in gaps if at < late_from][-STEP_TIMES_KEPT:])
    longest_gap = max(gap for gap, _ in gaps)
    # r0 waited the whole bound (5% below it where 4 x its median step passes the floor: r0
    # times its steps itself, not from this file), then went on alone: the gap past it (r0's
    # report, the leader's decision, the next epoch) was 0.08 s on 2 cores; 3 s of margin for a
    # busy CI machine. Without the bound r0 would wait out the 8 s.
    assert 0.95 * bound <= longest_gap < bound + 3.0, (longest_gap, bound)
    controller_log = (cfg.out_dir / "controller0.log").read_text()
    assert "removing r1: named at the all-reduce of epoch" in controller_log
    assert "had not arrived at the all-reduce" in (cfg.out_dir / "agent-r0.log").read_text()
    _came_back(cfg, summary)


@pytest.mark.parametrize("bad", ["40", "x:5", "0:5", "40:-1", "40:"])
def test_the_example_refuses_a_straggle_it_cannot_carry_out(bad, capsys):
    from ftsystem.example.train import parse_args
    assert parse_args(["--straggle", "40:8"]).straggle == (40, 8.0)
    with pytest.raises(SystemExit):
        parse_args(["--straggle", bad])
    assert "expected STEP:SECONDS" in capsys.readouterr().err
