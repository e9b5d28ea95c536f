"""The controller's live status page, ``GET /``: one self-contained HTML page (no external assets).

The page is rendered here, from one etcd read, with every value escaped; a small inline script
re-fetches the page every second and swaps in its ``#live`` part, so there is a single renderer
and the page also works without JavaScript. ETTR is not shown: it needs the replicas' commit
timelines, which live in their result files (``ftsystem run`` reports it), not in etcd.
"""

from __future__ import annotations

import json
import time
from html import escape
from string import Template
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from controller.leader import LeaderConfig
from ftsystem.control import keys
from ftsystem.control.store import Store

NUM_FAILURES_SHOWN = 20

PAGE = Template("""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ftsystem: $job</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em 2em; color: #1d2330; }
h1 { font-size: 1.4em; margin: 0 0 .2em } h2 { font-size: 1.1em; margin: 1.4em 0 .4em }
table { border-collapse: collapse; min-width: 36em }
th, td { text-align: left; padding: .25em .9em .25em 0; border-bottom: 1px solid #e3e6ec }
th { color: #5b6475; font-weight: 600 } td.num { font-variant-numeric: tabular-nums }
.muted { color: #5b6475 } .member { font-weight: 600 }
.state { padding: .05em .5em; border-radius: .7em; background: #e3e6ec }
.state-member { background: #c9efd3 } .state-ready, .state-done { background: #d3e4fb }
.state-catching_up, .state-starting { background: #fbeec4 }
.state-restarting { background: #f9d0cc } .paused { color: #b3261e; font-weight: 600 }
#stale { background: #f9d0cc; padding: .3em .6em }
</style></head>
<body data-refreshes="0">
<p id="stale" hidden></p>
<div id="live">
<h1>job <span id="job">$job</span></h1>
<p class="muted">controller $instance &middot; leader $leader &middot; rendered $now UTC</p>
<h2>epoch <span id="epoch">$epoch</span> $paused</h2>
<p>members: <span id="members">$members</span><br><span class="muted">$epoch_info</span></p>
<h2>replicas</h2>
<table id="replicas"><tr><th>id</th><th>state</th><th>step</th><th>generation</th>
<th>restarts</th><th>host</th></tr>
$replicas</table>
<h2>failures ($num_failures, newest first)</h2>
<table id="failures"><tr><th>time (UTC)</th><th>replica</th><th>generation</th><th>step</th>
<th>reason</th></tr>
$failures</table>
</div>
<script>
const stale = document.getElementById("stale");
setInterval(async () => {
  try {
    const response = await fetch(location.pathname, {cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    const page = new DOMParser().parseFromString(await response.text(), "text/html");
    document.getElementById("live").replaceWith(page.getElementById("live"));
    document.body.dataset.refreshes = Number(document.body.dataset.refreshes) + 1;
    stale.hidden = true;
  } catch (e) {
    stale.textContent = "not updating (" + e.message + "); showing the last data received";
    stale.hidden = false;
  }
}, 1000);
</script>
</body></html>
""")


def status_router(store: Store, cfg: LeaderConfig) -> APIRouter:
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse, summary="Live status page (HTML)")
    async def status_page() -> str:
        items, _ = await store.get_prefix(keys.job(cfg.job) + "/")
        return render_page(cfg.job, items, instance=cfg.instance_id, now=time.time())

    return router


def render_page(job: str, items: dict[str, bytes], *, instance: str, now: float) -> str:
    """Pure: the status page of ``job`` from its etcd keys."""
    from controller.app import build_job_view  # not at the top: app.py imports this module
    view = build_job_view(job, items)
    epoch, spec = view["epoch"], view["spec"] or {}
    members = set(epoch["members"])
    failures = recent_failures(job, items)
    return PAGE.substitute(
        job=_e(job), instance=_e(instance), leader=_e(view["leader"] or "none"),
        now=_e(_clock(now)), epoch=_e(epoch["number"]),
        paused='<span class="paused">PAUSED</span>' if epoch.get("paused") else "",
        members=_e(", ".join(epoch["members"]) or "none"),
        epoch_info=_e(f"reason {epoch.get('reason') or '-'}; spec: {spec.get('replicas', '?')} "
                      f"replicas, min {spec.get('min_replicas', '?')}, "
                      f"{spec.get('num_steps', '?')} steps"),
        replicas="\n".join(_replica_row(r, r["id"] in members) for r in view["replicas"]),
        num_failures=_e(len(failures)),
        failures="\n".join(_failure_row(f, now) for f in failures[:NUM_FAILURES_SHOWN]))


def recent_failures(job: str, items: dict[str, bytes]) -> list[dict[str, Any]]:
    """Pure: the job's failure records, newest first, each with its replica and generation."""
    prefix = keys.failures(job)
    failures = []
    for key, value in items.items():
        if key.startswith(prefix):
            rid, _, generation = key[len(prefix):].partition("/")
            failures.append({"replica": rid, "generation": generation.lstrip("0") or "0",
                             **json.loads(value)})
    return sorted(failures, key=lambda f: f["time"], reverse=True)


def _replica_row(replica: dict[str, Any], member: bool) -> str:
    state = _e(replica["state"])
    return (f'<tr data-replica="{_e(replica["id"])}"><td class="{"member" if member else ""}">'
            f'{_e(replica["id"])}</td><td><span class="state state-{state}">{state}</span></td>'
            f'<td class="num">{_e(replica["step"])}</td>'
            f'<td class="num">{_e(replica["generation"])}</td>'
            f'<td class="num">{_e(replica["restarts"])}</td><td>{_e(replica["host"])}</td></tr>')


def _failure_row(failure: dict[str, Any], now: float) -> str:
    return (f'<tr data-replica="{_e(failure["replica"])}">'
            f'<td>{_e(_clock(failure["time"]))} ({now - failure["time"]:.0f} s ago)</td>'
            f'<td>{_e(failure["replica"])}</td><td class="num">{_e(failure["generation"])}</td>'
            f'<td class="num">{_e(failure.get("step"))}</td><td>{_e(failure.get("reason"))}</td>'
            f'</tr>')


def _clock(t: float) -> str:
    """UTC: the controller, the replicas and the reader may each have their own time zone."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _e(value: Any) -> str:
    return escape("-" if value is None else str(value), quote=True)
