"""Finished simulator runs kept on disk, so that a bench stopped halfway resumes where it was.

A run is a pure function of its setup, its simulation settings, its method and its seed: the
key is a digest of all four (and of ``FORMAT``, raised when the simulator's results change for
the same inputs). Each run is one JSON file named after its key, written atomically once the
run has finished; a run that was interrupted leaves nothing, and is run again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from ftsystem.halos.config import PaperSetup
from ftsystem.halos.simulator import Curve, SimConfig

FORMAT = 1
"""Raise when the simulator gives other curves for the same inputs: old entries then miss."""
DEFAULT_DIR = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "ftsystem" / \
    "halos-runs"


def run_key(setup: PaperSetup, sim: SimConfig, method: str) -> str:
    """The digest that names a run (the seed is ``sim.workload.seed``)."""
    doc = {"format": FORMAT, "setup": dataclasses.asdict(setup),
           "sim": dataclasses.asdict(sim), "method": method}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]


class RunCache:
    """One directory of finished runs' curves."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)

    def get(self, key: str) -> Curve | None:
        """The curve of a finished run, or None."""
        try:
            doc = json.loads((self.dir / f"{key}.json").read_text())
        except FileNotFoundError:
            return None
        return Curve(**doc)

    def put(self, key: str, curve: Curve) -> None:
        self._write(key, dataclasses.asdict(curve))

    def measured(self, key: str, measure: Callable[[], float]) -> float:
        """A measurement taken once and kept (a step time): runs keyed by it then stay valid
        when the bench resumes."""
        path = self.dir / f"{key}.json"
        if path.exists():
            return float(json.loads(path.read_text()))
        value = measure()
        self._write(key, value)
        return value

    def _write(self, key: str, doc: object) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f"{key}.tmp{os.getpid()}"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.dir / f"{key}.json")  # a reader sees the whole entry or none
