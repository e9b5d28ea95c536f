"""The ``ftsystem bench controller`` command: options, rounds, the JSON and the tables.

The benchmarks themselves (``replicas``, ``nodes``) are imported when the command runs: they
bring etcd's client, numpy and h2, which listing the commands does not need."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ftsystem.benchmarks.controller.config import (
    DEFAULT_PROCESSES, FULL_REPLICAS, FULL_REVOKES, NODES_FULL_REPLICAS, NODES_FULL_SAMPLES,
    NODES_FULL_WINDOW_S, NODES_QUICK_REPLICAS, NODES_QUICK_SAMPLES, NODES_QUICK_WINDOW_S,
    QUICK_REPLICAS, QUICK_REVOKES, ControllerMode, KeepAliveMode, NodesConfig, ReplicasConfig,
    check_nodes_config)
from ftsystem.cli import ETCD_HELP, _fail, bench_app
from ftsystem.measure import report

ROUND_FIGURES = {"decision_p50_s": "decision_latency_s.p50",
                 "decision_p99_s": "decision_latency_s.p99",
                 "join_p99_s": "join_latency_s.p99"}
NODES_ROUND_FIGURES = {
    "node_lease_end_p99_s": "decision_latency_s.node_lease_end.p99",
    "reported_failure_p99_s": "decision_latency_s.reported_failure.p99",
    "keepalives_per_s": "etcd.keepalives_per_s", "writes_per_s": "etcd.writes_per_s"}
"""The headline figures reported over the rounds (dotted paths into one round's result)."""


def with_rounds(runs: list[dict], figures: dict[str, str]) -> dict:
    """The first round's result, in the shape one round gives, with each of ``figures``' median
    and min/max over every round (``over_rounds``) and the later rounds in full. One system
    runs here, so there is no order to alternate."""
    return runs[0] | {"rounds": len(runs), "over_rounds": report.per_round(runs, figures),
                      "later_rounds": runs[1:]}


@bench_app.command("controller")
def controller_bench(
        replicas: Optional[int] = typer.Option(
            None, min=2, help=f"simulated replicas (default {FULL_REPLICAS}; "
                              f"{QUICK_REPLICAS} with --quick)"),
        revokes: Optional[int] = typer.Option(
            None, min=1, help=f"lease revocations to time (default {FULL_REVOKES}; "
                              f"{QUICK_REVOKES} with --quick)"),
        quick: bool = typer.Option(False, "--quick", help="fewer replicas and revokes"),
        etcd: Optional[str] = typer.Option(None, help=ETCD_HELP + "; default: embedded"),
        controller: ControllerMode = typer.Option(
            ControllerMode.SUBPROCESS, help="run the leader as `ftsystem controller` in a "
                                            "subprocess, or as a task in this process"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="write the results here"),
        nodes: Optional[int] = typer.Option(
            None, min=2, help="simulate this many node agents, each with its own lease and "
                              "keep-alives, over --replicas replicas (default "
                              f"{NODES_FULL_REPLICAS}; {NODES_QUICK_REPLICAS} with --quick), "
                              "e.g. 16384; --revokes is then per kind of failure (default "
                              f"{NODES_FULL_SAMPLES}; {NODES_QUICK_SAMPLES} with --quick)"),
        processes: int = typer.Option(DEFAULT_PROCESSES, min=1,
                                      help="with --nodes: load-generator processes (default: "
                                           "one per core, 2 to 8)"),
        window: Optional[float] = typer.Option(
            None, min=1.0, help="with --nodes: seconds of steady state over which etcd's rates "
                                f"are measured (default {NODES_FULL_WINDOW_S:g}; "
                                f"{NODES_QUICK_WINDOW_S:g} with --quick)"),
        logs: Optional[Path] = typer.Option(
            None, help="with --nodes: keep etcd's data and the logs of the controller and the "
                       "load generators in this directory"),
        rounds: int = typer.Option(1, min=1, help="run the measurement this many times; the "
                                                  "JSON gives each headline figure's median "
                                                  "and min/max over the rounds"),
        keepalive: KeepAliveMode = typer.Option(
            KeepAliveMode.BATCHED, help="with --nodes: keep-alives over one stream per process "
                                        "(batched, as Store.keep_alive keeps its stream "
                                        "open), or one stream per keep-alive (per-call, "
                                        "aetcd's refresh_lease)"),
) -> None:
    """Membership decision latency: lease revoked -> epoch without the replica seen."""
    from ftsystem.control.store import parse_endpoints
    if etcd is not None:
        try:
            parse_endpoints(etcd)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--etcd") from e
    if nodes is None:
        _replicas_bench(ReplicasConfig(
            num_replicas=replicas or (QUICK_REPLICAS if quick else FULL_REPLICAS),
            num_revokes=revokes or (QUICK_REVOKES if quick else FULL_REVOKES),
            etcd=etcd, controller=controller), rounds, json_out)
        return
    cfg = NodesConfig(
        num_nodes=nodes,
        num_replicas=replicas or (NODES_QUICK_REPLICAS if quick else NODES_FULL_REPLICAS),
        num_samples=revokes or (NODES_QUICK_SAMPLES if quick else NODES_FULL_SAMPLES),
        etcd=etcd, controller=controller, num_processes=processes, keepalive=keepalive,
        window_s=window or (NODES_QUICK_WINDOW_S if quick else NODES_FULL_WINDOW_S),
        logs_dir=logs)
    try:
        check_nodes_config(cfg)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--nodes") from e
    _nodes_bench(cfg, rounds, json_out)


def _replicas_bench(cfg: ReplicasConfig, rounds: int, json_out: Path | None) -> None:
    from ftsystem.benchmarks.controller import replicas
    from ftsystem.control.store import StoreError
    try:
        result = with_rounds(replicas.run(cfg, rounds), ROUND_FIGURES)
    except (StoreError, RuntimeError) as e:  # BenchError, etcd not installed or not starting
        raise _fail(str(e))
    result["machine"] = report.machine()
    replicas.print_result(result)
    report.write_json(json_out, result)


def _nodes_bench(cfg: NodesConfig, rounds: int, json_out: Path | None) -> None:
    from ftsystem.benchmarks.controller.nodes import run_nodes
    from ftsystem.benchmarks.controller.nodes_report import print_nodes
    from ftsystem.control.store import StoreError
    try:
        runs = run_nodes(cfg, rounds)
    except (StoreError, RuntimeError) as e:
        raise _fail(str(e))
    result = with_rounds(runs, NODES_ROUND_FIGURES)
    result["error"] = next((r["error"] for r in runs if r["error"]), None)
    result["machine"] = report.machine()
    print_nodes(result)
    report.write_json(json_out, result)
    if result["error"]:  # the JSON says what the machine sustained; the exit says it failed
        raise _fail(result["error"])
