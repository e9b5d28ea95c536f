"""The controller's live status page, ``GET /``: one self-contained HTML page (no external assets).

The page is rendered here, from one etcd read and what the leading term measures (live ETTR,
the step rate and its history, the epochs of the term: ``controller.views.Progress``), with
every value escaped and the charts drawn as inline SVG (``controller.svg``); a small inline
script re-fetches the page every second and swaps in its ``#live`` part, so there is a single
renderer and the page also works without JavaScript (where reads are public). ``render_page`` is
pure: the route gathers, it renders.

The page is part of the API, behind the job's token. A browser cannot send a bearer header with
a navigation, so a request without the token gets a sign-in page (401, no job data): its script
takes the token from the address's fragment (``/#token=...``, which the browser never sends) or
from a form, keeps it in the tab's ``sessionStorage`` and sends it with each refresh. A
controller started with ``--public-read`` serves the page to anyone.

At thousands of replicas the page stays short: past ``MAX_REPLICA_ROWS`` the table lists only
the replicas that are not members (a count per state says the rest), and the joiners, failures
and chaos orders are capped, newest first.
"""

from __future__ import annotations

import dataclasses
import time
from html import escape
from string import Template
from typing import Any, Iterable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse
from starlette.exceptions import HTTPException

from controller import svg
from controller.leader import LeaderConfig, LiveTerm
from controller.views import (NUM_FAILURES_SHOWN, NUM_RATE_POINTS, Progress, build_job_view,
                              recent_failures)
from ftsystem.chaos.spec import Order, read_orders
from ftsystem.control import keys
from ftsystem.control.membership import Registration
from ftsystem.control.records import object_or_none, well_formed_under
from ftsystem.control.store import Store

NUM_JOINERS_SHOWN = 50
NUM_ORDERS_SHOWN = 20
MAX_REPLICA_ROWS = 200
"""Past this many replicas, the table shows only those that are not members."""

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
#sign-in { background: #f4f6f9; padding: .6em .8em; margin: 0 0 1em }
.figure { font-size: 1.3em; font-weight: 600; font-variant-numeric: tabular-nums }
.outcome-done { color: #1b6e33 } .outcome-failed { color: #b3261e }
.charts { display: flex; gap: 2.5em; flex-wrap: wrap; align-items: flex-start }
.charts h3 { font-size: .95em; margin: .6em 0 .3em; color: #5b6475; font-weight: 600 }
svg.bar { vertical-align: middle; margin-right: .5em }
</style></head>
<body data-refreshes="0">
<p id="stale" hidden></p>
<form id="sign-in" $sign_in_hidden><label>job token <input name="token" type="password"
autocomplete="off" size="34"></label> <button>show the job</button>
<span class="muted">kept in this tab only; or open this page as /#token=&lt;token&gt;, or start
the controller with --public-read</span></form>
<div id="live"$signed_out>
$live
</div>
<script>
const stale = document.getElementById("stale");
const signIn = document.getElementById("sign-in");
const TOKEN = "ftsystem-token";
const given = new URLSearchParams(location.hash.slice(1)).get("token");
if (given) {  // taken from the fragment (never sent to a server), then out of the address bar
  sessionStorage.setItem(TOKEN, given);
  history.replaceState(null, "", location.pathname + location.search);
}
function problem(text) {
  stale.textContent = text;
  stale.hidden = false;
}
async function refresh() {
  const token = sessionStorage.getItem(TOKEN);
  const signedOut = document.getElementById("live").dataset.signedOut === "1";
  if (signedOut && !token) return;
  try {
    const response = await fetch(location.pathname, {cache: "no-store",
      headers: token ? {Authorization: "Bearer " + token} : {}});
    if (response.status === 401) {
      signIn.hidden = false;
      throw new Error(token ? "the token was refused: enter the job's token"
                            : "this controller needs the job's token");
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    const page = new DOMParser().parseFromString(await response.text(), "text/html");
    document.getElementById("live").replaceWith(page.getElementById("live"));
    document.body.dataset.refreshes = Number(document.body.dataset.refreshes) + 1;
    signIn.hidden = true;
    stale.hidden = true;
  } catch (e) {
    problem("not updating (" + e.message + "); showing the last data received");
  }
}
signIn.addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN, signIn.elements.token.value.trim());
  signIn.reset();
  refresh();
});
if (document.getElementById("live").dataset.signedOut === "1") refresh();
setInterval(refresh, 1000);
</script>
</body></html>
""")

LIVE = Template("""<h1>job <span id="job">$job</span></h1>
<p class="muted">controller $instance &middot; leader $leader &middot; rendered $now UTC</p>
<h2>epoch <span id="epoch">$epoch</span> $paused</h2>
<p>members: <span id="members">$members</span><br><span class="muted">$epoch_info</span></p>
<h2>progress</h2>
<p id="progress">$progress</p>
<div class="charts">
<div><h3>step rate$window</h3>$sparkline</div>
<div><h3>epochs of this leader's term: members (failures dashed)</h3>$timeline</div>
</div>
<h2>replicas</h2>
<p class="muted" id="replica-counts">$replica_counts</p>
<table id="replicas"><tr><th>id</th><th>state</th><th>progress</th><th>step</th>
<th>generation</th><th>restarts</th><th>host</th></tr>
$replicas</table>
<h2>catching up ($num_joiners)</h2>
<table id="joiners"><tr><th>replica</th><th>donor</th><th>its step</th><th>donor's step</th>
<th>behind</th><th>received</th></tr>
$joiners</table>
<h2>failures ($num_failures, newest first)</h2>
<table id="failures"><tr><th>time (UTC)</th><th>replica</th><th>generation</th><th>step</th>
<th>reason</th></tr>
$failures</table>
<h2>chaos orders ($chaos_counts)</h2>
<table id="chaos"><tr><th>time (UTC)</th><th>order</th><th>action</th><th>target</th>
<th>state</th><th>outcome</th></tr>
$orders</table>""")


def install_status_page(app: FastAPI, api: APIRouter, store: Store, cfg: LeaderConfig,
                        term: LiveTerm) -> None:
    """``GET /`` on the API router (behind the token), and the sign-in page as its 401."""

    @api.get("/", response_class=HTMLResponse, summary="Live status page (HTML)",
             responses={401: {"content": {"text/html": {}},
                              "description": "the sign-in page: no token, or another"}})
    async def status_page() -> str:
        items, _ = await store.get_prefix(keys.job(cfg.job) + "/")
        now = time.time()
        return render_page(cfg.job, items, instance=cfg.instance_id, now=now,
                           progress=Progress.of(term, now))

    @app.exception_handler(HTTPException)
    async def sign_in_at_the_page(request: Request, exc: HTTPException):
        if exc.status_code == 401 and request.url.path == "/":
            return HTMLResponse(sign_in_page(cfg.job), status_code=401, headers=exc.headers)
        return await http_exception_handler(request, exc)


def sign_in_page(job: str) -> str:
    """The page without any of the job's data, its form shown: what a request without the
    token gets at ``/``."""
    live = (f'<h1>job <span id="job">{_e(job)}</span></h1><p>This controller shows the job '
            "only to a holder of the job's token: enter it above (or open this page as "
            "<code>/#token=&lt;token&gt;</code>).</p>")
    return PAGE.substitute(job=_e(job), live=live, signed_out=' data-signed-out="1"',
                           sign_in_hidden="")


def render_page(job: str, items: dict[str, bytes], *, instance: str, now: float,
                progress: Progress | None = None) -> str:
    """Pure: the status page of ``job`` from its etcd keys and, on the leading controller,
    what its term measures (``progress``; None elsewhere)."""
    view = build_job_view(job, items)
    epoch, spec = view["epoch"], view["spec"] or {}
    members = set(epoch["members"])
    failures = recent_failures(job, items)
    joiners = catching_up(job, items)
    orders = chaos_orders(job, items)
    shown = view["replicas"]
    if len(shown) > MAX_REPLICA_ROWS:
        shown = [r for r in shown if r["state"] != "member"][:MAX_REPLICA_ROWS]
    total = _total_steps(spec, view["replicas"])
    live = LIVE.substitute(
        job=_e(job), instance=_e(instance), leader=_e(view["leader"] or "none"),
        now=_e(_clock(now)), epoch=_e(epoch["number"]),
        paused='<span class="paused">PAUSED</span>' if epoch.get("paused") else "",
        members=_e(", ".join(epoch["members"]) or "none"),
        epoch_info=_e(f"reason {epoch.get('reason') or '-'}; spec: {spec.get('replicas', '?')} "
                      f"replicas, min {spec.get('min_replicas', '?')}, "
                      f"{spec.get('num_steps', '?')} steps"),
        progress=_progress(progress, view["leader"], instance),
        window=f", last {_span(now - _rate_start(progress, now))}" if progress else "",
        sparkline=_sparkline(progress, now),
        timeline=_timeline(progress, failures, now, spec),
        replica_counts=_e(_replica_counts(view["replicas"], len(shown))),
        replicas="\n".join(_replica_row(r, r["id"] in members, total) for r in shown),
        num_joiners=_e(_shown_of(NUM_JOINERS_SHOWN, len(joiners))),
        joiners=_rows(map(_joiner_row, joiners[:NUM_JOINERS_SHOWN]), 6, "none"),
        num_failures=_e(len(failures)),
        failures="\n".join(_failure_row(f, now) for f in failures[:NUM_FAILURES_SHOWN]),
        chaos_counts=_e(_chaos_counts(orders)),
        orders=_rows((_order_row(o, now) for o in recent_orders(orders, now)), 6, "none"))
    return PAGE.substitute(job=_e(job), live=live, signed_out="", sign_in_hidden="hidden")


def _total_steps(spec: dict[str, Any], replicas: list[dict[str, Any]]) -> int | None:
    """What a replica's bar is measured against: the spec's steps, else the job's furthest
    replica (the bars then show who lags)."""
    if isinstance(spec.get("num_steps"), int):
        return spec["num_steps"]
    steps = [r["step"] for r in replicas if isinstance(r["step"], int)]
    return max(steps, default=None)


def _rate_start(progress: Progress, now: float) -> float:
    """Where the sparkline starts: the rate window's start, or the term's first interval when
    the term is younger (a new leader's line fills the chart)."""
    first = progress.rates[0][0] - progress.window_s / NUM_RATE_POINTS if progress.rates else now
    return max(now - progress.window_s, min(first, now - 1.0))


def _sparkline(progress: Progress | None, now: float) -> str:
    if progress is None:
        return '<p class="muted">measured by the leading controller</p>'
    return svg.sparkline(progress.rates, start=_rate_start(progress, now), end=now,
                         element_id="rate-sparkline")


def _span(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _timeline(progress: Progress | None, failures: list[dict[str, Any]], now: float,
              spec: dict[str, Any]) -> str:
    if progress is None:
        return '<p class="muted">measured by the leading controller</p>'
    steps = [(m.time, m.num_members, f"epoch {m.number}: {m.num_members} members, "
              f"{m.reason or '-'}{', PAUSED' if m.paused else ''}", m.paused)
             for m in progress.epochs]
    start = steps[0][0] if steps else now
    capacity = spec.get("replicas") if isinstance(spec.get("replicas"), int) else 0
    return svg.step_timeline(steps, [f["time"] for f in failures], start=start, end=now,
                             capacity=capacity, start_label=f"{_clock(start)} UTC",
                             end_label="now", element_id="epoch-timeline")


def catching_up(job: str, items: dict[str, bytes]) -> list[dict[str, Any]]:
    """Pure: each replica in state ``catching_up``, with the donor the leader assigned it
    (``catchup/<rid>``: absent while none is assigned, empty when there is none to give and
    it joins with a full state sync), that donor's step, and how far the joiner is (its step
    as it replays, what it received: the joiner reports them at most every half second)."""
    registrations = {rid: dataclasses.asdict(reg) for rid, reg in well_formed_under(
        items, keys.replicas(job), Registration.from_json).items()}
    joiners = []
    for rid, reg in sorted(registrations.items()):
        if reg.get("state") != "catching_up":
            continue
        assigned = object_or_none(items, keys.catchups(job) + rid)
        donor = assigned.get("donor") if assigned else None
        donor = donor if isinstance(donor, str) else None
        donor_step = registrations.get(donor, {}).get("step") if donor else None
        joiners.append({"replica": rid, "step": reg.get("step"), "donor": donor,
                        "donor_step": donor_step, "received": reg.get("catchup") or {}})
    return joiners


def chaos_orders(job: str, items: dict[str, bytes]) -> list[Order]:
    """Pure: the job's chaos orders, by the time they are due."""
    prefix = keys.chaos_orders(job)
    return read_orders({k: v for k, v in items.items() if k.startswith(prefix)})


def recent_orders(orders: list[Order], now: float) -> list[Order]:
    """The last ``NUM_ORDERS_SHOWN`` orders that are due or were executed, newest first, then
    the next pending ones up to the same number: a long schedule shows what just happened
    and what comes next, not its whole horizon."""
    due = [o for o in orders if o.at <= now or o.state != "pending"][-NUM_ORDERS_SHOWN:]
    upcoming = [o for o in orders if o.at > now and o.state == "pending"]
    return due[::-1] + upcoming[:NUM_ORDERS_SHOWN - len(due)]


def _progress(progress: Progress | None, leader: str | None, instance: str) -> str:
    if progress is None:
        where = f"by the leading controller ({leader})" if leader else "by a leader: none now"
        return _e(f"ETTR and the step rate are measured {where}; open its page for them.")
    rate = "-" if progress.step_rate is None else f"{progress.step_rate:.2f}"
    return (f'ETTR (work) <span class="figure" id="ettr-work">{_ratio(progress.ettr_work)}'
            f'</span> &middot; ETTR (time) <span class="figure" id="ettr-time">'
            f'{_ratio(progress.ettr_time)}</span> &middot; <span class="figure" id="step-rate">'
            f'{_e(rate)}</span> steps/s over the last {progress.window_s / 60:.0f} min<br>'
            f'<span class="muted">work: steps the members committed, against what the spec\'s '
            f'replicas would have at the normal step time; measured by this leader for '
            f'{_e(_seconds(progress.measured_s))}</span>')


def _rows(rows: Iterable[str], columns: int, empty: str) -> str:
    text = "\n".join(rows)
    return text or f'<tr><td class="muted" colspan="{columns}">{_e(empty)}</td></tr>'


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} s"


def _replica_counts(replicas: list[dict[str, Any]], shown: int) -> str:
    counts: dict[str, int] = {}
    for replica in replicas:
        counts[replica["state"]] = counts.get(replica["state"], 0) + 1
    text = f"{len(replicas)} replicas: " + ", ".join(f"{n} {state}"
                                                      for state, n in sorted(counts.items()))
    if shown < len(replicas):
        text += f"; listed: {shown} that are not members"
    return text


def _shown_of(limit: int, total: int) -> str:
    return f"{total}, first {limit} shown" if total > limit else str(total)


def _chaos_counts(orders: list[Order]) -> str:
    counts = {state: sum(o.state == state for o in orders) for state in ("done", "failed",
                                                                          "pending")}
    return ", ".join(f"{n} {state}" for state, n in counts.items())


def _joiner_row(joiner: dict[str, Any]) -> str:
    donor = joiner["donor"]
    donor_text = ("waiting for the leader" if donor is None
                  else "none: full state sync at the epoch" if donor == "" else donor)
    behind = (joiner["donor_step"] - joiner["step"]
              if isinstance(joiner["donor_step"], int) and isinstance(joiner["step"], int)
              else None)
    return (f'<tr data-replica="{_e(joiner["replica"])}"><td>{_e(joiner["replica"])}</td>'
            f'<td>{_e(donor_text)}</td><td class="num">{_e(joiner["step"])}</td>'
            f'<td class="num">{_e(joiner["donor_step"])}</td>'
            f'<td class="num">{_e(behind)}</td>'
            f'<td class="num">{_e(_received(joiner["received"]))}</td></tr>')


def _received(progress: dict[str, Any]) -> str:
    """What a joiner received: the snapshot's share while it arrives, the steps replayed."""
    if not isinstance(progress.get("bytes"), int):
        return "-"
    text = f"{progress['bytes'] / 1e6:,.0f} MB"
    total, got = progress.get("snapshot_bytes"), progress.get("snapshot_received")
    if isinstance(total, int) and isinstance(got, int) and 0 < got < total:
        text += f" (snapshot {100 * got / total:.0f}%)"
    if steps := progress.get("steps_replayed"):
        text += f", {steps} steps replayed"
    return text


def _order_row(order: Order, now: float) -> str:
    when = order.executed_at if order.executed_at is not None else order.at
    relative = f"in {when - now:.0f} s" if when > now else f"{now - when:.0f} s ago"
    target = order.replica or "service"
    if order.action.startswith("host-"):
        target += f" node {order.node}"
    return (f'<tr data-order="{_e(order.id)}"><td>{_e(_clock(when))} ({_e(relative)})</td>'
            f'<td>{_e(order.id)}</td><td>{_e(order.action)}</td><td>{_e(target)}</td>'
            f'<td class="outcome-{_e(order.state)}">{_e(order.state)}</td>'
            f'<td>{_e(order.outcome or "")}</td></tr>')


def _replica_row(replica: dict[str, Any], member: bool, total: int | None) -> str:
    state = _e(replica["state"])
    step = replica["step"] if isinstance(replica["step"], int) else None
    label = f"step {'-' if step is None else step} of {'-' if total is None else total}"
    return (f'<tr data-replica="{_e(replica["id"])}"><td class="{"member" if member else ""}">'
            f'{_e(replica["id"])}</td><td><span class="state state-{state}">{state}</span></td>'
            f'<td class="bar">{svg.bar(step, total, label=label)}</td>'
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
