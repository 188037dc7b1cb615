"""What sidecar.proto says a field means is what the rank loop does with it (deadline_ms, timings on failure)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dspark_sidecar.proto as proto_pkg
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop


def _comment(field_line: str) -> str:
    """The // comment block right above `field_line` in sidecar.proto, as one line of text."""
    text = (Path(proto_pkg.__file__).parent / "sidecar.proto").read_text()
    block = re.search(r"((?:[ \t]*//[^\n]*\n)+)[ \t]*" + re.escape(field_line), text).group(1)
    return " ".join(line.strip().lstrip("/").strip() for line in block.splitlines())


class _Recording:
    """A one-rank rendezvous that keeps every post and aborts it (the steps here are refused anyway)."""

    def __init__(self):
        self.posts = []

    def agree(self, post):
        self.posts.append(post)
        return SimpleNamespace(go=False, reason="recorded")


@pytest.fixture
def loop():
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    ctx = RankContext(0, 1, SimpleNamespace(), model, None, None, Metrics(0), 8)
    loop = RankLoop(ctx, _Recording(), None)  # type: ignore[arg-type]
    yield loop
    loop.close()


def test_deadline_ms_zero_is_documented_as_what_the_rank_does_with_it(loop):
    """0 posts the step with no deadline at all (expires_ns 0): there is no server default step deadline
    (only --rendezvous-ms, the wait for the peers' copies). The .proto said "0 = the server's default",
    and an engine trusting it sent steps that a stall could launch any time later."""
    loop.answer_now(pb.DraftStepRequest(step_id=1, num_requests=0, deadline_ms=0))
    loop.answer_now(pb.DraftStepRequest(step_id=2, num_requests=0, deadline_ms=50))
    none, some = loop.rendezvous.posts
    assert none.expires_ns == 0 and some.expires_ns > 0
    doc = _comment("uint32 deadline_ms = 21;")
    assert "0 = the server's default" not in doc and "0: no deadline" in doc, doc
    # The deadline decides whether the step may launch; a launched step is not cut short.
    assert "covers rendezvous and compute" not in doc, doc


@pytest.mark.parametrize("path", ["stream", "doorbell"])
def test_a_failed_step_s_timings_are_documented_as_sent(loop, path):
    """A failed step's answer carries no StepTimings from the rank loop (the doorbell adds only its two
    CLOCK_MONOTONIC stamps); the .proto said they were "also set, as far as it got, on failure"."""
    req = pb.DraftStepRequest(step_id=3, num_requests=0)
    resp = loop.answer(req) if path == "stream" else loop.answer_now(req)
    assert resp.WhichOneof("result") == "error"
    assert not resp.HasField("timings")
    doc = _comment("StepTimings timings = 4;")
    assert "as far as it got" not in doc and "Not set on a failed step" in doc, doc


def test_the_draft_steps_stream_s_documented_ends_include_a_message_that_does_not_parse():
    """The stream ends INVALID_ARGUMENT at a message that does not parse (no step id to answer it under:
    server/errors.py, tests/server/test_rpc_fuzz.py); the .proto listed the ways it ends "only" without it."""
    doc = _comment("rpc DraftSteps(stream DraftStepRequest)")
    assert "ends only when" in doc and "does not parse" in doc, doc
