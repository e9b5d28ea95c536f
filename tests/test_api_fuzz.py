"""Schemathesis fuzzes the controller's REST API (a real process, a real etcd) from its OpenAPI.

Every operation gets random requests with random path parameters, then with the served job
fixed (so that replica ids are fuzzed too), then with a registered replica as well. No response
may be a 5xx, and responses must match the schema where it declares them. Then every operation
but the probes (``/healthz``, ``/readyz``) is fuzzed once more without the token: every answer
must be 401 (closed by default, reads included).
``status_code_conformance`` is not checked: FastAPI declares only 200/201/422, while the API
answers 400/401/404/429 by design. The schemathesis pytest plugin's ``from_fixture`` fails under pytest 9
(``'Function' object has no attribute '_nodeid'``), hence Hypothesis' ``@given`` here.
"""

from __future__ import annotations

import asyncio
import collections

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error,
                                 response_headers_conformance, response_schema_conformance)

from conftest import controller_process, wait_for
from controller.auth import ENV_TOKEN
from ftsystem.control import keys
from ftsystem.control.membership import Registration, ReplicaState
from ftsystem.control.store import Store

pytestmark = pytest.mark.slow
NUM_EXAMPLES = 100
"""Random requests per operation and variant: bounds the run to well under a minute."""
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance,
          response_headers_conformance]
# Known gaps between controller/app.py and its generated schema; delete an entry once fixed.
LENIENT: dict[str, list] = {}
TOKEN = "fuzz-token"
"""The controller's API token: the fuzzer authenticates, so that POSTs reach their handlers."""
# The chaos endpoint's rate limit (10 specs a minute) lifted: otherwise all but 10 fuzzed POSTs
# would stop at 429 before their handler.
UNLIMITED = {"FTSYSTEM_CHAOS_RATE": "1000000000/1"}


async def _job_with_replicas(etcd_url: str, job: str) -> None:
    async with Store(etcd_url) as store:
        await store.put_json(keys.spec(job), {"replicas": 2, "min_replicas": 1})
        for rid in ("a", "b"):
            await store.put_json(keys.agent(job, rid, 0), {"generation": 0, "host": "127.0.0.1"})
            lease = await store.grant(120)
            reg = Registration(replica_id=rid, state=ReplicaState.READY, generation=0,
                               step=3, metrics_addr="127.0.0.1:9")
            await store.put(keys.replica(job, rid), reg.to_json(), lease=lease)
        await store.put_json(keys.failure(job, "b", 0), {"time": 1.0, "reason": "x", "step": 1})


@pytest.fixture
def controller(etcd, job_id, tmp_path):
    asyncio.run(_job_with_replicas(etcd.url, job_id))
    with controller_process(etcd.url, job_id, tmp_path, {ENV_TOKEN: TOKEN, **UNLIMITED}) as base:
        yield base, schemathesis.openapi.from_url(f"{base}/openapi.json")


def test_no_server_errors_and_responses_match_schema(controller, job_id):
    base, schema = controller
    wait_for(lambda: _epoch_started(base, job_id), 30, "the first epoch")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/", "/healthz", "/metrics", "/v1/jobs/{job}",
                                              "/v1/jobs/{job}/replicas/{replica_id}",
                                              "/v1/jobs/{job}/chaos"}
    fixed = {"job": job_id, "replica_id": "b"}
    count, statuses = 0, collections.Counter()
    for operation in operations:
        checks = LENIENT.get(operation.label, CHECKS)
        names = [name for name in fixed if f"{{{name}}}" in operation.path]
        for i in range(len(names) + 1):  # fix none, then the first, then the first two
            path_parameters = {name: fixed[name] for name in names[:i]} or None
            @given(case=operation.as_strategy(path_parameters=path_parameters))
            @settings(max_examples=NUM_EXAMPLES, deadline=None, database=None,
                      phases=[Phase.generate, Phase.shrink],
                      suppress_health_check=list(HealthCheck))
            def fuzz(case) -> None:
                nonlocal count
                count += 1
                response = case.call_and_validate(
                    base_url=base, checks=checks, timeout=10,
                    headers={"Authorization": f"Bearer {TOKEN}"})
                statuses[response.status_code] += 1
            fuzz()
    print(f"schemathesis ran {count} cases over {len(operations)} operations; "
          f"status codes: {dict(sorted(statuses.items()))}")
    assert count > 50
    paths = httpx.get(f"{base}/openapi.json").json()["paths"]
    assert len(operations) == sum(len(methods) for methods in paths.values())  # every route
    closed = [op for op in operations if op.path not in ("/healthz", "/readyz")]
    assert len(closed) == len(operations) - 2
    for operation in closed:
        fixed_job = {"job": job_id} if "{job}" in operation.path else None
        @given(case=operation.as_strategy(path_parameters=fixed_job))
        @settings(max_examples=NUM_EXAMPLES // 4, deadline=None, database=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        def unauthenticated(case) -> None:
            response = case.call(base_url=base, timeout=10)
            assert response.status_code == 401, (case, response.text)
        unauthenticated()


def _epoch_started(base: str, job: str) -> bool:
    try:
        return httpx.get(f"{base}/v1/jobs/{job}", timeout=2, headers={
            "Authorization": f"Bearer {TOKEN}"}).json()["epoch"]["number"] >= 1
    except (httpx.HTTPError, KeyError):
        return False
