"""A replica that is alive but holds the others back is taken out within the straggler bound
(a multiple of the observed step time), not after the watchdog's third of the timeout."""

from __future__ import annotations

import json
import textwrap

import pytest

from ftsystem.measure import stall
from ftsystem.chaos.spec import parse_specs
from ftsystem.launch.launcher import RunConfig, run_job
from ftsystem.control.timeouts import Timeouts

TIMEOUT_S = 60.0  # the watchdog would restart a hung replica after 20 s


@pytest.mark.timeout(600)
def test_a_hung_replica_is_taken_out_within_the_straggler_bound(tmp_path, monkeypatch):
    monkeypatch.delenv("FTSYSTEM_STRAGGLER_FLOOR_S", raising=False)  # the default floor
    # r1's processes stop (SIGSTOP) for 12 s: its agent and lease stay healthy, and the
    # watchdog (20 s) does not fire, so only the survivors' wait at the all-reduce can tell.
    # The bound: 4 x the median step time, at least the 2 s floor. r0 alone needs more than
    # 12 s for its last 220 steps (0.05 s of sleep each), so the hang ends, and its order is
    # marked done, before the job does (with 150 steps and a 25 s hang a fast machine
    # finished first, and the order stayed pending).
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
    # r0 went on alone long before the watchdog would have restarted r1.
    longest_gap = max(b - a for (_, a), (_, b) in zip(r0, r0[1:])
                      if b > hang["executed_at"])
    assert longest_gap < Timeouts(TIMEOUT_S).watchdog_s / 2, longest_gap
    controller_log = (cfg.out_dir / "controller0.log").read_text()
    assert "removing r1: it had not arrived at the all-reduce" in controller_log
    # r1 came back (its agent restarted it when it woke up out of the epoch) and caught up.
    result = json.loads((results_dir / "r1.json").read_text())
    assert result["generation"] >= 1 and result["step"] == 250
    assert summary["bitwise_identical"] and summary["agents_ok"]
