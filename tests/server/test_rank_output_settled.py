"""A gRPC answer naming an output region on a GPU leaves only once the device has written it.

Over the doorbell the engine's stream waits on the sidecar's output_event; over gRPC (unary or stream)
there is no event, and the rank answered as soon as the step was launched: an engine reading its output
region at once could read hidden states (and rely on block K/V) not yet written. Inline answers were
always safe (.cpu() waits). These pin the wiring on a CPU rank, with the device's wait recorded.

That wait is the step's device work, so it is inside the answer's StepTimings (compute_ns, output_ns,
total_ns) and the `compute` and `total` latencies, as an inline answer's .cpu() always was: taken after
them, a GPU rank's gRPC answers in a region reported only the launch, and the device time nowhere.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server import rank as rank_mod
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop
from dspark_sidecar.server.rendezvous import Verdict
from dspark_sidecar.server.validate import Step, host_meta
from helpers.rank_fakes import FakeModel

DEVICE_S = 0.05  # the recorded device wait's stand-in: the GPU finishing the step


class _Memory:
    """The output region: one buffer every slice resolves to."""

    def __init__(self) -> None:
        self.buf = torch.zeros(7, 4)

    def resolve(self, region, dtype, shape, field):
        return self.buf


@pytest.fixture
def loop(monkeypatch):
    """A CPU rank loop at TP 1 whose steps take the real path, answering in a region when the request names one."""

    def validate(req, cfg, mem, max_reqs, indices=True, out_dtype=None, answer_limit=0, private=False):
        pos = torch.arange(0, 7)
        meta = StepMetadata(torch.tensor([7], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), pos.clone())
        return Step(req.step_id, 1, pos, torch.zeros(7, 4), None, meta, SimpleNamespace(layers=[]),
                    req.output if req.HasField("output") else None, host_meta(pos, meta))

    monkeypatch.setattr(rank_mod, "validate_step", validate)
    ctx = RankContext(0, 1, SimpleNamespace(), FakeModel(), None, _Memory(), Metrics(0), 8)
    rank = RankLoop(ctx, SimpleNamespace(agree=lambda post: Verdict(True, "", 0)), None)  # type: ignore[arg-type]
    waits: list[int] = []

    def device_done() -> None:  # what a GPU rank gets: torch.cuda.synchronize of its device
        time.sleep(DEVICE_S)
        waits.append(1)

    rank._device_done = device_done
    yield SimpleNamespace(rank=rank, waits=waits, memory=ctx.memory)
    rank.close()


def _req(step_id: int, region: bool) -> pb.DraftStepRequest:
    req = pb.DraftStepRequest(step_id=step_id, num_requests=1)
    if region:
        req.output.CopyFrom(pb.RegionSlice(region_id=1, offset_bytes=0))
    return req


def test_a_unary_or_stream_answer_in_a_region_waits_for_the_device(loop):
    assert loop.rank.submit(_req(1, region=True)).result(timeout=10).hidden_states.HasField("region")
    assert loop.waits == [1]
    req = _req(2, region=True)
    assert loop.rank.answer(req, loop.rank.submit(req)).hidden_states.HasField("region")  # the stream path
    assert loop.waits == [1, 1]
    assert torch.all(loop.memory.buf == 2.0)  # the step's rows are in the region


def test_an_inline_answer_and_a_doorbell_answer_do_not_wait(loop):
    assert loop.rank.submit(_req(1, region=False)).result(timeout=10).hidden_states.HasField("data")
    assert loop.rank.answer_now(_req(2, region=True)).hidden_states.HasField("region")  # the doorbell's event
    assert loop.waits == []


def test_the_device_wait_is_counted_in_the_step_s_compute_and_total(loop):
    t = loop.rank.submit(_req(1, region=True)).result(timeout=10).timings
    assert loop.waits == [1]
    floor = int(DEVICE_S * 1e9 * 0.9)
    assert t.output_ns >= floor and t.compute_ns >= t.output_ns and t.total_ns >= t.compute_ns, t
    assert t.total_ns == t.queue_ns + t.rendezvous_ns + t.compute_ns, t
    compute = {s.name: s for s in loop.rank.ctx.metrics.latencies_pb()}["compute"]
    assert compute.count == 1 and compute.p50_ns >= floor, compute
