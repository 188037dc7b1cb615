"""Counters of one shim: steps forwarded, fallbacks by reason, and forwarded-step latencies."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


def percentile(samples: list[int] | collections.deque, q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of integer samples; NaN when empty."""
    if not samples:
        return float("nan")
    s = sorted(samples)
    # The ceil(q/100 * n)-th sample, q * n first so that a whole rank stays whole. (round(x + 0.5) is not
    # a ceiling: Python rounds halves to even, and the p99 of 100 samples came out as their maximum.)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return float(s[k])


@dataclass
class ShimStats:
    forwarded: int = 0
    via_doorbell: int = 0  # of the forwarded steps, those that went through the shared-memory doorbell
    fallbacks: collections.Counter = field(default_factory=collections.Counter)
    forward_ns: collections.deque = field(default_factory=lambda: collections.deque(maxlen=100_000))

    @property
    def total_fallbacks(self) -> int:
        return sum(self.fallbacks.values())

    def as_dict(self) -> dict:
        return {"forwarded": self.forwarded, "via_doorbell": self.via_doorbell, "fallbacks": dict(self.fallbacks),
                "forward_p50_us": percentile(self.forward_ns, 50) / 1e3,
                "forward_p99_us": percentile(self.forward_ns, 99) / 1e3}
