"""The circuit breaker alone, on a fake clock and a scripted health probe."""

from __future__ import annotations

import pytest

from dspark_sidecar.client.breaker import BreakerState, CircuitBreaker
from dspark_sidecar.client.config import BreakerConfig, EngineConfigError


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opened_counts_every_transition_to_open_including_a_failed_half_open_try():
    """`opened` is "times the breaker opened". A half-open try that fails opens it again (calls stop
    until the next probe), and that was not counted: a sidecar that passes its health probe and then
    fails every step read as one opening for the life of the engine. A failed probe keeps it open: no
    new opening."""
    clock, probe_says = _Clock(), [False]
    b = CircuitBreaker(BreakerConfig(failure_threshold=2), lambda deadline_s: probe_says[0], clock)
    b.record_failure("x")
    b.record_failure("x")
    assert b.state is BreakerState.OPEN and b.opened == 1
    clock.now = b.retry_at
    assert not b.allow()  # a failed probe: still open, the same opening
    assert b.state is BreakerState.OPEN and b.opened == 1 and b.probes_failed == 1
    probe_says[0] = True
    for n in (2, 3):
        clock.now = b.retry_at
        assert b.allow() and b.state is BreakerState.HALF_OPEN
        b.record_failure("still failing")
        assert b.state is BreakerState.OPEN and b.opened == n
    clock.now = b.retry_at
    assert b.allow()
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.opened == 3


def test_backoff_doubles_per_failed_probe_up_to_the_cap_and_a_success_resets_it():
    """BreakerConfig: the first wait is backoff_initial_s, each failed probe doubles it up to
    backoff_max_s, and no probe is sent before the wait is over. After a success the next opening
    starts again from backoff_initial_s. Waits read off retry_at on the fake clock."""
    clock, probe_says, probed = _Clock(), [False], []

    def probe(deadline_s):
        probed.append(clock.now)
        return probe_says[0]

    b = CircuitBreaker(BreakerConfig(failure_threshold=1, backoff_initial_s=0.5, backoff_max_s=3.0), probe, clock)
    b.record_failure("x")
    waits = [b.retry_at - clock.now]
    for _ in range(4):
        clock.now = b.retry_at - 0.01
        assert not b.allow() and len(probed) == len(waits) - 1  # still waiting: no probe
        clock.now = b.retry_at
        assert not b.allow() and probed[-1] == clock.now  # the probe fails: a longer wait
        waits.append(b.retry_at - clock.now)
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0]
    probe_says[0] = True
    clock.now = b.retry_at
    assert b.allow()
    b.record_success()
    b.record_failure("again")
    assert b.state is BreakerState.OPEN and b.retry_at - clock.now == 0.5


def test_breaker_settings_that_cannot_work_are_refused():
    """No threshold below one failure, and no cap below the first wait (the doubling would start above it)."""
    with pytest.raises(EngineConfigError, match="breaker.failure_threshold: must be >= 1"):
        BreakerConfig(failure_threshold=0)
    with pytest.raises(EngineConfigError, match="breaker.backoff_max_s: must be >= backoff_initial_s"):
        BreakerConfig(backoff_initial_s=1.0, backoff_max_s=0.5)
    assert BreakerConfig(failure_threshold=1, backoff_initial_s=0.5, backoff_max_s=0.5).backoff_max_s == 0.5


@pytest.mark.parametrize("threshold", [float("nan"), float("inf"), 2.5, True])
def test_a_failure_threshold_that_is_not_a_whole_number_is_refused(threshold):
    """`failures >= nan` and `failures >= inf` are never true: such a threshold passed the `< 1` check and
    the breaker never opened, so a dead sidecar was called on every step, not behind its backoff. A fraction
    or a bool only worked by accident of the comparison. A positive integer, as EngineConfig's counts."""
    with pytest.raises(EngineConfigError, match="breaker.failure_threshold: must be >= 1"):
        BreakerConfig(failure_threshold=threshold)


def test_a_probe_that_raises_counts_as_failed_and_waits_out_a_longer_backoff():
    """The probe is the caller's (the shim's channel factory, a health Check, a refusal reader) and may raise
    something other than an RpcError. allow() let it through with the breaker OPEN and retry_at already past,
    so every later allow() (every step) probed again at once: no backoff at all, against "at most once per
    backoff period". A raise is a failed probe: counted, the wait doubled, and the error still reaches the
    caller (the shim logs it as its own)."""
    clock, probed = _Clock(), []

    def probe(deadline_s):
        probed.append(clock.now)
        raise OSError("the channel factory could not read its credentials")

    b = CircuitBreaker(BreakerConfig(failure_threshold=1, backoff_initial_s=0.5, backoff_max_s=3.0), probe, clock)
    b.record_failure("x")
    clock.now = b.retry_at
    with pytest.raises(OSError):
        b.allow()
    assert b.state is BreakerState.OPEN and b.probes == 1 and b.probes_failed == 1
    assert b.retry_at - clock.now == 1.0, "no backoff after a probe that raised"
    assert not b.allow() and probed == [clock.now], "probed again before the backoff expired"


def test_a_half_open_breaker_lets_calls_through_without_probing_again_until_a_result():
    """HALF_OPEN: the probe passed and the next call decides. Another allow() before that result (the readiness
    check on the next step, when the peers were not ready for this one) is let through with no second probe."""
    clock, probed = _Clock(), []
    b = CircuitBreaker(BreakerConfig(failure_threshold=1), lambda deadline_s: probed.append(clock.now) or True, clock)
    b.record_failure("x")
    clock.now = b.retry_at + 10
    assert b.allow() and b.state is BreakerState.HALF_OPEN and len(probed) == 1
    assert b.allow() and b.allow() and len(probed) == 1 and b.probes == 1
    b.record_failure("the try failed")
    assert b.state is BreakerState.OPEN and not b.allow() and len(probed) == 1


def test_a_sidecar_that_passes_its_probes_and_fails_every_try_is_tried_ever_less_often():
    """Each failed try after a passing probe doubles the wait (up to backoff_max_s), as a failed probe does: a
    sidecar healthy to its health check whose steps all fail is not tried again every backoff_initial_s, each try
    a step sent into its deadline, for as long as it stays so."""
    clock, probed = _Clock(), []
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, backoff_initial_s=0.5, backoff_max_s=3.0),
                       lambda deadline_s: probed.append(clock.now) or True, clock)
    b.record_failure("x")
    waits = [b.retry_at - clock.now]
    for _ in range(4):
        clock.now = b.retry_at
        assert b.allow() and b.state is BreakerState.HALF_OPEN
        b.record_failure("the try failed")
        waits.append(b.retry_at - clock.now)
    assert waits == [0.5, 1.0, 2.0, 3.0, 3.0] and len(probed) == 4


def test_failures_recorded_while_open_neither_reopen_it_nor_put_its_probe_off():
    """Once open, a failure the caller still records (a shim error while settling a late step, closing the data
    plane) is counted, but it is no new opening, and the probe stays due when the wait set at the opening ends:
    pushed back by each such failure, a rank that keeps recording them would never be probed again."""
    clock = _Clock()
    b = CircuitBreaker(BreakerConfig(failure_threshold=2, backoff_initial_s=0.5), lambda deadline_s: True, clock)
    b.record_failure("x")
    b.record_failure("x")
    retry_at = b.retry_at
    clock.now += 0.4
    b.record_failure("while open")
    assert b.state is BreakerState.OPEN and b.opened == 1 and b.failures == 3 and b.retry_at == retry_at
    clock.now = retry_at
    assert b.allow() and b.state is BreakerState.HALF_OPEN


def test_the_probe_is_bounded_by_probe_deadline_s():
    """The probe runs on the engine's step thread: each of its calls gets probe_deadline_s, not a wait of its own."""
    clock, deadlines = _Clock(), []
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, backoff_max_s=3.0, probe_deadline_s=0.125),
                       lambda deadline_s: deadlines.append(deadline_s) or False, clock)
    b.record_failure("x")
    clock.now = b.retry_at
    assert not b.allow() and deadlines == [0.125]


def test_only_consecutive_failures_open_the_breaker():
    """A success starts the count again: failures spread over a healthy run (one timed-out step now and then) must
    not add up to an opening, or every sidecar would be cut off once its engine had run long enough."""
    clock = _Clock()
    b = CircuitBreaker(BreakerConfig(failure_threshold=3), lambda deadline_s: True, clock)
    for _ in range(4):
        b.record_failure("x")
        b.record_failure("x")
        b.record_success()
    b.record_failure("x")
    b.record_failure("x")
    assert b.state is BreakerState.CLOSED and b.opened == 0 and b.failures == 2
    b.record_failure("x")
    assert b.state is BreakerState.OPEN and b.opened == 1


def test_a_breaker_waits_on_the_monotonic_clock_unless_given_one():
    """retry_at is read against this clock: on the wall clock, an NTP step or an operator setting the time back by
    an hour kept an open breaker from probing for that hour (every step fell back), and one set forward ended its
    backoff at once."""
    import inspect
    import time

    assert inspect.signature(CircuitBreaker).parameters["clock"].default is time.monotonic
