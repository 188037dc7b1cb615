"""Per-rank counters and latency histograms: Prometheus text endpoint, and the figures GetStatus reports."""

from __future__ import annotations

import collections
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from dspark_sidecar.percentiles import percentile
from dspark_sidecar.proto import sidecar_pb2 as pb

# invalid: the request was bad (validate.py, a stale binding). refused: the rank turned the step away
# whatever it held (shutting down, --strict-refusal); counted apart, so a drain or a refused deployment
# does not read as engines sending bad steps.
RESULTS = ("ok", "aborted", "invalid", "refused", "failed")
PHASES = ("queue", "rendezvous", "compute", "total")
# Draft steps take tens of microseconds (GPU) to tens of milliseconds (CPU reference).
BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0)


class Metrics:
    def __init__(self, rank: int, window: int = 2048) -> None:
        self.registry = CollectorRegistry()
        labels = {"rank": str(rank)}
        self.steps = Counter("dspark_steps", "Draft steps by result", ["rank", "result"], registry=self.registry)
        self.seconds = Histogram("dspark_step_seconds", "Draft step latency by phase", ["rank", "phase"],
                                 buckets=BUCKETS, registry=self.registry)
        self.binds = Counter("dspark_kv_binds", "KV cache (re-)bindings", ["rank"], registry=self.registry)
        self.serving = Gauge("dspark_serving", "1 when this rank serves draft steps", ["rank"], registry=self.registry)
        self.prelaunched = Counter("dspark_prelaunch", "Pre-launched doorbell steps by outcome (hit: answered from it)",
                                   ["rank", "outcome"], registry=self.registry)
        # Labelled children resolved once: a labels() lookup costs microseconds on every step.
        self._step_count = {r: self.steps.labels(result=r, **labels) for r in RESULTS}
        self._phase_hist = {p: self.seconds.labels(phase=p, **labels) for p in PHASES}
        self._prelaunch = {o: self.prelaunched.labels(outcome=o, **labels) for o in ("hit", "miss")}
        # Made here, so both read 0 from the start: an untouched labelled series is absent, and a query for
        # binds that stay at 0 or a rank that never serves (OPERATIONS.md) would match nothing.
        self._binds = self.binds.labels(**labels)
        self._serving = self.serving.labels(**labels)
        self._serving.set(0)
        self._lock = threading.Lock()
        self.counts = collections.Counter()
        self._recent = {p: collections.deque(maxlen=window) for p in PHASES}

    def step(self, result: str, timings_ns: dict[str, int], num_reqs: int = 0, launches: int = 0) -> None:
        self._step_count[result].inc()
        with self._lock:
            self.counts[result] += 1
            if result == "ok":
                self.counts["requests"] += num_reqs
                self.counts["rows"] += 7 * num_reqs
                self.counts["launches"] += launches
                for phase, ns in timings_ns.items():
                    self._recent[phase].append(ns)
        if result == "ok":
            for phase, ns in timings_ns.items():
                self._phase_hist[phase].observe(ns / 1e9)

    def prelaunch(self, hit: bool) -> None:
        """One queued step used (hit) or released unused (miss)."""
        self._prelaunch["hit" if hit else "miss"].inc()
        with self._lock:
            self.counts["steps_prelaunched" if hit else "prelaunch_misses"] += 1

    def bound(self) -> None:
        self._binds.inc()
        with self._lock:
            self.counts["kv_binds"] += 1

    def set_serving(self, serving: bool) -> None:
        self._serving.set(1 if serving else 0)

    def counters_pb(self) -> pb.Counters:
        with self._lock:
            c = self.counts
            return pb.Counters(steps_ok=c["ok"], steps_aborted=c["aborted"], steps_invalid=c["invalid"],
                               steps_refused=c["refused"], steps_failed=c["failed"], requests=c["requests"], rows=c["rows"],
                               launches=c["launches"], kv_binds=c["kv_binds"],
                               steps_prelaunched=c["steps_prelaunched"], prelaunch_misses=c["prelaunch_misses"])

    def latencies_pb(self) -> list[pb.LatencySummary]:
        # Copied under the lock, sorted outside it: the windows' sorts (~10 phases of up to `window` samples,
        # ~2.8 ms) held the lock that every step's `step` takes, so a GetStatus or a scrape delayed a step.
        with self._lock:
            windows = [(phase, list(dq)) for phase, dq in self._recent.items() if dq]
        return [pb.LatencySummary(name=phase, count=len(xs), p50_ns=int(percentile(xs, 50)),
                                  p99_ns=int(percentile(xs, 99))) for phase, xs in windows]

    def serve_http(self, host: str, port: int) -> None:
        """Prometheus text on host:port (default loopback: only the node's own scraper agent)."""
        # An IPv6 literal may come bracketed ("[::1]"), as --tcp-host and the parent's port check take it:
        # the HTTP server looks the text up as is, and every rank failed to start on a host the check passed.
        start_http_server(port, addr=host.strip("[]"), registry=self.registry)

