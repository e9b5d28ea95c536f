"""Spares and the end of a job: real etcd, a real controller, real agents (one per node, on
loopback) and their ranks, real signals.

A spare stands in for a node that was lost, never for a replica that is done; and a replica
that lost a node with nobody to take its place ends with the job instead of waiting forever."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import controller_process, exit_code_within, wait_for

from agent.supervisor import EXIT_MISSED_THE_END, _cancel
from ftsystem.control import keys
from ftsystem.control.store import Store, WatchEvent

TIMEOUT_S = 9.0  # the one timeout: lease TTL 3 s
WAIT_S = 240.0
"""Generous bound on any one event: CI's two cores also run etcd, a controller, agents and
ranks; a passing run takes a fraction of it."""


def _train(out: Path, steps: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "ftsystem.example.train", "--steps", str(steps),
            "--sleep-per-step", "0.02", "--out", str(out), *flags]


def _agent(etcd_url: str, job: str, replica: str, *flags: str, log: Path,
           program: list[str]) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", etcd_url, "--job", job,
             "--replica-id", replica, "--advertise-address", "127.0.0.1", *flags, "--",
             *program], stdout=out, stderr=subprocess.STDOUT)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _get(etcd_url: str, key: str) -> dict | None:
    async def read() -> dict | None:
        async with Store(etcd_url) as store:
            return await store.get_json(key)
    return asyncio.run(read())


def _prefix(etcd_url: str, prefix: str) -> dict[str, dict]:
    async def read() -> dict[str, dict]:
        async with Store(etcd_url) as store:
            items, _ = await store.get_prefix(prefix)
            return {key: json.loads(value) for key, value in items.items()}
    return asyncio.run(read())


def _put_spec(etcd_url: str, job: str, spec: dict) -> int:
    """The job's spec (the leader starts no epoch before it); returns the revision written."""
    async def put() -> int:
        async with Store(etcd_url) as store:
            return await store.put_json(keys.spec(job), spec | {"timeout_s": TIMEOUT_S})
    return asyncio.run(put())


def _history(etcd_url: str, job: str, since: int) -> list[WatchEvent]:
    """Every change to the job's keys from revision ``since`` to now, in order."""
    async def read() -> list[WatchEvent]:
        async with Store(etcd_url) as store:
            # The shared etcd's revision also counts other jobs' writes: a write of our own
            # marks where the history read ends.
            end = await store.put(keys.job(job) + "/test-history-end", "")
            events = []
            async for event in store.watch_prefix(keys.job(job) + "/", start_revision=since):
                events.append(event)
                if event.revision >= end:
                    return events
    return asyncio.run(read())


def _revision(events: list[WatchEvent], kind: str, key: str) -> int:
    return next(e.revision for e in events if e.kind == kind and e.key == key)


@pytest.mark.timeout(600)
def test_a_spare_takes_the_place_of_a_node_whose_agent_died(etcd, job_id, tmp_path):
    """Two nodes and a spare on loopback: node 1's agent is SIGKILLed (its ranks die with it);
    node 0 hears it fall silent, frees its rank, the spare takes it, and the replica restarts
    as a whole with the spare and trains to the end."""
    results = tmp_path / "results"
    _put_spec(etcd.url, job_id, {"replicas": 1, "nodes_per_replica": 2})

    def generation() -> dict:
        return _get(etcd.url, keys.generation(job_id, "r0")) or {}
    with controller_process(etcd.url, job_id, tmp_path):
        agents = [_agent(etcd.url, job_id, "r0", "--nodes", "2", *flags, log=tmp_path / name,
                         program=_train(results, 120))
                  for name, flags in (("n0.log", ("--node-rank", "0", "--node-id", "a")),
                                      ("n1.log", ("--node-rank", "1", "--node-id", "b")),
                                      ("spare.log", ("--spare", "--node-id", "c")))]
        try:
            first = wait_for(lambda: (g := generation()) and not g["ended"] and g, WAIT_S,
                             "the first generation")
            wait_for(lambda: (results / "r0.commits").exists(), WAIT_S, "the replica to train")
            agents[1].kill()  # node 1's agent dies; pdeathsig takes its rank with it
            # Node 0's rank may fail on the reset link before node 0 hears node 1 fall silent:
            # then a generation with node 1's dead agent comes first, and never starts.
            later = wait_for(lambda: (g := generation())["number"] > first["number"] and
                             not g["ended"] and g["agents"][1] not in first["agents"] and g,
                             WAIT_S, "a generation with the spare")
            assert later["agents"][0] == first["agents"][0]
            assert agents[0].wait(300) == 0 and agents[2].wait(60) == 0
        finally:
            _stop(agents)
    result = json.loads((results / "r0.json").read_text())
    assert result["step"] == 120 and result["generation"] == later["number"]


def test_a_spare_does_not_restart_a_replica_that_finished(etcd, job_id, tmp_path):
    """Two replicas of one node, each with a spare. When a replica finishes, its agent leaves
    and frees the node rank: the spare takes it, finds the replica finished, and leaves without
    starting anything. Nothing trains a second time, nothing overwrites a result."""
    results = tmp_path / "results"
    _put_spec(etcd.url, job_id, {"replicas": 2, "nodes_per_replica": 1})
    with controller_process(etcd.url, job_id, tmp_path):
        agents = {}
        for rid in ("r0", "r1"):
            program = _train(results, 30)
            agents[rid] = _agent(etcd.url, job_id, rid, "--node-id", f"{rid}-a",
                                 log=tmp_path / f"{rid}.log", program=program)
            agents[f"{rid}-spare"] = _agent(etcd.url, job_id, rid, "--spare", "--node-id",
                                            f"{rid}-b", log=tmp_path / f"{rid}-spare.log",
                                            program=program)
        try:
            codes = {name: proc.wait(WAIT_S) for name, proc in agents.items()}
        finally:
            _stop(list(agents.values()))
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in agents}
    assert codes == dict.fromkeys(agents, 0), (codes, logs)
    final = {rid: json.loads((results / f"{rid}.json").read_text()) for rid in ("r0", "r1")}
    for rid, result in final.items():
        spare = logs[f"{rid}-spare"]
        assert f"replica {rid} finished" in spare, spare
        assert "launching" not in spare, spare  # it ran no rank
        # The replica's last generation is the one that finished and wrote the result, and no
        # failure was recorded for it (nor for a later one) after it finished.
        generation = _get(etcd.url, keys.generation(job_id, rid))
        assert generation["finished"] and result["generation"] == generation["number"]
        failures = _prefix(etcd.url, f"{keys.failures(job_id)}{rid}/")
        assert all(int(keys.last_segment(k)) < generation["number"] for k in failures), failures
        assert result["step"] == 30
    assert final["r0"]["state_hash"] == final["r1"]["state_hash"]


def test_a_replica_that_lost_a_node_with_no_spare_ends_with_the_job(etcd, job_id, tmp_path):
    """Replica r1 (two nodes, no spare) loses node 1 to a SIGKILL before r0 (one node) trains.
    r1's other agent waits for the node while r0 trains and while r0, finished, waits for it;
    once r0 has left, the agent exits with its distinct status instead of waiting forever. An
    agent for r1 started after that refuses at once."""
    results = tmp_path / "results"
    # r1 is lost before r0 starts: the first epoch must not wait for it.
    since = _put_spec(etcd.url, job_id, {"replicas": 1})
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    r1 = [_agent(etcd.url, job_id, "r1", "--nodes", "2", "--node-rank", str(rank), "--node-id",
                 f"r1-n{rank}", log=tmp_path / f"r1-n{rank}.log", program=sleeper)
          for rank in (0, 1)]
    procs = list(r1)
    try:
        wait_for(lambda: (g := _get(etcd.url, keys.generation(job_id, "r1"))) and
                 not g["ended"], WAIT_S, "r1's first generation")
        r1[1].kill()  # node 1's agent dies (its rank with it), and no spare waits for r1
        assert r1[1].wait(30) == -9
        wait_for(lambda: _get(etcd.url, keys.generation(job_id, "r1"))["ended"] and
                 _get(etcd.url, keys.agent(job_id, "r1", 1)) is None, WAIT_S,
                 "node 0 of r1 to end its generation and free node rank 1")
        with controller_process(etcd.url, job_id, tmp_path):
            r0 = _agent(etcd.url, job_id, "r0", "--node-id", "r0-a", log=tmp_path / "r0.log",
                        program=_train(results, 20, "--linger", "3"))
            procs.append(r0)
            assert r0.wait(WAIT_S) == 0, (tmp_path / "r0.log").read_text()
            assert r1[0].wait(WAIT_S) == EXIT_MISSED_THE_END, \
                (tmp_path / "r1-n0.log").read_text()
        stranded = (tmp_path / "r1-n0.log").read_text()
        assert "waiting for node rank(s) 1" in stranded
        assert "the job finished at step 20" in stranded
        # It waited while r0 trained and while r0, finished, waited for it; it left only after
        # the last holder of the final state had left (its node rank released after r0's
        # registration was gone).
        history = _history(etcd.url, job_id, since)
        assert _revision(history, "PUT", keys.finished(job_id)) < \
            _revision(history, "DELETE", keys.replica(job_id, "r0")) < \
            _revision(history, "DELETE", keys.agent(job_id, "r1", 0)), \
            [(e.kind, e.key, e.revision) for e in history]
        # Arriving after the end: r1 never finished and nobody holds the final state; r0 did.
        late = subprocess.run(
            [sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", etcd.url, "--job", job_id,
             "--replica-id", "r1", "--nodes", "2", "--node-rank", "1", "--", *sleeper],
            check=False, capture_output=True, text=True, timeout=WAIT_S)
        assert late.returncode == EXIT_MISSED_THE_END, late.stderr[-2000:]
        assert "the job finished at step 20" in late.stderr and "launching" not in late.stderr
    finally:
        _stop(procs)
    result = json.loads((results / "r0.json").read_text())
    generation = _get(etcd.url, keys.generation(job_id, "r0"))
    assert result["step"] == 20 and generation["finished"]
    assert result["generation"] == generation["number"]


def test_a_spare_waiting_for_a_node_rank_exits_on_sigterm(etcd, job_id, tmp_path):
    """A spare waits for a node rank as long as the replica runs; SIGTERM (scancel, a deleted
    pod) ends the wait as it stops a training agent: exit 143 within the agent's stop bound,
    its spare record revoked rather than left to expire. The replica's agent trains on."""
    from agent.supervisor import EXIT_SIGNALLED_BASE, AgentConfig
    bound_s = AgentConfig(etcd="", job=job_id, replica_id="r0", command=[]).stop_bound_s
    _put_spec(etcd.url, job_id, {"replicas": 1})
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    node = _agent(etcd.url, job_id, "r0", "--node-id", "a", log=tmp_path / "node.log",
                  program=sleeper)
    spare = _agent(etcd.url, job_id, "r0", "--spare", "--node-id", "b",
                   log=tmp_path / "spare.log", program=sleeper)
    spares = f"{keys.replica_agents(job_id, 'r0')}spare-"
    try:
        # The replica runs on node a, which holds the only node rank: the spare waits.
        wait_for(lambda: (g := _get(etcd.url, keys.generation(job_id, "r0"))) and
                 not g["ended"], WAIT_S, "the replica's first generation")
        wait_for(lambda: _prefix(etcd.url, spares), WAIT_S, "the spare's record")
        spare.send_signal(signal.SIGTERM)
        margin_s = 10.0  # the interpreter's exit, and a loaded machine
        code = exit_code_within(spare, bound_s + margin_s, tmp_path / "spare.log",
                                "the spare told to stop by SIGTERM")
        assert code == EXIT_SIGNALLED_BASE + signal.SIGTERM == 143, \
            (tmp_path / "spare.log").read_text()[-3000:]
        assert _prefix(etcd.url, spares) == {}
        assert node.poll() is None, (tmp_path / "node.log").read_text()[-3000:]
        assert _get(etcd.url, keys.agent(job_id, "r0", 0))["node_id"] == "a"
    finally:
        _stop([node, spare])


def test_a_task_that_drops_its_cancellation_is_cancelled_again():
    """What lets a spare that finds its replica finished exit at once: its background tasks
    were cancelled while creating their watches, which in Python 3.11 can drop the
    cancellation (``asyncio.wait_for``, CPython gh-86296)."""
    async def scenario() -> list[str]:
        seen = []

        async def drops_one_cancellation() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                seen.append("dropped")  # as wait_for does when its inner future just finished
            await asyncio.Event().wait()

        task = asyncio.create_task(drops_one_cancellation())
        await asyncio.sleep(0)  # let it start
        await asyncio.wait_for(_cancel([task]), WAIT_S)
        assert task.cancelled()
        return seen
    assert asyncio.run(scenario()) == ["dropped"]
