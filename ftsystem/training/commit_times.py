"""Where the time of ``FTReplica.commit()`` goes, part by part, summed over commits.

``ftsystem bench overhead`` reads it from the replicas' results to explain ftsystem's steps/s
against DDP's: the all-reduce wait is what DDP pays too; the rest (packing the gradients, the
vote, the step function's copy, the carry, the log, the telemetry) is ftsystem's own.

The first commits of a process are summed apart (:attr:`CommitTimes.start_up`): their memory is
new: the step function's first call allocates the optimizer's state. (The buffers of the first
averages are not new: ``UpdateLog.reserve`` touches them at start. A fresh one page-faulted in
took 30-300 ms a pack at 10M parameters beside a second replica starting up, against 2.5 ms into
a reused buffer.) Averaged with the rest they would stand for the
steady state of a short run, whose throughput the benches measure after their warm-up steps too.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

from ftsystem.training.update_log import KEEP_MIN_ENTRIES

START_UP_COMMITS = KEEP_MIN_ENTRIES + 1
"""Commits whose parts are summed apart: as many as the update log's reserved buffers serve
before it recycles its own entries."""


class CommitTimes:
    """Seconds per part of ``commit()``, summed; a part is timed with :meth:`part`."""

    def __init__(self, start_up_commits: int = START_UP_COMMITS) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        """The parts of the commits after the start-up ones."""
        self.start_up: defaultdict[str, float] = defaultdict(float)
        """The parts of the first ``start_up_commits`` commits."""
        self.commits = 0
        self._start_up_commits = start_up_commits

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            into = self.start_up if self.commits < self._start_up_commits else self.seconds
            into[name] += time.perf_counter() - started

    def committed(self) -> None:
        self.commits += 1

    def per_commit_ms(self) -> dict[str, float]:
        """Milliseconds per commit of each part, after the start-up commits (the parts of
        commits that were dropped or retried count too: they are time the loop spent)."""
        steady = max(1, self.commits - self._start_up_commits)
        return {name: 1e3 * s / steady for name, s in sorted(self.seconds.items())}

    def start_up_ms(self) -> dict[str, float]:
        """Milliseconds of each part over the start-up commits, summed."""
        return {name: 1e3 * s for name, s in sorted(self.start_up.items())}
