"""Replicas that span nodes: one agent per node (each in its own network namespace), whole hosts
that die or are cut off, a control plane that goes away, and the flags an operator can get
wrong."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ftsystem.control import keys

from ftsystem.measure import stall
from ftsystem.chaos.spec import parse_specs
from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job
from ftsystem.chaos.faults import parse_fault_point
from ftsystem.launch.netns import netns_supported
from ftsystem.control.store import Store

NETNS = netns_supported()  # None, or why namespaces cannot be made here
TIMEOUT_S = 9.0  # the one timeout: lease TTL 3 s


def _run(tmp_path: Path, chaos: str, **overrides) -> tuple[dict, dict, dict]:
    cfg = RunConfig(**{"num_replicas": 2, "train_args": ["--sleep-per-step", "0.02"]} | overrides,
                    out_dir=tmp_path / "run", timeout_s=TIMEOUT_S, show_progress=False,
                    chaos=parse_specs(textwrap.dedent(chaos)))
    summary = run_job(cfg)
    results_dir = cfg.out_dir / "results"
    results = {p.stem: json.loads(p.read_text()) for p in results_dir.glob("*.json")}
    # Every generation's commits, (step, unix time), from the append-only progress files.
    timelines = {rid: stall.read_timeline(results_dir / f"{rid}.commits") for rid in results}
    return summary, results, timelines


def _stepped_during(timeline: list, start: float, seconds: float) -> bool:
    return any(start < t < start + seconds for _, t in timeline)


@pytest.mark.skipif(NETNS is not None, reason=str(NETNS))
@pytest.mark.timeout(600)  # 4 agents and up to 8 ranks on 2 cores: minutes on a busy machine
# Two ranks per node, sharded with FSDP2: the one-rank layout is the other tests' (a node's
# ranks die and come back together either way).
@pytest.mark.parametrize("ranks", [2], ids=["2x2x2-fsdp2"])
def test_a_dead_host_and_a_cut_link_restart_only_their_replica(tmp_path, ranks):
    steps = 150 if ranks == 1 else 100
    # Both faults hit replica r1 (a node killed, later a node cut off): r0 must keep stepping
    # through both, and r1 come back each time as a whole and catch up from r0.
    summary, results, timelines = _run(tmp_path, f"""
        action: host-kill
        selector: {{replicas: [r1]}}
        duration: 2s
        after_step: 15
        seed: 3
        ---
        action: host-partition
        selector: {{replicas: [r1]}}
        duration: 3s
        after_step: {steps // 2}
        seed: 4
    """, nodes_per_replica=2, nproc_per_node=ranks, netns=True, num_steps=steps)
    orders = {o["action"]: o for o in summary["chaos"]}
    assert [o["state"] for o in orders.values()] == ["done", "done"], orders
    assert "SIGKILL to all" in orders["host-kill"]["outcome"]
    for order in orders.values():
        hit = order["executed_at"]
        # r1 failed as a whole, noticed by its other node (a silent peer) or by its own ranks
        # (a collective with the dead peer): within seconds, long before a lease would tell.
        assert [f for f in summary["failures"] if hit <= f["time"] < hit + TIMEOUT_S / 3], \
            (order, summary["failures"])
        # r0 kept stepping meanwhile.
        assert _stepped_during(timelines["r0"], hit + 2.0, 3.0), (order, timelines["r0"])
    assert {f["replica"] for f in summary["failures"]} == {"r1"}, summary["failures"]
    assert results["r0"]["generation"] == 0 and results["r1"]["generation"] >= 2
    # The last generation of r1 took the job's state from r0, every rank its own shard (by
    # catch-up or the epoch's state sync), and was a member at the end.
    assert results["r1"]["epochs"] and results["r1"]["step"] == steps
    assert len(results["r1"]["shard_hashes"]) == 2 * ranks
    assert summary["steps"] == steps
    assert summary["bitwise_identical"] and summary["agents_ok"]


@pytest.mark.timeout(600)
def test_an_etcd_outage_longer_than_a_lease_restarts_only_the_replica_that_died(tmp_path):
    # etcd stops (SIGSTOP) for longer than the lease TTL, and replica r2 dies meanwhile.
    summary, results, timelines = _run(tmp_path, """
        action: etcd-pause
        duration: 8s
        after_step: 30
    """, num_replicas=3, num_steps=150, train_args=["--sleep-per-step", "0.1"],
        kills=[ReplicaKill(2, parse_fault_point("70:step"))])
    # The chaos orders: the pause, and the kill's record once etcd took it (if it did).
    [pause] = [o for o in summary["chaos"] if o["action"] == "etcd-pause"]
    assert pause["state"] == "done", pause
    died = max(t for _, t in timelines["r2"] if t < pause["executed_at"] + 8.0)
    assert pause["executed_at"] < died < pause["executed_at"] + 8.0, \
        "the premise: r2 died while etcd was stopped"
    # Every lease lapsed, but only the replica that died restarted: its failure was recorded
    # once etcd was back; the others trained through the outage in their epoch.
    assert [f["replica"] for f in summary["failures"]] == ["r2"], summary["failures"]
    assert results["r0"]["generation"] == results["r1"]["generation"] == 0
    assert results["r2"]["generation"] == 1
    for rid in ("r0", "r1"):
        assert _stepped_during(timelines[rid], pause["executed_at"] + 1.0, 3.0), rid
    assert summary["steps"] == 150 and summary["bitwise_identical"] and summary["agents_ok"]


# --- bad input -------------------------------------------------------------------------------

def _agent(etcd_url: str, job: str, replica: str, *flags: str, marker: Path) -> list[str]:
    program = [sys.executable, "-c", f"open({str(marker)!r}, 'a').write('ran\\n')"]
    return [sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", etcd_url, "--job", job,
            "--replica-id", replica, "--timeout", str(TIMEOUT_S), *flags, "--", *program]


async def _put_spec(etcd_url: str, job: str) -> None:
    async with Store(etcd_url) as store:
        await store.put_json(keys.spec(job), {"replicas": 2, "replica_ids": ["r0", "r1"],
                                              "nodes_per_replica": 2, "nproc_per_node": 1})


def _refused(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    return proc.stderr


def test_agents_that_contradict_their_replica_or_job_are_refused_before_launching(
        etcd, job_id, tmp_path):
    asyncio.run(_put_spec(etcd.url, job_id))
    marker = tmp_path / "ran"
    # Not in the job.
    err = _refused(_agent(etcd.url, job_id, "r5", "--node-rank", "0", "--nodes", "2",
                          marker=marker))
    assert "replica 'r5' is not in this job" in err and "r0, r1" in err
    # Another shape than the job's.
    err = _refused(_agent(etcd.url, job_id, "r0", "--node-rank", "0", "--nodes", "3",
                          marker=marker))
    assert "job spec says 2 node(s) x 1 rank(s)" in err
    err = _refused(_agent(etcd.url, job_id, "r0", "--node-rank", "0", "--nodes", "2",
                          "--nproc-per-node", "2", marker=marker))
    assert "--nproc-per-node 2" in err
    # Two agents claiming one node rank: the second is refused while the first waits for its
    # peer (node 1 never comes, so the first never launches either).
    first = subprocess.Popen(_agent(etcd.url, job_id, "r0", "--node-rank", "0", "--nodes", "2",
                                    "--node-id", "machine-a", marker=marker),
                             stderr=subprocess.PIPE, text=True)
    try:
        asyncio.run(_wait_key(etcd.url, keys.agent(job_id, "r0", 0)))
        err = _refused(_agent(etcd.url, job_id, "r0", "--node-rank", "0", "--nodes", "2",
                              "--node-id", "machine-b", marker=marker))
        assert "node rank 0 of replica r0 is held by another agent" in err
        assert "machine-a" in err and "--spare" in err
        assert first.poll() is None
    finally:
        first.terminate()
        first.wait(30)
    # A node rank outside the replica, and a spare with a rank.
    err = _refused(_agent(etcd.url, job_id, "r1", "--node-rank", "2", "--nodes", "2",
                          marker=marker))
    assert "--node-rank 2 is outside 0..1" in err
    err = _refused(_agent(etcd.url, job_id, "r1", "--node-rank", "1", "--spare", "--nodes",
                          "2", marker=marker))
    assert "either --spare or --node-rank" in err
    assert not marker.exists(), "nothing may be launched for a refused agent"


def test_the_first_agent_of_a_replica_fixes_its_shape(etcd, job_id, tmp_path):
    marker = tmp_path / "ran"  # no spec: the replica's first agent records its shape
    first = subprocess.Popen(_agent(etcd.url, job_id, "r0", "--node-rank", "0", "--nodes", "2",
                                    marker=marker), stderr=subprocess.PIPE, text=True)
    try:
        asyncio.run(_wait_key(etcd.url, keys.agent(job_id, "r0", 0)))
        err = _refused(_agent(etcd.url, job_id, "r0", "--node-rank", "1", "--nodes", "3",
                              marker=marker))
        assert "replica r0 runs 2 node(s) x 1 rank(s)" in err and "same values" in err
    finally:
        first.terminate()
        first.wait(30)
    assert not marker.exists()


def test_an_agent_whose_rank_was_taken_while_it_was_cut_off_stops(etcd, job_id, tmp_path):
    """An etcd outage outlived a node lease and a spare took the rank meanwhile (made here by
    revoking the agent's node lease and writing another agent's record): at its next renewal
    the agent finds the rank taken, stops its ranks and exits 1 saying why, instead of
    running on as a second copy of the node."""
    async def put_spec() -> None:
        async with Store(etcd.url) as store:
            await store.put_json(keys.spec(job_id), {"replicas": 1, "replica_ids": ["r0"],
                                                     "nodes_per_replica": 1,
                                                     "nproc_per_node": 1})

    async def take_the_rank() -> None:
        async with Store(etcd.url) as store:
            key = keys.agent(job_id, "r0", 0)
            holder = await store.get_json(key)
            await store.revoke(int(holder["lease"]))
            lease = await store.grant(120)
            assert await store.put_if_absent(key, json.dumps({"uid": "spare-1",
                                                              "node_id": "other"}), lease=lease)
    asyncio.run(put_spec())
    pid_file = tmp_path / "rank.pid"
    program = [sys.executable, "-c", "import os, time; open(%r, 'w').write(str(os.getpid())); "
               "time.sleep(600)" % str(pid_file)]
    agent = subprocess.Popen(
        [sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", etcd.url, "--job", job_id,
         "--replica-id", "r0", "--node-rank", "0", "--timeout", str(TIMEOUT_S), "--",
         *program], stderr=subprocess.PIPE, text=True)
    try:
        from conftest import wait_for
        wait_for(lambda: pid_file.exists() and pid_file.read_text(), 120, "the rank to start")
        asyncio.run(take_the_rank())
        _, err = agent.communicate(timeout=120)  # the next renewal is at most 10 s away
    finally:
        agent.kill()
    assert agent.returncode == 1, err[-2000:]
    assert "was taken by agent spare-1" in err
    rank = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(rank, 0)


async def _wait_key(etcd_url: str, key: str, timeout_s: float = 60.0) -> None:
    async with Store(etcd_url) as store:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while await store.get(key) is None:
            assert asyncio.get_running_loop().time() < deadline, f"{key} never appeared"
            await asyncio.sleep(0.05)
