"""Counters of one shim: steps forwarded, fallbacks by reason, and forwarded-step latencies."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from dspark_sidecar.percentiles import percentile


@dataclass
class ShimStats:
    forwarded: int = 0
    via_doorbell: int = 0  # of the forwarded steps, those that went through the shared-memory doorbell
    fallbacks: collections.Counter = field(default_factory=collections.Counter)
    forward_ns: collections.deque = field(default_factory=lambda: collections.deque(maxlen=100_000))
    # The engine thread writes through record_forward / record_fallback; as_dict may run on another thread (a
    # metrics or health reader). Unlocked, a step's three updates could interleave with a report: it counted the
    # step as forwarded but not via the doorbell (when every step went by it), and its p50 and p99 came from two
    # different sample sets. Held for an update (~0.1 us) and for as_dict's copy, never for the sorting.
    # Re-entrant, as the shim's link lock: a signal handler that reports them runs on the thread it interrupts.
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def record_forward(self, ns: int, via_doorbell: bool) -> None:
        with self._lock:
            self.forwarded += 1
            self.via_doorbell += int(via_doorbell)
            self.forward_ns.append(ns)

    def record_fallback(self, why: str) -> None:
        with self._lock:
            self.fallbacks[why] += 1

    def as_dict(self) -> dict:
        """One moment's counters, whichever thread asks."""
        with self._lock:
            forwarded, via, fallbacks, samples = (self.forwarded, self.via_doorbell, dict(self.fallbacks),
                                                  list(self.forward_ns))
        return {"forwarded": forwarded, "via_doorbell": via, "fallbacks": fallbacks,
                "forward_p50_us": percentile(samples, 50) / 1e3,
                "forward_p99_us": percentile(samples, 99) / 1e3}
