"""Anything can be written to etcd by whoever holds its credentials: a record that is not what
its writer writes is skipped and reported, never fatal to the controller, its API or a replica."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import API_TOKEN, controller_process, wait_for
from ftsystem.control import keys
from ftsystem.control.membership import Epoch, Registration, ReplicaState
from ftsystem.control.records import RecordError, well_formed
from ftsystem.control.store import Store

AUTH = {"Authorization": f"Bearer {API_TOKEN}"}
JUNK = [b"not json", b"[1, 2]", b"null", b'{"state": "bogus"}',
        b'{"replica_id": "r9", "state": "member", "generation": "one"}']


@pytest.mark.parametrize("raw", JUNK)
def test_a_malformed_registration_or_epoch_is_a_record_error_naming_what_is_wrong(raw):
    with pytest.raises(RecordError, match="registration"):
        Registration.from_json(raw)
    with pytest.raises(RecordError, match="epoch"):
        Epoch.from_json(raw)


def test_a_record_error_names_the_field_and_what_it_should_be():
    with pytest.raises(RecordError, match=r"state: Input should be 'starting'"):
        Registration.from_json(b'{"replica_id": "r1", "state": "bogus", "generation": 0}')
    good = Registration(replica_id="r1", state=ReplicaState.MEMBER, generation=2, late=("r2",))
    assert Registration.from_json(good.to_json()) == good
    epoch = Epoch(number=3, members=("r1", "r2"), generations={"r1": 2, "r2": 0})
    assert Epoch.from_json(epoch.to_json()) == epoch


def test_well_formed_keeps_the_good_records_and_skips_the_rest(caplog):
    good = Registration(replica_id="r1", state=ReplicaState.READY, generation=0).to_json()
    parsed = well_formed({"/j/replicas/r1": good.encode(), "/j/replicas/r2": b"junk"},
                         Registration.from_json)
    assert list(parsed) == ["/j/replicas/r1"]
    assert "/j/replicas/r2" in caplog.text


def _junk_everywhere(job: str) -> dict[str, bytes]:
    """Junk under every prefix the controller reads."""
    out = {}
    for n, raw in enumerate(JUNK):
        out[keys.replica(job, f"bad{n}")] = raw
        out[keys.agent(job, f"bad{n}", 0)] = raw
        out[keys.failure(job, f"bad{n}", 0)] = raw
        out[keys.divergence(job, 10 + n, f"bad{n}")] = raw
        out[keys.halted(job, f"bad{n}")] = raw
        out[keys.generation(job, f"bad{n}")] = raw
        out[keys.catchup(job, f"bad{n}")] = raw
        out[keys.controller(job, f"bad{n}")] = raw
        out[keys.metrics_endpoint(job, f"bad{n}", 0)] = raw
    return out


def test_junk_under_every_prefix_breaks_neither_the_leader_nor_the_api(etcd, job_id, tmp_path):
    async def write(items: dict[str, bytes | str]) -> None:
        async with Store(etcd.url) as store:
            for key, value in items.items():
                await store.put(key, value)

    async def epoch() -> bytes | None:
        async with Store(etcd.url) as store:
            return await store.get(keys.epoch(job_id))

    asyncio.run(write({keys.spec(job_id): b'{"replicas": 1, "min_replicas": 1}',
                       **_junk_everywhere(job_id)}))
    with controller_process(etcd.url, job_id, tmp_path) as base:
        # The leader still decides: a well-formed replica written after the junk gets its epoch.
        reg = Registration(replica_id="r0", state=ReplicaState.READY, generation=0)
        asyncio.run(write({keys.replica(job_id, "r0"): reg.to_json(),
                           keys.replica(job_id, "bad0"): b"junk, again, in a watch event"}))
        wait_for(lambda: asyncio.run(epoch()) is not None, 30, "the leader's first epoch")
        assert Epoch.from_json(asyncio.run(epoch())).members == ("r0",)
        for path in ("/", f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/status",
                     f"/v1/jobs/{job_id}/events", f"/v1/jobs/{job_id}/chaos", "/metrics"):
            response = httpx.get(base + path, headers=AUTH, timeout=10)
            assert response.status_code == 200, (path, response.text[:500])
        metrics = httpx.get(base + "/metrics", headers=AUTH, timeout=10).text
        skipped = [line for line in metrics.splitlines()
                   if line.startswith("ftsystem_malformed_records_total{")]
        assert skipped and all(float(line.rsplit(" ", 1)[1]) > 0 for line in skipped), skipped
    log = (tmp_path / "controller.log").read_text()
    assert keys.replica(job_id, "bad3") in log and "Traceback" not in log
