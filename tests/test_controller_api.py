"""The controller as a real process against a real etcd: REST API, epochs, metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import controller_process, wait_for
from ftsystem import keys
from ftsystem.membership import Registration, ReplicaState
from ftsystem.store import Store


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
                               store_addr="127.0.0.1:1", step=7, metrics_addr=f"127.0.0.1:9{rid}")
            await store.put(keys.replica(job, rid), reg.to_json(), lease=leases[rid])
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
    assert targets[("replica", "a")] == ["127.0.0.1:9a"] and ("replica", "b") not in targets
    assert [c for c, _ in targets].count("controller") == 1
    assert all(g["labels"]["job"] == job_id for g in groups)


def test_bad_requests_get_clear_errors(controller, job_id):
    unknown_job = httpx.get(f"{controller}/v1/jobs/nope")
    assert unknown_job.status_code == 404 and "this controller manages" in unknown_job.text
    unknown_replica = httpx.get(f"{controller}/v1/jobs/{job_id}/replicas/zz")
    assert unknown_replica.status_code == 404 and "lists its replicas" in unknown_replica.text
    illegal = httpx.get(f"{controller}/v1/jobs/{job_id}/replicas/a%20b%3B")
    assert illegal.status_code == 400 and "invalid replica id" in illegal.text
