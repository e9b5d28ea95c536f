"""Summaries of latency samples, as every figure of the controller benchmarks reports them."""

from __future__ import annotations

import numpy as np


def summarize(samples: list[float]) -> dict[str, float]:
    values = np.asarray(samples, dtype=float)
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
            "mean": float(values.mean()), "max": float(values.max())}


def summarize_n(samples: list[float]) -> dict[str, float | None]:
    """``summarize`` and the number of samples; None for each figure when there is none."""
    if not samples:
        return {"p50": None, "p99": None, "mean": None, "max": None, "n": 0}
    return {**summarize(samples), "n": len(samples)}
