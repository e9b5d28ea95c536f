"""Benchmark and simulator output: the machine description, a table on stdout, JSON on disk;
and the rounds a bench runs its systems in, each figure summarized over them."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any, Callable, Hashable, Mapping, Sequence, TypeVar

from rich.console import Console
from rich.table import Table

System = TypeVar("System", bound=Hashable)
"""What a bench compares: a system's name, or any key naming one run of a round."""


def machine() -> str:
    """One line naming the machine a figure was measured on."""
    import torch

    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.machine()}, {os.cpu_count()} cores, {mem_gib:.0f} GiB, "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {gpu}")


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))
    Console().print(table)


def write_json(path: str | os.PathLike | None, data: dict) -> None:
    """Write ``data`` (which should carry a ``machine`` entry) as indented JSON, if asked to."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    """The median and the min/max of ``values`` (missing ones left out): how every bench reports
    a figure measured over several rounds or samples."""
    present = [v for v in values if v is not None]
    if not present:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def round_order(systems: Sequence[System], round_index: int) -> list[System]:
    """The order the systems run in, in a round: reversed every other round, so that none
    always runs first (or last) on a machine whose load drifts."""
    return list(systems) if round_index % 2 == 0 else list(systems)[::-1]


def in_rounds(systems: Sequence[System], rounds: int, run: Callable[[System, int], dict], *,
              at_round_start: Callable[[int], dict] = lambda _: {},
              after_run: Callable[[dict[System, list[dict]], list[dict]], None] = (
                  lambda *_: None)) -> tuple[dict[System, list[dict]], list[dict]]:
    """``run(system, round_index)`` for every system, ``rounds`` times, the order alternated
    per round (:func:`round_order`).

    Returns each system's results in round order, each stamped with its ``round``, and the
    round log: per round its order, the machine's 1-minute load average before it and after its
    latest run (other work on a shared machine makes figures noisy), and whatever
    ``at_round_start`` measured as it began. ``after_run`` sees both after every run: a long
    bench keeps what it has measured.
    """
    results: dict[System, list[dict]] = {name: [] for name in systems}
    log: list[dict] = []
    for r in range(rounds):
        order = round_order(systems, r)
        log.append({"round": r, "order": order, "load_1m_before": os.getloadavg()[0]})
        log[-1] |= at_round_start(r)
        for name in order:
            results[name].append(run(name, r) | {"round": r})
            log[-1]["load_1m_after"] = os.getloadavg()[0]
            after_run(results, log)
    return results, log


def per_round(runs: Sequence[dict], figures: Mapping[str, str]) -> dict[str, dict]:
    """For each figure, named ``name: path`` (a dotted path into a round's result, such as
    ``stall_s.median``), its spread over the rounds ``runs`` (one result per round)."""
    return {name: spread([figure(run, path) for run in runs]) for name, path in figures.items()}


def over_rounds(runs: Sequence[dict], figures: Mapping[str, str]) -> dict:
    """One system over its rounds, as every bench reports it: each figure's spread
    (:func:`per_round`) and every round in full."""
    return {**per_round(runs, figures), "rounds": list(runs)}


def paired_ratio(ours: Sequence[dict], theirs: Sequence[dict], path: str) -> dict:
    """Our figure at ``path`` over theirs, round by round (two runs of one round met the same
    load), and the spread of those ratios; a round where either is missing or zero has none."""
    ratios = [a / b if (a := figure(o, path)) and (b := figure(t, path)) else None
              for o, t in zip(ours, theirs)]
    return spread(ratios) | {"per_round": ratios}


def figure(run: Any, path: str) -> float | None:
    """The number at the dotted ``path`` of ``run`` (None: absent, or not a number)."""
    for part in path.split("."):
        run = run.get(part) if isinstance(run, dict) else None
    return run if isinstance(run, (int, float)) and not isinstance(run, bool) else None
