"""The shim's counters: the nearest-rank percentile its latency report uses."""

from __future__ import annotations

import math

import pytest

from dspark_sidecar.client.stats import ShimStats
from dspark_sidecar.percentiles import percentile


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 7, 10, 99, 100, 101, 200, 1000])
@pytest.mark.parametrize("q", [1, 50, 90, 99, 100])
def test_percentile_is_the_nearest_rank(n, q):
    """The smallest sample with at least q% of the samples at or below it: the ceil(q/100 * n)-th.
    Before, the rank was round(q/100 * n + 0.5), and Python rounds halves to even: where q/100 * n is
    a whole odd number it came out one rank high (the p99 of 100 samples was their maximum, the p50
    of 2 samples the larger one)."""
    samples = list(range(1, n + 1))[::-1]  # unsorted on purpose
    expected = max(1, math.ceil(q * n / 100))  # sample k is the value k
    assert percentile(samples, q) == expected


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 50))


def test_the_report_p99_of_100_steps_is_not_their_slowest():
    stats = ShimStats()
    stats.forward_ns.extend(1000 * k for k in range(1, 101))  # 1 .. 100 us
    out = stats.as_dict()
    assert out["forward_p50_us"] == 50.0 and out["forward_p99_us"] == 99.0
