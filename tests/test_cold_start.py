"""A whole-job restart from disk: every replica is killed at once, the agents restart them, and
the job resumes from the newest complete DCP checkpoint instead of from step 0."""

from __future__ import annotations

import json
import textwrap

import pytest

from ftsystem.chaos.spec import parse_specs
from ftsystem.training.checkpoint import Checkpointer
from ftsystem.launch.launcher import RunConfig, run_job
from ftsystem.example.train import parse_args, warmup_cosine

EVERY = 10
TRAIN_DEFAULTS = parse_args([])


# Two ranks per replica: each checkpoint holds two FSDP2 shards, the case with more to get wrong
# (a single rank's checkpoint round trip is tests/test_checkpoint.py's).
@pytest.mark.parametrize("ranks", [2], ids=["2-ranks-fsdp2"])
def test_a_job_whose_replicas_all_die_resumes_from_its_newest_checkpoint(tmp_path, ranks):
    kill_everyone = parse_specs(textwrap.dedent("""
        action: kill
        mode: percent
        value: 100
        after_step: 35
    """))
    # With 2 ranks per replica, each replica's checkpoint holds both FSDP2 shards, written
    # and read collectively by its ranks.
    cfg = RunConfig(num_replicas=2, nproc_per_node=ranks, num_steps=150,
                    out_dir=tmp_path / "run",
                    train_args=["--sleep-per-step", "0.05"], timeout_s=15, show_progress=False,
                    chaos=kill_everyone, checkpoint_every=EVERY)
    summary = run_job(cfg)
    results = {p.stem: json.loads(p.read_text()) for p in (cfg.out_dir / "results").glob("*.json")}
    assert len(summary["failures"]) == 2, summary["failures"]
    killed_at = min(f["step"] for f in summary["failures"])
    # The first replica back finds no member to catch up from and loads the newest complete
    # checkpoint (at most one interval, and a save in flight, lost); a replica back later
    # catches up from it. Nobody starts again from step 0.
    resumed = [r["resumed_from"] for r in results.values() if r["resumed_from"] is not None]
    assert resumed, results
    assert all(s % EVERY == 0 and killed_at - 2 * EVERY <= s <= killed_at for s in resumed)
    for result in results.values():
        assert result["generation"] == 1
        assert result["commits"][0][0] > min(resumed), result["commits"][:3]
    assert summary["steps"] == 150 and summary["bitwise_identical"] and summary["agents_ok"]
    # The checkpoint held the LR schedule too: it ends where 150 uninterrupted steps end it,
    # not where a schedule restarted at the checkpoint's step would be.
    full_schedule = warmup_cosine(TRAIN_DEFAULTS.warmup, 150)(150) * TRAIN_DEFAULTS.lr
    assert all(r["lr"] == pytest.approx(full_schedule) for r in results.values()), \
        {k: r["lr"] for k, r in results.items()}
    assert Checkpointer(cfg.out_dir / "checkpoints", EVERY).latest_complete() >= 140
