"""Benchmark and simulator output: the machine description, a table on stdout, JSON on disk."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any, Sequence

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
