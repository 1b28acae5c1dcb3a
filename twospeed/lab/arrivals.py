"""Arrival processes: when each request should be sent, as offsets in seconds from the start of a run.

Open loop (the client sends on schedule whatever the server does): Poisson, gamma with a burstiness factor
(the coefficient of variation of the gaps: 1 is Poisson, above 1 bursty, below 1 more regular than
Poisson), constant spacing, or a replayed trace. Closed loop (a fixed number of users, each sending when its
last answer is done) has no schedule; bench.py runs it. Pure functions of a numpy Generator.
"""

from __future__ import annotations

import numpy as np


def gaps(rng: np.random.Generator, process: str, rate: float, n: int, burstiness: float = 1.0) -> np.ndarray:
    """n inter-arrival gaps (s) with mean 1/rate."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if process == "poisson":
        return rng.exponential(1.0 / rate, size=n)
    if process == "gamma":
        shape = 1.0 / burstiness**2  # CV of a gamma is 1/sqrt(shape)
        return rng.gamma(shape, 1.0 / (rate * shape), size=n)
    if process == "constant":
        return np.full(n, 1.0 / rate)
    raise ValueError(f"unknown arrival process {process!r}")


def offsets(rng: np.random.Generator, process: str, rate: float, *, n: int | None = None,
            duration: float | None = None, burstiness: float = 1.0) -> np.ndarray:
    """Send offsets, the first at 0: exactly n of them, or all that fall before `duration` seconds."""
    if (n is None) == (duration is None):
        raise ValueError("give exactly one of n and duration")
    if n is not None:
        g = gaps(rng, process, rate, max(n - 1, 0), burstiness)
        return np.concatenate([[0.0], np.cumsum(g)])[:n]
    out, t = [0.0], 0.0
    while True:  # draw in blocks so long runs stay vectorised
        block = np.cumsum(gaps(rng, process, rate, max(16, int(rate * duration)), burstiness)) + t
        out.extend(block[block < duration].tolist())
        if block[-1] >= duration:
            return np.asarray(out)
        t = block[-1]


def burstiness_of(times: np.ndarray) -> float:
    """The coefficient of variation of the gaps between sorted send times (1 for Poisson)."""
    g = np.diff(np.sort(times))
    return float(g.std() / g.mean()) if len(g) > 1 and g.mean() > 0 else 0.0
