"""Latency statistics: p50/p90/p99/max with a bootstrap confidence interval on the tail, SLO attainment.

Percentiles use numpy's default (linear interpolation), so they can be checked against numpy directly. The
bootstrap resamples the observations with replacement under a fixed seed: a run's CI is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

QUANTILES = (50, 90, 99)


def bootstrap_ci(values: Sequence[float], q: float, *, level: float = 0.95, resamples: int = 1000,
                 seed: int = 0) -> tuple[float, float] | None:
    """The `level` percentile-bootstrap interval of the q-th percentile (None with fewer than 2 values)."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return None
    rng = np.random.default_rng(seed)
    samples = x[rng.integers(0, len(x), size=(resamples, len(x)))]
    estimates = np.percentile(samples, q, axis=1)
    lo, hi = np.percentile(estimates, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])
    return float(lo), float(hi)


def summarize(values: Sequence[float], *, seed: int = 0) -> dict:
    """n, mean, p50, p90, p99, max, and 95% bootstrap CIs on p50 and p99; Nones when there is no value."""
    x = np.asarray([v for v in values if v is not None], dtype=float)
    if len(x) == 0:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None, "p50_ci": None,
                "p99_ci": None}
    p = np.percentile(x, QUANTILES)
    ci50, ci99 = bootstrap_ci(x, 50, seed=seed), bootstrap_ci(x, 99, seed=seed)
    return {"n": int(len(x)), "mean": float(x.mean()), "p50": float(p[0]), "p90": float(p[1]),
            "p99": float(p[2]), "max": float(x.max()), "p50_ci": list(ci50) if ci50 else None,
            "p99_ci": list(ci99) if ci99 else None}


def proportion_ci(k: int, n: int, level: float = 0.95) -> list[float] | None:
    """Wilson score interval for k successes of n (a pass rate's noise)."""
    if n == 0:
        return None
    z = {0.95: 1.959964, 0.99: 2.575829}[level]
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [float(max(0.0, centre - half)), float(min(1.0, centre + half))]


def overlaps(a: Sequence[float] | None, b: Sequence[float] | None) -> bool | None:
    """Do two intervals overlap? None when either is unknown (then the difference cannot be called)."""
    if not a or not b:
        return None
    return a[0] <= b[1] and b[0] <= a[1]
