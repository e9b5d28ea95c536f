"""Where the time of ``FTReplica.commit()`` goes, part by part, summed over commits.

``ftsystem bench overhead`` reads it from the replicas' results to explain ftsystem's steps/s
against DDP's: the all-reduce wait is what DDP pays too; the rest (packing the gradients, the
vote, the step function's copy, the carry, the log, the telemetry) is ftsystem's own.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator


class CommitTimes:
    """Seconds per part of ``commit()``, summed; a part is timed with :meth:`part`."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.commits = 0

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def committed(self) -> None:
        self.commits += 1

    def per_commit_ms(self) -> dict[str, float]:
        """Milliseconds per commit of each part (the parts of commits that were dropped or
        retried count too: they are time the loop spent)."""
        return {name: 1e3 * s / max(1, self.commits) for name, s in sorted(self.seconds.items())}
