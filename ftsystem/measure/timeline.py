"""The PNG timeline of a run: job steps per second, epoch members, and each survivor's commit
gaps over time, failures marked."""

from __future__ import annotations

import logging
from pathlib import Path

from ftsystem.measure.ettr import job_timeline

log = logging.getLogger(__name__)


def draw(results: dict[str, dict], failures: list[dict], path: Path, *, bin_s: float = 1.0
         ) -> None:
    """``figure`` as a PNG at ``path``. Skipped, with a note, where matplotlib (the ``sim``
    extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        log.warning("%s not drawn: matplotlib is not installed (pip install 'ftsystem[sim]')",
                    path)
        return
    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt
    fig = figure(results, failures, bin_s=bin_s)
    if fig is not None:
        fig.savefig(path, dpi=100)
        plt.close(fig)


def figure(results: dict[str, dict], failures: list[dict], *, bin_s: float = 1.0):
    """Three panels over time, failures marked: job steps/s (from the first commit of each
    step); epoch members, in whole replicas from 0; and each survivor's commit gaps (seconds
    since its previous commit, at each commit), where a stall shows as a spike however short.
    None when nothing was committed."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    job = job_timeline({rid: r["commits"] for rid, r in results.items()})
    if not job:
        return None
    start = job[0][1]
    fig, (rate_ax, members_ax, gap_ax) = plt.subplots(
        3, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [2, 1.2, 2]})
    times = [t - start for _, t in job]
    bins = int(times[-1] // bin_s) + 1
    rate_ax.hist(times, bins=bins, range=(0, bins * bin_s), weights=[1 / bin_s] * len(times),
                 histtype="stepfilled", alpha=0.6)
    rate_ax.set_ylabel("job steps / s")
    epochs = sorted((e["time"] - start, len(e["members"]))
                    for r in results.values() for e in r["epochs"])
    if epochs:
        members_ax.step([t for t, _ in epochs], [n for _, n in epochs], where="post")
    members_ax.set_ylim(0, max([len(results)] + [n for _, n in epochs]) + 0.5)
    members_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    members_ax.set_ylabel("epoch members")
    failed = {f["replica"] for f in failures}
    for rid, gaps in sorted(commit_gaps(results, start, failed).items()):
        gap_ax.plot([t for t, _ in gaps], [g for _, g in gaps], linewidth=1, marker=".",
                    markersize=2, label=rid)
    gap_ax.set_ylim(bottom=0)
    gap_ax.set_ylabel("s since its last commit")
    gap_ax.set_xlabel("seconds since the first commit")
    gap_ax.set_title("commit gap of each survivor, per step", fontsize=10)
    if gap_ax.lines:
        gap_ax.legend(loc="upper right", fontsize=8)
    for ax in (rate_ax, members_ax, gap_ax):
        for f in failures:
            ax.axvline(f["time"] - start, color="red", linestyle="--", linewidth=1)
    named = ", ".join(f"{f['replica']}@{f['step']}" for f in failures) or "none"
    rate_ax.set_title(f"failures (red): {named}")
    fig.tight_layout()
    return fig


def commit_gaps(results: dict[str, dict], start: float, failed: set[str]
                ) -> dict[str, list[tuple[float, float]]]:
    """Per replica that never failed (every replica if all did): at each commit after its
    first, (seconds since ``start``, seconds since its previous commit) (pure)."""
    survivors = [rid for rid in results if rid not in failed] or list(results)
    gaps = {}
    for rid in survivors:
        commits = sorted(results[rid]["commits"])
        gaps[rid] = [(t - start, t - before)
                     for (_, before), (_, t) in zip(commits, commits[1:])]
    return gaps
