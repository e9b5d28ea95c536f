"""Who a finished replica stays for: pure logic over the job's etcd keys."""

from __future__ import annotations

import json
import subprocess
import sys

from agent.supervisor import missed_the_end
from ftsystem.control import keys
from ftsystem.launch.launcher import RunConfig, run_job
from ftsystem.training.end_of_job import replicas_to_serve
from ftsystem.control.membership import Registration, ReplicaState

JOB = "j"


def _registration(rid: str, state: ReplicaState) -> tuple[str, bytes]:
    reg = Registration(replica_id=rid, state=state, generation=0, host="h")
    return keys.replica(JOB, rid), reg.to_json().encode()


def _generation(rid: str, ended: str) -> tuple[str, bytes]:
    return keys.generation(JOB, rid), json.dumps({"number": 1, "ended": ended}).encode()


def _agent(rid: str, node_rank: int) -> tuple[str, bytes]:
    return keys.agent(JOB, rid, node_rank), b"{}"


def test_a_replica_whose_agents_freed_each_others_ranks_is_still_served() -> None:
    # r0 finished; r1's nodes were cut apart: each agent freed the other's node rank, neither
    # has taken its own back yet, and its generation ended with the cut link.
    items = dict([_registration("r0", ReplicaState.DONE), _agent("r0", 0), _agent("r0", 1),
                  _generation("r0", ""), _generation("r1", "node 1 silent for 1.0s")])
    assert replicas_to_serve(JOB, items) == {"r1"}


def test_done_halted_stopped_and_finished_replicas_are_not_waited_for() -> None:
    items = dict([_registration("r0", ReplicaState.DONE), _agent("r0", 0),
                  _registration("r1", ReplicaState.DONE), _agent("r1", 0),
                  _generation("r2", "killed by SIGKILL"), (keys.halted(JOB, "r2"), b"{}"),
                  _generation("r3", "stopped"),
                  _generation("r4", "")])  # finished and gone
    assert replicas_to_serve(JOB, items) == set()
    # A replica with an agent but not done yet (starting, catching up) is waited for.
    items.update([_agent("r5", 0), _registration("r6", ReplicaState.CATCHING_UP),
                  _agent("r6", 0)])
    assert replicas_to_serve(JOB, items) == {"r5", "r6"}


def test_a_replica_restarted_after_everyone_left_a_finished_job_is_not_trained_again() -> None:
    finished = {"step": 150, "replica": "r0"}
    assert missed_the_end("r1", finished, {"r0"}) is None  # r0 waits for it: catch up from r0
    reason = missed_the_end("r1", finished, {"r1"})  # only its own, stale or not
    assert "finished at step 150" in reason and "ftsystem job delete" in reason
    assert missed_the_end("r1", finished, set())
    # A replica that waited for a lost node says which.
    assert "waiting for node rank(s) 1, 3" in missed_the_end("r1", finished, set(), [1, 3])


def test_an_agent_started_for_a_replica_that_finished_starts_nothing(etcd, job_id, tmp_path):
    # A whole job runs to its end; an agent for one of its replicas arrives afterwards (a host
    # back from repair, a restart loop that outlived the job): its replica is done. (One for a
    # replica that missed the end: tests/test_spares.py.)
    cfg = RunConfig(num_replicas=1, num_steps=10, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    train_args=["--linger", "0"], show_progress=False)
    # What an earlier run left in the same directory is not this run's.
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r0.commits").write_text("500 1.0\n")
    (tmp_path / "results" / "r3.json").write_text("{}")
    summary = run_job(cfg)
    assert summary["agents_ok"] and summary["steps"] == 10
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["r0.commits", "r0.json"]
    commits = (tmp_path / "results" / "r0.commits").read_text().splitlines()
    assert max(int(line.split()[0]) for line in commits) == 10
    marker = tmp_path / "ran"
    program = [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('ran')"]
    late = subprocess.run([sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", etcd.url,
                           "--job", job_id, "--replica-id", "r0", "--", *program],
                          capture_output=True, text=True, timeout=120)
    assert late.returncode == 0, late.stderr[-2000:]
    assert "replica r0 finished (generation 0)" in late.stderr
    assert not marker.exists()  # nothing was started
