"""One chaos rate limit for every way in: the API of any controller and ``ftsystem chaos
apply``, which writes to etcd directly (and says that it bypasses the API)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from typer.testing import CliRunner

from conftest import API_TOKEN, controller_process
from ftsystem.control import keys
from ftsystem.chaos.rate import parse_rate
from ftsystem.cli import app
from ftsystem.control.store import Store

SPEC = "action: hang\nduration: 1s\n"


@pytest.mark.parametrize("text, parsed", [("10/60", (10, 60.0)), ("1/0.5", (1, 0.5))])
def test_parse_rate(text, parsed):
    assert parse_rate(text) == parsed


@pytest.mark.parametrize("text", ["10", "x/60", "0/60", "10/0", "10/-1"])
def test_a_malformed_rate_says_the_format(text):
    with pytest.raises(ValueError, match="expected N/SECONDS"):
        parse_rate(text)


def _apply(path, etcd_url: str, job: str):
    return CliRunner().invoke(app, ["chaos", "apply", str(path), "--etcd", etcd_url,
                                    "--job", job])


def test_cli_and_api_share_one_rate_limit(etcd, job_id, tmp_path, monkeypatch):
    async def register_agent():
        async with Store(etcd.url) as store:
            await store.put_json(keys.agent(job_id, "r0", 0), {"host": "127.0.0.1"})
    asyncio.run(register_agent())
    monkeypatch.setenv("FTSYSTEM_CHAOS_RATE", "2/600")
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    first = _apply(spec, etcd.url, job_id)
    assert first.exit_code == 0, first.output
    assert "bypassing the controller's API" in first.output and "etcd credentials" in first.output
    with controller_process(etcd.url, job_id, tmp_path) as base:
        url = f"{base}/v1/jobs/{job_id}/chaos"
        auth = {"Authorization": f"Bearer {API_TOKEN}"}
        assert httpx.post(url, json={"action": "melt"}, headers=auth).status_code == 400
        second = httpx.post(url, json={"action": "hang", "duration": "1s"}, headers=auth)
        assert second.status_code == 201, second.text  # an invalid spec took no budget
        refused = httpx.post(url, json={"action": "hang", "duration": "1s"}, headers=auth)
        assert refused.status_code == 429 and "at most 2" in refused.text
    third = _apply(spec, etcd.url, job_id)
    assert third.exit_code == 2 and "at most 2 chaos submissions" in third.output
    assert "nothing was stored" in third.output
