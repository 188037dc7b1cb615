"""Counters of one shim: steps forwarded, fallbacks by reason, and forwarded-step latencies."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from dspark_sidecar.percentiles import percentile


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
