"""A circuit breaker per sidecar rank: stop calling after repeated failures, come back through a health probe."""

from __future__ import annotations

import enum
import logging
import time
from typing import Callable

from dspark_sidecar.client.config import BreakerConfig

log = logging.getLogger("dspark_sidecar.client")


class BreakerState(enum.Enum):
    CLOSED = "closed"  # calls flow
    OPEN = "open"  # no calls until the backoff expires and a health probe passes (SERVING, or a refusal to read)
    HALF_OPEN = "half_open"  # the probe passed: the next call decides (success closes, failure reopens)


class CircuitBreaker:
    """Consecutive-failure breaker with exponential backoff between health probes.

    The probe runs only from `allow()`, on the caller's thread, at most once per backoff period,
    and each of its calls is bounded by its own deadline (the shim's: a health Check, then a GetStatus
    only when health answers NOT_SERVING), so a dead sidecar costs the engine one cheap failed
    connect per backoff period rather than one per step.
    """

    def __init__(self, cfg: BreakerConfig, probe: Callable[[float], bool],
                 clock: Callable[[], float] = time.monotonic, name: str = "sidecar") -> None:
        self.cfg, self._probe, self._clock, self.name = cfg, probe, clock, name
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.backoff_s = cfg.backoff_initial_s
        self.retry_at = 0.0
        self.opened = 0  # times the breaker went to OPEN (from CLOSED, or from a failed HALF_OPEN try)
        self.probes = 0  # health probes sent
        self.probes_failed = 0

    def allow(self) -> bool:
        """May the caller talk to the sidecar now? (May run one bounded health probe.)"""
        if self.state is not BreakerState.OPEN:
            return True
        if self._clock() < self.retry_at:
            return False
        self.probes += 1
        try:
            passed = self._probe(self.cfg.probe_deadline_s)
        except BaseException:
            # A failed probe all the same: counted, the backoff grown, then the error for the caller. Before, it
            # escaped with retry_at already past, and every later allow() (every step) probed again at once.
            self.probes_failed += 1
            self._reopen(grow=True)
            raise
        if passed:
            self.state = BreakerState.HALF_OPEN
            log.info("%s: health probe passed, trying again", self.name)
            return True
        self.probes_failed += 1
        self._reopen(grow=True)
        return False

    def record_success(self) -> None:
        if self.state is not BreakerState.CLOSED:
            log.info("%s: breaker closed", self.name)
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.backoff_s = self.cfg.backoff_initial_s

    def record_failure(self, why: str = "") -> None:
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN:
            # The try after a passing probe failed: open again. Counted, as any opening: before, a sidecar
            # that passed its probes and failed every step read as one opening for the life of the engine.
            self.opened += 1
            log.info("%s: breaker open again, the try after a passing health probe failed (%s)",  # once a backoff
                     self.name, why or "no detail")
            self._reopen(grow=True)
        elif self.state is BreakerState.CLOSED and self.failures >= self.cfg.failure_threshold:
            self.opened += 1
            log.warning("%s: breaker open after %d failures (%s); probing health every %.3g s and up",
                        self.name, self.failures, why or "no detail", self.backoff_s)
            self._reopen(grow=False)

    def _reopen(self, grow: bool) -> None:
        if grow:
            self.backoff_s = min(self.backoff_s * 2, self.cfg.backoff_max_s)
        self.state = BreakerState.OPEN
        self.retry_at = self._clock() + self.backoff_s
