"""HALoS in real mode: the GPS, the LPSs and the workers as processes under agents, on loopback.

The end-to-end tests run what users run (``ftsystem halos run``) against the session's real etcd,
SIGKILL a node mid-run, and check the summary the launcher builds from the nodes' counters in
etcd and the agents' failure records. The counter checks themselves are tested without processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch

from ftsystem.control import keys
from ftsystem.halos.config import load_setup
from ftsystem.halos.gps import GlobalServer
from ftsystem.halos.node import FINISHED_STATUS, Header, Node, pack, unpack
from ftsystem.halos.real import Kill, check, node_command, parse_kill
from ftsystem.halos.realconfig import GPS, RealConfig
from ftsystem.training.runtime import ReplicaContext
from ftsystem.control.store import Store

FTSYSTEM = str(Path(sys.executable).with_name("ftsystem"))
# A short run: 2 regions x 2 workers, K = 8, the paper's other hyperparameters. A local step
# lasts 50 ms (emulated), so a global update takes about 1 s whatever the load, and the run goes
# on while a killed node restarts (an agent's backoff plus a cold `import torch`: 3 s on an idle
# machine, 15 s on a loaded one). Plus about 10 s to start the 7 processes.
RUN_ARGS = ["--regions", "2", "--workers-per-region", "2", "--accumulation-k", "8",
            "--step-time", "0.05", "--deadline", "200"]


def small_config(**changes) -> RealConfig:
    return RealConfig.from_setup(load_setup(), **({"num_updates": 4, "accumulation_k": 2}
                                                  | changes))


def consistent_stats() -> dict[str, dict]:
    """Counters of a clean run of ``small_config()``: 4 global updates, K = 2."""
    return {
        "gps": {"updates": 4, "per_lps": {"lps0": 2, "lps1": 2},
                "loss": [[0, 4.8, 0.0], [4, 4.6, 1.0]]},
        "lps0": {"pushes": 5, "merges": 2, "per_worker": {"w0": 3, "w1": 2}},
        "lps1": {"pushes": 4, "merges": 2, "per_worker": {"w2": 2, "w3": 2}},
        "w0": {"pushes": 3}, "w1": {"pushes": 2}, "w2": {"pushes": 2}, "w3": {"pushes": 2},
    }


def test_config_travels_as_json_and_names_its_nodes():
    cfg = small_config(num_regions=3, workers_per_region=1)
    assert RealConfig.from_json(cfg.to_json()) == cfg
    assert cfg.node_names() == ["gps", "lps0", "lps1", "lps2", "w0", "w1", "w2"]
    assert cfg.worker_regions == [0, 1, 2]
    assert node_command("lps2")[-3:] == ["ftsystem.halos.lps", "--region", "2"]
    assert node_command("w1")[-2:] == ["--worker", "1"]
    assert parse_kill("3:w1", cfg) == Kill(3, "w1")
    for bad in ("w1", "x:w1", "3:w9", "3:lps3"):
        with pytest.raises(ValueError, match="UPDATE:NODE"):
            parse_kill(bad, cfg)
    with pytest.raises(ValueError, match="accumulation K"):
        small_config(accumulation_k=0)


def test_counter_checks_accept_a_clean_run_and_name_each_inconsistency():
    cfg = small_config()
    codes = dict.fromkeys(cfg.node_names(), 0)
    assert check(cfg, consistent_stats(), Counter(), codes) == []

    def problems(edit, restarts: Counter | None = None, exit_codes=codes) -> str:
        stats = consistent_stats()
        edit(stats)
        return "; ".join(check(cfg, stats, restarts or Counter(), exit_codes))

    assert "GPS applied 3 updates" in problems(lambda s: s["gps"].update(updates=3))
    assert "do not add up" in problems(lambda s: s["gps"]["per_lps"].update(lps0=1))
    assert "after only 3 pushes" in problems(lambda s: s["lps1"].update(
        pushes=3, per_worker={"w2": 1, "w3": 2}))
    assert "applied 2 pushes of w3" in problems(lambda s: s["w3"].update(pushes=3))
    assert "did not decrease" in problems(lambda s: s["gps"]["loss"].append([4, 4.9, 2.0]))
    assert "w0 exited with 1" in problems(lambda s: None, exit_codes=codes | {"w0": 1})

    def one_more_push(stats):  # w0 killed after its LPS counted a push, before it was told
        stats["lps0"].update(pushes=6, per_worker={"w0": 4, "w1": 2})

    assert problems(one_more_push) and not problems(one_more_push, restarts=Counter(w0=1))

    def merge_lost(stats):  # lps1 killed after the GPS applied its delta, before it merged
        stats["lps1"].update(merges=1)

    assert problems(merge_lost) and not problems(merge_lost, restarts=Counter(lps1=1))


def test_gps_applies_each_delta_once_checkpoints_and_stops_at_the_budget(etcd, job_id, tmp_path):
    """The GPS's HTTP API in-process, against the real etcd: retries, the end, metrics, resume."""
    cfg = small_config(num_updates=2, state_dir=str(tmp_path))

    async def start_gps(store: Store) -> GlobalServer:
        ctx = ReplicaContext(etcd=etcd.url, job=job_id, replica_id=GPS, generation=0,
                             lease_id=await store.grant(10), heartbeat_path="",
                             host="127.0.0.1", rank=0, world_size=1, timeout_s=10)
        node = Node(GPS, ctx)
        gps = GlobalServer(node, await node.start())
        gps.resume_or_start()
        return gps

    async def post(client: httpx.AsyncClient, body: bytes, seq: int) -> httpx.Response:
        return await client.post("/delta", content=body, headers={
            Header.NODE: "lps0", Header.GENERATION: "0", Header.SEQ: str(seq)})

    async def scenario() -> None:
        async with Store(etcd.url) as store:
            await store.put(keys.halos_config(job_id), cfg.to_json())
            gps = await start_gps(store)
            transport = httpx.ASGITransport(app=gps.app())
            async with httpx.AsyncClient(transport=transport, base_url="http://gps") as client:
                theta0 = unpack((await client.get("/model")).content)
                delta = pack(torch.full_like(theta0, 0.01))
                first, retry = await post(client, delta, 1), await post(client, delta, 1)
                assert first.content == retry.content and gps.updates == 1
                assert not torch.equal(unpack(first.content), theta0)
                assert (await post(client, b"junk", 2)).status_code == 400
                assert (await post(client, pack(torch.ones(3)), 2)).status_code == 400
                last = await post(client, delta, 2)
                assert last.headers[Header.FINISHED] == "1"
                assert (await post(client, delta, 3)).status_code == FINISHED_STATUS
                scraped = (await client.get("/metrics")).text
            assert f'ftsystem_halos_updates_applied_total{{job="{job_id}",server="gps"}} 2.0' \
                in scraped
            assert (await store.get_json(keys.halos_done(job_id)))["updates"] == 2
            assert (await store.get_json(keys.halos_stat(job_id, GPS)))["per_lps"] == {"lps0": 2}
            resumed = await start_gps(store)  # as the agent would restart it
            assert resumed.updates == 2 and resumed.finished
            assert torch.equal(resumed.state.theta, unpack(last.content))
            assert [s["from"] for s in resumed.node.stats["starts"]] == ["initial", "checkpoint"]
            await gps.node.close()
            await resumed.node.close()

    asyncio.run(scenario())


def run_halos(etcd_url: str, job: str, out: Path, *args: str) -> dict:
    """``ftsystem halos run`` against the test's etcd; its JSON summary."""
    cmd = [FTSYSTEM, "halos", "run", "--etcd", etcd_url, "--job", job, "--out", str(out),
           "--json", str(out / "s.json"), *RUN_ARGS, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "COLUMNS": "120"})
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in out.glob("agent-*.log"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    return json.loads((out / "s.json").read_text())


def registered_nodes(etcd_url: str, job: str) -> dict:
    async def read() -> dict:
        async with Store(etcd_url) as store:
            return (await store.get_prefix(keys.halos_nodes(job)))[0]
    return asyncio.run(read())


def assert_run_consistent(summary: dict, updates: int, killed: str) -> None:
    assert summary["problems"] == [], summary["problems"]
    assert summary["updates"] == updates
    assert sum(summary["gps"]["per_lps"].values()) == updates
    assert summary["final_loss"] < summary["initial_loss"] - 0.05, summary["loss_curve"]
    assert summary["restarts"] == {n: int(n == killed) for n in summary["restarts"]}
    [failure] = summary["failures"]
    assert (failure["node"], failure["generation"]) == (killed, 0)
    assert failure["reason"] == "killed by SIGKILL"
    [kill] = summary["kills"]
    assert kill["node"] == killed and kill["gps_updates"] < updates  # the run went on after it


@pytest.mark.slow
def test_worker_sigkilled_mid_run_is_restarted_and_the_run_completes(etcd, job_id, tmp_path):
    summary = run_halos(etcd.url, job_id, tmp_path, "--updates", "24", "--kill-at", "1:w1")
    assert_run_consistent(summary, 24, killed="w1")
    w1 = summary["workers"]["w1"]
    assert w1["generation"] == 1
    restart = w1["starts"][-1]
    # The restarted worker took its LPS's current model, not the initial one, and went on
    # training from its counters: it pushed again and every push it was told of was applied.
    assert restart["generation"] == 1 and restart["lps_version"] > 0
    assert restart["local_steps"] == 8 * restart["pushes"]
    assert w1["pushes"] > restart["pushes"]
    lps0 = summary["lps"]["lps0"]
    assert 0 <= lps0["per_worker"]["w1"] - w1["pushes"] <= 1
    for worker in ("w0", "w2", "w3"):  # never killed: the LPS and the worker agree exactly
        lps = summary["lps"]["lps0" if worker == "w0" else "lps1"]
        assert lps["per_worker"][worker] == summary["workers"][worker]["pushes"] > 0
    for name in ("lps0", "lps1"):
        lps = summary["lps"][name]
        assert lps["merges"] == summary["gps"]["per_lps"][name] > 0
        assert lps["pushes"] >= 8 * lps["merges"]
    assert registered_nodes(etcd.url, job_id) == {}  # every node's lease went with it


@pytest.mark.slow
def test_lps_sigkilled_mid_run_resumes_from_its_checkpoint(etcd, job_id, tmp_path):
    summary = run_halos(etcd.url, job_id, tmp_path, "--updates", "20", "--kill-at", "2:lps1")
    assert_run_consistent(summary, 20, killed="lps1")
    lps1 = summary["lps"]["lps1"]
    first, restart = lps1["starts"]
    assert (first["from"], restart["from"]) == ("gps", "checkpoint")
    # It resumed with what it had absorbed (model, momentum, the updates not sent yet)...
    assert restart["generation"] == 1 and restart["version"] >= restart["pushes"] > 0
    # ...and its workers came back to it: it applied their pushes and sent deltas again.
    assert lps1["pushes"] > restart["pushes"]
    assert summary["gps"]["per_lps"]["lps1"] >= lps1["merges"] > restart["merges"]
    assert summary["lps"]["lps0"]["merges"] == summary["gps"]["per_lps"]["lps0"]
