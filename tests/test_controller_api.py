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
        # Replica a's two ranks publish their own endpoints.
        for rank in (0, 1):
            await store.put_json(keys.metrics_endpoint(job, "a", rank),
                                 {"addr": f"127.0.0.1:8{rank}"}, lease=leases["a"])
    return leases


async def _revoke(etcd_url: str, lease: int) -> None:
    async with Store(etcd_url) as store:
        await store.revoke(lease)


def test_job_view_follows_registrations(controller, etcd, job_id):
    leases = asyncio.run(_register(etcd.url, job_id, ["a", "b", "c"]))
    view = wait_for(lambda: (v := httpx.get(f"{controller}/v1/jobs/{job_id}").json())
                    ["epoch"]["number"] >= 1 and v, 30, "the first epoch")
    assert view["job"] == job_id and view["epoch"]["members"] == ["a", "b", "c"]
    assert [(r["id"], r["state"], r["step"], r["generation"]) for r in view["replicas"]] == [
        ("a", "ready", 7, 0), ("b", "ready", 7, 0), ("c", "ready", 7, 0)]
    asyncio.run(_revoke(etcd.url, leases["b"]))
    view = wait_for(lambda: (v := httpx.get(f"{controller}/v1/jobs/{job_id}").json())
                    ["epoch"]["number"] >= 2 and v, 30, "the removal epoch")
    assert view["epoch"]["members"] == ["a", "c"]
    one = httpx.get(f"{controller}/v1/jobs/{job_id}/replicas/c").json()
    assert one["id"] == "c" and one["state"] == "ready"
    metrics = httpx.get(f"{controller}/metrics").text
    assert f'ftsystem_epoch{{job="{job_id}"}} 2.0' in metrics
    assert f'ftsystem_controller_is_leader{{job="{job_id}"}} 1.0' in metrics
    assert httpx.get(f"{controller}/healthz").json()["leader"] is True
    groups = httpx.get(f"{controller}/v1/sd/prometheus").json()
    targets = {(g["labels"]["component"], g["labels"]["instance_id"]): g["targets"] for g in groups}
    assert ("replica", "b") not in targets
    assert targets[("replica", "c")] == ["127.0.0.1:9c"]  # no rank endpoints: its registration
    ranks = {g["labels"]["rank"]: g["targets"] for g in groups
             if g["labels"].get("replica") == "a"}
    assert ranks == {"0": ["127.0.0.1:80"], "1": ["127.0.0.1:81"]}  # every rank, labelled
    assert [c for c, _ in targets].count("controller") == 1
    assert all(g["labels"]["job"] == job_id for g in groups)


def test_public_answers_show_no_internal_addresses(controller, etcd, job_id):
    asyncio.run(_register(etcd.url, job_id, ["a", "b"]))
    wait_for(lambda: httpx.get(f"{controller}/v1/jobs/{job_id}").json()["epoch"]["number"] >= 1,
             30, "the first epoch")
    for path in ("/", f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/replicas/a",
                 f"/v1/jobs/{job_id}/chaos", f"/v1/jobs/{job_id}/events"):
        body = httpx.get(f"{controller}{path}").text
        assert STORE_ADDR not in body and STATE_ADDR not in body, path


def test_every_mutating_route_needs_the_token(controller, job_id):
    """Whatever the route, a request that is not a read gets 401 without the right token."""
    paths = httpx.get(f"{controller}/openapi.json").json()["paths"]
    mutations = [(method.upper(), path.replace("{job}", job_id))
                 for path, operations in paths.items() for method in operations
                 if method.upper() not in ("GET", "HEAD", "OPTIONS")]
    assert ("POST", f"/v1/jobs/{job_id}/chaos") in mutations
    for method, path in mutations:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_TOKEN}):
            response = httpx.request(method, f"{controller}{path}", json={}, headers=headers)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
        granted = httpx.request(method, f"{controller}{path}", json={},
                                headers={"Authorization": f"Bearer {API_TOKEN}"})
        assert granted.status_code not in (401, 403), (method, path)
    assert httpx.get(f"{controller}/v1/jobs/{job_id}/chaos").status_code == 200  # reads: open


def test_insecure_controller_takes_mutations_without_a_token(etcd, job_id, tmp_path):
    env = {"FTSYSTEM_API_TOKEN": ""}
    with controller_process(etcd.url, job_id, tmp_path, env, insecure=True) as base:
        response = httpx.post(f"{base}/v1/jobs/{job_id}/chaos", json={"action": "melt"})
        assert response.status_code == 400 and "invalid chaos spec" in response.text
    assert b"--insecure: mutating endpoints are open" in (tmp_path / "controller.log").read_bytes()


def test_bad_requests_get_clear_errors(controller, job_id):
    unknown_job = httpx.get(f"{controller}/v1/jobs/nope")
    assert unknown_job.status_code == 404 and "this controller manages" in unknown_job.text
    unknown_replica = httpx.get(f"{controller}/v1/jobs/{job_id}/replicas/zz")
    assert unknown_replica.status_code == 404 and "lists its replicas" in unknown_replica.text
    illegal = httpx.get(f"{controller}/v1/jobs/{job_id}/replicas/a%20b%3B")
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
