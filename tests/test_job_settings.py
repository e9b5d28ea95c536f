"""The job's spec decides the agents' timeout and the ranks' checkpoint policy: the pure rules,
then real agents against a real etcd (a flag that contradicts the spec is refused, the ranks get
the spec's settings, a job deleted under a running agent stops it)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agent.job_settings import SpecConflict, rank_settings_env, resolve_timeout
from agent.supervisor import EXIT_BAD_INPUT, EXIT_JOB_DELETED
from ftsystem.control import jobs
from ftsystem.control.store import Store

SPEC = {"replicas": 1, "timeout_s": 12.0,
        "checkpoint": {"every_steps": 5, "dir": "/shared/ckpt", "keep": 2}}


# --- the rules (pure) ------------------------------------------------------------------------

def test_the_spec_sets_the_timeout_and_a_flag_may_only_agree():
    assert resolve_timeout(None, SPEC) == 12.0
    assert resolve_timeout(12, SPEC) == 12.0
    with pytest.raises(SpecConflict, match="--timeout 9.*drop --timeout"):
        resolve_timeout(9.0, SPEC)


def test_without_a_spec_timeout_the_flag_or_the_default_applies():
    assert resolve_timeout(9.0, {"replicas": 2}) == 9.0
    assert resolve_timeout(9.0, None) == 9.0
    assert resolve_timeout(None, None) == 30.0


def test_the_ranks_get_the_timeout_and_the_checkpoint_policy():
    assert rank_settings_env(SPEC, 12.0) == {
        "FTSYSTEM_TIMEOUT_S": "12", "FTSYSTEM_CHECKPOINT_EVERY": "5",
        "FTSYSTEM_CHECKPOINT_KEEP": "2", "FTSYSTEM_CHECKPOINT_DIR": "/shared/ckpt"}
    # No policy in the spec: nothing about checkpoints, so an inherited setting stays.
    assert rank_settings_env({"replicas": 1, "checkpoint": {"every_steps": 0}}, 30.0) == {
        "FTSYSTEM_TIMEOUT_S": "30"}


# --- real agents -----------------------------------------------------------------------------

def _create(etcd_url: str, job: str, directory: Path) -> None:
    spec = jobs.JobSpec(replicas=1, timeout_s=12.0, checkpoint=jobs.CheckpointPolicy(
        every_steps=5, dir=str(directory), keep=2))

    async def create() -> None:
        async with Store(etcd_url) as store:
            await jobs.create_job(store, job, spec, now=time.time())
    asyncio.run(create())


def _agent(etcd_url: str, job: str, program: str, *flags: str,
           env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", etcd_url, "--job", job,
         "--replica-id", "r0", "--insecure", "--max-restarts", "2", *flags, "--",
         sys.executable, "-c", textwrap.dedent(program)],
        capture_output=True, text=True, timeout=120, env=env)


def test_an_agent_whose_timeout_contradicts_the_spec_is_refused(etcd, job_id, tmp_path):
    _create(etcd.url, job_id, tmp_path / "ckpt")
    marker = tmp_path / "ran"
    proc = _agent(etcd.url, job_id, f"open({str(marker)!r}, 'w')", "--timeout", "9")
    assert proc.returncode == EXIT_BAD_INPUT, proc.stderr[-2000:]
    assert "the job's spec sets the timeout to 12 s" in proc.stderr
    assert not marker.exists(), "nothing may run for a refused agent"


def test_the_ranks_run_with_the_spec_settings(etcd, job_id, tmp_path):
    _create(etcd.url, job_id, tmp_path / "ckpt")
    seen, tmp = tmp_path / "env.json", tmp_path / "tmp"
    tmp.mkdir()
    proc = _agent(etcd.url, job_id, f"""
        import json, os
        names = ["FTSYSTEM_TIMEOUT_S", "FTSYSTEM_CHECKPOINT_DIR", "FTSYSTEM_CHECKPOINT_EVERY",
                 "FTSYSTEM_CHECKPOINT_KEEP", "FTSYSTEM_HEARTBEAT"]
        json.dump({{n: os.environ.get(n) for n in names}}, open({str(seen)!r}, "w"))
    """, env=os.environ | {"TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    settings = json.loads(seen.read_text())
    assert settings.pop("FTSYSTEM_HEARTBEAT").startswith(str(tmp / "ftsystem-agent-r0-"))
    assert settings == {
        "FTSYSTEM_TIMEOUT_S": "12", "FTSYSTEM_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "FTSYSTEM_CHECKPOINT_EVERY": "5", "FTSYSTEM_CHECKPOINT_KEEP": "2"}
    assert list(tmp.iterdir()) == [], "the agent leaves its working directory behind"


def test_a_job_deleted_under_a_running_agent_stops_it_instead_of_a_restart(
        etcd, job_id, tmp_path):
    _create(etcd.url, job_id, tmp_path / "ckpt")
    runs = tmp_path / "runs"
    # The rank deletes its job (as `ftsystem job delete --force` would), then fails.
    proc = _agent(etcd.url, job_id, f"""
        import asyncio, os
        from ftsystem.control import jobs
        from ftsystem.control.store import Store
        open({str(runs)!r}, "a").write("ran\\n")
        async def delete():
            async with Store(os.environ["FTSYSTEM_ETCD"]) as store:
                await jobs.delete_job(store, os.environ["FTSYSTEM_JOB"], force=True)
        asyncio.run(delete())
        raise SystemExit(1)
    """)
    assert proc.returncode == EXIT_JOB_DELETED, proc.stderr[-2000:]
    assert "spec was deleted while replica r0 ran" in proc.stderr
    assert runs.read_text() == "ran\n", "the replica must not be restarted into no job"
