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
    resp = loop.answer(req, loop.submit(req)) if path == "stream" else loop.answer_now(req)
    assert resp.WhichOneof("result") == "error"
    assert not resp.HasField("timings")
    doc = _comment("StepTimings timings = 4;")
    assert "as far as it got" not in doc and "Not set on a failed step" in doc, doc


def test_the_draft_steps_stream_s_documented_ends_include_a_message_that_does_not_parse():
    """The stream ends INVALID_ARGUMENT at a message that does not parse (no step id to answer it under:
    server/errors.py, tests/server/test_rpc_fuzz.py); the .proto listed the ways it ends "only" without it."""
    doc = _comment("rpc DraftSteps(stream DraftStepRequest)")
    assert "ends only when" in doc and "does not parse" in doc, doc


def test_steps_failed_is_documented_as_the_count_no_living_rank_makes(loop, monkeypatch):
    """A step that fails inside its launch ends the rank (exit 3: a peer may be inside a collective), so
    Counters.steps_failed stays 0 (deploy/OPERATIONS.md says so of dspark_steps_total{result="failed"}). The
    .proto said it counts "Steps that failed while computing", and an operator watching it saw no failure."""
    exits = []

    def fail(*args, **kwargs):
        raise RuntimeError("kernel fault")

    def exit_(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(loop, "_run", fail)
    monkeypatch.setattr("dspark_sidecar.server.rank.os._exit", exit_)
    with pytest.raises(SystemExit):
        loop.answer_now(pb.DraftStepRequest(step_id=4, num_requests=1))
    assert exits == [3] and loop.ctx.metrics.counters_pb().steps_failed == 0
    doc = _comment("uint64 steps_failed = 4;")
    assert "stays 0" in doc and "ends the rank" in doc, doc


# Every RPC but GetStatus starts with servicer._require_same_node (memory, and the steps that write it).
SAME_NODE_RPCS = ("BindKV", "UnbindKV", "RegisterBuffers", "UnregisterBuffers", "AttachDoorbell", "DraftStep",
                  "DraftSteps")


def test_the_same_node_rule_and_the_stream_s_refusals_at_open_are_documented():
    """A peer off this node gets PERMISSION_DENIED (REMOTE_PEER) from every RPC but GetStatus, and a rank still
    loading ends a DraftSteps stream at once with UNAVAILABLE (LOADING). The .proto said "Same-node peers only"
    of AttachDoorbell and UnregisterBuffers alone, and listed the ways a DraftSteps stream ends "only" without
    either: an engine reading it took a stream that opened as a stream that serves."""
    import grpc

    from dspark_sidecar.server.app import LateServicer
    from dspark_sidecar.server.errors import SidecarError
    from dspark_sidecar.server.servicer import DrafterServicer

    def never(*_a, **_k):
        raise AssertionError("a remote peer's call got past the same-node check")

    fake = SimpleNamespace(loop=SimpleNamespace(submit=never, answer=never, exclusive=never), ctx=never)
    fake._require_same_node = lambda ctx, what="memory registration": DrafterServicer._require_same_node(
        fake, ctx, what)
    remote = SimpleNamespace(peer=lambda: "ipv4:192.0.2.2:40000")
    requests = {"DraftSteps": iter([pb.DraftStepRequest(step_id=1)])}
    for name in SAME_NODE_RPCS:
        method = getattr(DrafterServicer, name)
        with pytest.raises(SidecarError) as err:
            out = method(fake, requests.get(name, None), remote)
            next(out)  # DraftSteps is a generator: its checks run at the first step
        assert (err.value.code, err.value.reason) == (grpc.StatusCode.PERMISSION_DENIED, "REMOTE_PEER"), name
    with pytest.raises(SidecarError) as err:
        LateServicer().DraftSteps(iter([]), SimpleNamespace(peer=lambda: "unix:"))
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.UNAVAILABLE, "LOADING")

    service = _comment("service DrafterSidecar {")
    assert "GetStatus" in service and "PERMISSION_DENIED" in service and "REMOTE_PEER" in service, service
    stream = _comment("rpc DraftSteps(stream DraftStepRequest)")
    assert "ends only when" in stream, stream
    for words in ("UNAVAILABLE", "LOADING", "REMOTE_PEER"):
        assert words in stream, (words, stream)


def test_the_unary_step_s_cap_is_documented_as_the_servicer_s():
    """The .proto states the number of unary DraftStep calls a rank holds and the refusal past it."""
    from dspark_sidecar.server.servicer import MAX_STREAMS, MAX_UNARY_STEPS

    doc = _comment("rpc DraftStep(DraftStepRequest)")
    assert f"at most {MAX_UNARY_STEPS} unary DraftStep calls" in doc and "TOO_MANY_STEPS" in doc, doc
    assert "RESOURCE_EXHAUSTED" in doc, doc
    assert f"at most {MAX_STREAMS} open streams" in _comment("rpc DraftSteps(stream DraftStepRequest)")
