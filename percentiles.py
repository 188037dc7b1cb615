"""Nearest-rank percentiles: one rule for the shim's latency report, GetStatus and the bench."""

from __future__ import annotations

from collections.abc import Collection


def percentile(samples: Collection[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of `samples`, in any order; NaN when empty."""
    if not samples:
        return float("nan")
    s = sorted(samples)
    # The ceil(q/100 * n)-th sample, q * n first so that a whole rank stays whole. (round(x + 0.5) is not
    # a ceiling: Python rounds halves to even, and the p99 of 100 samples came out as their maximum; an index
    # of int(0.99 n) is one rank high wherever 0.99 n is whole, as GetStatus's was.)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return float(s[k])
