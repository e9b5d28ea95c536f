"""A job's lifecycle: its spec validated, created once, read, listed and deleted, through the
REST API of a real controller and through ``ftsystem job`` against a real etcd; the leader
waits for the spec, and live ETTR is measured against the spec's capacity."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import yaml
import pytest
from typer.testing import CliRunner

from conftest import API_TOKEN, controller_process, wait_for
from ftsystem.cli import app
from ftsystem.control import keys
from ftsystem.control.jobs import JobSpecError, parse_spec, unfinished_replicas
from ftsystem.control.membership import Registration, ReplicaState
from ftsystem.control.store import Store
from ftsystem.measure.ettr import LiveEttr

AUTH = {"Authorization": f"Bearer {API_TOKEN}"}
WAITING = "has no spec: no epoch before it exists"
"""What the leader logs, once per term, while the job has no spec."""


@pytest.mark.parametrize("raw, message", [
    ({}, "replicas is missing"),
    ({"replicas": 2, "min_replicas": 3}, "min_replicas 3 > replicas 2: lower min_replicas"),
    ({"replicas": True}, "replicas must be an integer from 1 to"),
    ({"replicas": 2, "nodes": 2}, "unknown field(s) 'nodes': the fields are"),
    ({"replicas": 2, "timeout_s": 1}, "timeout_s must be a number of seconds from 6 to"),
    ({"replicas": 1, "checkpoint": {"every_steps": 10}}, "without checkpoint.dir"),
    ({"replicas": 2, "replica_ids": ["r0"]}, "replica_ids lists 1 id(s) for 2 replicas"),
    ([1, 2], "a job spec is a JSON object"),
    ({"replicas": 10 ** 30}, "replicas must be an integer from 1 to 1000000"),
    ({"replicas": 2, "nproc_per_node": 100_000}, "nproc_per_node must be an integer from 1 to"),
    ({"replicas": 2, "timeout_s": 1e300}, "timeout_s must be a number of seconds from 6 to 3600"),
    ({"replicas": 1, "replica_ids": ["r0\n"]}, "invalid replica id 'r0\\n'"),
])
def test_a_malformed_spec_says_what_to_fix(raw, message):
    with pytest.raises(JobSpecError, match=re.escape(message)):
        parse_spec(raw)


def test_a_spec_takes_defaults_and_round_trips():
    spec = parse_spec({"replicas": 4, "checkpoint": {"every_steps": 50, "dir": "/ckpt"}})
    assert (spec.min_replicas, spec.nodes_per_replica, spec.timeout_s) == (1, 1, 30.0)
    assert parse_spec(spec.to_json()) == spec
    assert (spec.policy.initial_replicas, spec.policy.min_replicas) == (4, 1)


FINISHED = {"number": 1, "ended": "", "finished": True}


@pytest.mark.parametrize("spec, generations, halted, reasons", [
    ({"replicas": 2}, {"r0": FINISHED, "r1": FINISHED}, {}, []),
    ({"replicas": 2}, {"r0": FINISHED, "r1": {"number": 0, "ended": "", "finished": False}},
     {}, ["replica r1 did not finish: its generation 0 never ended (its agents died with "
          "their nodes, or still run)"]),
    ({"replicas": 2}, {"r0": FINISHED, "r1": {"number": 2, "ended": "node rank 1 silent"}},
     {}, ["replica r1 did not finish: its generation 2 ended (node rank 1 silent) and none "
          "followed (a node lost for good, no spare to take its place, or stopped)"]),
    ({"replicas": 2}, {"r0": FINISHED, "r1": {"number": 0, "ended": "exited with code 1"}},
     {"r1": {"step": 7, "reason": "diverged"}}, ["replica r1 halted at step 7: diverged"]),
    ({"replicas": 3}, {"r0": FINISHED}, {}, ["2 of the job's 3 replicas never started"]),
    ({"replicas": 2, "replica_ids": ["a", "b", "c"]}, {"b": FINISHED}, {},
     ["1 of the job's 2 replicas never started (of a, c)"]),
])
def test_the_outcome_names_each_replica_that_did_not_finish(spec, generations, halted,
                                                            reasons):
    assert unfinished_replicas(parse_spec(spec), generations, halted) == reasons


def test_live_work_ettr_is_measured_against_the_capacity():
    """Two of four replicas train at the normal pace: half the work of the job's capacity."""
    ettr = LiveEttr(num_replicas=4)
    for step in range(1, 21):
        for replica in ("a", "b"):
            ettr.observe(replica, step, True, now=float(step))
    values = ettr.values(now=20.0)
    assert values["ettr_time"] == pytest.approx(1.0)
    assert values["ettr_work"] == pytest.approx(2 * 19 / (4 * 19))


async def _register(etcd_url: str, job: str, rid: str, state: ReplicaState, step: int = 0,
                    lease: int | None = None) -> int:
    async with Store(etcd_url) as store:
        lease = lease or await store.grant(60)
        reg = Registration(replica_id=rid, state=state, generation=0, step=step, lease=lease)
        await store.put(keys.replica(job, rid), reg.to_json(), lease=lease)
        return lease


async def _job_keys(etcd_url: str, job: str) -> dict[str, bytes]:
    async with Store(etcd_url) as store:
        return (await store.get_prefix(keys.job(job) + "/"))[0]


def _epoch(etcd_url: str, job: str) -> dict | None:
    raw = asyncio.run(_job_keys(etcd_url, job)).get(keys.epoch(job))
    return json.loads(raw) if raw else None


def _waits(log: Path) -> int:
    return log.read_text().count(WAITING)


def _terms(log: Path) -> int:
    return log.read_text().count(" leads job ")


def _work_ettr(api: httpx.Client, job: str) -> float | None:
    text = api.get("/metrics", headers=AUTH).text
    found = re.search(rf'ftsystem_ettr_ratio{{job="{job}",kind="work"}} (\S+)', text)
    return float(found.group(1)) if found else None


def test_rest_lifecycle_the_leader_waits_and_ettr_uses_the_spec(etcd, job_id, tmp_path):
    log = tmp_path / "controller.log"
    asyncio.run(_register(etcd.url, job_id, "a", ReplicaState.READY))
    with (controller_process(etcd.url, job_id, tmp_path) as base,
          httpx.Client(base_url=base, timeout=60) as api):  # a loaded machine answers late
        url = f"/v1/jobs/{job_id}"
        # The leader waits for the spec: a ready replica, and no epoch.
        wait_for(lambda: _waits(log), 60, "the leader to say it waits for the spec")
        assert _epoch(etcd.url, job_id) is None
        assert api.get(url, headers=AUTH).json()["spec"] is None
        assert api.post(url, json={"replicas": 1}).status_code == 401
        assert api.delete(url, params={"force": "true"}).status_code == 401
        bad = api.post(url, json={"replicas": 1, "min_replicas": 2}, headers=AUTH)
        assert bad.status_code == 422 and "lower min_replicas" in bad.text
        assert api.get(url, headers=AUTH).json()["spec"] is None  # nothing was stored
        created = api.post(url, json={"replicas": 1, "timeout_s": 12}, headers=AUTH)
        assert created.status_code == 201, created.text
        assert created.json()["spec"]["timeout_s"] == 12
        epoch = wait_for(lambda: _epoch(etcd.url, job_id), 60, "the first epoch")
        assert epoch["members"] == ["a"] and _waits(log) <= _terms(log)  # once per term
        again = api.post(url, json={"replicas": 3}, headers=AUTH)
        assert again.status_code == 409 and "delete it first" in again.text
        assert api.get(url, headers=AUTH).json()["spec"]["replicas"] == 1  # unchanged
        listed = api.get("/v1/jobs", headers=AUTH).json()["jobs"]
        assert {"job": job_id, "spec": created.json()["spec"]} in listed

        # Delete: refused while a replica is registered, then forced; every key goes.
        waited = _waits(log)
        running = api.delete(url, headers=AUTH)
        assert running.status_code == 409 and "--force" in running.text
        assert api.delete(url, params={"force": "true"}, headers=AUTH).status_code == 200
        left = asyncio.run(_job_keys(etcd.url, job_id))
        assert set(left) <= {keys.leader(job_id), *(k for k in left
                                                    if k.startswith(keys.controllers(job_id)))}
        # The controller stays, waiting for a new spec: its next term starts clean.
        wait_for(lambda: _waits(log) > waited, 60, "a new term waiting for a new spec")
        wait_for(lambda: api.get("/v1/sd/prometheus", headers=AUTH).json(), 60,
                 "the controller's discovery record back")

        # A new job of 8 replicas with 2 training: live work ETTR well under 1 (it would be
        # 1.0 against one replica's capacity).
        assert api.post(url, json={"replicas": 8}, headers=AUTH).status_code == 201
        leases = {rid: asyncio.run(_register(etcd.url, job_id, rid, ReplicaState.MEMBER))
                  for rid in ("a", "b")}
        for step in range(1, 13):
            for rid, lease in leases.items():
                asyncio.run(_register(etcd.url, job_id, rid, ReplicaState.MEMBER, step, lease))
        work = wait_for(lambda: _work_ettr(api, job_id), 60, "live work-based ETTR")
        assert 0 < work < 0.75, work
        # Nothing of the deleted job carries over: no epoch yet (the first waits up to 60 s for
        # 8 replicas), or, on a machine slow enough to reach that, epoch 1 again.
        assert (_epoch(etcd.url, job_id) or {"number": 1})["number"] == 1


def _cli(*args: str, base: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, ["job", *args, "--controller", base], env=env)


def test_cli_lifecycle_through_the_api(etcd, job_id, tmp_path):
    with controller_process(etcd.url, job_id, tmp_path) as base:
        _cli_lifecycle(etcd.url, job_id, base, tmp_path)


def _cli_lifecycle(etcd_url: str, job_id: str, base: str, tmp_path: Path) -> None:
    bad = _cli("create", job_id, "--replicas", "2", "--min-replicas", "3", base=base)
    assert bad.exit_code == 2 and "lower min_replicas" in bad.output
    assert "nothing was stored" in bad.output
    assert keys.spec(job_id) not in asyncio.run(_job_keys(etcd_url, job_id))

    # The token: none, another, or from a file.
    nobody = _cli("create", job_id, "--replicas", "2", base=base,
                  env={"FTSYSTEM_API_TOKEN": "", "FTSYSTEM_API_TOKEN_FILE": ""})
    assert nobody.exit_code == 2
    assert "needs the job's token: set FTSYSTEM_API_TOKEN" in nobody.output
    other = _cli("get", job_id, base=base, env={"FTSYSTEM_API_TOKEN": "wrong"})
    assert other.exit_code == 2 and "refused the token" in other.output
    token_file = tmp_path / "token"
    token_file.write_text(API_TOKEN + "\n")
    created = _cli("create", job_id, "--replicas", "2", "--checkpoint-every", "100",
                   "--checkpoint-dir", "/shared/ckpt", "--replica-ids", "r0,r1",
                   "--token-file", str(token_file), base=base, env={"FTSYSTEM_API_TOKEN": ""})
    assert created.exit_code == 0, created.output
    assert json.loads(created.output)["spec"]["replica_ids"] == ["r0", "r1"]
    stored = json.loads(asyncio.run(_job_keys(etcd_url, job_id))[keys.spec(job_id)])
    assert stored["checkpoint"] == {"every_steps": 100, "dir": "/shared/ckpt", "keep": 3}
    assert stored["replica_ids"] == ["r0", "r1"] and stored["created_at"] <= time.time()

    again = _cli("create", job_id, "--replicas", "5", base=base)
    assert again.exit_code == 1 and "exists: delete it first" in again.output
    same = _cli("create", job_id, "--replicas", "2", "--checkpoint-every", "100",
                "--checkpoint-dir", "/shared/ckpt", "--replica-ids", "r0,r1", "--exist-ok",
                base=base)
    assert same.exit_code == 0, same.output
    assert json.loads(same.output)["spec"]["created_at"] == stored["created_at"]
    assert json.loads(asyncio.run(_job_keys(etcd_url, job_id))[keys.spec(job_id)]) == stored

    got = _cli("get", job_id, base=base)
    assert got.exit_code == 0 and json.loads(got.output)["spec"] == stored
    unstarted = _cli("outcome", job_id, base=base)
    assert unstarted.exit_code == 1, unstarted.output
    assert "2 of the job's 2 replicas never started (of r0, r1)" in unstarted.output

    async def finish(replica: str) -> None:
        async with Store(etcd_url) as store:
            await store.put_json(keys.generation(job_id, replica), FINISHED)
    for replica in ("r0", "r1"):
        asyncio.run(finish(replica))
    done = _cli("outcome", job_id, base=base)
    assert done.exit_code == 0 and "every replica finished" in done.output, done.output
    listed = _cli("list", base=base)
    assert listed.exit_code == 0
    assert any(line.split("\t")[:3] == [job_id, "2", "1"] for line in listed.output.splitlines())

    async def leave_a_run_behind() -> None:
        async with Store(etcd_url) as store:
            await store.put_json(keys.epoch(job_id), {"number": 7, "members": ["r0"]})
            await store.put_json(keys.failure(job_id, "r0", 0), {"reason": "x"})
            await store.put_json(keys.agent(job_id, "r0", 0), {"host": "h"},
                                 lease=await store.grant(60))
    asyncio.run(leave_a_run_behind())
    refused = _cli("delete", job_id, base=base)
    assert refused.exit_code == 1 and "is running" in refused.output
    assert _cli("delete", job_id, "--force", base=base).exit_code == 0
    left = asyncio.run(_job_keys(etcd_url, job_id))  # every key but the controller's own
    assert set(left) <= {keys.leader(job_id), *(k for k in left
                                                if k.startswith(keys.controllers(job_id)))}
    gone = _cli("get", job_id, base=base)
    assert gone.exit_code == 1 and "ftsystem job create" in gone.output
    no_outcome = _cli("outcome", job_id, base=base)
    assert no_outcome.exit_code == 1 and "nothing to report" in no_outcome.output

    # What an earlier run left without a spec (an epoch) keeps a new job from starting on it.
    async def stale_epoch() -> None:
        async with Store(etcd_url) as store:
            await store.put_json(keys.epoch(job_id), {"number": 3, "members": ["r0"]})
    asyncio.run(stale_epoch())
    stale = _cli("create", job_id, "--replicas", "1", base=base)
    assert stale.exit_code == 1 and "earlier run's state (epoch 3)" in stale.output
    assert _cli("delete", job_id, base=base).exit_code == 0
    assert _cli("create", job_id, "--replicas", "1", base=base).exit_code == 0
    assert keys.spec(job_id) in asyncio.run(_job_keys(etcd_url, job_id))


# --- the deployment files create the job their agents run -----------------------------------

DOCKER = Path(__file__).resolve().parents[1] / "docker"


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _stored_spec(etcd_url: str, job: str) -> dict:
    return json.loads(asyncio.run(_job_keys(etcd_url, job))[keys.spec(job)])


def _create_twice(argv: list[str], base: str) -> None:
    """A deployment step runs again (a restarted pod or service): the same spec is no error."""
    for _ in range(2):
        done = CliRunner().invoke(app, argv, env={"FTSYSTEM_CONTROLLER": base})
        assert done.exit_code == 0, done.output


def test_compose_creates_the_job_its_agents_run(etcd, job_id, tmp_path):
    services = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    job = services["job"]
    assert job["entrypoint"][0] == "ftsystem"
    # Through the first controller's API, once it answers, with the job's token.
    assert job["environment"]["FTSYSTEM_CONTROLLER"] == "http://controller:8080"
    assert "FTSYSTEM_API_TOKEN" in job["environment"]
    assert job["depends_on"] == {"controller": {"condition": "service_healthy"}}
    agents = [s["command"] for s in services.values()
              if s.get("build", {}).get("target") == "agent"]
    assert all(s["depends_on"]["job"] == {"condition": "service_completed_successfully"}
               for s in services.values() if s.get("build", {}).get("target") == "agent")
    argv = job["entrypoint"][1:] + job["command"]
    name = argv[argv.index("create") + 1]
    assert {_option(a, "--job") for a in agents} == {name}
    with controller_process(etcd.url, job_id, tmp_path) as base:
        _create_twice([job_id if a == name else a for a in argv], base)
    spec = _stored_spec(etcd.url, job_id)
    assert spec["replicas"] == len(agents)
    assert spec["replica_ids"] == sorted(_option(a, "--replica-id") for a in agents)


def test_kubernetes_creates_the_job_its_agents_run(etcd, job_id, tmp_path):
    (create,) = [d for d in yaml.safe_load_all((DOCKER / "k8s" / "create-job.yaml").read_text())
                 if d]
    assert create["kind"] == "Job"
    (container,) = create["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") or e["valueFrom"]["configMapKeyRef"]["key"]
           for e in container["env"]}
    assert env == {"JOB_ID": "JOB_ID", "FTSYSTEM_CONTROLLER": "http://ftsystem-controller:8080",
                   "FTSYSTEM_API_TOKEN_FILE": "/var/run/secrets/ftsystem/token"}
    controllers = [d for d in yaml.safe_load_all((DOCKER / "k8s" / "controller.yaml").read_text())
                   if d and d["kind"] == "Service"]
    assert [(s["metadata"]["name"], s["spec"]["ports"][0]["port"]) for s in controllers] == [
        ("ftsystem-controller", 8080)]
    argv = container["command"][1:] + [re.sub(r"\$\((\w+)\)", lambda m: job_id, a)
                                       for a in container["args"]]
    with controller_process(etcd.url, job_id, tmp_path) as base:
        _create_twice(argv, base)
        agent_jobs = [d for d in yaml.safe_load_all((DOCKER / "k8s" / "agents.yaml").read_text())
                      if d and d["kind"] == "Job"]
        spec = _stored_spec(etcd.url, job_id)
        assert spec["replicas"] == len(agent_jobs)
        assert spec["replica_ids"] == sorted(j["metadata"]["labels"]["ftsystem/replica"]
                                             for j in agent_jobs)
        for agent_job in agent_jobs:
            (agent,) = agent_job["spec"]["template"]["spec"]["containers"]
            assert spec["nodes_per_replica"] == agent_job["spec"]["completions"]
            assert spec["nproc_per_node"] == int(_option(agent["args"], "--nproc-per-node"))
        at = argv.index("--min-replicas") + 1
        other = CliRunner().invoke(app, [*argv[:at], "2", *argv[at + 1:]],
                                   env={"FTSYSTEM_CONTROLLER": base})  # another spec
        assert other.exit_code == 1 and "exists with another spec" in other.output


def test_an_id_ending_in_a_newline_is_refused():
    with pytest.raises(keys.InvalidIdError):
        keys.check_id("job", "demo\n")
    assert keys.check_id("job", "demo") == "demo"


def test_a_chaos_duration_beyond_a_day_is_refused():
    from ftsystem.chaos.spec import ChaosSpecError, spec_from_mapping
    with pytest.raises(ChaosSpecError, match="duration: at most 24h"):
        spec_from_mapping({"action": "slow", "duration": "100000h", "schedule": "@every 1h"})
    with pytest.raises(ChaosSpecError, match="duration: at most 24h"):
        spec_from_mapping({"action": "hang", "duration": 1e300, "schedule": "@every 1h"})
