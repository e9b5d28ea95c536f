"""The agent's addresses and metrics flags on a real agent process: --etcd and --job from the
environment, a fixed metrics port for the agent (P) and its ranks (P+1+local rank), series that
exist at zero from the start, the advertised address in the agent's record."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest

from conftest import wait_for
from ftsystem.control import keys
from ftsystem.control.etcd_server import _port_free, free_port
from ftsystem.measure.metrics import metrics_port
from ftsystem.control.store import Store

RANK = ("import os, time\nfrom ftsystem.measure import metrics\n"
        "open(os.environ['OUT'], 'w').write(metrics.serve(os.environ['FTSYSTEM_HOST']))\n"
        "time.sleep(60)\n")
"""The replica: serves its metrics as a rank does, and says where."""


@pytest.mark.parametrize("env, port", [({}, 0), ({"FTSYSTEM_METRICS_PORT": "9400"}, 9400),
                                       ({"FTSYSTEM_METRICS_PORT": "9400", "LOCAL_RANK": "3"},
                                        9404)])
def test_metrics_port(env, port):
    assert metrics_port(env) == port


def test_a_malformed_metrics_port_says_what_is_expected():
    with pytest.raises(ValueError, match="expected a port number"):
        metrics_port({"FTSYSTEM_METRICS_PORT": "http"})


def _two_free_ports() -> int:
    return next(p for p in iter(free_port, None) if _port_free(p + 1))


def _agent_record(etcd_url: str, job: str) -> dict | None:
    async def read():
        async with Store(etcd_url) as store:
            return await store.get_json(keys.agent(job, "r0", 0))
    return asyncio.run(read())


@pytest.mark.slow
def test_fixed_metrics_ports_and_the_advertised_address(etcd, job_id, tmp_path):
    port, out = _two_free_ports(), tmp_path / "rank-metrics"
    env = os.environ | {"FTSYSTEM_ETCD": etcd.url, "FTSYSTEM_JOB": job_id, "OUT": str(out)}
    agent = subprocess.Popen([sys.executable, "-m", "ftsystem.cli", "agent", "--replica-id", "r0",
                              "--advertise-address", "127.0.0.1", "--bind", "127.0.0.1",
                              "--metrics-port", str(port), "--", sys.executable, "-c", RANK],
                             env=env)
    try:
        record = wait_for(lambda: _agent_record(etcd.url, job_id), 30, "the agent's record")
        assert record["host"] == "127.0.0.1" and record["metrics_addr"] == f"127.0.0.1:{port}"
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        labels = f'job="{job_id}",replica="r0"'
        assert f"ftsystem_replica_restarts_total{{{labels}}} 0.0" in text  # before any restart
        assert (f'ftsystem_failures_injected_total{{action="kill",job="{job_id}",state="done"}}'
                f" 0.0") in text
        assert "_created" not in text  # no creation timestamp beside each counter
        wait_for(lambda: out.exists() and out.read_text(), 30, "the rank's metrics endpoint")
        assert out.read_text() == f"127.0.0.1:{port + 1}"  # local rank 0: P + 1
        assert httpx.get(f"http://127.0.0.1:{port + 1}/metrics").status_code == 200
    finally:
        agent.terminate()
        agent.wait(30)
