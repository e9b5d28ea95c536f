"""HALoS in real mode: the GPS, the LPSs and the workers as processes under agents.

The end-to-end tests run what users run (``ftsystem halos run``) against the session's real etcd,
SIGKILL a node mid-run, and check the summary the launcher builds from the nodes' counters in
etcd and the agents' failure records; a shaped run puts every node in its own network namespace
with real ``tc`` classes and checks the transfer times they imply. The counter checks, the
speeds, the shaping plan and the comparison with the simulator are tested without processes.
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

import dataclasses
import statistics

from ftsystem.control import keys
from ftsystem.halos import compare, shaping
from ftsystem.halos.config import load_setup
from ftsystem.halos.gps import GlobalServer
from ftsystem.halos.node import FINISHED_STATUS, Header, Node, pack, unpack
from ftsystem.halos.real import Kill, check, node_command, parse_kill, prometheus_targets, summarize
from ftsystem.halos.realconfig import GPS, RealConfig, speeds_of_regions
from ftsystem.launch.netns import IFACE, HostNetwork, unique_network_name
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


# --- speeds, shaping, the simulator comparison: pure ----------------------------------------

def shaped_config(**changes) -> RealConfig:
    """The paper's speeds and bandwidths for 2 regions x 2 workers, 50 ms steps."""
    paper, cfg = load_setup(), small_config(local_step_s=0.05, **changes)
    return dataclasses.replace(
        cfg, worker_speeds=speeds_of_regions(paper.network.worker_speeds, 2, 2),
        bandwidth_bps=shaping.scaled_bandwidths(
            paper.network.bandwidth_gbps, 2, model_bytes=cfg.model_bytes,
            paper_model_bytes=paper.time_model.model_bytes, step_s=0.05,
            paper_step_s=paper.time_model.local_step_time_s))


def test_speeds_rescale_h_and_the_step_time_and_share_one_schedule():
    alike = small_config(local_step_s=0.05)
    assert [alike.local_steps_of(i) for i in range(4)] == [8] * 4
    assert alike.step_s_of(3) == 0.05 and alike.schedule_position(5) == 5 * 8  # as before
    paper = load_setup()
    speeds = speeds_of_regions(paper.network.worker_speeds, 2, 2)
    # Region 0's first two workers and region 1's: 0.232, 0.907 | 0.574, 0.531, over 0.907.
    assert speeds == pytest.approx([0.232 / 0.907, 1.0, 0.574 / 0.907, 0.531 / 0.907])
    cfg = dataclasses.replace(alike, worker_speeds=speeds)
    assert [cfg.local_steps_of(i) for i in range(4)] == [3, 8, 6, 5]  # ceil(8 * speed)
    assert cfg.step_s_of(0) == pytest.approx(0.05 * 0.907 / 0.232)
    # One job of any worker advances the schedule by the mean H, as the simulator's
    # global iteration does: the fast worker does not run ahead in its learning rate.
    assert cfg.mean_local_steps == 5.5 and cfg.schedule_position(2) == 11
    assert cfg.schedule_steps == -(-4 * 2 * 5.5 // 4)
    assert RealConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="need 4 speeds"):
        dataclasses.replace(alike, worker_speeds=[1.0, 0.5])
    with pytest.raises(ValueError, match="do not fit"):
        speeds_of_regions(paper.network.worker_speeds, 2, 5)


def test_bandwidths_scale_so_that_a_transfer_takes_the_papers_share_of_a_step():
    paper = load_setup()
    tm = paper.time_model
    scale = {"model_bytes": 71_552, "paper_model_bytes": tm.model_bytes, "step_s": 0.05,
             "paper_step_s": tm.local_step_time_s}
    for gbps in (100.0, 0.537, 0.117):
        ours = shaping.transfer_s(71_552, shaping.scaled_bps(gbps, **scale)) / 0.05
        theirs = shaping.transfer_s(tm.model_bytes, gbps * 1e9) / tm.local_step_time_s
        assert ours == pytest.approx(theirs)  # transfer time in local steps: the paper's
    assert shaping.scaled_bps(1e-9, **scale) == shaping.MIN_RATE_BPS
    with pytest.raises(ValueError, match="--step-time"):
        shaping.scaled_bps(1.0, **scale | {"step_s": 0.0})
    with pytest.raises(ValueError, match="4 regions, not 5"):
        shaping.scaled_bandwidths(paper.network.bandwidth_gbps, 5, **scale)


def test_shaping_plan_gives_each_pair_that_talks_its_links_rate():
    cfg = shaped_config()
    intra0, inter = cfg.bandwidth_bps[0][0], cfg.bandwidth_bps[0][1]
    assert cfg.bandwidth_bps[1][1] == intra0 and inter < intra0 / 100
    plan = shaping.egress_plan(cfg)
    assert plan == {
        "gps": [("lps0", intra0), ("lps1", inter)],
        "lps0": [("gps", intra0), ("w0", intra0), ("w1", intra0)],
        "lps1": [("gps", inter), ("w2", intra0), ("w3", intra0)],
        "w0": [("lps0", intra0)], "w1": [("lps0", intra0)],
        "w2": [("lps1", intra0)], "w3": [("lps1", intra0)]}
    for a, b in (("w0", "w1"), ("w0", "gps"), ("lps0", "lps1"), ("w0", "lps1")):
        assert shaping.link_bps(cfg, a, b) is None  # never talk: default class
    three = small_config(num_regions=3, workers_per_region=1, gps_region=2, bandwidth_bps=[
        [1.0, 2.0, 3.0], [2.0, 4.0, 5.0], [3.0, 5.0, 6.0]])
    assert shaping.link_bps(three, "lps0", "gps") == 3.0  # [gps_region][r]
    assert shaping.link_bps(three, "w1", "lps1") == 4.0 == shaping.link_bps(three, "lps1", "w1")
    with pytest.raises(ValueError, match="no bandwidths"):
        shaping.egress_plan(small_config())


def test_tc_commands_make_one_fixed_rate_class_per_peer_and_an_unshaped_default():
    commands = shaping.tc_commands("eth0", [("10.1.2.3", 650_307.9), ("10.1.2.4", 1.2e8)])
    root, default, *peers = commands
    assert root == ["qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb",
                    "default", "1"]
    assert default[default.index("rate") + 1] == shaping.DEFAULT_RATE
    cls, flt = peers[0], peers[1]
    assert cls[cls.index("classid") + 1] == "1:10" == flt[flt.index("flowid") + 1]
    assert cls[cls.index("rate") + 1] == cls[cls.index("ceil") + 1] == "650308bit"
    assert flt[flt.index("dst") + 1] == "10.1.2.3/32"
    assert peers[2][peers[2].index("burst") + 1] == "15000"  # 1 ms of 120 Mbit/s
    assert peers[3][peers[3].index("flowid") + 1] == "1:11"


def test_comparison_with_the_simulator_reads_both_curves_alike():
    real = [[0, 4.0, 0.0], [1, 3.5, 2.0], [2, 3.0, 4.0], [3, 2.8, 6.0], [4, 2.5, 8.0]]
    out = compare.compare(real, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [4.0, 3.6, 3.1, 2.9, 2.4, 2.3])
    assert out["updates_compared"] == 4
    assert out["per_update"]["ratio_median"] == 2.0
    by_fraction = {t["fraction"]: t for t in out["targets"]}
    assert by_fraction[0.25]["loss"] == 3.6 and by_fraction[0.25]["real_s"] == 2.0
    assert by_fraction[1.0]["loss"] == 2.5  # the worse of the two after 4 updates
    assert by_fraction[1.0]["sim_s"] == 4.0 and by_fraction[1.0]["ratio_real_to_sim"] == 2.0
    with pytest.raises(ValueError, match="no global update"):
        compare.compare(real[:1], [0.0], [4.0])
    with pytest.raises(ValueError, match="--shape"):
        compare.sim_setup(small_config(), load_setup())
    sim = compare.sim_setup(shaped_config(), load_setup())
    assert sim.network.speeds == pytest.approx(shaped_config().worker_speeds)
    assert sim.time_model.model_bytes == shaped_config().model_bytes
    assert sim.network.bandwidth_gbps[0][1] == shaped_config().bandwidth_bps[0][1] / 1e9


def test_summary_times_the_loss_from_the_start_and_discovery_names_every_endpoint():
    cfg, stats = small_config(), consistent_stats()
    stats["gps"]["loss"] = [[0, 4.8, 99.0], [4, 4.6, 112.5]]
    summary = summarize(cfg, stats, [], kills=[], missed=[],
                        exit_codes=dict.fromkeys(cfg.node_names(), 0), wall_s=20.0,
                        launched=90.0, clock=100.0)
    assert summary["loss_curve_s"] == [[0, 4.8, 0.0], [4, 4.6, 12.5]]
    assert summary["startup_s"] == 10.0
    nodes = {keys.halos_node("j", "gps"): json.dumps({"role": "gps", "url": "http://a:1"}),
             keys.halos_node("j", "w0"): json.dumps({"role": "worker", "metrics": "b:2"})}
    # w0's agent names its machine: w0 and its agent carry it as `host`; gps has no agent here.
    agents = {keys.agent("j", "w0", 0): json.dumps({"metrics_addr": "c:3", "node_id": "m1"})}
    assert prometheus_targets("j", nodes, agents) == [
        {"targets": ["a:1"], "labels": {"job": "j", "component": "gps", "instance_id": "gps"}},
        {"targets": ["b:2"], "labels": {"job": "j", "component": "worker", "instance_id": "w0",
                                        "host": "m1"}},
        {"targets": ["c:3"], "labels": {"job": "j", "component": "agent",
                                        "instance_id": "w0/00000", "host": "m1"}}]


# --- shaping for real: namespaces, tc ---------------------------------------------------------

NO_SHAPING = shaping.unsupported()


@pytest.mark.skipif(NO_SHAPING is not None, reason=f"no shaping here: {NO_SHAPING}")
def test_tc_class_shapes_a_tcp_transfer_between_namespaces():
    """What the plan's commands do: 100 KB from one host to another at 800 kbit/s take 1 s."""
    size, bps = 100_000, 800_000.0
    with HostNetwork(2, name=unique_network_name("s")) as net:
        a, b = net.hosts
        shaping.apply(a.name, IFACE, [(b.address, bps)])
        server = subprocess.Popen(b.wrap([sys.executable, "-c", RECEIVER, b.address,
                                          str(size)]), stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "listening"
        sent = subprocess.run(a.wrap([sys.executable, "-c", SENDER, b.address, str(size)]),
                              capture_output=True, text=True, timeout=30, check=True)
        server.wait(10)
        elapsed = float(sent.stdout)
        wire = shaping.class_bytes(a.name, IFACE)["1:10"]
    assert wire >= size  # it went through the peer's class, headers and all
    assert 0.9 * shaping.transfer_s(wire, bps) <= elapsed <= 1.5 * shaping.transfer_s(wire, bps)


RECEIVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5001)); s.listen(); print("listening", flush=True)
c, _ = s.accept(); n = 0
while n < int(sys.argv[2]):
    n += len(c.recv(65536))
c.sendall(b"k")
"""
SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5001)); t = time.perf_counter()
c.sendall(b"x" * int(sys.argv[2])); c.recv(1); print(time.perf_counter() - t)
"""


@pytest.mark.slow
@pytest.mark.skipif(NO_SHAPING is not None, reason=f"no shaping here: {NO_SHAPING}")
def test_shaped_run_at_the_setups_speeds_takes_the_links_time_and_completes(job_id, tmp_path):
    """Every node in its own namespace, the paper's speeds and scaled bandwidths (lps1 is an
    inter-region hop of 0.88 s per model transfer, lps0 is beside the GPS), and the simulator."""
    out = tmp_path
    cmd = [FTSYSTEM, "halos", "run", "--job", job_id, "--out", str(out), "--json",
           str(out / "s.json"), "--shape", "--speeds", "setup", "--compare-sim", *RUN_ARGS,
           "--updates", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False,
                          env={**os.environ, "COLUMNS": "120"})
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in out.glob("agent-*.log"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    summary = json.loads((out / "s.json").read_text())
    assert summary["problems"] == [] and summary["updates"] == 6
    cfg = RealConfig.from_json(json.dumps(summary["config"]))
    for i, name in enumerate(cfg.node_names()[3:]):  # each worker ran its own H
        worker = summary["workers"][name]
        assert worker["local_steps"] == worker["pushes"] * [3, 8, 6, 5][i] > 0
    links = {(r["from"], r["to"]): r for r in summary["shaping"]["links"]}
    hop = links[("lps1", "gps")]["model_transfer_s"]
    assert hop == links[("gps", "lps1")]["model_transfer_s"] == pytest.approx(0.88, abs=0.01)
    # An exchange is a model's transfer each way plus the GPS's update: without the update,
    # the measured round trips of lps1 last what the shaping implies.
    apply_s = statistics.median(summary["gps"]["apply_s"])
    far = statistics.median(summary["lps"]["lps1"]["exchange_s"]) - apply_s
    near = statistics.median(summary["lps"]["lps0"]["exchange_s"]) - apply_s
    assert 0.9 * 2 * hop <= far <= 1.5 * 2 * hop + 0.2, (far, hop)
    assert near < 0.25 * far
    merges = summary["lps"]["lps1"]["merges"]
    assert links[("lps1", "gps")]["bytes_sent"] >= merges * summary["shaping"]["model_bytes"]
    times = [t for _, _, t in summary["loss_curve_s"]]
    assert times == sorted(times) and summary["startup_s"] > 0
    # The simulator, on the same configuration, times the same updates within a factor 2.
    sim = summary["simulator"]
    assert sim["updates_compared"] >= 4
    assert 0.5 <= sim["per_update"]["ratio_median"] <= 2.0, sim["per_update"]


def test_launch_refuses_shaping_it_cannot_do_and_says_what_to_do():
    from ftsystem.halos.real import LaunchConfig

    with pytest.raises(ValueError, match="own network namespace"):
        LaunchConfig(real=shaped_config())
    with pytest.raises(ValueError, match="loopback"):
        LaunchConfig(real=shaped_config(), netns=True, etcd="http://127.0.0.1:2379")
    LaunchConfig(real=shaped_config(), netns=True, etcd="http://10.1.2.1:2379")

    def refused(*args: str) -> str:
        done = subprocess.run([FTSYSTEM, "halos", "run", *args], capture_output=True,
                              text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert done.returncode == 2, done.stdout + done.stderr
        return " ".join(done.stderr.split())

    assert "add --shape" in refused("--compare-sim")
    assert "--step-time" in refused("--shape") if NO_SHAPING is None else \
        "leave out --shape" in refused("--shape")
