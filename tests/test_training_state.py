"""The whole training state of a real loop, end to end: registered objects travel, catch-up
replays the user's step function, divergence is found and repaired or stops the job.

The loop is ``ftsystem.example.train``: AdamW, a warmup+cosine ``LambdaLR`` written with numpy,
a ``GradScaler``, clipping of the averaged gradient, dropout, a torchdata ``StatefulDataLoader``
shuffling a dataset shorter than the job, and here also an EMA (``AveragedModel``) and a frozen
layer. Real etcd,
agents, controllers and replica processes; kills are real SIGKILLs at exact fault points.
``state_hash`` covers parameters, optimizer state, scheduler, scaler and loader position.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from conftest import API_TOKEN, controller_process
from ftsystem.chaos.faults import FaultPoint
from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job

pytestmark = pytest.mark.slow


REAL_LOOP = ["--ema", "0.99", "--freeze", "pos", "--passes", "5"]
"""An EMA registered, a frozen layer, and at least five shuffled passes over the data."""


def _results(cfg: RunConfig) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (cfg.out_dir / "results").glob("*.json")}


def _events(etcd_url: str, job: str, log_dir: Path) -> list[dict]:
    """The job's events through the REST API of a controller started for the purpose."""
    with controller_process(etcd_url, job, log_dir) as base:
        return httpx.get(f"{base}/v1/jobs/{job}/events", timeout=10,
                         headers={"Authorization": f"Bearer {API_TOKEN}"}).json()["events"]


@pytest.mark.timeout(600)  # 5 restarts of up to 6 ranks on 2 cores: 3 minutes when idle
def test_kills_in_every_phase_leave_every_replica_with_the_same_whole_state(etcd, job_id,
                                                                           tmp_path):
    # r1 dies between steps, r2 mid all-reduce. r0 dies the first time it serves a joiner's
    # catch-up (the joiner must switch donors). Later r1 fails an all-reduce that the others
    # completed, so the next epoch's sync moves state to it, and r2 (restarted) dies in that
    # sync, or in an earlier one at or after the step before. Each replica is 2 ranks of
    # FSDP2, whose state travels shard by shard; the kills hit the last rank, and its death
    # takes the replica down. (Replicas of one rank meet the same kills, but the one in a
    # sync, in test_fault_tolerance and test_catchup.)
    late = 200
    kills = [ReplicaKill(1, FaultPoint(30, "step")), ReplicaKill(2, FaultPoint(60, "allreduce")),
             ReplicaKill(0, FaultPoint(1, "donate")),
             ReplicaKill(1, FaultPoint(late, "fail-allreduce")),
             ReplicaKill(2, FaultPoint(late - 10, "sync"))]
    cfg = RunConfig(num_replicas=3, nproc_per_node=2, num_steps=late + 120,
                    etcd=etcd.url, job=job_id, out_dir=tmp_path, kills=kills,
                    train_args=["--sleep-per-step", "0.05", "--linger", "60", *REAL_LOOP],
                    show_progress=False)
    summary = run_job(cfg)
    results = _results(cfg)

    assert summary["agents_ok"] and summary["replicas_finished"] == 3, summary
    assert summary["steps"] == cfg.num_steps
    failed = sorted((f["replica"], f["reason"]) for f in summary["failures"])
    assert failed == [("r0", "killed by SIGKILL"), ("r1", "killed by SIGKILL"),
                      ("r2", "killed by SIGKILL"), ("r2", "killed by SIGKILL")], failed
    # (r0 can only have died serving a joiner: the joiner went on with another donor, or
    # joined with a full state sync when none was left.)
    # Whole state, bit for bit: parameters, AdamW, LambdaLR, GradScaler, loader position.
    assert summary["bitwise_identical"], {k: r["state_hash"] for k, r in results.items()}
    assert len({r["lr"] for r in results.values()}) == 1
    assert all(not r["divergences"] for r in results.values()), \
        {k: r["divergences"] for k, r in results.items()}


def test_a_job_with_no_fault_over_several_shuffled_passes_reports_no_divergence(
        etcd, job_id, tmp_path, monkeypatch):
    # Every replica loads the loader's state at the first state sync (all but member 0) or
    # never; from the second pass on both must draw the same order, or the digests differ.
    monkeypatch.setenv("FTSYSTEM_FINGERPRINT_EVERY", "10")
    cfg = RunConfig(num_replicas=3, min_replicas=3, num_steps=100, etcd=etcd.url, job=job_id,
                    out_dir=tmp_path, train_args=["--linger", "30", *REAL_LOOP],
                    show_progress=False)
    summary = run_job(cfg)
    results = _results(cfg)

    assert summary["agents_ok"] and summary["failures"] == [], summary
    assert summary["bitwise_identical"], {k: r["state_hash"] for k, r in results.items()}
    assert all(not r["divergences"] for r in results.values()), \
        {k: r["divergences"] for k, r in results.items()}
    assert _events(etcd.url, job_id, tmp_path) == []


def test_a_joiner_that_copied_a_donor_gone_bad_never_outvotes_the_healthy_replicas(
        etcd, job_id, tmp_path, monkeypatch):
    # r1 dies at step 30 and catches up from a donor that corrupts a parameter just before
    # the snapshot is taken (whichever member the leader assigns). Donor and joiner then hold
    # the same bad state: two of four. The joiner's copy is no vote of its own, so the two
    # healthy members are the majority, and the bad two receive their state.
    monkeypatch.setenv("FTSYSTEM_FINGERPRINT_EVERY", "20")
    kills = [ReplicaKill(1, FaultPoint(30, "step"))] + \
        [ReplicaKill(r, FaultPoint(30, "corrupt-donate")) for r in (0, 2, 3)]
    cfg = RunConfig(num_replicas=4, min_replicas=3, num_steps=140, etcd=etcd.url, job=job_id,
                    out_dir=tmp_path, kills=kills,
                    train_args=["--sleep-per-step", "0.03", "--linger", "30", *REAL_LOOP],
                    show_progress=False)
    summary = run_job(cfg)
    results = _results(cfg)

    assert summary["agents_ok"] and summary["replicas_finished"] == 4, summary
    assert summary["bitwise_identical"], {k: r["state_hash"] for k, r in results.items()}
    donors = set(results["r1"]["catchup"]["donors"])
    reported = {e["replica"] for e in _events(etcd.url, job_id, tmp_path)
                if e["kind"] == "divergence"}
    # The corruption was found, and only in the replicas that held it.
    assert reported and reported <= donors | {"r1"}, (reported, donors)
    healthy = {"r0", "r2", "r3"} - donors
    assert not reported & healthy and len(healthy) == 2


def test_a_corrupted_replica_is_found_reported_and_repaired(etcd, job_id, tmp_path,
                                                            monkeypatch):
    monkeypatch.setenv("FTSYSTEM_FINGERPRINT_EVERY", "20")
    # Gradient buckets sent during backward: the repaired replica's first sum in the repair
    # epoch must be one flat buffer, as the other members' is (else Gloo pairs a bucket with
    # a whole buffer and aborts).
    monkeypatch.setenv("FTSYSTEM_OVERLAP", "1")
    monkeypatch.setenv("FTSYSTEM_BUCKET_BYTES", str(64 << 10))
    # min_replicas=3: nobody trains before all three are in (a replica that joined after step
    # 50 would never commit it, nor corrupt it).
    cfg = RunConfig(num_replicas=3, min_replicas=3, num_steps=120, etcd=etcd.url, job=job_id,
                    out_dir=tmp_path, kills=[ReplicaKill(1, FaultPoint(50, "corrupt"))],
                    train_args=["--sleep-per-step", "0.02", "--linger", "30"],
                    show_progress=False)
    summary = run_job(cfg)
    results = _results(cfg)

    assert summary["agents_ok"] and summary["failures"] == [], summary
    found = results["r1"]["divergences"]
    assert [(d["step"], d["found_by"]) for d in found] == [(60, "state-digest")], found
    assert sorted(found[0]["differs_from"]) == ["r0", "r2"]
    assert not results["r0"]["divergences"] and not results["r2"]["divergences"]
    # repaired: it received the majority's state in a resync epoch and trained on with it
    assert any(e["reason"] == "resync" for e in results["r1"]["epochs"])
    assert all(r["overlapped_commits"] > 0 for r in results.values())
    assert summary["bitwise_identical"]
    events = _events(etcd.url, job_id, tmp_path)
    assert [(e["kind"], e["replica"], e["step"]) for e in events] == [("divergence", "r1", 60)]


def test_a_loop_that_forgets_its_scheduler_gets_a_divergence_report(etcd, job_id, tmp_path,
                                                                   monkeypatch):
    # The restarted r1 receives model and optimizer, not the scheduler it did not register:
    # its next steps use another learning rate. The digests must name it, with the step.
    monkeypatch.setenv("FTSYSTEM_FINGERPRINT_EVERY", "10")
    cfg = RunConfig(num_replicas=3, num_steps=200, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    kills=[ReplicaKill(1, FaultPoint(20, "step"))],
                    train_args=["--sleep-per-step", "0.05", "--linger", "30",
                                "--forget-scheduler"], show_progress=False)
    run_job(cfg)
    events = _events(etcd.url, job_id, tmp_path)
    reports = [e for e in events if e["kind"] == "divergence"]
    assert reports, events
    assert {e["replica"] for e in reports} == {"r1"}, reports
    assert all(e["step"] > 20 and e["step"] % 10 == 0 for e in reports), reports
    assert all(sorted(e["differs_from"]) == ["r0", "r2"] for e in reports), reports


def test_replicas_that_register_different_objects_halt_with_a_clear_error(etcd, job_id,
                                                                          tmp_path):
    cfg = RunConfig(num_replicas=2, num_steps=60, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    replica_args={1: ["--forget-scheduler"]},
                    train_args=["--sleep-per-step", "0.02", "--linger", "10"],
                    show_progress=False)
    summary = run_job(cfg)
    halts = [e for e in _events(etcd.url, job_id, tmp_path) if e["kind"] == "halt"]
    assert len(halts) == 1, halts
    assert "must register the same objects" in halts[0]["reason"], halts
    assert not summary["agents_ok"]  # the halted replica's agent gave up, on purpose
    # the other replica trained to the end
    assert summary["steps"] == cfg.num_steps


def test_a_corruption_in_the_first_interval_is_repaired_by_the_majority(etcd, job_id,
                                                                        tmp_path, monkeypatch):
    # Every replica but r0 received r0's initial state at the job's start. That sync is no
    # copy of a history: each replica computed every step since on its own, so at the first
    # comparison the healthy two are two witnesses against one, and r2 is repaired.
    monkeypatch.setenv("FTSYSTEM_FINGERPRINT_EVERY", "20")
    cfg = RunConfig(num_replicas=3, min_replicas=3, num_steps=60, etcd=etcd.url, job=job_id,
                    out_dir=tmp_path, kills=[ReplicaKill(2, FaultPoint(10, "corrupt"))],
                    train_args=["--sleep-per-step", "0.02", "--linger", "30"],
                    show_progress=False)
    summary = run_job(cfg)
    results = _results(cfg)

    assert summary["agents_ok"] and summary["failures"] == [], summary
    assert summary["bitwise_identical"], {k: r["state_hash"] for k, r in results.items()}
    events = _events(etcd.url, job_id, tmp_path)
    assert [(e["kind"], e["replica"], e["step"]) for e in events] == [("divergence", "r2", 20)]
    assert [d["step"] for d in results["r2"]["divergences"]] == [20]
    assert any(e["reason"] == "resync" for e in results["r2"]["epochs"])
    assert not results["r0"]["divergences"] and not results["r1"]["divergences"]


def test_replicas_that_copied_each_other_never_hand_a_corruption_the_job(etcd, job_id,
                                                                          tmp_path, monkeypatch):
    # r2 goes bad at step 10; r0 dies at 20 and catches up from a peer before the first
    # comparison (min_replicas=3: the others wait for it). Whichever donor it copied, its
    # state and its donor's are one witness: two witnesses, one good and one bad, and
    # nobody can tell which is right. The job stops, and no healthy replica is overwritten
    # with the bad state.
    monkeypatch.setenv("FTSYSTEM_FINGERPRINT_EVERY", "40")
    cfg = RunConfig(num_replicas=3, min_replicas=3, num_steps=80, etcd=etcd.url, job=job_id,
                    out_dir=tmp_path, kills=[ReplicaKill(2, FaultPoint(10, "corrupt")),
                                             ReplicaKill(0, FaultPoint(20, "step"))],
                    train_args=["--sleep-per-step", "0.02", "--linger", "10"],
                    show_progress=False)
    run_job(cfg)
    events = _events(etcd.url, job_id, tmp_path)
    halts = [e for e in events if e["kind"] == "halt"]
    assert halts and all("no majority" in e["reason"] and "copied it from one another"
                         in e["reason"] for e in halts), events
    assert all(e["step"] == 40 for e in events if e["kind"] == "divergence"), events
    # A halted replica writes no result; any that did never entered a repair epoch.
    results = _results(cfg)
    assert not any(e["reason"] == "resync" for r in results.values() for e in r["epochs"])


@pytest.mark.timeout(300)
def test_unfreezing_a_layer_mid_run_halts_the_job_once_with_what_to_do(etcd, job_id, tmp_path):
    # Every replica's loop unfreezes the layer at one step; a restart would meet the same
    # step again, so each replica halts there instead of being restarted into it.
    cfg = RunConfig(num_replicas=2, num_steps=60, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    train_args=["--freeze", "pos", "--unfreeze-at", "20", "--linger", "5"],
                    show_progress=False)
    summary = run_job(cfg)
    assert not summary["agents_ok"]
    halts = [e for e in _events(etcd.url, job_id, tmp_path) if e["kind"] == "halt"]
    assert sorted(e["replica"] for e in halts) == ["r0", "r1"], halts
    assert all(e["step"] == 20 and "requires_grad on every parameter before" in e["reason"]
               for e in halts), halts
    # One exit per replica: neither agent restarted its replica into the same step.
    assert sorted(f["replica"] for f in summary["failures"]) == ["r0", "r1"], summary["failures"]
