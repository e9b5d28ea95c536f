"""The restart-all baseline for real: torchrun elastic agents, DDP over Gloo, a real SIGKILL
and a real network partition; after each, every node restarts from the last checkpoint."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import pytest

from ftsystem.baselines.restart_all import (
    ChaosActionError,
    Node,
    RestartAllConfig,
    RestartAllJob,
    final_lineage,
    restart_rounds,
    summarize,
    torchrun_command,
)
from ftsystem.chaos.spec import Order
from ftsystem.launch.netns import netns_supported
from conftest import wait_for

CHECKPOINT_EVERY = 10
NETNS = netns_supported()  # None, or why namespaces cannot be made here


def _config(tmp_path: Path, **overrides) -> RestartAllConfig:
    settings = {"out_dir": tmp_path, "num_nodes": 3, "num_steps": 30,
                "checkpoint_every": CHECKPOINT_EVERY, "timeout_s": 12.0, "deadline_s": 240.0,
                "train_args": ["--sleep-per-step", "0.05"]}
    return RestartAllConfig(**settings | overrides)


def _order(action: str, replica: str, duration_s: float = 0.0) -> Order:
    return Order(id=f"test-{action}", action=action, replica=replica, at=time.time(),
                 duration_s=duration_s)


def _mid_interval(job: RestartAllJob, node: str, past: int) -> int | None:
    """``node``'s step once it is past step ``past`` and halfway to a checkpoint (else None)."""
    commits = job.commits()[node]
    step = commits[-1][0] if commits else 0
    return step if step > past and 3 <= step % CHECKPOINT_EVERY <= 6 else None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_kill_then_partition_restart_every_node_from_the_checkpoint(tmp_path: Path) -> None:
    # A partition longer than the collective timeout: Gloo gives up on both sides of the cut.
    faults = [_order("kill", "r1")]
    if NETNS is None:
        faults.append(_order("partition", "r2", duration_s=8.0))
    else:
        warnings.warn(f"partition not tested: {NETNS}", stacklevel=1)
    with RestartAllJob(_config(tmp_path, netns=NETNS is None)) as job:
        for i, order in enumerate(faults):
            past = (i + 1) * CHECKPOINT_EVERY
            wait_for(lambda o=order, p=past: _mid_interval(job, o.replica, p), 180,
                     f"{order.replica} to train past step {past}", poll=0.02)
            job.inject(order)
        outcome = job.wait()
    assert outcome == "finished", outcome
    starts, commits = job.starts(), job.commits()
    assert all(len(s) == 1 + len(faults) for s in starts.values()), starts
    for k in range(1, 1 + len(faults)):
        resumed = {s[k]["resumed_from"] for s in starts.values()}
        assert resumed == {k * CHECKPOINT_EVERY}, starts  # every node, from one checkpoint
        times = [s[k]["time"] for s in starts.values()]
        since = min(times) - max(s[k - 1]["time"] for s in starts.values())
        # Together: a start is recorded once the training group formed, a collective of every
        # rank, so the nodes of one rendezvous round start within a scheduling delay (0.01 s
        # measured), far within half the time since the previous generation (12 s and more).
        assert max(times) - min(times) < since / 2, starts
        for node, timeline in commits.items():  # the steps after the checkpoint: again
            assert [s for s, _ in timeline].count(k * CHECKPOINT_EVERY + 1) == 2, node
    summary = summarize(commits=commits, starts=starts, results=job.results(), records=[],
                        outcome=outcome, num_nodes=3, wall_s=0.0)
    assert summary["restarts"] == len(faults) and summary["recomputed_steps"] >= len(faults)
    assert summary["steps"] == 30 and summary["ettr_time"] < 1.0
    pids = [s["pid"] for node in starts.values() for s in node]
    assert not [pid for pid in pids if _alive(pid)], "a worker outlived its job"


def test_a_host_kill_takes_the_node_down_and_the_group_waits_for_its_reboot(
        tmp_path: Path) -> None:
    with RestartAllJob(_config(tmp_path, num_nodes=2)) as job:
        wait_for(lambda: _mid_interval(job, "r1", CHECKPOINT_EVERY), 180,
                 "r1 to train past its first checkpoint", poll=0.02)
        first_agent = job.nodes[1].agent
        # From a thread, as the bench's schedule does: the agent started again must outlive it.
        job.schedule([_order("host-kill", "r1", duration_s=2.0)])
        wait_for(lambda: first_agent.poll() is not None, 30, "the node's torchrun to be gone")
        assert job.wait() == "finished"
        assert job.nodes[1].agent is not first_agent and not job.nodes[1].down
    [record] = job.records
    assert record["state"] == "done" and "started again after 2 s" in record["outcome"]
    starts = job.starts()
    # The rebooted node's new agent and the survivor's met in one new round, from the
    # checkpoint, and the job trained to its end.
    assert [len(s) for s in starts.values()] == [2, 2], starts
    assert {s[1]["resumed_from"] for s in starts.values()} == {CHECKPOINT_EVERY}, starts
    assert max(r["step"] for r in job.results().values()) == 30


def test_a_run_past_its_deadline_is_killed_and_reported(tmp_path: Path) -> None:
    with RestartAllJob(_config(tmp_path, num_nodes=2, deadline_s=3.0)) as job:
        outcome = job.wait()  # start-up alone takes longer than 3 s
    assert outcome.startswith("timed out after 3 s")
    assert all(node.agent.poll() is not None for node in job.nodes)


def test_partition_without_namespaces_is_refused(tmp_path: Path) -> None:
    job = RestartAllJob(_config(tmp_path))
    job.nodes = [Node(name="r0", address="127.0.0.1")]
    with pytest.raises(ChaosActionError, match="network namespaces"):
        job.inject(_order("partition", "r0", duration_s=1.0))
    with pytest.raises(ChaosActionError, match="no node 'r9'"):
        job.inject(_order("kill", "r9"))


def test_final_lineage_drops_rolled_back_commits() -> None:
    # Steps 11-13 were committed, lost to a restart from checkpoint 10, and committed again.
    log = [(10, 1.0), (11, 2.0), (12, 3.0), (13, 4.0), (11, 9.0), (12, 10.0), (13, 11.0),
           (14, 12.0)]
    assert final_lineage(log) == [(10, 1.0), (11, 9.0), (12, 10.0), (13, 11.0), (14, 12.0)]


def test_restart_rounds_count_recomputed_steps() -> None:
    starts = {"r0": [{"rank": 0, "resumed_from": 0, "time": 0.0},
                     {"rank": 1, "resumed_from": 10, "time": 8.5}],
              "r1": [{"rank": 1, "resumed_from": 0, "time": 0.0},
                     {"rank": 0, "resumed_from": 10, "time": 8.0}]}
    commits = {"r0": [(s, float(s) * 0.5) for s in range(1, 14)], "r1": []}
    assert restart_rounds(starts, commits) == [
        {"time": 8.0, "resumed_from": 10, "recomputed_steps": 3}]


def test_torchrun_command_is_elastic_restart_all(tmp_path: Path) -> None:
    cmd = torchrun_command(_config(tmp_path, max_restarts=7), endpoint="10.0.0.1:29500",
                           local_addr="10.0.0.2", until=123.0)
    text = " ".join(cmd)
    for part in ("torch.distributed.run", "--nnodes 1:3", "--rdzv-backend c10d",
                 "--rdzv-endpoint 10.0.0.1:29500", "--max-restarts 7", "--local-addr 10.0.0.2",
                 "--no-python setpriv --pdeathsig KILL", "--until 123.000",
                 "--timeout 4.0"):  # a third of the one timeout (12 s), as ftsystem detects
        assert part in text, part


def test_summary_measures_stalls_from_the_fault_instant() -> None:
    # r1 killed at 5.05 s; the group is back at 9 s (r0's steps 6.. again from checkpoint 5).
    r0 = [(s, float(s)) for s in range(1, 6)] + [(s, 3.0 + s) for s in range(6, 10)]
    record = {"id": "k", "action": "kill", "replica": "r1", "at": 5.0, "executed_at": 5.05,
              "state": "done", "outcome": "SIGKILL"}
    summary = summarize(commits={"r0": r0, "r1": []}, starts={}, results={}, records=[record],
                        outcome="finished", num_nodes=2, wall_s=0.0)
    [fault] = summary["faults"]
    assert fault["time"] == 5.05 and fault["action"] == "kill"
    # the gap holding the kill (5 s to 9 s), less a normal step (1 s); the former measure,
    # from the kill to the next commit less a step, beside it
    assert fault["stall_s"] == pytest.approx(9.0 - 5.0 - 1.0)
    assert fault["whole_steps_s"] == pytest.approx(9.0 - 5.05 - 1.0)
    assert summary["stall_s"]["median"] == pytest.approx(fault["stall_s"])


def test_window_ettr_counts_a_stall_at_the_end_of_the_window() -> None:
    from ftsystem.benchmarks.ettr_bench import window_ettr
    steady = {r: [(i, float(i)) for i in range(1, 11)] for r in ("r0", "r1")}
    assert window_ettr(steady, num_replicas=2, end=10.0)["ettr_time"] == 1.0
    # No commit in the last 9 s of the window: 8 s of it (all but one step) are lost.
    stuck = window_ettr(steady, num_replicas=2, end=19.0)
    assert stuck["ettr_time"] == pytest.approx(1 - 8 / 18) and stuck["ettr_work"] == 0.5


def test_bench_counts_faults_in_the_window_and_prefers_full_histories(tmp_path: Path) -> None:
    from ftsystem.benchmarks.ettr_bench import ftsystem_timelines, measure
    steady = {"r0": [(i, 100.0 + i) for i in range(1, 11)]}
    faults = [{"action": "hang", "state": "done", "executed_at": t} for t in (50.0, 105.0)]
    m = measure(steady, num_replicas=1, launched=90.0, end=110.0, injected=faults)
    assert m["failures"] == 1 and m["window_start_s"] == 11.0  # the one at 50 s hit start-up
    (tmp_path / "r0.json").write_text('{"replica": "r0", "commits": [[7, 7.0]]}')
    assert ftsystem_timelines(tmp_path) == ({"r0": [[7, 7.0]]}, "last generation only")
    (tmp_path / "r0.commits").write_text("1 1.0\n7 7.0\n")
    assert ftsystem_timelines(tmp_path) == ({"r0": [(1, 1.0), (7, 7.0)]}, "all generations")
