"""The metrics' exposition in one process: renamed metrics under both names until the release
that drops the old ones, and no ``_created`` series. Which rank exports what is tested on real
ranks (tests/test_hsdp_ranks.py), the discovery's labels on a real controller
(tests/test_controller_api.py)."""

from __future__ import annotations

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ftsystem
from ftsystem.measure import metrics


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _samples(name: str) -> dict[tuple, float]:
    """Every sample of the metric exposed as ``name``, by its labels, in this process."""
    text = generate_latest(REGISTRY).decode()
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


def test_renamed_metrics_keep_their_old_names_for_one_release():
    assert _release(ftsystem.__version__) < _release(metrics.ALIASES_REMOVED_IN), (
        f"ftsystem {ftsystem.__version__} must no longer export {sorted(metrics.RENAMED)}: "
        "remove metrics._OldName and RENAMED, and their table in docs/operations.md")
    metrics.init_controller("j")
    metrics.init_replica("j", "r0", speaks_for_replica=True)
    metrics.ETTR.labels("j", "work").set(0.75)
    metrics.DIVERGENCES.labels("j", "r0", "commit-chain").inc()
    metrics.FTAR_OVERLAPPED.labels("j", "r0").inc(3)
    for old, new in metrics.RENAMED.items():
        assert _samples(new), new
        assert _samples(old) == _samples(new), (old, new)
    assert _samples("ftsystem_ettr")[(("job", "j"), ("kind", "work"))] == 0.75
    assert "_created" not in generate_latest(REGISTRY).decode()
