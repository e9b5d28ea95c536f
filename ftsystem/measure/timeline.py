"""The PNG timeline of a run: steps per second, members, failures and stalls over time."""

from __future__ import annotations

import logging
from pathlib import Path

from ftsystem.measure.ettr import job_timeline

log = logging.getLogger(__name__)


def draw(results: dict[str, dict], failures: list[dict], path: Path, *, bin_s: float = 1.0
         ) -> None:
    """Job steps/s (from the first commit of each step) and epoch members, failures marked.
    Skipped, with a note, where matplotlib (the ``sim`` extra) is not installed."""
    job = job_timeline({rid: r["commits"] for rid, r in results.items()})
    if not job:
        return
    try:
        import matplotlib
    except ImportError:
        log.warning("%s not drawn: matplotlib is not installed (pip install 'ftsystem[sim]')",
                    path)
        return
    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt
    start = job[0][1]
    fig, (rate_ax, members_ax) = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    times = [t - start for _, t in job]
    bins = int(times[-1] // bin_s) + 1
    rate_ax.hist(times, bins=bins, range=(0, bins * bin_s), weights=[1 / bin_s] * len(times),
                 histtype="stepfilled", alpha=0.6)
    rate_ax.set_ylabel("steps / s")
    epochs = sorted((e["time"] - start, len(e["members"]))
                    for r in results.values() for e in r["epochs"])
    if epochs:
        members_ax.step([t for t, _ in epochs], [n for _, n in epochs], where="post")
    members_ax.set_ylabel("members")
    members_ax.set_xlabel("seconds since the first commit")
    for ax in (rate_ax, members_ax):
        for f in failures:
            ax.axvline(f["time"] - start, color="red", linestyle="--", linewidth=1)
    failed = ", ".join(f"{f['replica']}@{f['step']}" for f in failures) or "none"
    rate_ax.set_title(f"failures (red): {failed}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
