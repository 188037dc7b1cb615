"""The step counters say what they mean: `invalid` is a bad request; a step the rank itself refuses
(shutting down, --strict-refusal) is `refused`, in GetStatus's Counters and on the Prometheus endpoint."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
import torch
from prometheus_client import generate_latest

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop
from helpers.rank_fakes import RefusingRendezvous


@pytest.fixture
def loop():
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    ctx = RankContext(0, 2, SimpleNamespace(), model, None, None, Metrics(0), 8)
    loop = RankLoop(ctx, RefusingRendezvous(), None)  # type: ignore[arg-type]
    yield loop
    loop.close()


def _series(m: Metrics, result: str) -> float:
    text = generate_latest(m.registry).decode()
    line = next(ln for ln in text.splitlines() if ln.startswith(f'dspark_steps_total{{rank="0",result="{result}"}}'))
    return float(line.rsplit(" ", 1)[1])


def test_steps_refused_while_shutting_down_are_refused_not_invalid(loop):
    assert loop.stop_steps(timeout_s=5)
    resp = loop.answer_now(pb.DraftStepRequest(step_id=1, num_requests=1))  # the doorbell's path
    assert resp.error.reason == "SHUTTING_DOWN"
    err = loop.submit(pb.DraftStepRequest(step_id=2, num_requests=1)).exception(timeout=5)  # gRPC's path
    assert isinstance(err, SidecarError) and err.reason == "SHUTTING_DOWN"
    m = loop.ctx.metrics
    c = m.counters_pb()
    assert (c.steps_invalid, c.steps_refused, c.steps_aborted) == (0, 2, 0)
    assert (_series(m, "invalid"), _series(m, "refused")) == (0.0, 2.0)


def test_a_step_the_strict_refusal_turns_away_is_refused_not_invalid(loop):
    loop.ctx.refusal = "TP n != 4"
    resp = loop.answer_now(pb.DraftStepRequest(step_id=1, num_requests=1))
    assert resp.error.reason == "REFUSED"
    assert resp.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    c = loop.ctx.metrics.counters_pb()
    assert (c.steps_invalid, c.steps_refused) == (0, 1)
    assert _series(loop.ctx.metrics, "refused") == 1.0


def test_a_bad_request_is_still_invalid(loop):
    resp = loop.answer_now(pb.DraftStepRequest(step_id=1, num_requests=0))
    assert resp.error.reason == "OUT_OF_RANGE"
    c = loop.ctx.metrics.counters_pb()
    assert (c.steps_invalid, c.steps_refused) == (1, 0)
    assert (_series(loop.ctx.metrics, "invalid"), _series(loop.ctx.metrics, "refused")) == (1.0, 0.0)
