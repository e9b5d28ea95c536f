"""A replica that is alive but holds the others back is taken out within the straggler bound
(a multiple of the observed step time), not after the watchdog's third of the timeout."""

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


@pytest.mark.timeout(600)
def test_a_hung_replica_is_taken_out_within_the_straggler_bound(tmp_path, monkeypatch):
    monkeypatch.delenv("FTSYSTEM_STRAGGLER_FLOOR_S", raising=False)  # the default floor
    # r1's processes stop (SIGSTOP) for 12 s: its agent and lease stay healthy, and the
    # watchdog (20 s) does not fire, so only the survivors' wait at the all-reduce can tell.
    # The bound: 4 x the median step time, at least the 2 s floor. r0 alone needs more than
    # 12 s for its last 220 steps (0.05 s of sleep each), so the hang ends, and its order is
    # marked done, before the job does (with 150 steps and a 25 s hang a fast machine
    # finishes first, and the order stays pending).
    cfg = RunConfig(num_replicas=2, num_steps=250, out_dir=tmp_path / "run",
                    train_args=["--sleep-per-step", "0.05"], timeout_s=TIMEOUT_S,
                    show_progress=False, chaos=parse_specs(textwrap.dedent("""
                        action: hang
                        selector: {replicas: [r1]}
                        duration: 12s
                        after_step: 30
                    """)))
    summary = run_job(cfg)
    [hang] = summary["chaos"]
    assert hang["state"] == "done", hang
    results_dir = cfg.out_dir / "results"
    r0 = stall.read_timeline(results_dir / "r0.commits")
    gaps = [(b - a, b) for (_, a), (_, b) in zip(r0, r0[1:])]
    # The bound r0 waited, from its own step times before the hang (the floor, 2 s, where
    # 4 x a step of about 0.07 s is less).
    bound = StragglerBound.from_env(os.environ, Timeouts(TIMEOUT_S)).bound_s(
        [gap for gap, at in gaps if at <= hang["executed_at"]][-STEP_TIMES_KEPT:])
    longest_gap = max(gap for gap, at in gaps if at > hang["executed_at"])
    # r0 waited the whole bound (5% below it where 4 x its median step passes the floor: r0
    # times its steps itself, not from this file), then went on alone: the gap past it (r0's
    # report, the leader's decision, the next epoch) was 0.08 s on 2 cores; 3 s of margin for a
    # busy CI machine. Without the bound r0 would wait out the 12 s hang.
    assert 0.95 * bound <= longest_gap < bound + 3.0, (longest_gap, bound)
    controller_log = (cfg.out_dir / "controller0.log").read_text()
    assert "removing r1: it had not arrived at the all-reduce" in controller_log
    # r1 came back (its agent restarted it when it woke up out of the epoch) and caught up.
    result = json.loads((results_dir / "r1.json").read_text())
    assert result["generation"] >= 1 and result["step"] == 250
    assert summary["bitwise_identical"] and summary["agents_ok"]
