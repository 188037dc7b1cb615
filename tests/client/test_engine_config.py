"""The shim's EngineConfig: values the wire cannot carry are refused by name."""

from __future__ import annotations

import pytest

from dspark_sidecar.client.config import EngineConfig, EngineConfigError


@pytest.mark.parametrize("deadline_s", [0.0005, 0.0009999])
def test_a_step_deadline_under_one_millisecond_is_refused(deadline_s):
    """DraftStepRequest.deadline_ms carries whole milliseconds and 0 there is the sidecar's "no deadline":
    a step deadline under 1 ms (DSPARK_STEP_DEADLINE_MS=0.5) was accepted and sent as 0, so the sidecar
    ran each step with no deadline at all while the shim gave up on it after half a millisecond."""
    with pytest.raises(EngineConfigError, match="step_deadline_s: must be at least 0.001 s"):
        EngineConfig(tp_size=4, step_deadline_s=deadline_s)


def test_a_one_millisecond_step_deadline_is_sent_as_one():
    cfg = EngineConfig(tp_size=4, step_deadline_s=0.001)
    assert int(cfg.step_deadline_s * 1000) == 1  # DrafterShim._request's deadline_ms
