"""The shim's EngineConfig: values the wire cannot carry are refused by name."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.client.binding import Binding
from dspark_sidecar.client.config import BreakerConfig, EngineConfig, EngineConfigError
from dspark_sidecar.client.shim import DrafterShim
from helpers.engine_fakes import step_inputs


@pytest.mark.parametrize("deadline_s", [0.0005, 0.0009999])
def test_a_step_deadline_under_one_millisecond_is_refused(deadline_s):
    """DraftStepRequest.deadline_ms carries whole milliseconds and 0 there is the sidecar's "no deadline":
    a step deadline under 1 ms (DSPARK_STEP_DEADLINE_MS=0.5) was accepted and sent as 0, so the sidecar
    ran each step with no deadline at all while the shim gave up on it after half a millisecond."""
    with pytest.raises(EngineConfigError, match="step_deadline_s: must be at least 0.001 s"):
        EngineConfig(tp_size=4, step_deadline_s=deadline_s)


@pytest.mark.parametrize("deadline_s, sent_ms", [(0.001, 1), (0.5, 500), (2.0, 2000), (1.001, 1001), (0.0015, 1)])
def test_a_one_millisecond_step_deadline_is_sent_as_one(deadline_s, sent_ms):
    """Read off the request DrafterShim._request builds: the test recomputed the shim's conversion itself, so
    a shim sending whole seconds (0 for any deadline under 1 s: no deadline at all) passed it."""
    shim = SimpleNamespace(config=EngineConfig(tp_size=4, step_deadline_s=deadline_s),
                           binder=SimpleNamespace(current=Binding(1, 1, ())))
    _, pos, meta = step_inputs(1)
    req, _ = DrafterShim._request(shim, 1, 1, pos, torch.zeros(7, 8), meta, inline=False)
    assert req.deadline_ms == sent_ms


@pytest.mark.parametrize("make, field", [
    (lambda v: EngineConfig(tp_size=4, step_deadline_s=v), "step_deadline_s"),
    (lambda v: EngineConfig(tp_size=4, bind_deadline_s=v), "bind_deadline_s"),
    (lambda v: EngineConfig(tp_size=4, late_grace_s=v), "late_grace_s"),
    (lambda v: EngineConfig(tp_size=4, connect_deadline_s=v), "connect_deadline_s"),
    (lambda v: BreakerConfig(backoff_initial_s=v), "breaker.backoff_initial_s"),
    (lambda v: BreakerConfig(backoff_max_s=v), "breaker.backoff_max_s"),
    (lambda v: BreakerConfig(probe_deadline_s=v), "breaker.probe_deadline_s"),
])
@pytest.mark.parametrize("value", ["2", None, True, float("inf"), 3601.0, 0, 0.0, -0.5])
def test_a_wait_that_is_no_number_is_named(make, field, value):
    """The waits were only range-checked: a string or None raised TypeError from `0 < v` (a traceback naming
    no field, which the vLLM plug-in's EngineConfigError handler let through), and True passed as a 1 s wait.
    The int fields beside them already refused a bool. Every wait is bounded (at most 3600 s): an infinite one
    never ends, and gRPC fails a call with an infinite timeout at once. And above 0: a gRPC call with a timeout of
    0 fails at once (DEADLINE_EXCEEDED), and a backoff of 0 stays 0 as it doubles (an open breaker probed on
    every step)."""
    with pytest.raises(EngineConfigError, match=f"^{re.escape(field)}: must be above 0"):
        make(value)


@pytest.mark.parametrize("field", ["tp_size", "dp_size", "pp_size", "required_tp", "max_catchup_binds", "max_reqs"])
def test_a_count_given_as_true_is_refused(field):
    """bool is an int to isinstance: True passed as a count of 1 (a TP size, a request limit)."""
    kw = {"tp_size": 4, field: True}
    with pytest.raises(EngineConfigError, match=f"^{field}: must be a positive integer, got True"):
        EngineConfig(**kw)


def test_the_agreement_outwaits_a_live_peer_probing_its_sidecar():
    """A rank whose breaker is open probes its sidecar before the pre-flight (a health Check, then a GetStatus
    when it answers NOT_SERVING, each bounded by probe_deadline_s), and again in a catch-up after it: its peers
    wait at the next agreement meanwhile. The wait counted the binds, registrations and the step but not the
    probes, so with a probe_deadline_s of 30 s (BreakerConfig takes up to 3600) it stayed 65 s while a live
    peer could take two probes (120 s) and a reconnect: its peers raised AgreementTimeout into the engine."""
    cfg = EngineConfig(tp_size=4, breaker=BreakerConfig(probe_deadline_s=30.0, backoff_max_s=30.0))
    probes = 2 * 2 * cfg.breaker.probe_deadline_s
    live = probes + cfg.connect_deadline_s + cfg.bind_deadline_s
    assert cfg.agreement_timeout_s > live
    # The defaults' probes (0.25 s) add one second: 66 s, as README and FAILURE_MODES.md say.
    assert EngineConfig(tp_size=4).agreement_timeout_s == 66.0
    short = dict(step_deadline_s=0.1, late_grace_s=0.1, connect_deadline_s=0.1, bind_deadline_s=0.1)
    assert EngineConfig(tp_size=4, **short).agreement_timeout_s == 60.0  # 60 s at least, no more
    with pytest.raises(EngineConfigError, match="^breaker: must be a BreakerConfig"):
        EngineConfig(tp_size=4, breaker={"probe_deadline_s": 30.0})  # type: ignore[arg-type]
