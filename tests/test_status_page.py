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
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import wait_for
from controller.status_page import render_page
from ftsystem.control import keys
from ftsystem.control.etcd_server import free_port
from ftsystem.chaos.faults import FaultPoint
from ftsystem.launch.launcher import ReplicaKill, RunConfig, run_job
from ftsystem.control.store import Store

CHROMIUM = Path("/usr/bin/chromium")
SAVE_SCREENSHOT_ENV = "FTSYSTEM_SAVE_SCREENSHOT"
DOCS_SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "status_page.png"


def test_every_value_is_escaped():
    job, evil = "demo", '<img src=x onerror="alert(1)">'
    items = {
        keys.epoch(job): json.dumps({"number": 2, "members": [evil], "reason": evil}).encode(),
        keys.replicas(job) + evil: json.dumps(
            {"state": evil, "step": evil, "generation": 0, "host": evil}).encode(),
        keys.failures(job) + evil + "/000001": json.dumps(
            {"time": 1.0, "reason": evil, "step": evil}).encode(),
    }
    page = render_page(job, items, instance=evil, now=2.0)
    assert "<img" not in page and page.count("&lt;img src=x onerror=&quot;alert(1)&quot;&gt;") > 5


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.is_file(),
                    reason=f"no browser at {CHROMIUM}: install Debian's `chromium` package")
def test_live_page_in_headless_chromium(etcd, job_id, tmp_path):
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
        wait_for(lambda: _rejoined(base, job_id), 120, "r1 to fail and rejoin", poll=0.2)
        dom = _chromium(tmp_path, "--dump-dom", f"{base}/").stdout
        screenshot = tmp_path / "status_page.png"
        _chromium(tmp_path, f"--screenshot={screenshot}", f"{base}/")
    finally:
        _stop_job(etcd.url, job_id, runner)
    # the inline script polled and swapped in fresh data at least once
    assert int(re.search(r'<body data-refreshes="(\d+)"', dom).group(1)) >= 1, dom
    members = re.search(r'<span id="members">([^<]*)</span>', dom).group(1)
    assert sorted(members.split(", ")) == ["r0", "r1"], dom
    failures = dom[dom.index('<table id="failures">'):]
    failures = failures[:failures.index("</table>")]
    assert re.search(r'<tr data-replica="r1">.*killed by SIGKILL', failures), failures
    r1 = re.search(r'<tr data-replica="r1">.*?</tr>', dom).group(0)
    assert re.findall(r'<td class="num">([^<]*)</td>', r1)[1:] == ["1", "1"], r1  # gen, restarts
    assert screenshot.stat().st_size > 10_000
    if os.environ.get(SAVE_SCREENSHOT_ENV) == "1":
        shutil.copyfile(screenshot, DOCS_SCREENSHOT)


def _rejoined(base: str, job: str) -> bool:
    """True once r1 has failed, restarted and is a member again beside r0: its restarted
    generation registered as a member. (Its failure is recorded first, while the epoch from
    before the kill still lists it: members and restarts alone are true for a moment then.)"""
    try:
        view = httpx.get(f"{base}/v1/jobs/{job}", timeout=2).json()
    except httpx.HTTPError:
        return False
    r1 = [r for r in view["replicas"] if r["id"] == "r1"]
    return (sorted(view["epoch"]["members"]) == ["r0", "r1"] and bool(r1)
            and (r1[0]["state"], r1[0]["generation"], r1[0]["restarts"]) == ("member", 1, 1))


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
         "--window-size=1280,900", "--virtual-time-budget=3000", *args],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    print(f"chromium {args[0]}: {time.monotonic() - started:.1f} s")
    return result
