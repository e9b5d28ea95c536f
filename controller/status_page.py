"""The controller's live status page, ``GET /``: one self-contained HTML page (no external assets).

The page is rendered here, from one etcd read and what the leading term measures (live ETTR
and the step rate, ``LiveEttr``), with every value escaped; a small inline script re-fetches the
page every second and swaps in its ``#live`` part, so there is a single renderer and the page
also works without JavaScript. ``render_page`` is pure: the route gathers, it renders.

At thousands of replicas the page stays short: past ``MAX_REPLICA_ROWS`` the table lists only
the replicas that are not members (a count per state says the rest), and the joiners, failures
and chaos orders are capped, newest first.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from html import escape
from string import Template
from typing import Any, Iterable

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from controller.leader import LeaderConfig, LiveTerm
from ftsystem.chaos.spec import Order, read_orders
from ftsystem.control import keys
from ftsystem.control.store import Store
from ftsystem.measure.ettr import LiveEttr

NUM_FAILURES_SHOWN = 20
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
.figure { font-size: 1.3em; font-weight: 600; font-variant-numeric: tabular-nums }
.outcome-done { color: #1b6e33 } .outcome-failed { color: #b3261e }
</style></head>
<body data-refreshes="0">
<p id="stale" hidden></p>
<div id="live">
<h1>job <span id="job">$job</span></h1>
<p class="muted">controller $instance &middot; leader $leader &middot; rendered $now UTC</p>
<h2>epoch <span id="epoch">$epoch</span> $paused</h2>
<p>members: <span id="members">$members</span><br><span class="muted">$epoch_info</span></p>
<h2>progress</h2>
<p id="progress">$progress</p>
<h2>replicas</h2>
<p class="muted" id="replica-counts">$replica_counts</p>
<table id="replicas"><tr><th>id</th><th>state</th><th>step</th><th>generation</th>
<th>restarts</th><th>host</th></tr>
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
$orders</table>
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


@dataclass(frozen=True, slots=True)
class Progress:
    """What the leading term measured from the replicas' step reports (``LiveEttr``)."""

    ettr_work: float | None
    ettr_time: float | None
    step_rate: float | None
    """Job steps per second over the last ``window_s``."""
    window_s: float
    measured_s: float | None
    """How long the term has measured (it starts over with each new leader)."""

    @classmethod
    def of(cls, live: LiveEttr, now: float) -> "Progress":
        values = live.values(now)
        return cls(ettr_work=values["ettr_work"], ettr_time=values["ettr_time"],
                   step_rate=live.step_rate(now), window_s=live.rate_window_s,
                   measured_s=live.measured_s)


def status_router(store: Store, cfg: LeaderConfig, term: LiveTerm | None = None) -> APIRouter:
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse, summary="Live status page (HTML)")
    async def status_page() -> str:
        items, _ = await store.get_prefix(keys.job(cfg.job) + "/")
        now = time.time()
        live = term.ettr if term is not None else None
        return render_page(cfg.job, items, instance=cfg.instance_id, now=now,
                           progress=Progress.of(live, now) if live is not None else None)

    return router


def render_page(job: str, items: dict[str, bytes], *, instance: str, now: float,
                progress: Progress | None = None) -> str:
    """Pure: the status page of ``job`` from its etcd keys and, on the leading controller,
    what its term measures (``progress``; None elsewhere)."""
    from controller.app import build_job_view  # not at the top: app.py imports this module
    view = build_job_view(job, items)
    epoch, spec = view["epoch"], view["spec"] or {}
    members = set(epoch["members"])
    failures = recent_failures(job, items)
    joiners = catching_up(job, items)
    orders = chaos_orders(job, items)
    shown = view["replicas"]
    if len(shown) > MAX_REPLICA_ROWS:
        shown = [r for r in shown if r["state"] != "member"][:MAX_REPLICA_ROWS]
    return PAGE.substitute(
        job=_e(job), instance=_e(instance), leader=_e(view["leader"] or "none"),
        now=_e(_clock(now)), epoch=_e(epoch["number"]),
        paused='<span class="paused">PAUSED</span>' if epoch.get("paused") else "",
        members=_e(", ".join(epoch["members"]) or "none"),
        epoch_info=_e(f"reason {epoch.get('reason') or '-'}; spec: {spec.get('replicas', '?')} "
                      f"replicas, min {spec.get('min_replicas', '?')}, "
                      f"{spec.get('num_steps', '?')} steps"),
        progress=_progress(progress, view["leader"], instance),
        replica_counts=_e(_replica_counts(view["replicas"], len(shown))),
        replicas="\n".join(_replica_row(r, r["id"] in members) for r in shown),
        num_joiners=_e(_shown_of(NUM_JOINERS_SHOWN, len(joiners))),
        joiners=_rows(map(_joiner_row, joiners[:NUM_JOINERS_SHOWN]), 6, "none"),
        num_failures=_e(len(failures)),
        failures="\n".join(_failure_row(f, now) for f in failures[:NUM_FAILURES_SHOWN]),
        chaos_counts=_e(_chaos_counts(orders)),
        orders=_rows((_order_row(o, now) for o in recent_orders(orders, now)), 6, "none"))


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


def catching_up(job: str, items: dict[str, bytes]) -> list[dict[str, Any]]:
    """Pure: each replica in state ``catching_up``, with the donor the leader assigned it
    (``catchup/<rid>``: absent while none is assigned, empty when there is none to give and
    it joins with a full state sync), that donor's step, and how far the joiner is (its step
    as it replays, what it received: the joiner reports them at most every half second)."""
    registrations = {k[len(keys.replicas(job)):]: json.loads(v) for k, v in items.items()
                     if k.startswith(keys.replicas(job))}
    joiners = []
    for rid, reg in sorted(registrations.items()):
        if reg.get("state") != "catching_up":
            continue
        raw = items.get(keys.catchups(job) + rid)
        donor = json.loads(raw).get("donor") if raw else None
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
