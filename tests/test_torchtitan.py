"""torchtitan's debug Llama trained by ``FTSystemTrainer`` (``ftsystem.integrations.torchtitan``):
3 replicas on CPU under real agents, a real etcd and controller, real Gloo groups, two real
SIGKILLs, and every replica's state bitwise identical at the end.

It needs the ``torchtitan`` extra (``pip install -e '.[torchtitan]'``; ``bash
scripts/install.sh --test`` installs it) and is skipped without it; each rank runs
``tests/torchtitan_replica.py``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from ftsystem.chaos.faults import FaultPoint
from ftsystem.example.workload import MarkovLanguage
from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job

pytest.importorskip("torchtitan", reason="torchtitan is not installed: pip install -e "
                    "'.[torchtitan]' (see docs/torchtitan.md)")
if importlib.util.find_spec("triton") is None:  # not imported here: only the replicas need it
    pytest.skip("triton is not installed, and torchtitan's models import it: pip install -e "
                "'.[torchtitan]' brings it (see docs/torchtitan.md)", allow_module_level=True)

PROGRAM = str(Path(__file__).with_name("torchtitan_replica.py"))


@pytest.mark.slow
def test_torchtitan_replicas_survive_kills_bitwise_identical(tmp_path, monkeypatch):
    # The update log keeps a few of the 25 MB averages, not the default 1 GiB of them.
    monkeypatch.setenv("FTSYSTEM_CATCHUP_LOG_BYTES", str(300_000_000))
    tokens = tmp_path / "tokens.bin"
    language = MarkovLanguage(vocab_size=64, seed=0)
    np.asarray(language.batch(shard=0, step=0, batch_size=40, seq_len=500),
               dtype=np.uint16).tofile(tokens)
    # The steps are paced so that r0 trains on while r1 and r2 restart (a torchtitan replica
    # takes about 6 s to import and build on this CPU) and catch up from it.
    cfg = RunConfig(num_replicas=3, num_steps=48, out_dir=tmp_path / "run", program=(PROGRAM,),
                    kills=[ReplicaKill(1, FaultPoint(4)), ReplicaKill(2, FaultPoint(9))],
                    train_args=["--tokens", str(tokens), "--num-replicas", "3",
                                "--sleep-per-step", "0.4"],
                    timeout_s=20, show_progress=False)
    summary = run_job(cfg)
    results = {p.stem: json.loads(p.read_text()) for p in (cfg.out_dir / "results").glob("*.json")}

    assert sorted((f["replica"], f["step"]) for f in summary["failures"]) == [("r1", 4),
                                                                               ("r2", 9)]
    assert {r: results[r]["generation"] for r in results} == {"r0": 0, "r1": 1, "r2": 1}
    for rid in ("r1", "r2"):  # caught up from a live replica, then joined
        assert results[rid]["catchup"]["bytes"] > 0 and results[rid]["catchup"]["donors"], \
            results[rid]["catchup"]
    assert summary["steps"] == 48 and summary["agents_ok"] and summary["replicas_finished"] == 3
    assert summary["bitwise_identical"], {r: results[r]["state_hash"] for r in results}
