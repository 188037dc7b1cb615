"""DoorbellTransport's own judgements: which steps fit its buffers, when it is alive, no ring after its stream ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.client.connection import StreamBroken
from dspark_sidecar.client.doorbell_transport import DoorbellTransport
from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb

MAX_REQS, MAX_PAGES, WIDTH = 4, 8, 32


def _transport(alive: bool = True, bell_alive: bool = True) -> DoorbellTransport:
    """A transport over stand-ins: buffers for MAX_REQS requests of MAX_PAGES pages, a bell that records."""
    t = DoorbellTransport.__new__(DoorbellTransport)
    t.max_reqs, t.max_pages = MAX_REQS, MAX_PAGES
    t.buffers = SimpleNamespace(embeds=torch.zeros(7 * MAX_REQS, WIDTH))
    t.liveness = SimpleNamespace(alive=alive, end=None if alive else StreamBroken(None, "the sidecar's stream ended"))
    t.bell = SimpleNamespace(alive=bell_alive, events=[])
    t.bell.order_inputs = lambda: t.bell.events.append("order")
    t.bell.send_bytes = lambda data, key: t.bell.events.append("ring")
    t._view = t._out = None
    return t


def _meta(reqs: int, pages: int) -> StepMetadata:
    return StepMetadata(torch.full((reqs,), 7, dtype=torch.int32), torch.zeros(reqs, pages, dtype=torch.int32),
                        torch.zeros(7 * reqs, dtype=torch.int64))


@pytest.mark.parametrize("reqs, pages, width, fits", [
    (MAX_REQS, MAX_PAGES, WIDTH, True),  # the registered sizes themselves
    (1, 1, WIDTH, True),
    (MAX_REQS + 1, MAX_PAGES, WIDTH, False),
    (MAX_REQS, MAX_PAGES + 1, WIDTH, False),
    (MAX_REQS, MAX_PAGES, WIDTH + 1, False),
])
def test_a_step_fits_the_doorbell_exactly_when_the_registered_buffers_hold_it(reqs, pages, width, fits):
    """A step that does not fit goes over the gRPC stream. Said to fit, a wider block table failed in the
    staging (DataPlaneError) as a shim error counted against the breaker, and a full-size step (max_reqs
    requests) read as too large went over the stream for nothing."""
    assert _transport().fits(reqs, _meta(reqs, pages), width) is fits


@pytest.mark.parametrize("liveness, bell, alive", [(True, True, True), (False, True, False), (True, False, False)])
def test_the_transport_is_alive_only_while_both_its_page_and_its_liveness_stream_are(liveness, bell, alive):
    """The shim rings only an alive transport: a page the sidecar closed (DoorbellClosed) or a sidecar whose
    stream ended answers no ring."""
    assert _transport(alive=liveness, bell_alive=bell).alive is alive


def test_no_step_is_rung_once_the_liveness_stream_has_ended():
    """settled() reads an ended liveness stream as "the sidecar is done with the step" (a dead process writes
    nothing), so nothing may be rung after the end: a step rung then would count as settled before anything
    said it had run. send refuses before any copy or ring, with the stream's own reason."""
    t = _transport(alive=False)
    t.buffers.stage = lambda *a: pytest.fail("inputs copied into the regions of a gone sidecar")
    with pytest.raises(StreamBroken, match="the sidecar's stream ended"):
        t.send(pb.DraftStepRequest(step_id=3), torch.zeros(7, WIDTH), torch.zeros(7, dtype=torch.int64), _meta(1, 1))
    assert t.bell.events == []


@pytest.mark.parametrize("change, refused", [
    ({}, None),
    ({"offset_bytes": 8}, "not in the output region the step named"),
    ({"region_id": 5}, "not in the output region the step named"),
    ({"dtype": pb.DTYPE_BF16}, "of dtype"),
    ({"shape": [7, WIDTH + 1]}, "of dtype"),
], ids=["good", "another offset", "another region", "another dtype", "another shape"])
def test_an_answer_is_taken_only_where_and_as_the_step_asked_for_it(change, refused):
    """check_answer: the hidden states must be the output region from offset 0, [rows, width] of the buffers'
    dtype. Each of these otherwise good answers read the region at the wrong rows, or its bytes as another dtype or
    shape; the whole-message comparison that passes a good answer at once must not pass any of them."""
    t = _transport()
    t.buffers.hidden_id, t.buffers.dtype, t._answer_ref = 6, torch.float32, {}
    h = codec.region_tensor_ref(torch.float32, (7, WIDTH), 6, 0)
    for field in ("offset_bytes", "region_id"):
        if field in change:
            setattr(h.region, field, change[field])
    if "dtype" in change:
        h.dtype = change["dtype"]
    if "shape" in change:
        h.shape[:] = change["shape"]
    for _ in range(2):  # the second time through the kept reference answer
        if refused is None:
            t.check_answer(pb.DraftStepResponse(step_id=4, hidden_states=h), 4, 7, WIDTH)
        else:
            with pytest.raises(ValueError, match=refused):
                t.check_answer(pb.DraftStepResponse(step_id=4, hidden_states=h), 4, 7, WIDTH)
