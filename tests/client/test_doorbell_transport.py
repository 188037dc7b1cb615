"""DoorbellTransport's own judgements: which steps fit its buffers, when it is alive, no ring after its stream ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.client import doorbell_transport as dt
from dspark_sidecar.client.connection import StreamBroken
from dspark_sidecar.client.dataplane import DataPlaneError
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


@pytest.mark.parametrize("hidden, max_reqs", [(0, MAX_REQS), (WIDTH, 0)])
def test_buffers_that_cannot_be_made_are_refused_before_the_doorbell_is_attached(monkeypatch, hidden, max_reqs):
    """A StatusReport's hidden_size 0 (or no requests) is refused before any remote call: attached first, the
    sidecar rank polled a page the engine then dropped, and torch's refusal to view the region said nothing."""
    monkeypatch.setattr(dt, "DoorbellChannel", lambda *a, **k: pytest.fail("doorbell attached for no buffers"))
    conn = SimpleNamespace(stub=object(), endpoint="unix:/nonexistent/rank0.sock")
    with pytest.raises(DataPlaneError, match=f"no step buffers for hidden size {hidden} and {max_reqs} requests"):
        DoorbellTransport(conn, hidden, max_reqs, MAX_PAGES, torch.float32, torch.device("cpu"), 1.0)


def test_a_liveness_stream_that_cannot_be_opened_leaves_no_doorbell_or_buffers(monkeypatch):
    """The page attached and the regions registered, the idle stream's opening raises: both are released
    (the sidecar would keep them until it exits) and the error reaches the shim, which falls back to gRPC."""
    closed = []
    monkeypatch.setattr(dt, "DoorbellChannel", lambda *a, **k: SimpleNamespace(close=lambda: closed.append("bell")))
    monkeypatch.setattr(dt, "StepBuffers", lambda *a, **k: SimpleNamespace(close=lambda: closed.append("buffers")))

    def no_stream():
        raise RuntimeError("the step stream could not be opened (test)")

    conn = SimpleNamespace(stub=object(), endpoint="unix:/nonexistent/rank0.sock", stream=no_stream)
    with pytest.raises(RuntimeError, match="could not be opened"):
        DoorbellTransport(conn, WIDTH, MAX_REQS, MAX_PAGES, torch.float32, torch.device("cpu"), 1.0)
    assert closed == ["bell", "buffers"]


def test_a_good_answer_for_one_shape_is_not_kept_for_its_transpose():
    """check_answer keeps the good answer per (rows, width), in that order: kept under (width, rows), the
    answer good for [7, 16] passed for a step of [16, 7], whose rows it does not describe."""
    t = _transport()
    t.buffers.hidden_id, t.buffers.dtype, t._answer_ref = 6, torch.float32, {}
    answer = pb.DraftStepResponse(step_id=4, hidden_states=codec.region_tensor_ref(torch.float32, (7, 16), 6, 0))
    t.check_answer(answer, 4, 7, 16)
    with pytest.raises(ValueError, match="expected"):
        t.check_answer(answer, 4, 16, 7)


def test_the_kept_good_answers_stay_bounded():
    """One kept answer per step shape: an engine's R runs up to MAX_REQS_LIMIT (256) shapes, each a message
    kept; past 64 they are dropped and made again."""
    t = _transport()
    t.buffers.hidden_id, t.buffers.dtype, t._answer_ref = 6, torch.float32, {}
    for r in range(1, 101):
        rows = 7 * r
        t.check_answer(pb.DraftStepResponse(
            step_id=1, hidden_states=codec.region_tensor_ref(torch.float32, (rows, WIDTH), 6, 0)), 1, rows, WIDTH)
        assert len(t._answer_ref) <= 64


def test_an_answer_copied_out_once_is_the_engines_and_a_second_read_does_not_write_into_it():
    """hidden() hands the engine the tensor send() made for this answer, to keep as long as it likes: a second
    hidden() for the same answer (nothing in between) is a clone, never a copy into the tensor already handed out."""
    region = torch.zeros(7 * MAX_REQS, WIDTH)
    t = _transport()
    t.bell.copies_raw = True
    t.bell.copy_rows = lambda dst, src: dst.copy_(src)
    t.buffers.stage = lambda *a: SimpleNamespace(hidden=region[:7], fields=b"", launch_key=1)
    t.send(pb.DraftStepRequest(step_id=1), torch.zeros(7, WIDTH), torch.zeros(7, dtype=torch.int64), _meta(1, 1))
    region[:7] = 1.0
    first = t.hidden()
    region[:7] = 2.0  # the region as a later step leaves it
    second = t.hidden()
    assert bool((first == 1.0).all()), "the tensor handed to the engine was written again"
    assert second.data_ptr() != first.data_ptr() and bool((second == 2.0).all())
