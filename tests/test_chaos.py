"""Chaos specs: validation (pure), expansion (pure), execution by a real agent with real
signals, and the authenticated REST endpoint."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

from conftest import controller_process, wait_for
from ftsystem.control import keys
from ftsystem.chaos.spec import ChaosSpecError, expand, parse_spec, read_orders, slow_pattern
from ftsystem.cli import app
from ftsystem.control.store import Store


def test_a_full_spec_parses():
    spec = parse_spec("""
        action: hang
        mode: percent
        value: 50
        selector: {replicas: [r1, r2]}
        duration: 1500ms
        schedule: "@every 30s"
        horizon: 2m
        seed: 7
    """)
    assert (spec.actions, spec.mode, spec.value, spec.replicas) == (("hang",), "percent", 50,
                                                                   ("r1", "r2"))
    assert (spec.duration_s, spec.every_s, spec.horizon_s, spec.seed) == (1.5, 30, 120, 7)
    assert parse_spec('{"action": "kill", "schedule": {"mtbf": "10s"}}').mtbf_s == 10


@pytest.mark.parametrize("text, message", [
    ("action: explode", "action must be one of kill, hang, slow"),
    ("[1, 2]", "a mapping"),
    ("action: hang", "needs a positive duration"),
    ("action: kill\nschedule: every minute", "schedule must be"),
    ("action: kill\nduration: soon", "not a duration"),
    ("action: kill\nmode: percent\nvalue: 150", "does not fit mode percent"),
    ("action: kill\nselector: {replicas: ['a/b']}", "invalid replica id"),
    ("action: kill\ntarget: r1", "unknown key(s) target"),
    ("action: [unclosed", "not YAML or JSON"),
    ("action: [kill, explode]", "or a list of them"),
    ("action: []", "or a list of them"),
    ("action: [kill, partition]", "partition needs a positive duration"),
])
def test_bad_specs_say_what_is_wrong(text, message):
    with pytest.raises(ChaosSpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_spec(text)


def test_expansion_follows_schedule_mode_and_selector():
    every = parse_spec("action: kill\nschedule: '@every 10s'\nhorizon: 60s")
    orders = expand(every, ["r0", "r1", "r2"], now=1000.0, name="t")
    assert [o.at for o in orders] == [1010.0, 1020.0, 1030.0, 1040.0, 1050.0, 1060.0]
    assert len({o.id for o in orders}) == len(orders)
    half = parse_spec("action: kill\nmode: percent\nvalue: 50")
    assert len(expand(half, ["r0", "r1", "r2", "r3"], now=0, name="t")) == 2
    chosen = parse_spec("action: kill\nmode: fixed\nvalue: 5\nselector: {replicas: [r2]}")
    assert [o.replica for o in expand(chosen, ["r0", "r1", "r2"], now=0, name="t")] == ["r2"]
    mtbf = parse_spec("action: kill\nschedule: {mtbf: 30s}\nhorizon: 1h\nseed: 3")
    a, b = (expand(mtbf, ["r0", "r1"], now=0, name="t") for _ in range(2))
    assert a == b and 60 < len(a) < 180  # seeded Poisson: about 120 in an hour
    with pytest.raises(ChaosSpecError, match="matches none"):
        expand(chosen, ["r0"], now=0, name="t")


def test_mixed_actions_are_seeded_and_service_actions_target_no_replica():
    mixed = parse_spec("action: [kill, hang, partition, controller-kill]\nduration: 2s\n"
                       "schedule: {mtbf: 10s}\nhorizon: 10m\nseed: 1")
    orders = expand(mixed, ["r0", "r1"], now=0, name="m")
    assert orders == expand(mixed, ["r0", "r1"], now=0, name="m")
    assert {o.action for o in orders} == {"kill", "hang", "partition", "controller-kill"}
    for order in orders:
        assert (order.replica == "") == (order.action == "controller-kill")
    assert len({o.id for o in orders}) == len(orders)


def test_slow_pattern_stops_the_given_share():
    pattern = slow_pattern(2.0, 0.25)
    assert len(pattern) == 10 and all(abs(stop / (run + stop) - 0.25) < 1e-9
                                      for run, stop in pattern)


TICKER = "import time,sys\nwhile True:\n    print(time.time(), flush=True)\n    time.sleep(0.02)\n"


def _ticks(path) -> list[float]:
    return [float(line) for line in path.read_text().split()]


def _values(etcd_url: str, prefix: str) -> list[dict]:
    async def read():
        async with Store(etcd_url) as store:
            items, _ = await store.get_prefix(prefix)
        return [json.loads(v) for v in items.values()]
    return asyncio.run(read())


def _orders(etcd_url: str, job: str) -> list[dict]:
    return _values(etcd_url, keys.chaos_orders(job))


def _apply(tmp_path, etcd, job_id, text: str) -> None:
    spec = tmp_path / f"spec{time.monotonic_ns()}.yaml"
    spec.write_text(text)
    result = CliRunner().invoke(app, ["chaos", "apply", str(spec), "--etcd", etcd.url,
                                      "--job", job_id])
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_agent_executes_hang_slow_and_kill(etcd, job_id, tmp_path):
    ticks = tmp_path / "ticks"
    agent = subprocess.Popen([
        sys.executable, "-m", "ftsystem.cli", "agent", "--etcd", etcd.url, "--job", job_id,
        "--replica-id", "r0", "--", "sh", "-c", f"exec {sys.executable} -c '{TICKER}' >> {ticks}"])
    try:
        wait_for(lambda: ticks.exists() and len(_ticks(ticks)) > 10, 30, "the replica to tick")
        _apply(tmp_path, etcd, job_id, "action: hang\nduration: 1500ms")
        hang = wait_for(lambda: [o for o in _orders(etcd.url, job_id) if o["state"] == "done"],
                        30, "the hang to be executed")[0]
        # The ticker resumes a moment after the order is marked done: wait for its first tick.
        wait_for(lambda: _ticks(ticks)[-1] > hang["executed_at"] + 1.5, 30, "a tick after the hang")
        times = [t for t in _ticks(ticks) if t > hang["executed_at"] - 1]
        assert max(b - a for a, b in zip(times, times[1:])) >= 1.4  # it really stopped

        _apply(tmp_path, etcd, job_id, "action: slow\nduration: 2s\nslow_fraction: 0.5")
        wait_for(lambda: sum(o["state"] == "done" for o in _orders(etcd.url, job_id)) == 2,
                 30, "the slowdown to finish")
        slow = max(_orders(etcd.url, job_id), key=lambda o: o["at"])
        wait_for(lambda: _ticks(ticks)[-1] > slow["executed_at"] + 2, 30, "a tick after the slowdown")
        window = [t for t in _ticks(ticks) if slow["executed_at"] < t < slow["executed_at"] + 2]
        assert 10 <= len(window) <= 75  # about half of the 100 ticks of 2 s

        _apply(tmp_path, etcd, job_id, "action: kill")
        wait_for(lambda: sum(o["state"] == "done" for o in _orders(etcd.url, job_id)) == 3,
                 30, "the kill to be executed")
        failures = wait_for(lambda: _values(etcd.url, keys.failures(job_id)), 30,
                            "the failure record")
        assert failures[0]["reason"] == "killed by SIGKILL"
    finally:
        agent.terminate()
        agent.wait(30)


def test_chaos_apply_refuses_a_bad_spec(tmp_path, etcd, job_id):
    spec = tmp_path / "bad.yaml"
    spec.write_text("action: melt")
    result = CliRunner().invoke(app, ["chaos", "apply", str(spec), "--etcd", etcd.url,
                                      "--job", job_id])
    assert result.exit_code == 2 and "nothing was stored" in result.output
    assert _orders(etcd.url, job_id) == []


@pytest.fixture
def secured_controller(etcd, job_id, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with controller_process(etcd.url, job_id, tmp_path,
                            {"FTSYSTEM_API_TOKEN_FILE": str(token_file)}) as base:
        yield base
    assert b"s3cret" not in (tmp_path / "controller.log").read_bytes()  # never logged


def test_chaos_api_needs_the_token_and_validates(secured_controller, etcd, job_id):
    async def register_agent():
        async with Store(etcd.url) as store:
            await store.put_json(keys.agent(job_id, "r0", 0), {"host": "127.0.0.1"})
    asyncio.run(register_agent())
    url = f"{secured_controller}/v1/jobs/{job_id}/chaos"
    spec = {"action": "hang", "duration": "1s", "schedule": "@every 1h", "horizon": "1h"}
    assert httpx.post(url, json=spec).status_code == 401
    assert httpx.post(url, json=spec, headers={"Authorization": "Bearer nope"}).status_code == 401
    good = {"Authorization": "Bearer s3cret"}
    bad = httpx.post(url, json={"action": "melt"}, headers=good)
    assert bad.status_code == 400 and "nothing was stored" in bad.text
    for hostile in ({"action": "kill", "mode": "fixed", "value": float("inf")},
                    {"action": "kill", "schedule": "@every 1ms", "horizon": "1000000h"}):
        assert httpx.post(url, content=json.dumps(hostile), headers={
            **good, "content-type": "application/json"}).status_code == 400
    created = httpx.post(url, json=spec, headers=good)
    assert created.status_code == 201 and len(created.json()["orders"]) == 1
    assert httpx.get(url).status_code == 401  # reads need the token too
    listed = httpx.get(url, headers=good).json()["orders"]
    assert [(o["action"], o["replica"], o["state"]) for o in listed] == [("hang", "r0", "pending")]
    codes = [httpx.post(url, json=spec, headers=good).status_code for _ in range(12)]
    assert 429 in codes  # the rate limit: 10 orders a minute


def test_a_malformed_order_written_to_etcd_is_skipped_not_fatal(secured_controller, etcd, job_id):
    # Orders are JSON in etcd, where anyone with etcd credentials can write anything: the API,
    # the status page and the agents' executors must keep working for the other orders.
    async def register_agent():
        async with Store(etcd.url) as store:
            await store.put_json(keys.agent(job_id, "r0", 0), {"host": "127.0.0.1"})
            await store.put(keys.chaos_orders(job_id) + "broken", b'{"id": "broken", "act')
            await store.put_json(keys.chaos_orders(job_id) + "alien", {"what": "ever"})
    asyncio.run(register_agent())
    url = f"{secured_controller}/v1/jobs/{job_id}/chaos"
    spec = {"action": "hang", "duration": "1s", "schedule": "@every 1h", "horizon": "1h"}
    assert httpx.post(url, json=spec, headers={"Authorization": "Bearer s3cret"}).status_code == 201
    auth = {"Authorization": "Bearer s3cret"}
    listed = httpx.get(url, headers=auth)
    assert listed.status_code == 200, listed.text
    assert [o["action"] for o in listed.json()["orders"]] == ["hang"]
    page = httpx.get(f"{secured_controller}/", headers=auth)
    assert page.status_code == 200 and "hang" in page.text
    orders = read_orders({"a": b"not json", "b": b"[1, 2]", "c": b'{"id": "x"}'})
    assert orders == []
