"""The shim's EngineConfig: values the wire cannot carry are refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.client.binding import Binding
from dspark_sidecar.client.config import EngineConfig, EngineConfigError
from dspark_sidecar.client.shim import DrafterShim
from helpers.engine_fakes import step_inputs


@pytest.mark.parametrize("deadline_s", [0.0005, 0.0009999])
def test_a_step_deadline_under_one_millisecond_is_refused(deadline_s):
    """DraftStepRequest.deadline_ms carries whole milliseconds and 0 there is the sidecar's "no deadline":
    a step deadline under 1 ms (DSPARK_STEP_DEADLINE_MS=0.5) was accepted and sent as 0, so the sidecar
    ran each step with no deadline at all while the shim gave up on it after half a millisecond."""
    with pytest.raises(EngineConfigError, match="step_deadline_s: must be at least 0.001 s"):
        EngineConfig(tp_size=4, step_deadline_s=deadline_s)


@pytest.mark.parametrize("deadline_s, sent_ms", [(0.001, 1), (0.5, 500), (2.0, 2000)])
def test_a_one_millisecond_step_deadline_is_sent_as_one(deadline_s, sent_ms):
    """Read off the request DrafterShim._request builds: the test recomputed the shim's conversion itself, so
    a shim sending whole seconds (0 for any deadline under 1 s: no deadline at all) passed it."""
    shim = SimpleNamespace(config=EngineConfig(tp_size=4, step_deadline_s=deadline_s),
                           binder=SimpleNamespace(current=Binding(1, 1, ())))
    _, pos, meta = step_inputs(1)
    req, _ = DrafterShim._request(shim, 1, 1, pos, torch.zeros(7, 8), meta, inline=False)
    assert req.deadline_ms == sent_ms
