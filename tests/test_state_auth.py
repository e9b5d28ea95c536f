"""The state servers are closed by default: the fetching replica's own token, then members and
assigned joiners.

A real ``StateServer`` over a real socket, gated by a real control plane on a real etcd; the
agent's side of the contract (refuse without a token unless ``--insecure``, hand the ranks the
key derived from it, never the token) with real agent processes; and every deployment file
handing the token down.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from typer.testing import CliRunner

from agent.supervisor import job_token_env
from conftest import wait_for
from ftsystem.cli import app
from ftsystem.control import keys
from ftsystem.control.membership import Epoch
from ftsystem.control.store import Store
from ftsystem.control.tokens import AuthConfigError, load_token, replica_token, state_key
from ftsystem.training.fingerprint import GENESIS
from ftsystem.training.http_transport import HTTPTransport, StateServer
from ftsystem.training.runtime import ControlPlane, ReplicaContext
from ftsystem.training.snapshot import Snapshotter
from ftsystem.training.state_access import (GRANT_TTL_S, HEADER_REPLICA, Credentials,
                                            StateAccess, StateAccessError, replica_access)
from ftsystem.training.transport import DonorUnavailableError
from ftsystem.training.update_log import LoggedUpdate, UpdateLog
from test_deploy import agent_services, compose, fake_slurm, interpolate, k8s, run_sbatch

TOKEN = "job-secret-0123456789"
KEY = state_key(TOKEN)


def _context(job: str, etcd_url: str = "", **changes) -> ReplicaContext:
    return ReplicaContext(**{"etcd": etcd_url, "job": job, "replica_id": "r0", "generation": 0,
                             "lease_id": 0, "heartbeat_path": "", "host": "127.0.0.1",
                             "rank": 0, "world_size": 1, "timeout_s": 10.0,
                             "state_key": KEY} | changes)


async def _put(etcd_url: str, items: dict[str, str]) -> None:
    async with Store(etcd_url) as store:
        for key, value in items.items():
            await store.put(key, value)


def _donor(access: StateAccess) -> StateServer:
    """A donor at step 5 with a snapshot taken and one logged update."""
    state = {"model": {"w": torch.arange(6.0)}, "step": 5}
    snapshotter = Snapshotter(lambda: state)
    snapshotter.request()
    snapshotter.after_commit(5)  # on CPU the live state is the snapshot: offered at once
    log = UpdateLog()
    log.append(5, LoggedUpdate(torch.ones(3), parent=GENESIS, chain=GENESIS))
    return StateServer("127.0.0.1", snapshotter, log, current_step=lambda: 5, timeout_s=10,
                       access=access)


def test_only_token_holders_that_are_members_or_assigned_joiners_get_state(etcd, job_id):
    asyncio.run(_put(etcd.url, {
        keys.epoch(job_id): Epoch(number=3, members=("r0", "r1")).to_json(),
        keys.catchup(job_id, "r2"): json.dumps({"donor": "r0", "state_addr": "x"}),
        keys.catchup(job_id, "r3"): json.dumps({"donor": "r1", "state_addr": "y"})}))
    ctx = _context(job_id, etcd.url)
    control = ControlPlane(ctx)
    access, own = replica_access(ctx, control)
    server = _donor(access)
    url = f"http://{server.address}"
    try:
        assert own == Credentials("r0", replica_token(KEY, "r0"))
        # 401 without the named replica's token, on every route; never a byte of state. The
        # job's token and the key are no replica's token, and a replica's token proves only
        # that replica: a joiner's (r2's) does not fetch as the member r1.
        r1, r2 = replica_token(KEY, "r1"), replica_token(KEY, "r2")
        for headers in ({}, {HEADER_REPLICA: "r1"},
                        {HEADER_REPLICA: "r1", "Authorization": "Bearer wrong"},
                        {HEADER_REPLICA: "r1", "Authorization": r1},
                        {HEADER_REPLICA: "r1", "Authorization": f"Bearer {TOKEN}"},
                        {HEADER_REPLICA: "r1", "Authorization": f"Bearer {KEY}"},
                        {HEADER_REPLICA: "r1", "Authorization": f"Bearer {r2}"},
                        {"Authorization": f"Bearer {r1}"}):
            for path in ("/snapshot", "/log?after=4", "/status"):
                answer = httpx.get(url + path, headers=headers)
                assert answer.status_code == 401, (path, headers)
                assert answer.headers["WWW-Authenticate"] == "Bearer"
                assert "replica token" in answer.text and HEADER_REPLICA in answer.text
                assert not any(secret in answer.text for secret in (TOKEN, KEY, r1, r2))
        with pytest.raises(DonorUnavailableError, match="401"):
            HTTPTransport(10, Credentials("r1", "wrong")).fetch_snapshot(server.address)
        with pytest.raises(DonorUnavailableError, match="401"):
            HTTPTransport(10, Credentials("r1", r2)).fetch_snapshot(server.address)

        # 200 for a member, and for a joiner the leader assigned to this donor
        member = HTTPTransport(10, Credentials.of("r1", KEY))
        joiner = HTTPTransport(10, Credentials.of("r2", KEY))
        snapshot = member.fetch_snapshot(server.address)
        assert snapshot.step == 5 and torch.equal(snapshot.state["model"]["w"], torch.arange(6.0))
        assert joiner.fetch_snapshot(server.address).step == 5
        updates, head, _ = joiner.fetch_log(server.address, 4)
        assert [s for s, _ in updates] == [5] and head == 5
        assert joiner.fetch_head(server.address) == 5

        # 403 for a replica that is neither, one assigned to another donor, or one unnamed
        for stranger in ("r9", "r3", "../r0"):
            with pytest.raises(DonorUnavailableError, match="403.*neither a member of epoch 3"):
                HTTPTransport(10, Credentials.of(stranger, KEY)).fetch_log(server.address, 4)
        # /status needs a valid token only (steps and byte counts, no state)
        status = httpx.get(url + "/status", headers=Credentials.of("r9", KEY).headers())
        assert status.status_code == 200 and status.json()["step"] == 5

        # a replica let into a newer epoch is served as soon as the donor sees that epoch
        asyncio.run(_put(etcd.url, {
            keys.epoch(job_id): Epoch(number=4, members=("r0", "r1", "r9")).to_json()}))
        wait_for(lambda: _served(server.address, Credentials.of("r9", KEY)), 10,
                 "the donor to follow epoch 4")
    finally:
        server.shutdown()
        control.close()


def _served(addr: str, credentials: Credentials) -> bool:
    try:
        return HTTPTransport(10, credentials).fetch_log(addr, 4) is not None
    except DonorUnavailableError:
        return False


def test_the_assignment_is_read_only_for_non_members_and_a_grant_lasts_the_session():
    reads, now, assignments = [], [0.0], {"r2": "r0"}

    def assigned_donor(replica: str) -> str | None:
        reads.append(replica)
        return assignments.get(replica)
    access = StateAccess(key=KEY, donor="r0", epoch=lambda: (7, ("r0", "r1")),
                         assigned_donor=assigned_donor, clock=lambda: now[0])
    assert access.authorize({HEADER_REPLICA: "r1"}) is None and reads == []
    assert access.authorize({HEADER_REPLICA: "r2"}) is None and reads == ["r2"]
    # the joiner registered ready: its assignment is deleted before the join epoch lists it,
    # and it is still served while it keeps asking
    del assignments["r2"]
    for _ in range(5):
        now[0] += GRANT_TTL_S * 0.9
        assert access.authorize({HEADER_REPLICA: "r2"}) is None
    assert reads == ["r2"]
    now[0] += GRANT_TTL_S + 0.1  # it stopped asking: the grant lapsed, etcd decides again
    refusal = access.authorize({HEADER_REPLICA: "r2"})
    assert refusal.status == 403 and "epoch 7" in refusal.message and reads == ["r2", "r2"]


def test_insecure_serves_without_a_token_but_still_only_members():
    access = StateAccess(key=None, donor="r0", epoch=lambda: (1, ("r0", "r1")),
                         assigned_donor=lambda r: None)
    assert access.authenticate({}) is None
    assert access.authorize({HEADER_REPLICA: "r1"}) is None
    assert access.authorize({HEADER_REPLICA: "r7"}).status == 403
    assert Credentials.of("r1", "").headers() == {HEADER_REPLICA: "r1"}  # no Authorization


def test_a_rank_without_a_token_refuses_to_serve_unless_its_agent_was_insecure():
    with pytest.raises(StateAccessError) as refused:
        replica_access(_context("j", state_key=""), control=None)
    message = str(refused.value)
    assert "FTSYSTEM_STATE_KEY" in message and "FTSYSTEM_API_TOKEN" in message
    assert "--insecure" in message
    access, credentials = replica_access(_context("j", state_key="", insecure=True),
                                         control=None)
    assert access.authenticate({}) is None and credentials == Credentials("r0")
    env = {"FTSYSTEM_ETCD": "http://e:1", "FTSYSTEM_JOB": "j", "FTSYSTEM_REPLICA_ID": "r0",
           "FTSYSTEM_LEASE_ID": "1"}
    ctx = ReplicaContext.from_env(env | {"FTSYSTEM_STATE_KEY": KEY})
    assert (ctx.state_key, ctx.insecure) == (KEY, False) and KEY not in repr(ctx)
    assert ReplicaContext.from_env(env | {"FTSYSTEM_INSECURE": "1"}).insecure
    assert KEY not in repr(Credentials("r0", KEY))


def test_the_agent_hands_down_the_key_from_the_token_or_refuses(tmp_path):
    assert job_token_env(TOKEN, insecure=False) == {"FTSYSTEM_STATE_KEY": KEY}
    assert job_token_env(TOKEN, insecure=True) == {"FTSYSTEM_STATE_KEY": KEY}
    assert KEY != TOKEN and state_key("another job") != KEY
    # per replica, and not the same as the key or the token
    assert len({replica_token(KEY, r) for r in ("r0", "r1", "r10")} | {KEY, TOKEN}) == 5
    assert job_token_env(None, insecure=True) == {"FTSYSTEM_INSECURE": "1"}
    with pytest.raises(AuthConfigError, match="FTSYSTEM_API_TOKEN.*--insecure"):
        job_token_env(None, insecure=False)
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    assert load_token({"FTSYSTEM_API_TOKEN_FILE": str(token_file),
                       "FTSYSTEM_API_TOKEN": "other"}) == TOKEN  # the file wins


def test_ftsystem_agent_refuses_without_a_token_and_starts_with_insecure(monkeypatch):
    monkeypatch.delenv("FTSYSTEM_API_TOKEN", raising=False)
    monkeypatch.delenv("FTSYSTEM_API_TOKEN_FILE", raising=False)
    monkeypatch.setenv("FTSYSTEM_ETCD_RETRY_S", "1")
    argv = ["agent", "--etcd", "http://127.0.0.1:1", "--job", "j", "--replica-id", "r0"]
    result = CliRunner().invoke(app, [*argv, "--", "true"])
    assert result.exit_code == 2
    assert "no job token" in result.output and "--insecure" in result.output
    # --insecure passes the gate: what stops it now is the unreachable etcd
    result = CliRunner().invoke(app, [*argv, "--insecure", "--", "true"])
    assert result.exit_code == 2 and "etcd unreachable" in result.output


RANK_SECRETS = ("FTSYSTEM_STATE_KEY", "FTSYSTEM_INSECURE", "FTSYSTEM_API_TOKEN",
                "FTSYSTEM_API_TOKEN_FILE")
RECORD_ENV = ("import json, os, sys; json.dump({k: os.environ.get(k) for k in "
              f"{RANK_SECRETS!r}}}, open(sys.argv[1], 'w'))")


@pytest.mark.parametrize("insecure", [False, True])
def test_a_real_agent_gives_its_ranks_the_key_or_the_insecure_mark(etcd, job_id, tmp_path,
                                                                   insecure):
    seen = tmp_path / "env.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTSYSTEM_API_TOKEN")}
    # what the agent's own environment says of the ranks' variables is never passed on
    env |= {"FTSYSTEM_INSECURE": "1", "FTSYSTEM_STATE_KEY": "stale"}
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    env |= {} if insecure else {"FTSYSTEM_API_TOKEN_FILE": str(token_file)}
    agent = subprocess.run(
        [sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", etcd.url, "--job", job_id,
         "--replica-id", "r0", *(["--insecure"] if insecure else []), "--",
         sys.executable, "-c", RECORD_ENV, str(seen)],
        env=env, capture_output=True, text=True, timeout=120)
    assert agent.returncode == 0, agent.stderr[-2000:]
    # the job's token (here its file) never reaches a rank: it opens the controllers' API
    expected = dict.fromkeys(RANK_SECRETS) | (
        {"FTSYSTEM_INSECURE": "1"} if insecure else {"FTSYSTEM_STATE_KEY": KEY})
    assert json.loads(seen.read_text()) == expected
    assert not any(s in agent.stderr + agent.stdout for s in (TOKEN, KEY))  # never logged


# --- deployments hand the token down ------------------------------------------------------

def test_compose_agents_require_the_job_token():
    controller_env = compose()["services"]["controller"]["environment"]
    for name, service in agent_services().items():
        environment = service["environment"]
        assert environment["FTSYSTEM_API_TOKEN"] == controller_env["FTSYSTEM_API_TOKEN"], name
        with pytest.raises(AssertionError, match="refuses to start"):
            interpolate(environment["FTSYSTEM_API_TOKEN"], {})


def test_k8s_agents_read_the_job_token_from_the_controllers_secret():
    (deployment,) = k8s("Deployment")
    secrets = {v["secret"]["secretName"] for v in deployment["spec"]["template"]["spec"]["volumes"]
               if "secret" in v}
    for job in k8s("Job"):
        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        token_file = Path(next(e["value"] for e in container["env"]
                               if e["name"] == "FTSYSTEM_API_TOKEN_FILE"))
        mount = next(m for m in container["volumeMounts"]
                     if Path(m["mountPath"]) == token_file.parent)
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] in secrets and "optional" not in volume["secret"]


FAKE_AGENT_ENV = """#!{python}
import json, os
with open(os.path.join(os.environ["AGENT_ARGV"], os.environ["SLURM_NODEID"] + ".json"), "w") as f:
    json.dump(os.environ.get("FTSYSTEM_API_TOKEN_FILE"), f)
"""


def _slurm(tmp_path: Path, **env: str) -> dict[str, str]:
    tmp_path.mkdir()
    env = fake_slurm(tmp_path, ETCD_ENDPOINTS="http://etcd.example:2379", START_CONTROLLER="0",
                     **env)
    # the fake srun runs FAKE_AGENT on every node: this one records the token file it got
    Path(env["FAKE_AGENT"]).write_text(FAKE_AGENT_ENV.format(python=sys.executable))
    return env


def _token_files(env: dict[str, str]) -> list[str]:
    return [json.loads(p.read_text()) for p in sorted(Path(env["AGENT_ARGV"]).glob("*.json"))]


def test_slurm_agents_get_the_job_token_file(tmp_path):
    env = _slurm(tmp_path / "a")
    run_sbatch(env)
    token = Path(env["OUT_DIR"]) / "api-token"
    assert _token_files(env) == [str(token)] * 4
    assert token.stat().st_mode & 0o077 == 0 and len(token.read_text()) == 32
    yours = tmp_path / "yours"
    yours.write_text(TOKEN)
    env = _slurm(tmp_path / "b", FTSYSTEM_API_TOKEN_FILE=str(yours))
    run_sbatch(env)
    assert _token_files(env) == [str(yours)] * 4
    assert not (Path(env["OUT_DIR"]) / "api-token").exists()
