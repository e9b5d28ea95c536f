"""Fault tests with real processes: etcd, controllers, agents, replicas, SIGKILL.

After every test the invariant is asserted: all replicas that committed the last step hold
bitwise-identical parameters and optimizer state (equal SHA-256 of their state).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import descendants, exit_code_within, wait_for
from ftsystem.control.etcd_server import EmbeddedEtcd, free_port
from ftsystem.chaos.faults import FaultPoint
from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job
from ftsystem.control.store import Store

pytestmark = pytest.mark.slow
# Slow steps keep the job running while a killed replica restarts (python + torch import).
TRAIN_ARGS = ["--sleep-per-step", "0.03", "--linger", "60"]


def assert_invariant(summary: dict, cfg: RunConfig) -> None:
    assert summary["agents_ok"], summary
    assert summary["replicas_finished"] == cfg.num_replicas
    assert summary["steps"] == cfg.num_steps
    assert summary["bitwise_identical"], "replicas diverged"


def load_results(out_dir: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (out_dir / "results").glob("*.json")}


def test_sigkill_between_steps_and_during_allreduce(etcd, job_id, tmp_path):
    cfg = RunConfig(num_replicas=3, num_steps=300, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    kills=[ReplicaKill(1, FaultPoint(30, "step")),
                           ReplicaKill(2, FaultPoint(90, "allreduce"))],
                    train_args=TRAIN_ARGS, show_progress=False)
    summary = run_job(cfg)
    assert_invariant(summary, cfg)
    failures = summary["failures"]
    assert [(f["replica"], f["reason"]) for f in failures] == [
        ("r1", "killed by SIGKILL"), ("r2", "killed by SIGKILL")]
    # the survivors went on committing after each failure
    assert all(f["stall_s"] is not None for f in failures)
    results = load_results(tmp_path)
    assert results["r1"]["generation"] == 1 and results["r2"]["generation"] == 1
    assert results["r0"]["generation"] == 0
    # r0 never restarted: its timeline covers the whole job, without a hole at either failure.
    # A step may be missing where r0 entered an epoch: it had sent its buckets during
    # backward, a peer completed that step in the old epoch, and r0 replayed the result.
    steps = [s for s, _ in results["r0"]["commits"]]
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] == cfg.num_steps
    missing = set(range(1, cfg.num_steps + 1)) - set(steps)
    assert len(missing) < len(results["r0"]["epochs"]), sorted(missing)
    assert 0 < summary["ettr_time"] <= 1 and 0 < summary["ettr_work"] <= 1
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    # the restarted replicas rejoined mid-job, in a later epoch than the failure's
    for rid in ("r1", "r2"):
        first_step = results[rid]["commits"][0][0]
        assert 1 < first_step < cfg.num_steps, f"{rid} did not rejoin while training"


def test_controller_leader_killed_while_training(etcd, job_id, tmp_path):
    """Two controllers; the leader is SIGKILLed mid-run; the other takes over, steps go on."""
    ports = [free_port(), free_port()]
    cfg = RunConfig(num_replicas=2, num_steps=250, etcd=etcd.url, job=job_id, out_dir=tmp_path,
                    controller_ports=ports, train_args=TRAIN_ARGS, show_progress=False)
    summaries: list[dict] = []
    runner = threading.Thread(target=lambda: summaries.append(run_job(cfg)))
    runner.start()
    try:
        leader = wait_for(lambda: _leader(ports), 60, "a leader")
        token = wait_for(lambda: _run_token(tmp_path), 60, "the run's token")
        wait_for(lambda: _max_step(leader, job_id, token) >= 40, 120, "training underway")
        pid = httpx.get(f"http://127.0.0.1:{leader}/healthz").json()["pid"]
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        other = [p for p in ports if p != leader]
        wait_for(lambda: _leader(other), 30, "the other controller to lead", poll=0.02)
        took_over_at = time.time()
    finally:
        runner.join(300)
    assert_invariant(summaries[0], cfg)
    r0 = load_results(tmp_path)["r0"]["commits"]
    # replicas kept committing while no leader existed
    assert any(killed_at < t < took_over_at for _, t in r0), "training stopped without a leader"


def _run_token(out_dir) -> str | None:
    """The token ``ftsystem run`` made for its controllers (``OUT/api-token``)."""
    path = out_dir / "api-token"
    return path.read_text() if path.exists() else None


def _leader(ports: list[int]) -> int | None:
    """The port of the leading controller among ``ports``."""
    for port in ports:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).json()["leader"]:
                return port
        except httpx.HTTPError:
            continue
    return None


def _max_step(port: int, job: str, token: str) -> int:
    try:
        view = httpx.get(f"http://127.0.0.1:{port}/v1/jobs/{job}", timeout=2,
                         headers={"Authorization": f"Bearer {token}"}).json()
    except httpx.HTTPError:
        return 0
    return max((r["step"] or 0 for r in view["replicas"]), default=0)


def test_etcd_restart_mid_training_loses_nothing(tmp_path, job_id, monkeypatch):
    """An outage longer than the clients' retry deadline: everybody waits it out."""
    monkeypatch.setenv("FTSYSTEM_ETCD_RETRY_S", "2")
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd").start()
    cfg = RunConfig(num_replicas=2, num_steps=200, etcd=server.url, job=job_id,
                    out_dir=tmp_path / "run", train_args=TRAIN_ARGS, show_progress=False)
    summaries: list[dict] = []
    runner = threading.Thread(target=lambda: summaries.append(run_job(cfg)))
    try:
        runner.start()
        wait_for(lambda: _max_registered_step(server) >= 40, 120, "training underway")
        server.stop()
        time.sleep(4.0)
        server.start()
        runner.join(300)
    finally:
        server.stop()
    assert_invariant(summaries[0], cfg)
    assert summaries[0]["failures"] == []  # the outage cost no replica


def _max_registered_step(server: EmbeddedEtcd) -> int:
    async def steps() -> int:
        async with Store(server.url) as store:
            items, _ = await store.get_prefix("/ftsystem/")
        return max((json.loads(v).get("step", 0) for k, v in items.items()
                    if "/replicas/" in k), default=0)
    return asyncio.run(steps())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead for our purpose
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_agent_leaves_no_orphans(etcd, job_id, tmp_path, sig):
    pid_file = tmp_path / "child.pid"
    agent = subprocess.Popen([
        sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", etcd.url, "--job", job_id,
        "--replica-id", "r0", "--", "sh", "-c", f"echo $$ > {pid_file}; exec sleep 300"])
    try:
        child = wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 30,
                         "the replica to start")
        agent.send_signal(sig)
        agent.wait(30)
        wait_for(lambda: not _pid_alive(int(child)), 10, "the replica to die with its agent")
    finally:
        agent.kill()
    if sig != signal.SIGKILL:  # 128 + the signal, as a shell reports it: 143, 130
        assert agent.returncode == 128 + sig


@pytest.fixture
def own_etcd(tmp_path):
    """An etcd of this test alone: it is frozen (SIGSTOP), which the session's must not be."""
    with EmbeddedEtcd(data_dir=tmp_path / "etcd") as server:
        yield server
        server.process.send_signal(signal.SIGCONT)  # stop() must reach it


def test_agent_told_to_stop_exits_in_bounded_time_while_etcd_is_frozen(own_etcd, job_id,
                                                                        tmp_path):
    """etcd frozen (its connections hang instead of failing), then SIGTERM: the agent gives up
    the etcd work of its way out (revoking the replica lease, ending the generation, releasing
    its node rank) at its stop deadline, and exits 143 within the ranks' grace plus
    ``STOP_ETCD_S``. Its store would otherwise retry each of those calls for a minute."""
    from agent.supervisor import EXIT_SIGNALLED_BASE, AgentConfig
    bound_s = AgentConfig(etcd="", job=job_id, replica_id="r0", command=[]).stop_bound_s
    pid_file = tmp_path / "child.pid"
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        agent = subprocess.Popen([
            sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", own_etcd.url, "--job",
            job_id, "--replica-id", "r0", "--", "sh", "-c",
            f"echo $$ > {pid_file}; exec sleep 300"],
            env={**os.environ, "FTSYSTEM_ETCD_RETRY_S": "60"}, stdout=log,
            stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 30,
                 "the replica to start")
        own_etcd.process.send_signal(signal.SIGSTOP)
        agent.send_signal(signal.SIGTERM)
        margin_s = 10.0  # the interpreter's exit, and a loaded machine
        code = exit_code_within(agent, bound_s + margin_s, log_path,
                                "the agent told to stop by SIGTERM")
    finally:
        agent.kill()
    assert code == EXIT_SIGNALLED_BASE + signal.SIGTERM == 143, log_path.read_text()[-3000:]
    assert "skipped" in log_path.read_text(), "no etcd work was reported as skipped"


def _as_a_foreground_job() -> None:
    """In the child before it runs: SIGINT back to its default. A shell without job control
    starts a background command (``pytest ... &``) with SIGINT ignored, its children inherit
    that, and Python then leaves Ctrl-C ignored: ``ftsystem run`` would rightly not stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_on_run_leaves_no_process_behind(tmp_path):
    printed = tmp_path / "printed.txt"
    with printed.open("w") as out:
        run = subprocess.Popen([sys.executable, "-m", "ftsystem.cli", "run", "--replicas", "2",
                                "--steps", "100000", "--out", str(tmp_path), "--sleep-per-step",
                                "0.05"], stdout=out, stderr=subprocess.DEVNULL,
                               preexec_fn=_as_a_foreground_job)
    try:
        # It says where to look first.
        wait_for(lambda: re.search(r"status page: http://127\.0\.0\.1:\d+/", printed.read_text()),
                 120, "the status page's URL")
        # etcd, a controller, 2 agents and their 2 replicas (each behind its setpriv exec)
        tree = wait_for(lambda: len(d := descendants(run.pid)) >= 6 and
                        (tmp_path / "results").exists() and d, 120, "the job to start")
        time.sleep(5)  # let the replicas get into training
        tree |= descendants(run.pid)
        run.send_signal(signal.SIGINT)
        run.wait(60)
        wait_for(lambda: not [p for p in tree if _pid_alive(p)], 30, "every process to exit")
    finally:
        run.kill()
