"""``ftsystem sim ettr``: ETTR of sync, FT-HSDP and ftsystem from 1K to 200K GPUs.

Reads the benchmark files that hold ftsystem's inputs at scale (the survivors' stall after a host
dies, the controller's decision at 16,384 node agents, a replica's time to join and the join
stall), builds ftsystem's recovery at each scale from them and from published, modelled and
assumed inputs (``ftsystem.sim.scale_inputs``), runs the discrete-event simulation of
``ftsystem.sim.ettr`` over the sweep of scales and, at 98K GPUs, against each input (ranked by how
far it moves the result); prints tables, writes JSON and optionally a PNG. See
docs/ettr_simulation.md.
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
from ftsystem.measure.report import machine, print_table, write_json
from ftsystem.sim import ettr
from ftsystem.sim import scale_inputs as si

DEFAULT_HOST_FAILOVER_JSON = Path("bench/results/failover_host.json")
DEFAULT_CONTROLLER_JSON = Path("bench/results/controller_nodes.json")
DEFAULT_REJOIN_JSON = Path("bench/results/rejoin.json")

LABELS = {"sync": "sync restart-all", "fthsdp": "FT-HSDP (paper)", "ftsystem": "ftsystem"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision:
    """How much virtual time the simulation covers."""

    failures: int
    """Failures per simulated run (the horizon is this many MTTFs)."""
    seeds: int
    """Independent runs per scale; the report gives their mean."""
    sensitivity_failures: int
    """Failures per run at each point of the sensitivity table."""
    sensitivity_seeds: int
    """Runs per point of the sensitivity table."""


FULL = Precision(failures=10_000, seeds=4, sensitivity_failures=10_000, sensitivity_seeds=4)
QUICK = Precision(failures=2_000, seeds=2, sensitivity_failures=400, sensitivity_seeds=1)

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


def _spread(value: Any, what: str, path: Path, option: str) -> si.Spread:
    """A figure read from a benchmark file: a number, or one of several rounds
    ({"median": x, "min": .., "max": ..}; a missing extreme is the median)."""
    if not isinstance(value, dict):
        one = _non_negative(value, what, path, option)
        return si.Spread(median=one, low=one, high=one)
    median = _non_negative(value, what, path, option)
    low, high = (_non_negative(value.get(k, median), f"{what}.{k}", path, option)
                 for k in ("min", "max"))
    return si.Spread(median=median, low=min(low, median), high=max(high, median))


def _non_negative(value: Any, what: str, path: Path, option: str) -> float:
    """A number read from a benchmark file (seconds, parameters): finite and not negative. A
    figure from several rounds ({"median": x, ...}) gives its median."""
    if isinstance(value, dict) and "median" in value:
        value = value["median"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise typer.BadParameter(f"{what} in {path} must be a non-negative number, got {value!r}",
                                 param_hint=option)
    return float(value)


def _benchmark_file(given: Path | None, default: Path) -> Path | None:
    """The file to read: the one given (an error later if unreadable), else the default if it
    exists, else None (the input falls back to an assumption)."""
    if given is not None:
        return given
    return default if default.is_file() else None


def _host_stalls(path: Path) -> tuple[dict[int, dict[str, float]], str, float]:
    """({nodes per replica: {"median", "max"}}, source, the timeout it ran at) from
    ``bench failover --scenario host``: the main layout and every one under ``layouts``."""
    option = "--host-failover-json"
    data = _read_json(path, option)
    others = data.get("layouts", {}) if isinstance(data, dict) else {}
    if not isinstance(others, dict):
        raise typer.BadParameter(f"{path}: layouts must map a layout to its results",
                                 param_hint=option)
    entries = [data, *others.values()]
    layouts, failures = {}, 0
    for entry in entries:
        stall = _field(entry, ("ftsystem", "stall_s"), path, option)
        nodes = entry["ftsystem"].get("nodes_per_replica", entry.get("nodes_per_replica", 1))
        layouts[int(nodes)] = {k: _non_negative(_field(stall, (k,), path, option),
                                                f"ftsystem.stall_s.{k}", path, option)
                               for k in ("median", "max")}
        failures += int(entry["ftsystem"].get("failures", 0))
    timeout_s = data.get("setup", {}).get("ftsystem_timeout_s", si.DEFAULT_TIMEOUT_S)
    return (layouts, f"{path}, ftsystem.stall_s over {failures} host kills from the fault's "
                     f"instant at --timeout {timeout_s:g}", float(timeout_s))


def _decision(path: Path) -> tuple[float, float, int, str]:
    """(p50, p99, node agents, source) of the slower kind of decision in
    ``bench controller --nodes``."""
    option = "--controller-json"
    data = _read_json(path, option)
    nodes = int(_non_negative(_field(data, ("config", "nodes"), path, option), "config.nodes",
                              path, option))
    kinds = _field(data, ("decision_latency_s",), path, option)
    if not isinstance(kinds, dict) or not kinds:
        raise typer.BadParameter(f"{path}: decision_latency_s must name at least one kind",
                                 param_hint=option)
    p99 = {k: _non_negative(_field(v, ("p99",), path, option), f"decision_latency_s.{k}.p99",
                            path, option) for k, v in kinds.items()}
    slow = max(p99, key=p99.get)
    p50 = _non_negative(_field(kinds[slow], ("p50",), path, option),
                        f"decision_latency_s.{slow}.p50", path, option)
    return p50, p99[slow], nodes, (f"{path}, decision_latency_s.{slow}.p99 at {nodes:,} node "
                                   f"agents (p50 {p50 * 1e3:.0f} ms)")


@dataclass(frozen=True, kw_only=True, slots=True)
class Rejoin:
    """What ``bench rejoin`` says of ftsystem at its largest model."""

    time_to_join: si.Spread
    join_stall: si.Spread
    join_step_stall: float | None
    """The members' stall at the joiner's first step alone (``join_step_stall_s``), if given."""
    source: str


def _rejoin(path: Path) -> Rejoin:
    """ftsystem's figures at the largest model size in ``bench rejoin`` (closest to a real job;
    ``ftsystem`` is the joiner with the warm-up step, the default on the GPUs simulated):
    ``sizes[i].ftsystem.time_to_join_s`` and ``.join_stall_s`` (each a number or a figure of
    several rounds), and ``.join_step_stall_s`` if present."""
    option = "--rejoin-json"
    data = _read_json(path, option)
    sizes = _field(data, ("sizes",), path, option)
    if not isinstance(sizes, list) or not sizes:
        raise typer.BadParameter(f"{path}: sizes must be a non-empty list", param_hint=option)
    params = [_non_negative(_field(size, ("params",), path, option), "params", path, option)
              for size in sizes]
    largest = sizes[params.index(max(params))]
    joined, stalled = (_spread(_field(largest, ("ftsystem", key), path, option),
                               f"ftsystem.{key}", path, option)
                       for key in ("time_to_join_s", "join_stall_s"))
    at_step = largest["ftsystem"].get("join_step_stall_s")
    if at_step is not None:
        at_step = _spread(at_step, "ftsystem.join_step_stall_s", path, option).median
    rounds = data.get("rounds") if isinstance(data, dict) else None
    over = f", median of {rounds} rounds" if isinstance(rounds, int) else ""
    return Rejoin(time_to_join=joined, join_stall=stalled, join_step_stall=at_step,
                  source=f"{path}, ftsystem at {max(params):,.0f} params{over}")


def read_evidence(host_failover: Path | None, controller: Path | None,
                  rejoin: Path | None) -> si.Evidence:
    """The inputs the benchmark files hold; an input whose file is None is assumed, and says so."""
    timeout_s, layouts, host_source = si.DEFAULT_TIMEOUT_S, None, ""
    if host_failover is not None:
        layouts, host_source, timeout_s = _host_stalls(host_failover)
    p50 = p99 = None
    nodes, decision_source = None, ""
    if controller is not None:
        p50, p99, nodes, decision_source = _decision(controller)
    joined = None if rejoin is None else _rejoin(rejoin)
    source = "" if joined is None else joined.source
    return si.Evidence(
        host_stall=si.host_stall_input(layouts, host_source, timeout_s=timeout_s),
        decision=si.decision_input(p50, p99, decision_source), decision_nodes=nodes,
        time_to_join=si.time_to_join_input(
            None if joined is None else joined.time_to_join,
            f"{source}, time_to_join_s (process start to first commit)"),
        join_stall=si.join_stall_input(
            None if joined is None else joined.join_stall,
            f"{source}, join_stall_s (the members' stall from the joiner's launch to its first "
            "computed step)",
            at_join_step=None if joined is None else joined.join_step_stall))


FORMULA = ("stall = (1 - hang_fraction) x host_stall + hang_fraction x straggler_bound(step) + "
           "decision + nccl_reinit + rendezvous(survivors' ranks); relaunch = host_wait + "
           "replica_nccl_init (shared with FT-HSDP); catch-up = time_to_join; join stall = "
           "join_stall + decision + nccl_reinit + rendezvous(all ranks); rendezvous(n ranks, m "
           "members) = n x (2 x store_connect + (3 + m - 1) x store_request); throughput = 1 - "
           "2 x vote / (step + 2 x vote), vote = 2 x (replica ranks - 1) x vote_hop")


def _input_entry(part: si.Input) -> dict:
    return {"value": part.value, "unit": part.unit, "kind": part.kind, "source": part.source,
            "range": list(part.range()), "sweep": list(part.points())}


def _inputs_report(parts: dict[str, si.Input], gpus: int) -> dict:
    recovery = si.recovery(parts, gpus)
    return {
        "gpus": gpus,
        "inputs": {name: _input_entry(p) for name, p in parts.items()},
        "by_kind": {kind: [n for n, p in parts.items() if p.kind == kind] for kind in si.KINDS},
        "recovery": {"stall_s": recovery.stall_s, "relaunch_s": recovery.relaunch_s,
                     "catchup_s": recovery.catchup_s, "join_stall_s": recovery.join_stall_s,
                     "replica_gpus": recovery.replica_gpus, "throughput": recovery.throughput},
        "terms": si.terms(parts, gpus),
        "formula": FORMULA,
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
    inputs = report["assumptions"]["inputs"]
    print_table(f"Every input at {ettr.PAPER_GPUS:,} GPUs (sources below)",
                ["input", "used by", "value", "unit", "kind", "range"],
                [[name, ", ".join(i["used_by"]), i["value"], i["unit"], i["kind"],
                  f"{i['range'][0]:.3g}..{i['range'][1]:.3g}"]
                 for name, i in inputs.items()])
    console = Console()
    console.print("Sources:", highlight=False)
    for name, i in inputs.items():
        console.print(f"  {name}: {i['source']}", highlight=False, markup=False)
    sens = report.get("sensitivity", {"gpus": ettr.PAPER_GPUS, "rows": []})
    if sens["rows"]:
        print_table(f"Sensitivity at {sens['gpus']:,} GPUs: ftsystem ETTR (work-based) against "
                    "each input, the others at base, largest swing first",
                    ["input", "kind", "base", "swing", "value -> ETTR"],
                    [[row["input"], row["kind"], f"{row['base']:.3g} {row['unit']}",
                      f"{row['swing'] * 100:.1f} pts",
                      "  ".join(f"{p['value']:.3g}->{p['work']:.3f}" for p in row["points"])]
                     for row in sens["rows"]])
    fts = report["ftsystem"]
    Console().print(f"ftsystem at {fts['gpus']:,} GPUs: ETTR {fts['ettr_100k']:.3f} work-based "
                    f"(seeds {fts['seeds_min']:.3f}..{fts['seeds_max']:.3f}), "
                    f"{fts['ettr_time_100k']:.3f} time-based; inputs assumed because a "
                    f"benchmark file is missing: "
                    f"{', '.join(report['assumptions']['ftsystem']['missing']) or 'none'}")


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
    host_failover_json: Annotated[Optional[Path], typer.Option(
        "--host-failover-json", dir_okay=False,
        help=f"bench failover --scenario host (default: {DEFAULT_HOST_FAILOVER_JSON}, if it "
             "exists)")] = None,
    controller_json: Annotated[Optional[Path], typer.Option(
        "--controller-json", dir_okay=False,
        help=f"bench controller --nodes (default: {DEFAULT_CONTROLLER_JSON}, if it exists)")
    ] = None,
    rejoin_json: Annotated[Optional[Path], typer.Option(
        "--rejoin-json", dir_okay=False,
        help=f"bench rejoin (default: {DEFAULT_REJOIN_JSON}, if it exists)")] = None,
    failure_model: Annotated[FailureModel, typer.Option(
        "--failure-model", help="Published failure statistics to scale from.")
    ] = FailureModel("kokolis"),
    sensitivity: Annotated[bool, typer.Option(
        "--sensitivity/--no-sensitivity",
        help="ETTR at 98K GPUs against each of ftsystem's inputs (about half the run time).")
    ] = True,
) -> None:
    """Simulate ETTR of sync restart-all, FT-HSDP and ftsystem from 1K to 200K GPUs."""
    files = {option: _benchmark_file(given, default) for option, given, default in (
        ("--host-failover-json", host_failover_json, DEFAULT_HOST_FAILOVER_JSON),
        ("--controller-json", controller_json, DEFAULT_CONTROLLER_JSON),
        ("--rejoin-json", rejoin_json, DEFAULT_REJOIN_JSON))}
    evidence = read_evidence(*files.values())
    precision = QUICK if quick else FULL
    model = FailureModel(failure_model).value
    budget = {"failure_model": model, "failures": precision.failures, "seeds": precision.seeds,
              "seed": seed}

    def ftsystem_at(gpus: int) -> ettr.ReplicaRecovery:
        return si.recovery(si.components(evidence, gpus), gpus)

    def fthsdp_at(gpus: int) -> ettr.ReplicaRecovery:
        return si.fthsdp_recovery(si.components(evidence, gpus), gpus)

    rows = [ettr.ettr_at_scale(gpus, ftsystem_at, fthsdp_at, **budget) for gpus in ettr.SCALES]
    for row in rows:
        recovery = ftsystem_at(row["gpus"])
        row["ftsystem_recovery_s"] = {"stall": recovery.stall_s, "relaunch": recovery.relaunch_s,
                                      "catchup": recovery.catchup_s,
                                      "join_stall": recovery.join_stall_s}
        row["ftsystem_throughput"] = recovery.throughput
        row["fthsdp_relaunch_s"] = fthsdp_at(row["gpus"]).relaunch_s
    at_paper_scale = next(row for row in rows if row["gpus"] == ettr.PAPER_GPUS)
    parts = si.components(evidence, ettr.PAPER_GPUS)
    report: dict = {}
    if reproduce_paper:
        report["paper"] = {"gpus": ettr.PAPER_GPUS,
                           **{n: at_paper_scale[n] for n in ettr.PAPER_ETTR},
                           "time_based": {n: at_paper_scale["time_based"][n]
                                          for n in ettr.PAPER_ETTR},
                           "published": ettr.PAPER_ETTR,
                           "reproduced": ettr.paper_reproduced(at_paper_scale)}
    report["ftsystem"] = {"gpus": ettr.PAPER_GPUS, "ettr_100k": at_paper_scale["ftsystem"],
                          "ettr_time_100k": at_paper_scale["time_based"]["ftsystem"],
                          "seeds_sd": at_paper_scale["sd"]["ftsystem"],
                          "seeds_min": at_paper_scale["range"]["ftsystem"][0],
                          "seeds_max": at_paper_scale["range"]["ftsystem"][1]}
    if sensitivity:
        report["sensitivity"] = {
            "gpus": ettr.PAPER_GPUS, "ettr": "work-based in 'work', time-based in 'time'",
            "failures_per_run": precision.sensitivity_failures,
            "seeds": precision.sensitivity_seeds,
            "ranking": "rows sorted by swing: the largest minus the smallest work-based ETTR "
                       "over the input's sweep",
            "rows": si.sensitivity(parts, ettr.PAPER_GPUS, lambda recovery: {
                k: v for k, v in ettr.mean_ettr(
                    recovery, ettr.PAPER_GPUS, failure_model=model, seed=seed,
                    failures=precision.sensitivity_failures,
                    seeds=precision.sensitivity_seeds).items() if k in ("work", "time")})}
    shared = ("host_wait_s", "replica_nccl_init_s")
    every = {name: {**_input_entry(p), "used_by": ["sync", "fthsdp", "ftsystem"]}
             for name, p in si.baseline_inputs(model).items()}
    for name in ("sync_restart_s", "checkpoint_write_s", "checkpoint_interval_s"):
        every[name]["used_by"] = ["sync"]
    for name in ("fthsdp_stall_s", "fthsdp_catchup_s"):
        every[name]["used_by"] = ["fthsdp"]
    every["replica_gpus"]["used_by"] = ["fthsdp", "ftsystem"]
    every.update({name: {**_input_entry(p),
                         "used_by": ["fthsdp", "ftsystem"] if name in shared else ["ftsystem"]}
                  for name, p in parts.items()})
    report["assumptions"] = {**ettr.model_assumptions(model,
                                                      si.fthsdp_recovery(parts, ettr.PAPER_GPUS)),
                             "inputs": every,
                             "ftsystem": {**_inputs_report(parts, ettr.PAPER_GPUS),
                                          "missing": [o for o, f in files.items() if f is None]},
                             "simulation": {"failures_per_run": precision.failures,
                                            "seeds": precision.seeds, "seed": seed,
                                            "rng": "numpy default_rng((seed, gpus, k)) for "
                                                   "k in range(seeds), the same traces for "
                                                   "every model and sensitivity point",
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
