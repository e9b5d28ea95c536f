"""``ftsystem sim ettr``: ETTR of sync, FT-HSDP and ftsystem from 1K to 200K GPUs.

Reads ftsystem's measured recovery costs from its benchmark JSON files, runs the discrete-event
simulation of ``ftsystem.sim.ettr`` over the sweep of scales, prints a table, writes JSON and
optionally a PNG. See docs/ettr_simulation.md.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from ftsystem.cli import sim_app
from ftsystem.report import machine, print_table, write_json
from ftsystem.sim import ettr

DEFAULT_FAILOVER_JSON = Path("bench/results/failover.json")
DEFAULT_REJOIN_JSON = Path("bench/results/rejoin.json")

ASSUMED_COSTS = {
    "stall_s": (5.0, "assumed (no failover benchmark): lease-bound detection plus one "
                     "reconfiguration"),
    "join_stall_s": (1.0, "assumed (no rejoin benchmark): one reconfiguration"),
    "catchup_s": (60.0, "assumed (no rejoin benchmark): snapshot transfer and log replay"),
}
"""ftsystem's costs when its benchmarks have not been run: (seconds, why this value)."""

LABELS = {"sync": "sync restart-all", "fthsdp": "FT-HSDP (paper)", "ftsystem": "ftsystem"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision:
    """How much virtual time the simulation covers."""

    failures: int
    """Failures per simulated run (the horizon is this many MTTFs)."""
    seeds: int
    """Independent runs per scale; the report gives their mean."""


FULL = Precision(failures=10_000, seeds=4)
QUICK = Precision(failures=2_000, seeds=2)

FailureModel = enum.Enum("FailureModel", {name: name for name in ettr.FAILURE_MODELS}, type=str)


def _read_json(path: Path, option: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint=option)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"{path} is not valid JSON ({exc})", param_hint=option)


def _field(data: Any, keys: tuple[str, ...], path: Path, option: str) -> Any:
    """``data[k0][k1]...``, or a message naming the missing key and the file."""
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            raise typer.BadParameter(f"{path} has no {'.'.join(keys)}; see "
                                     "docs/ettr_simulation.md for the expected shape",
                                     param_hint=option)
        data = data[key]
    return data


def _non_negative(value: Any, what: str, path: Path, option: str) -> float:
    """A number read from a benchmark file (seconds, parameters): finite and not negative."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise typer.BadParameter(f"{what} in {path} must be a non-negative number, got {value!r}",
                                 param_hint=option)
    return float(value)


def _benchmark_file(given: Path | None, default: Path) -> Path | None:
    """The file to read: the one given (an error later if unreadable), else the default if it
    exists, else None (costs assumed)."""
    if given is not None:
        return given
    return default if default.is_file() else None


def _failover_costs(path: Path) -> dict[str, tuple[float, str]]:
    option = "--failover-json"
    data = _read_json(path, option)
    stall = _field(data, ("ftsystem", "stall_s"), path, option)
    median = _non_negative(_field(stall, ("median",), path, option), "ftsystem.stall_s.median",
                      path, option)
    count = data["ftsystem"].get("failures", "?")
    return {"stall_s": (median, f"measured: {path}, ftsystem.stall_s.median over {count} "
                                f"failures (max {stall.get('max', '?')} s)")}


def _rejoin_costs(path: Path) -> dict[str, tuple[float, str]]:
    """Costs at the largest model size in the rejoin benchmark (closest to a real job)."""
    option = "--rejoin-json"
    sizes = _field(_read_json(path, option), ("sizes",), path, option)
    if not isinstance(sizes, list) or not sizes:
        raise typer.BadParameter(f"{path}: sizes must be a non-empty list", param_hint=option)
    params = [_non_negative(_field(size, ("params",), path, option), "params", path, option)
              for size in sizes]
    largest = sizes[params.index(max(params))]
    where = f"measured: {path}, ftsystem at {max(params):,.0f} params"

    def cost(key: str) -> tuple[float, str]:
        value = _field(largest, ("ftsystem", key), path, option)
        return _non_negative(value, f"ftsystem.{key}", path, option), f"{where}, {key}"

    return {"join_stall_s": cost("join_stall_s"), "catchup_s": cost("time_to_join_s")}


def ftsystem_costs(failover: Path | None, rejoin: Path | None) -> dict[str, tuple[float, str]]:
    """ftsystem's recovery costs as {name: (seconds, source)}: measured where a benchmark file is
    given, assumed (and labelled so) where not."""
    costs = dict(ASSUMED_COSTS)
    if failover is not None:
        costs.update(_failover_costs(failover))
    if rejoin is not None:
        costs.update(_rejoin_costs(rejoin))
    return costs


def _ftsystem_assumptions(costs: dict[str, tuple[float, str]]) -> dict:
    return {
        **{name: {"value_s": value, "source": source} for name, (value, source) in costs.items()},
        "measured": [name for name, (_, source) in costs.items() if source.startswith("measured")],
        "assumed": [name for name, (_, source) in costs.items() if source.startswith("assumed")],
        "relaunch_s": ettr.RELAUNCH_S, "replica_gpus": ettr.REPLICA_GPUS,
        "relaunch_and_replicas_source": "assumed: same as FT-HSDP, so only ftsystem's own costs "
                                        "differ",
    }


def _plot(path: Path, rows: list[dict]) -> None:
    """ETTR (work-based) against GPUs, log x-axis, with the paper's two figures as crosses."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    gpus = [row["gpus"] for row in rows]
    for name, label in LABELS.items():
        ax.plot(gpus, [row[name] for row in rows], marker="o", label=label)
    ax.scatter([ettr.PAPER_GPUS] * len(ettr.PAPER_ETTR), list(ettr.PAPER_ETTR.values()),
               marker="x", s=80, color="black", zorder=3, label="paper, O(100K) GPUs")
    ax.set_xscale("log")
    ticks = [g for g in gpus if g != ettr.PAPER_GPUS]  # its label would collide with 128K
    ax.set_xticks(ticks, [f"{g // 1024}K" for g in ticks])
    ax.minorticks_off()
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ETTR (work-based)")
    ax.set_title("Effective training time ratio under published failure rates")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _print(report: dict) -> None:
    print_table("ETTR by scale: work-based (time-based)",
                ["GPUs", "MTTF min", *LABELS.values()],
                [[row["gpus"], row["mttf_min"],
                  *(f"{row[n]:.3f} ({row['time_based'][n]:.3f})" for n in LABELS)]
                 for row in report["scales"]])
    if "paper" in report:
        paper = report["paper"]
        print_table(f"Paper reproduction at {paper['gpus']:,} GPUs",
                    ["model", "paper", "simulated", "time-based", "within 3 points"],
                    [[LABELS[n], published, paper[n], paper["time_based"][n],
                      abs(paper[n] - published) <= ettr.PAPER_TOLERANCE]
                     for n, published in ettr.PAPER_ETTR.items()])
    costs = report["assumptions"]["ftsystem"]
    Console().print(f"ftsystem at {ettr.PAPER_GPUS:,} GPUs: ETTR "
                    f"{report['ftsystem']['ettr_100k']:.3f} (work-based); costs measured: "
                    f"{', '.join(costs['measured']) or 'none'}; assumed: "
                    f"{', '.join(costs['assumed']) or 'none'}")


@sim_app.command("ettr")
def ettr_command(
    reproduce_paper: Annotated[bool, typer.Option(
        "--reproduce-paper", help="First check the FT-HSDP paper's 44% (sync) and 80% (FT-HSDP) "
                                  "at O(100K) GPUs; exit 1 if not within 3 points.")] = False,
    json_path: Annotated[Optional[Path], typer.Option(
        "--json", dir_okay=False, help="Write the report here.")] = None,
    png: Annotated[Optional[Path], typer.Option(
        "--png", dir_okay=False, help="Draw ETTR against scale here.")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="Fewer seeds and less virtual time (noisier, seconds).")] = False,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Base random seed.")] = 0,
    failover_json: Annotated[Optional[Path], typer.Option(
        "--failover-json", dir_okay=False,
        help=f"ftsystem failover benchmark (default: {DEFAULT_FAILOVER_JSON}, if it exists)")] = None,
    rejoin_json: Annotated[Optional[Path], typer.Option(
        "--rejoin-json", dir_okay=False,
        help=f"ftsystem rejoin benchmark (default: {DEFAULT_REJOIN_JSON}, if it exists)")] = None,
    failure_model: Annotated[FailureModel, typer.Option(
        "--failure-model", help="Published failure statistics to scale from.")
    ] = FailureModel("kokolis"),
) -> None:
    """Simulate ETTR of sync restart-all, FT-HSDP and ftsystem from 1K to 200K GPUs."""
    costs = ftsystem_costs(_benchmark_file(failover_json, DEFAULT_FAILOVER_JSON),
                           _benchmark_file(rejoin_json, DEFAULT_REJOIN_JSON))
    ftsystem = ettr.ftsystem_recovery(**{name: value for name, (value, _) in costs.items()})
    precision = QUICK if quick else FULL
    model = FailureModel(failure_model).value
    rows = [ettr.ettr_at_scale(gpus, ftsystem, failure_model=model, failures=precision.failures,
                               seeds=precision.seeds, seed=seed)
            for gpus in ettr.SCALES]
    at_paper_scale = next(row for row in rows if row["gpus"] == ettr.PAPER_GPUS)
    report: dict = {}
    if reproduce_paper:
        report["paper"] = {"gpus": ettr.PAPER_GPUS,
                           **{n: at_paper_scale[n] for n in ettr.PAPER_ETTR},
                           "time_based": {n: at_paper_scale["time_based"][n]
                                          for n in ettr.PAPER_ETTR},
                           "published": ettr.PAPER_ETTR,
                           "reproduced": ettr.paper_reproduced(at_paper_scale)}
    report["ftsystem"] = {"gpus": ettr.PAPER_GPUS, "ettr_100k": at_paper_scale["ftsystem"],
                          "ettr_time_100k": at_paper_scale["time_based"]["ftsystem"]}
    report["assumptions"] = {**ettr.model_assumptions(model),
                             "ftsystem": _ftsystem_assumptions(costs),
                             "simulation": {"failures_per_run": precision.failures,
                                            "seeds": precision.seeds, "seed": seed,
                                            "quick": quick}}
    report["scales"] = rows
    report["machine"] = machine()
    _print(report)
    write_json(json_path, report)
    if png is not None:
        _plot(png, rows)
    if reproduce_paper and not report["paper"]["reproduced"]:
        Console(stderr=True).print("[red]The simulation does not reproduce the paper's figures "
                                   "within 3 points: its predictions are not to be trusted.[/red]")
        raise typer.Exit(1)
