"""The controller as a real process against a real etcd: REST API, epochs, metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import API_TOKEN, controller_process, wait_for
from ftsystem.control import keys
from ftsystem.control.etcd_server import EmbeddedEtcd
from ftsystem.control.membership import Registration, ReplicaState
from ftsystem.control.store import Store


AUTH = {"Authorization": f"Bearer {API_TOKEN}"}
STORE_ADDR, STATE_ADDR = "10.1.2.3:4567", "10.7.6.5:4321"
"""Internal addresses (rendezvous store, state server) that no public answer may show."""


@pytest.fixture
def controller(etcd, job_id, tmp_path):
    with controller_process(etcd.url, job_id, tmp_path) as base:
        yield base


async def _register(etcd_url: str, job: str, rids: list[str]) -> dict[str, int]:
    leases = {}
    async with Store(etcd_url) as store:
        await store.put_json(keys.spec(job), {"replicas": len(rids), "min_replicas": 1})
        for rid in rids:
            leases[rid] = await store.grant(60)
            reg = Registration(replica_id=rid, state=ReplicaState.READY, generation=0,
                               store_addr=STORE_ADDR, state_addr=STATE_ADDR, step=7,
                               metrics_addr=f"127.0.0.1:9{rid}")
            await store.put(keys.replica(job, rid), reg.to_json(), lease=leases[rid])
        # Replica a's two ranks publish their own endpoints, one rank on each of its machines
        # m0 and m1; the agent of m1 its own.
        for rank in (0, 1):
            await store.put_json(keys.metrics_endpoint(job, "a", rank),
                                 {"addr": f"127.0.0.1:8{rank}", "node_id": f"m{rank}"},
                                 lease=leases["a"])
        await store.put_json(keys.agent(job, "a", 1),
                             {"metrics_addr": "127.0.0.1:71", "node_id": "m1"}, lease=leases["a"])
    return leases


def _view(base: str, job: str) -> dict:
    return httpx.get(f"{base}/v1/jobs/{job}", headers=AUTH).json()


async def _revoke(etcd_url: str, lease: int) -> None:
    async with Store(etcd_url) as store:
        await store.revoke(lease)


def test_job_view_follows_registrations(controller, etcd, job_id):
    leases = asyncio.run(_register(etcd.url, job_id, ["a", "b", "c"]))
    view = wait_for(lambda: (v := _view(controller, job_id))["epoch"]["number"] >= 1 and v, 30,
                    "the first epoch")
    assert view["job"] == job_id and view["epoch"]["members"] == ["a", "b", "c"]
    assert [(r["id"], r["state"], r["step"], r["generation"]) for r in view["replicas"]] == [
        ("a", "ready", 7, 0), ("b", "ready", 7, 0), ("c", "ready", 7, 0)]
    asyncio.run(_revoke(etcd.url, leases["b"]))
    view = wait_for(lambda: (v := _view(controller, job_id))["epoch"]["number"] >= 2 and v, 30,
                    "the removal epoch")
    assert view["epoch"]["members"] == ["a", "c"]
    one = httpx.get(f"{controller}/v1/jobs/{job_id}/replicas/c", headers=AUTH).json()
    assert one["id"] == "c" and one["state"] == "ready"
    metrics = httpx.get(f"{controller}/metrics", headers=AUTH).text
    assert f'ftsystem_epoch{{job="{job_id}"}} 2.0' in metrics
    assert f'ftsystem_controller_is_leader{{job="{job_id}"}} 1.0' in metrics
    # Its counters and histograms export no creation timestamps.
    assert f'ftsystem_membership_changes_total{{job="{job_id}",reason="removal"}} 1.0' in metrics
    assert "_created" not in metrics
    assert httpx.get(f"{controller}/healthz").json()["leader"] is True
    groups = httpx.get(f"{controller}/v1/sd/prometheus", headers=AUTH).json()
    targets = {(g["labels"]["component"], g["labels"]["instance_id"]): g["targets"] for g in groups}
    assert ("replica", "b") not in targets
    assert targets[("replica", "c")] == ["127.0.0.1:9c"]  # no rank endpoints: its registration
    ranks = {g["labels"]["rank"]: (g["targets"], g["labels"]["host"]) for g in groups
             if g["labels"]["component"] == "replica" and g["labels"]["replica"] == "a"}
    # Every rank, labelled with its rank and its machine.
    assert ranks == {"0": (["127.0.0.1:80"], "m0"), "1": (["127.0.0.1:81"], "m1")}
    assert {"targets": ["127.0.0.1:71"], "labels": {
        "job": job_id, "component": "agent", "instance_id": "a/00001", "replica": "a",
        "node_rank": "1", "host": "m1"}} in groups
    assert [c for c, _ in targets].count("controller") == 1
    assert all(g["labels"]["job"] == job_id for g in groups)


def test_public_answers_show_no_internal_addresses(controller, etcd, job_id):
    asyncio.run(_register(etcd.url, job_id, ["a", "b"]))
    wait_for(lambda: _view(controller, job_id)["epoch"]["number"] >= 1, 30, "the first epoch")
    for path in ("/", f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/replicas/a",
                 f"/v1/jobs/{job_id}/chaos", f"/v1/jobs/{job_id}/events"):
        body = httpx.get(f"{controller}{path}", headers=AUTH).text
        assert STORE_ADDR not in body and STATE_ADDR not in body, path


def test_every_route_but_the_probes_needs_the_token(controller, job_id):
    """Whatever the route and the method, a request without the right token gets 401; only
    /healthz and /readyz answer without it. The schema declares the bearer scheme on every
    other operation, and typed bodies."""
    schema = httpx.get(f"{controller}/openapi.json").json()
    assert schema["components"]["securitySchemes"]["jobToken"] == {
        "type": "http", "scheme": "bearer",
        "description": schema["components"]["securitySchemes"]["jobToken"]["description"]}
    operations = {(method.upper(), path): operation
                  for path, methods in schema["paths"].items()
                  for method, operation in methods.items()}
    assert {("POST", "/v1/jobs/{job}/chaos"), ("GET", "/v1/jobs/{job}/status"),
            ("GET", "/"), ("GET", "/metrics")} <= set(operations)
    for (method, template), operation in operations.items():
        path = template.replace("{job}", job_id).replace("{replica_id}", "a")
        if path in ("/healthz", "/readyz"):
            assert "security" not in operation, path
            assert httpx.request(method, f"{controller}{path}").status_code in (200, 503)
            continue
        assert operation["security"] == [{"jobToken": []}], (method, template)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_TOKEN}):
            response = httpx.request(method, f"{controller}{path}", json={}, headers=headers)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
        granted = httpx.request(method, f"{controller}{path}", json={}, headers=AUTH)
        assert granted.status_code not in (401, 403), (method, path)
    # Typed bodies: the spec of a job and of a chaos order, the job's view, its status.
    bodies = {name: schema["paths"][path][method]["requestBody"]["content"][
        "application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        for name, path, method in (("job", "/v1/jobs/{job}", "post"),
                                   ("chaos", "/v1/jobs/{job}/chaos", "post"))}
    assert bodies == {"job": "JobSpecRequest", "chaos": "ChaosSpecRequest"}
    models = schema["components"]["schemas"]
    assert models["JobSpecRequest"]["required"] == ["replicas"]
    assert models["JobSpecRequest"]["additionalProperties"] is False
    assert {"action", "duration", "schedule", "selector"} <= set(
        models["ChaosSpecRequest"]["properties"])
    answers = {path: schema["paths"][path]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"].get("$ref", "").rsplit("/", 1)[-1]
        for path in ("/v1/jobs/{job}", "/v1/jobs/{job}/status", "/v1/jobs/{job}/chaos")}
    assert answers == {"/v1/jobs/{job}": "JobView", "/v1/jobs/{job}/status": "JobStatus",
                       "/v1/jobs/{job}/chaos": "OrderList"}
    assert {"replicas", "epoch", "failures", "progress", "leader_address"} <= set(
        models["JobStatus"]["properties"])
    assert models["ErrorDetail"]["required"] == ["detail"]  # every route's 401 refers to it
    # The status page without the token: the sign-in page, with none of the job's data.
    page = httpx.get(f"{controller}/")
    assert page.status_code == 401 and '<form id="sign-in" >' in page.text
    assert 'id="replicas"' not in page.text


def test_public_read_opens_reads_only(etcd, job_id, tmp_path):
    """--public-read: every GET answers without the token (the status page, /metrics, the
    job's state); a mutation still needs it."""
    asyncio.run(_register(etcd.url, job_id, ["a"]))
    with controller_process(etcd.url, job_id, tmp_path, public_read=True) as base:
        for path in ("/", "/metrics", f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/status",
                     f"/v1/jobs/{job_id}/chaos", "/v1/sd/prometheus"):
            assert httpx.get(f"{base}{path}").status_code == 200, path
        chaos = httpx.post(f"{base}/v1/jobs/{job_id}/chaos", json={"action": "kill"})
        assert chaos.status_code == 401
        assert httpx.delete(f"{base}/v1/jobs/{job_id}").status_code == 401
    assert b"--public-read: GET and HEAD" in (tmp_path / "controller.log").read_bytes()


def test_insecure_controller_takes_mutations_without_a_token(etcd, job_id, tmp_path):
    env = {"FTSYSTEM_API_TOKEN": ""}
    with controller_process(etcd.url, job_id, tmp_path, env, insecure=True) as base:
        response = httpx.post(f"{base}/v1/jobs/{job_id}/chaos", json={"action": "melt"})
        assert response.status_code == 400 and "invalid chaos spec" in response.text
    assert b"--insecure: the API is open" in (tmp_path / "controller.log").read_bytes()


def test_bad_requests_get_clear_errors(controller, job_id):
    unknown_job = httpx.get(f"{controller}/v1/jobs/nope", headers=AUTH)
    assert unknown_job.status_code == 404 and "this controller manages" in unknown_job.text
    unknown_replica = httpx.get(f"{controller}/v1/jobs/{job_id}/replicas/zz", headers=AUTH)
    assert unknown_replica.status_code == 404 and "lists its replicas" in unknown_replica.text
    illegal = httpx.get(f"{controller}/v1/jobs/{job_id}/replicas/a%20b%3B", headers=AUTH)
    assert illegal.status_code == 400 and "invalid replica id" in illegal.text


def _readyz(base: str) -> tuple[int, dict] | None:
    try:
        reply = httpx.get(f"{base}/readyz", timeout=5)
    except httpx.HTTPError:
        return None
    return reply.status_code, reply.json()


def test_readyz_follows_etcd_while_healthz_stays_up(job_id, tmp_path):
    """etcd stopped: /readyz answers 503 naming etcd, /healthz still 200 (liveness must not
    restart the controllers for an outage); etcd back: /readyz 200 with the leader."""
    with EmbeddedEtcd(data_dir=tmp_path / "etcd") as etcd, \
            controller_process(etcd.url, job_id, tmp_path) as base:
        status, body = wait_for(lambda: (r := _readyz(base)) and r[0] == 200 and r, 30,
                                "the controller to lead and be ready")
        assert body["ready"] is True and body["leader"]
        etcd.stop()
        status, body = wait_for(lambda: (r := _readyz(base)) and r[0] == 503 and r, 30,
                                "/readyz to report etcd down")
        assert body["ready"] is False and body["failed"] == "etcd", body
        assert httpx.get(f"{base}/healthz", timeout=5).status_code == 200
        etcd.start()  # the same port and data: the controllers' endpoint
        status, body = wait_for(lambda: (r := _readyz(base)) and r[0] == 200 and r, 60,
                                "/readyz to recover with etcd")
        assert body["ready"] is True and body["leader"]


def test_readiness_names_the_condition_that_failed():
    from controller.app import readiness_reply
    assert readiness_reply("j", leader=b"c-0", etcd_error=None) == (
        200, {"ready": True, "leader": "c-0"})
    status, body = readiness_reply("j", leader=None, etcd_error="no answer")
    assert (status, body["ready"], body["failed"]) == (503, False, "etcd")
    assert "no answer" in body["detail"]
    status, body = readiness_reply("j", leader=None, etcd_error=None)
    assert (status, body["failed"]) == (503, "leader") and "job j" in body["detail"]
