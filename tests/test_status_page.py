"""The controller's status page, rendered by a real headless Chromium during a real job."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import controller_process, wait_for
from controller.leader import EpochMark
from controller.status_page import (MAX_REPLICA_ROWS, NUM_ORDERS_SHOWN, Progress, render_page,
                                    sign_in_page)
from ftsystem.chaos.spec import Order, spec_from_mapping, submit
from ftsystem.control import keys
from ftsystem.control.etcd_server import free_port
from ftsystem.chaos.faults import FaultPoint
from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job
from ftsystem.control.store import Store

CHROMIUM = Path("/usr/bin/chromium")
SAVE_SCREENSHOT_ENV = "FTSYSTEM_SAVE_SCREENSHOT"
DOCS_SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "status_page.png"


def _put(items: dict, key: str, value: dict) -> None:
    if "/replicas/" in key:  # a registration has its replica's id and generation
        value = {"replica_id": keys.last_segment(key), "generation": 0, **value}
    items[key] = json.dumps(value).encode()


def _section(page: str, table_id: str) -> str:
    table = page[page.index(f'<table id="{table_id}">'):]
    return table[:table.index("</table>")]


def test_every_value_is_escaped():
    job, evil = "demo", '<img src=x onerror="alert(1)">'
    items: dict[str, bytes] = {}
    _put(items, keys.epoch(job), {"number": 2, "members": [evil], "reason": evil})
    # Well-formed records (a malformed one is not shown at all) with markup wherever a string is.
    _put(items, keys.replicas(job) + evil,
         {"replica_id": evil, "state": "member", "step": 3, "generation": 0, "host": evil})
    _put(items, keys.failures(job) + evil + "/000001", {"time": 1.0, "reason": evil, "step": 2})
    _put(items, keys.replicas(job) + "j" + evil,
         {"replica_id": "j" + evil, "state": "catching_up", "step": 1, "generation": 0})
    _put(items, keys.catchups(job) + "j" + evil, {"donor": evil, "state_addr": evil})
    items[keys.chaos(job, "o")] = _order(evil, at=1.0).to_json().encode()
    items[keys.leader(job)] = evil.encode()
    page = render_page(job, items, instance=evil, now=2.0)
    assert "<img" not in page and page.count("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;") > 5
    for table in ("joiners", "chaos"):
        assert "&lt;img src=x" in _section(page, table), table
    assert "&lt;img src=x" in page[page.index('<p id="progress">'):]  # the leader's name


def _order(text: str, *, at: float, state: str = "done", replica: str | None = None) -> Order:
    return Order(id=f"o-{text}", action=text, replica=text if replica is None else replica, at=at,
                 state=state, outcome=text if state != "pending" else "",
                 executed_at=at + 0.1 if state != "pending" else None)


def test_progress_shows_the_leaders_ettr_and_step_rate_and_a_standby_names_the_leader():
    job, items = "demo", {keys.leader("demo"): b"c-leader"}
    progress = Progress(ettr_work=0.8125, ettr_time=0.97, step_rate=12.5, window_s=120.0,
                        measured_s=42.0)
    page = render_page(job, items, instance="c-leader", now=100.0, progress=progress)
    assert '<span class="figure" id="ettr-work">0.812</span>' in page
    assert '<span class="figure" id="ettr-time">0.970</span>' in page
    assert '<span class="figure" id="step-rate">12.50</span> steps/s over the last 2 min' in page
    assert "for 42 s" in page
    young = Progress(ettr_work=None, ettr_time=None, step_rate=None, window_s=120.0,
                     measured_s=None)
    assert '<span class="figure" id="ettr-work">-</span>' in render_page(
        job, items, instance="c-leader", now=100.0, progress=young)
    standby = render_page(job, items, instance="c-standby", now=100.0)
    assert "measured by the leading controller (c-leader)" in standby
    assert 'id="ettr-work"' not in standby


def test_joiners_show_their_donor_how_far_behind_they_are_and_what_they_received():
    job, items = "demo", {}
    _put(items, keys.replica(job, "r0"), {"state": "member", "step": 500, "generation": 0})
    for rid, step in (("r1", 0), ("r2", 120), ("r3", 0)):
        _put(items, keys.replica(job, rid), {"state": "catching_up", "step": step})
    _put(items, keys.catchup(job, "r1"), {"donor": "r0", "state_addr": "h:1"})
    _put(items, keys.catchup(job, "r2"), {"donor": "", "state_addr": ""})
    # r3: no assignment yet
    joiners = _section(render_page(job, items, instance="c", now=1.0), "joiners")
    rows = dict(re.findall(r'<tr data-replica="(r\d)">(.*?)</tr>', joiners))
    assert sorted(rows) == ["r1", "r2", "r3"]  # r0 is a member, not a joiner
    assert re.findall(r"<td[^>]*>([^<]*)</td>", rows["r1"]) == ["r1", "r0", "0", "500", "500",
                                                                 "-"]
    assert "none: full state sync" in rows["r2"] and "waiting for the leader" in rows["r3"]
    assert re.findall(r'<td class="num">([^<]*)</td>', rows["r3"]) == ["0", "-", "-", "-"]
    nobody = render_page(job, {}, instance="c", now=1.0)
    assert '<td class="muted" colspan="6">none</td>' in _section(nobody, "joiners")
    # What a joiner reports as it catches up: the snapshot in flight, then the steps replayed.
    _put(items, keys.replica(job, "r1"), {"state": "catching_up", "step": 0, "catchup": {
        "bytes": 412_000_000, "snapshot_received": 412_000_000,
        "snapshot_bytes": 1_148_000_000, "steps_replayed": 0}})
    _put(items, keys.replica(job, "r2"), {"state": "catching_up", "step": 498, "catchup": {
        "bytes": 1_930_000_000, "snapshot_received": 1_148_000_000,
        "snapshot_bytes": 1_148_000_000, "steps_replayed": 2}})
    rows = dict(re.findall(r'<tr data-replica="(r\d)">(.*?)</tr>',
                           _section(render_page(job, items, instance="c", now=1.0), "joiners")))
    assert re.findall(r"<td[^>]*>([^<]*)</td>", rows["r1"])[-1] == "412 MB (snapshot 36%)"
    assert re.findall(r"<td[^>]*>([^<]*)</td>", rows["r2"])[-4:] == [
        "498", "-", "-", "1,930 MB, 2 steps replayed"]
    assert '<td class="muted" colspan="6">none</td>' in _section(nobody, "chaos")


def test_chaos_shows_the_last_orders_with_their_outcomes_then_the_next_pending_ones():
    job, items, now = "demo", {}, 1000.0
    orders = [_order(f"k{i}", at=float(i), state="failed" if i == 3 else "done", replica="r1")
              for i in range(NUM_ORDERS_SHOWN + 5)]
    orders += [_order(f"p{i}", at=now + 60 * (i + 1), state="pending", replica="r2")
               for i in range(3)]
    for order in orders:
        items[keys.chaos(job, order.id)] = order.to_json().encode()
    page = render_page(job, items, instance="c", now=now)
    assert f"chaos orders ({NUM_ORDERS_SHOWN + 4} done, 1 failed, 3 pending)" in page
    shown = re.findall(r'<tr data-order="([^"]+)">', _section(page, "chaos"))
    newest = [f"o-k{i}" for i in reversed(range(5, NUM_ORDERS_SHOWN + 5))]
    assert shown == newest  # the last N executed fill the table: no room for pending ones
    row = re.search(r'<tr data-order="o-k24">.*?</tr>', page).group(0)
    assert "<td>k24</td><td>r1</td>" in row and 'class="outcome-done">done<' in row
    # with fewer executed orders, the next pending ones follow, soonest first
    few = {k: v for k, v in items.items() if json.loads(v)["state"] == "pending"
           or json.loads(v)["id"] in ("o-k3", "o-k4")}
    page = render_page(job, few, instance="c", now=now)
    shown = re.findall(r'<tr data-order="([^"]+)">', _section(page, "chaos"))
    assert shown == ["o-k4", "o-k3", "o-p0", "o-p1", "o-p2"]
    assert 'class="outcome-failed">failed<' in page and "(in 60 s)" in page


def test_thousands_of_replicas_list_only_those_that_are_not_members():
    job, items = "demo", {}
    members = [f"r{i:04d}" for i in range(MAX_REPLICA_ROWS + 1000)]
    _put(items, keys.epoch(job), {"number": 3, "members": members[:-2], "reason": "join"})
    for rid in members[:-2]:
        _put(items, keys.replica(job, rid), {"state": "member", "step": 9, "generation": 0})
    for rid in members[-2:]:
        _put(items, keys.replica(job, rid), {"state": "catching_up", "step": 0})
    page = render_page(job, items, instance="c", now=1.0)
    rows = re.findall(r'<tr data-replica="([^"]+)">', _section(page, "replicas"))
    assert rows == members[-2:]
    assert (f"{len(members)} replicas: 2 catching_up, {len(members) - 2} member; "
            "listed: 2 that are not members") in page


def test_charts_show_the_step_rate_the_epochs_and_each_replicas_progress():
    job, items, now = "demo", {}, 1000.0
    _put(items, keys.spec(job), {"replicas": 3, "num_steps": 200})
    _put(items, keys.epoch(job), {"number": 3, "members": ["r0", "r2"], "reason": "removal"})
    for rid, step in (("r0", 150), ("r1", 50), ("r2", 100)):
        _put(items, keys.replica(job, rid), {"state": "member", "step": step, "generation": 0})
    _put(items, keys.failure(job, "r1", 0), {"time": 950.0, "reason": "killed", "step": 40})
    epochs = (EpochMark(number=1, time=900.0, num_members=3, reason="start", paused=False),
              EpochMark(number=2, time=950.0, num_members=1, reason="removal", paused=True),
              EpochMark(number=3, time=960.0, num_members=2, reason="join", paused=False))
    progress = Progress(ettr_work=0.5, ettr_time=0.9, step_rate=2.0, window_s=120.0,
                        measured_s=100.0, rates=((940.0, 4.0), (970.0, 0.0), (1000.0, 2.0)),
                        epochs=epochs)
    page = render_page(job, items, instance="c", now=now, progress=progress)
    spark = re.search(r'<svg id="rate-sparkline".*?</svg>', page).group(0)
    points = re.search(r'<polyline points="([^"]+)"', spark).group(1).split()
    xs, ys = zip(*((float(x), float(y)) for x, y in (p.split(",") for p in points)))
    assert xs == tuple(sorted(xs)) and xs[-1] == 360.0  # oldest first, up to now
    assert ys[1] == 48.0 and ys[0] < ys[2] < 48.0  # 4/s highest, 0/s on the axis, 2/s between
    assert "peak 4.00/s" in spark and "step rate, last 63 s" in page  # a young term: its span
    timeline = re.search(r'<svg id="epoch-timeline".*?</svg>', page).group(0)
    rects = re.findall(r'<rect class="epoch" x="([\d.]+)" y="[\d.]+" width="([\d.]+)" '
                       r'height="([\d.]+)" fill="(#\w+)"', timeline)
    assert len(rects) == 3
    heights = [float(h) for _, _, h, _ in rects]
    assert heights == pytest.approx([heights[0], heights[0] / 3, heights[0] * 2 / 3], abs=0.1)
    assert rects[1][3] == "#b3261e" and rects[0][3] != rects[1][3]  # the paused one in red
    assert len(re.findall(r'<line class="failure"', timeline)) == 1
    assert "epoch 2: 1 members, removal, PAUSED" in timeline
    assert ">1970-01-01 00:15:00 UTC</text>" in timeline and ">now</text>" in timeline  # from epoch 1
    bars = dict(re.findall(r'<tr data-replica="(r\d)">.*?<rect width="140" .*?<rect '
                           r'width="([\d.]+)"', page))
    assert bars == {"r0": "105.0", "r1": "35.0", "r2": "70.0"}  # steps of 200
    assert "step 150 of 200" in page
    standby = render_page(job, items, instance="other", now=now)
    assert 'id="rate-sparkline"' not in standby and "measured by the leading controller" in standby
    no_total = {k: v for k, v in items.items() if k != keys.spec(job)}
    bars = dict(re.findall(r'<tr data-replica="(r\d)">.*?<rect width="140" .*?<rect '
                           r'width="([\d.]+)"', render_page(job, no_total, instance="c", now=now)))
    assert bars["r0"] == "140.0"  # without the spec's steps: against the furthest replica


def test_the_sign_in_page_holds_none_of_the_jobs_data():
    page = sign_in_page("demo")
    assert '<form id="sign-in" >' in page and 'data-signed-out="1"' in page
    assert 'id="replicas"' not in page and 'id="members"' not in page
    assert "sessionStorage" in page and "#token=" in page


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.is_file(),
                    reason=f"no browser at {CHROMIUM}: install Debian's `chromium` package")
def test_live_page_in_headless_chromium_and_the_cli_views(etcd, job_id, tmp_path):
    """One real job (r1 killed at step 60, one chaos order) seen by a browser, by `ftsystem
    status` and `ftsystem watch`, asked at the leader and at a standby."""
    port = free_port()
    # More steps than the test lasts: the job must not end (and its members leave the page)
    # before the browser has rendered it; the test stops the job itself once done.
    cfg = RunConfig(num_replicas=2, num_steps=100_000, etcd=etcd.url, job=job_id,
                    out_dir=tmp_path / "run", kills=[ReplicaKill(1, FaultPoint(60, "step"))],
                    train_args=["--sleep-per-step", "0.03"], controller_ports=[port],
                    show_progress=False)
    base = f"http://127.0.0.1:{port}"
    runner = threading.Thread(target=run_job, args=(cfg,), daemon=True)
    runner.start()
    try:
        token = wait_for(lambda: _run_token(cfg.out_dir), 60, "the run's token")
        # one real chaos order, harmless: r0 slowed for half a second once training runs
        order = _submit_slow_r0(etcd.url, job_id)
        wait_for(lambda: _rejoined(base, job_id, token), 120, "r1 to fail and rejoin", poll=0.2)
        wait_for(lambda: _order_state(etcd.url, job_id, order) != "pending", 60,
                 "the chaos order to be executed", poll=0.2)
        page = f"{base}/#token={token}"  # the page takes it from the fragment
        dom = _chromium(tmp_path, "--dump-dom", page).stdout
        screenshot = tmp_path / "status_page.png"
        _chromium(tmp_path, f"--screenshot={screenshot}", page)
        signed_out = _chromium(tmp_path, "--dump-dom", f"{base}/").stdout
        _check_the_cli_views(etcd.url, base, job_id, token, tmp_path)
    finally:
        _stop_job(etcd.url, job_id, runner)
    # the inline script sent the token, polled and swapped in fresh data at least once
    assert int(re.search(r'<body data-refreshes="(\d+)"', dom).group(1)) >= 1, dom
    assert re.search(r'<form id="sign-in" hidden(="")?>', dom) and token not in dom
    members = re.search(r'<span id="members">([^<]*)</span>', dom).group(1)
    assert sorted(members.split(", ")) == ["r0", "r1"], dom
    failures = dom[dom.index('<table id="failures">'):]
    failures = failures[:failures.index("</table>")]
    assert re.search(r'<tr data-replica="r1">.*killed by SIGKILL', failures), failures
    r1 = re.search(r'<tr data-replica="r1">.*?</tr>', dom).group(0)
    assert re.findall(r'<td class="num">([^<]*)</td>', r1)[1:] == ["1", "1"], r1  # gen, restarts
    # the leader's live ETTR and step rate: the job has trained
    ettr_work = float(re.search(r'<span class="figure" id="ettr-work">([^<]*)<', dom).group(1))
    assert 0.0 < ettr_work <= 1.0, dom
    assert float(re.search(r'<span class="figure" id="step-rate">([^<]*)<', dom).group(1)) > 0
    # the charts: the step rate's history, the epochs (start, r1's removal and rejoin) with
    # r1's failure, each replica's bar
    assert re.search(r'<svg id="rate-sparkline"[^>]*>.*<polyline points="[^"]+ [^"]+"', dom)
    timeline = re.search(r'<svg id="epoch-timeline".*?</svg>', dom).group(0)
    assert len(re.findall(r'<rect class="epoch"', timeline)) >= 3, timeline
    assert '<line class="failure"' in timeline
    assert len(re.findall(r'<svg class="bar"', dom)) == 2
    assert '<table id="joiners">' in dom  # r1 has caught up: the table may be empty
    chaos = dom[dom.index('<table id="chaos">'):]
    row = re.search(rf'<tr data-order="{re.escape(order)}">.*?</tr>', chaos).group(0)
    assert "<td>slow</td><td>r0</td>" in row and 'class="outcome-done">done<' in row, row
    # without the token: the sign-in form, none of the job's data
    assert re.search(r'<form id="sign-in"\s*>', signed_out) and 'id="members"' not in signed_out
    assert screenshot.stat().st_size > 10_000
    if os.environ.get(SAVE_SCREENSHOT_ENV) == "1":
        shutil.copyfile(screenshot, DOCS_SCREENSHOT)


def _check_the_cli_views(etcd_url: str, base: str, job: str, token: str, tmp_path: Path
                         ) -> None:
    """`ftsystem status` and `ftsystem watch` against the live job, with the run's token from
    a file; then `status` at a standby, which completes its answer from the leader."""
    token_file = tmp_path / "token"
    token_file.write_text(token)
    cli = [sys.executable, "-m", "ftsystem.cli"]
    auth = ["--controller", base, "--token-file", str(token_file)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTSYSTEM_API_TOKEN")}
    env["COLUMNS"] = "120"
    status = _run([*cli, "status", job, *auth, "--json"], env)
    found = json.loads(status)
    assert sorted(found["epoch"]["members"]) == ["r0", "r1"]
    assert found["progress"]["step_rate"] > 0 and found["progress"]["rates"]
    assert [e["reason"] for e in found["progress"]["epochs"]][:1] == ["start"]
    assert [f["replica"] for f in found["failures"]] == ["r1"]
    text = _run([*cli, "status", job, *auth], env)
    assert f"job {job}" in text and "steps/s over 2 min" in text
    # each replica's step of the spec's 100,000 (its bar still empty this early)
    assert re.search(r"^r0 +member +\d+/100000 ", text, re.M), text
    assert "killed by SIGKILL" in text
    started = time.monotonic()
    watched = _run([*cli, "watch", job, *auth, "--iterations", "2", "--interval", "0.5"], env)
    assert time.monotonic() - started >= 0.5
    assert watched.count(f"job {job}") == 2 and watched.count("steps/s over 2 min") == 2
    refused = subprocess.run([*cli, "status", job, "--controller", base], env=env,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "needs the job's token" in refused.stderr
    with controller_process(etcd_url, job, tmp_path,
                            {"FTSYSTEM_API_TOKEN": token}) as standby:
        via = json.loads(_run([*cli, "status", job, "--controller", standby, "--token-file",
                               str(token_file), "--json"], env))
        assert via["leader_address"] == base.removeprefix("http://")
        assert via["progress"] is not None and via["progress"]["step_rate"] > 0


def _run(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-2000:])
    return done.stdout


def _run_token(out_dir: Path) -> str | None:
    """The token ``ftsystem run`` made for its controllers (``OUT/api-token``)."""
    path = out_dir / "api-token"
    return path.read_text() if path.exists() else None


def _rejoined(base: str, job: str, token: str) -> bool:
    """True once r1 has failed, restarted and is a member again beside r0: its restarted
    generation registered as a member. (Its failure is recorded first, while the epoch from
    before the kill still lists it: members and restarts alone are true for a moment then.)"""
    try:
        view = httpx.get(f"{base}/v1/jobs/{job}", timeout=2,
                         headers={"Authorization": f"Bearer {token}"}).json()
    except httpx.HTTPError:
        return False
    r1 = [r for r in view["replicas"] if r["id"] == "r1"]
    return (sorted(view["epoch"]["members"]) == ["r0", "r1"] and bool(r1)
            and (r1[0]["state"], r1[0]["generation"], r1[0]["restarts"]) == ("member", 1, 1))


def _submit_slow_r0(etcd_url: str, job: str) -> str:
    """Submit, as ``ftsystem chaos apply`` does, once r0's agent is registered."""
    async def go() -> str | None:
        async with Store(etcd_url) as store:
            agents, _ = await store.get_prefix(keys.replica_agents(job, "r0"))
            if not agents:
                return None
            spec = spec_from_mapping({"action": "slow", "duration": "500ms",
                                      "selector": {"replicas": ["r0"]}, "after_step": 5})
            return (await submit(store, job, spec, "page-test", now=time.time()))[0].id

    return wait_for(lambda: asyncio.run(go()), 60, "r0's agent to register", poll=0.2)


def _order_state(etcd_url: str, job: str, order: str) -> str:
    async def go() -> str:
        async with Store(etcd_url) as store:
            return (await store.get_json(keys.chaos(job, order)))["state"]
    return asyncio.run(go())


def _stop_job(etcd_url: str, job: str, runner: threading.Thread) -> None:
    """Stop the job as an operator stops it, SIGTERM to every node agent (each stops its
    ranks and exits), until ``run_job`` returns: agents that had not registered yet are
    found on the next round."""
    async def agent_pids() -> list[int]:
        async with Store(etcd_url) as store:
            items, _ = await store.get_prefix(keys.agents(job))
        return [json.loads(v)["pid"] for v in items.values()]

    deadline = time.monotonic() + 300
    while runner.is_alive() and time.monotonic() < deadline:
        for pid in asyncio.run(agent_pids()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        runner.join(5)
    assert not runner.is_alive(), "the job did not stop after SIGTERM to its agents"


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    started = time.monotonic()
    result = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'chromium-profile'}",
         "--window-size=1280,1100", "--virtual-time-budget=3000", *args],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    print(f"chromium {args[0]}: {time.monotonic() - started:.1f} s")
    return result
