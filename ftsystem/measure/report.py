"""Benchmark and simulator output: the machine description, a table on stdout, JSON on disk."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.table import Table


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


def round_order(systems: Sequence[str], round_index: int) -> list[str]:
    """The order the systems run in, in a round: reversed every other round, so that none
    always runs first (or last) on a machine whose load drifts."""
    return list(systems) if round_index % 2 == 0 else list(systems)[::-1]


def in_rounds(systems: Sequence[str], rounds: int,
              run: Callable[[str, int], dict]) -> dict[str, list[dict]]:
    """``run(system, round_index)`` for every system, ``rounds`` times, the order alternated
    per round; each system's results in round order."""
    results: dict[str, list[dict]] = {name: [] for name in systems}
    for r in range(rounds):
        for name in round_order(systems, r):
            results[name].append(run(name, r))
    return results


def per_round(runs: Sequence[dict], figures: dict[str, str]) -> dict[str, dict]:
    """For each figure, named ``name: path`` (a dotted path into a round's result, such as
    ``stall_s.median``), its spread over the rounds ``runs`` (one result per round)."""
    def pick(run: Any, path: str) -> float | None:
        for part in path.split("."):
            run = run.get(part) if isinstance(run, dict) else None
        return run if isinstance(run, (int, float)) and not isinstance(run, bool) else None
    return {name: spread([pick(run, path) for run in runs]) for name, path in figures.items()}
