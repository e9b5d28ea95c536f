"""``ftsystem status J`` and ``ftsystem watch J``: a job as an operator follows it, from the
controller's ``GET /v1/jobs/{job}/status`` (with the job's token).

One view serves both: the epoch and its members, the step rate (with its recent history as a
sparkline) and ETTR, the epochs of the leader's term, each replica's progress bar, and the
recent failures. ``status`` prints it once; ``watch`` redraws it in place every ``--interval``
seconds (``rich.live``), or, where the output is not a terminal, prints one view per refresh.

The step rate, ETTR and the epochs are measured by the leading controller: when the one asked
is a standby, its answer names the leader's address and the view is completed from there.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer
from rich.console import Console, Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ftsystem.cli import _check_id, _fail, app
from ftsystem.control.api_client import ApiError, ControllerClient
from ftsystem.control.jobs_cli import CONTROLLER, TOKEN_FILE, client

BLOCKS = "▁▂▃▄▅▆▇█"
NUM_FAILURES_SHOWN = 5
NUM_EPOCHS_SHOWN = 6


def fetch_status(api: ControllerClient, job: str) -> dict[str, Any]:
    """The job's status; from a standby, completed with the leader's measure when the leader's
    address answers (else ``progress`` stays null and ``progress_note`` says why)."""
    status = api.get(f"/v1/jobs/{job}/status", failures=NUM_FAILURES_SHOWN)
    address = status.get("leader_address")
    if status["progress"] is None and address:
        try:
            with api.at(address) as leader:
                status["progress"] = leader.get(f"/v1/jobs/{job}/status", failures=0)[
                    "progress"]
        except ApiError as e:
            status["progress_note"] = (f"measured by the leader {status['leader']} at "
                                       f"{address}, which this machine does not reach ({e}): "
                                       "point --controller at it")
    return status


def sparkline(values: list[float]) -> str:
    """One block character per value, scaled to the largest (pure)."""
    if not values:
        return ""
    peak = max(values) or 1.0
    return "".join(BLOCKS[min(len(BLOCKS) - 1, int(v / peak * (len(BLOCKS) - 1) + 0.5))]
                   for v in values)


def render(status: dict[str, Any]) -> Group:
    """The view of one ``status`` answer, as rich renderables (pure)."""
    return Group(_header(status), _replicas(status), Text(""), _failures(status))


def _header(status: dict[str, Any]) -> Text:
    epoch, spec = status["epoch"], status["spec"] or {}
    text = Text()
    text.append(f"job {status['job']}", style="bold")
    leader = status["leader"] or "none"
    if status.get("leader_address"):
        leader += f" ({status['leader_address']})"
    text.append(f"  leader {leader}  {_clock(status['time'])} UTC\n", style="dim")
    text.append(f"epoch {epoch['number']}", style="bold")
    text.append(f" ({epoch.get('reason') or '-'})")
    if epoch.get("paused"):
        text.append("  PAUSED", style="bold red")
    text.append(f"  {len(epoch['members'])} of {spec.get('replicas', '?')} replicas: "
                f"{', '.join(epoch['members']) or 'none'}\n")
    progress = status["progress"]
    if progress is None:
        note = status.get("progress_note") or "measured by the leading controller: none leads"
        text.append(f"step rate, ETTR: {note}\n", style="dim")
        return text
    rate = progress["step_rate"]
    text.append("step rate ")
    text.append("-" if rate is None else f"{rate:.2f}", style="bold")
    text.append(f" steps/s over {progress['window_s'] / 60:.0f} min  ")
    text.append(sparkline([p["steps_per_s"] for p in progress["rates"]]), style="blue")
    text.append(f"  ETTR work {_ratio(progress['ettr_work'])}, time "
                f"{_ratio(progress['ettr_time'])}\n")
    epochs = progress["epochs"][-NUM_EPOCHS_SHOWN:]
    if epochs:
        text.append("epochs: " + "  ".join(
            f"{e['number']} {e['reason'] or '-'} {e['num_members']}"
            f"{' PAUSED' if e['paused'] else ''} ({_ago(status['time'], e['time'])})"
            for e in epochs) + "\n", style="dim")
    return text


def _replicas(status: dict[str, Any]) -> Table:
    replicas = status["replicas"]
    spec = status["spec"] or {}
    steps = [r["step"] for r in replicas if isinstance(r["step"], int)]
    total = spec.get("num_steps") if isinstance(spec.get("num_steps"), int) else max(
        steps, default=0)
    members = set(status["epoch"]["members"])
    table = Table(title=f"replicas ({len(replicas)})", title_justify="left", box=None,
                  pad_edge=False)
    for column in ("id", "state", "progress", "step", "gen", "restarts", "host"):
        table.add_column(column, justify="right" if column in ("step", "gen", "restarts")
                         else "left")
    for r in replicas:
        step = r["step"] if isinstance(r["step"], int) else 0
        table.add_row(Text(r["id"], style="bold" if r["id"] in members else ""), r["state"],
                      ProgressBar(total=max(total, 1), completed=min(step, total or 1),
                                  width=30, complete_style="blue", finished_style="green"),
                      f"{_dash(r['step'])}/{total}" if total else _dash(r["step"]),
                      _dash(r["generation"]), str(r["restarts"]), _dash(r["host"]))
    return table


def _failures(status: dict[str, Any]) -> Table | Text:
    failures = status["failures"]
    if not failures:
        return Text("failures: none", style="dim")
    table = Table(title=f"recent failures ({len(failures)} of {status['num_failures']}, "
                  "newest first)", title_justify="left", box=None, pad_edge=False)
    for column in ("time (UTC)", "replica", "gen", "step", "reason"):
        table.add_column(column)
    for f in failures:
        table.add_row(f"{_clock(f['time'])} ({_ago(status['time'], f['time'])})",
                      f["replica"], _dash(f["generation"]), _dash(f.get("step")),
                      _dash(f.get("reason")))
    return table


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t))


def _ago(now: float, t: float) -> str:
    return f"{max(0.0, now - t):.0f} s ago"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _fetch(api: ControllerClient, job: str) -> dict[str, Any]:
    try:
        return fetch_status(api, job)
    except ApiError as e:
        raise _fail(str(e))


@app.command()
def status(job: str = typer.Argument(..., help="job id"), controller: str = CONTROLLER,
           token_file: Optional[Path] = TOKEN_FILE,
           json_out: bool = typer.Option(False, "--json", help="print the API's answer (JSON)")
           ) -> None:
    """One snapshot of a job: epoch and members, step rate, ETTR, each replica's progress,
    recent failures."""
    _check_id("job", job)
    with client(controller, token_file) as api:
        found = _fetch(api, job)
    if json_out:
        typer.echo(json.dumps(found, indent=2))
    else:
        Console().print(render(found))


@app.command()
def watch(job: str = typer.Argument(..., help="job id"), controller: str = CONTROLLER,
          token_file: Optional[Path] = TOKEN_FILE,
          interval: float = typer.Option(1.0, min=0.1, help="seconds between refreshes"),
          iterations: int = typer.Option(0, min=0, help="stop after this many views (0: until "
                                         "Ctrl-C)")) -> None:
    """A live view of a job, refreshed every --interval: what `ftsystem status` shows. While
    the controller does not answer, the last view stays, with a note."""
    _check_id("job", job)
    with client(controller, token_file) as api, _screen(Console()) as show:
        try:
            for count, view in enumerate(views(api, job), start=1):
                show(view)
                if count == iterations:
                    return
                time.sleep(interval)
        except ApiError as e:
            raise _fail(str(e))
        except KeyboardInterrupt:
            return


def views(api: ControllerClient, job: str) -> Iterator[RenderableType]:
    """The job's view at each step of the iteration; once one was made, a request that fails
    yields the last one with a note instead (the first failure raises ``ApiError``)."""
    last = None
    while True:
        try:
            last = render(fetch_status(api, job))
            yield last
        except ApiError as e:
            if last is None:
                raise
            yield Group(last, Text(f"not updating ({e}); showing the last view",
                                   style="bold red"))


@contextmanager
def _screen(console: Console) -> Iterator[Callable[[RenderableType], None]]:
    """Where views go: redrawn in place on a terminal, else printed one after the other."""
    if not console.is_terminal:
        def show(view: RenderableType) -> None:
            console.print(view)
            console.rule(style="dim")
        yield show
        return
    from rich.live import Live
    with Live(console=console, auto_refresh=False) as live:
        yield lambda view: live.update(view, refresh=True)
