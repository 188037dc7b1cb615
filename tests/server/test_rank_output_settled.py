"""A gRPC answer naming an output region on a GPU leaves only once the device has written it.

Over the doorbell the engine's stream waits on the sidecar's output_event; over gRPC (unary or stream)
there is no event, and the rank answered as soon as the step was launched: an engine reading its output
region at once could read hidden states (and rely on block K/V) not yet written. Inline answers were
always safe (.cpu() waits). These pin the wiring on a CPU rank, with the device's wait recorded.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop


@pytest.fixture
def loop():
    """A CPU rank loop whose steps answer at once: in a region when the request names an output."""
    ctx = RankContext(0, 1, SimpleNamespace(), SimpleNamespace(device=torch.device("cpu")), None, None, Metrics(0), 8)
    rank = RankLoop(ctx, SimpleNamespace(), None)  # type: ignore[arg-type]
    waits: list[int] = []
    rank._device_done = lambda: waits.append(1)  # what a GPU rank gets: torch.cuda.synchronize of its device

    def run(req, *args, **kwargs):
        if req.HasField("output"):
            return pb.DraftStepResponse(step_id=req.step_id, hidden_states=codec.region_tensor_ref(
                torch.float32, (7, 4), req.output.region_id, req.output.offset_bytes))
        return pb.DraftStepResponse(step_id=req.step_id, hidden_states=codec.to_tensor_ref(torch.zeros(7, 4)))

    rank._run = run  # type: ignore[method-assign]
    yield SimpleNamespace(rank=rank, waits=waits)
    rank.close()


def _req(step_id: int, region: bool) -> pb.DraftStepRequest:
    req = pb.DraftStepRequest(step_id=step_id)
    if region:
        req.output.CopyFrom(pb.RegionSlice(region_id=1, offset_bytes=0))
    return req


def test_a_unary_or_stream_answer_in_a_region_waits_for_the_device(loop):
    assert loop.rank.submit(_req(1, region=True)).result(timeout=10).hidden_states.HasField("region")
    assert loop.waits == [1]
    assert loop.rank.answer(_req(2, region=True)).hidden_states.HasField("region")  # the stream path
    assert loop.waits == [1, 1]


def test_an_inline_answer_and_a_doorbell_answer_do_not_wait(loop):
    loop.rank.submit(_req(1, region=False)).result(timeout=10)
    loop.rank.answer_now(_req(2, region=True))  # the doorbell: its output_event orders the engine instead
    assert loop.waits == []
