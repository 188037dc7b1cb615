"""Open DraftSteps streams cannot starve a rank of the threads its other calls need.

Each open stream holds one of the rank's gRPC handler threads for as long as it lives. With 16
idle streams open (an engine that leaks streams across reconnects, a stray client) every later
call queued for a thread for ever: GetStatus, BindKV, even the health check (UNREACHABLE:
DEADLINE_EXCEEDED), so the engine hung on its next call and an orchestrator saw a dead rank.
Streams past the rank's limit are refused at once (RESOURCE_EXHAUSTED, naming the limit), and
the rank keeps answering everything else.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.servicer import MAX_STREAMS
from helpers.engine_sim import PAGE, DraftStream, EngineSim
from helpers.sidecar_proc import SidecarProcess
from helpers.waiting import wait_until

OPENED = 20  # more than the rank's 16 gRPC threads


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_cfg, tiny_ckpt, tiny_embed):
    tmp = tmp_path_factory.mktemp("stream_limit")
    with SidecarProcess(tmp, tp=1, checkpoint=tiny_ckpt) as sc:
        eng = EngineSim(tiny_cfg, [sc.socket(0)], 16, torch.float32)
        eng.bind()
        try:
            yield sc, eng, tiny_cfg, tiny_embed
        finally:
            eng.close()


def test_idle_streams_past_the_limit_are_refused_and_the_rank_answers_on(rig):
    sc, eng, cfg, embed = rig
    stub = eng.stubs[0]
    step = scenario.random_step(cfg, [3], PAGE, 16, embed, seed=1)
    streams = [DraftStream(stub) for _ in range(OPENED)]
    try:
        # The refused ones end by themselves; the others stay open, each holding a handler thread.
        wait_until(lambda: sum(s.end is not None for s in streams) >= OPENED - MAX_STREAMS, 10.0,
                   lambda: f"{OPENED - MAX_STREAMS} streams refused: {[s.end for s in streams]}", interval_s=0.05)
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=5.0)  # hung (DEADLINE_EXCEEDED) before
        assert status.serving, status.state
        assert sc.health() == ["SERVING"]
        ended = [s for s in streams if s.end is not None]
        assert len(ended) == OPENED - MAX_STREAMS, [s.end for s in streams]
        assert {s.end for s in ended} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        details = ended[0].call.details()
        assert f"{MAX_STREAMS} DraftSteps streams" in details and "close" in details, details
        # An open stream still serves steps.
        live = next(s for s in streams if s.end is None)
        resp = live.ask(eng.request(0, 1, step), timeout=30.0)
        assert resp is not None and resp.HasField("hidden_states"), resp
    finally:
        for s in streams:
            s.close()
    # Closed streams give their places back: a new one is served.
    answered: list = []
    wait_until(lambda: _served(stub, eng.request(0, 2, step), answered), 30.0,
               lambda: f"a stream opened after the others closed is served: {answered[-1:]}", interval_s=0.05)
    assert answered[-1][0].HasField("hidden_states"), answered[-1]


def _served(stub, req: pb.DraftStepRequest, answered: list) -> bool:
    """Whether a stream opened now is served (not refused for the limit): it answers req, where a refused one ends
    (its None). Not "still open half a second on": a refusal that reached the reader later (a loaded box) read as
    served, and the step then went to a stream the rank had refused. Appends (the answer, how the stream ended)."""
    s = DraftStream(stub)
    try:
        resp = s.ask(req, timeout=30.0)
    finally:
        s.close()
    answered.append((resp, s.end))
    return resp is not None
