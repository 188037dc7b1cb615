"""A step whose inline answer cannot be sent is refused before it runs, and the stream goes on.

A step sent with input_ids is small, but its inline answer [7R, hidden] is not: past the server's
--max-message-bytes gRPC could not send it. The step ran (and wrote its K/V) all the same, the unary
caller got RESOURCE_EXHAUSTED "Sent message larger than max" (nothing about what to change), and on
DraftSteps the whole stream ended with it, though a failed step must not end the stream. Over the
doorbell, an inline answer past the page's capacity was also refused only after the step had run.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter import scenario
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import doorbell as page_words
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_sim import PAGE, DraftStream, EngineSim
from helpers.sidecar_proc import SidecarProcess

MAX_MESSAGE = 1 << 20  # the smallest --max-message-bytes
MAX_REQS = 256
PAGES = MAX_REQS + 8
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_cfg, tiny_ckpt, tiny_embed):
    tmp = tmp_path_factory.mktemp("answer_size")
    with SidecarProcess(tmp, tp=1, checkpoint=tiny_ckpt,
                        extra_args=["--max-reqs", str(MAX_REQS), "--max-message-bytes", str(MAX_MESSAGE)]) as sc:
        eng = EngineSim(tiny_cfg, [sc.socket(0)], PAGES, torch.float32)
        eng.bind()
        try:
            yield sc, eng, tiny_cfg, tiny_embed
        finally:
            eng.close()


def _ids_step(eng, cfg, embed, R: int, step_id: int, seed: int) -> pb.DraftStepRequest:
    """R one-page requests sent as input_ids: a request of a few KiB, an answer of 7 KiB per request."""
    step = scenario.random_step(cfg, [1] * R, PAGE, PAGES, embed, seed=seed)
    req = eng.request(0, step_id, step)
    req.input_ids.CopyFrom(codec.to_tensor_ref(step.input_ids))  # replaces inputs_embeds (a oneof)
    return req


def _answer_bytes(cfg, R: int) -> int:
    return layout.QPR * R * cfg.hidden_size * 4  # fp32 hidden states


def _kv(eng) -> list[torch.Tensor]:
    return [t.clone() for t in eng.kv_tensors(0)]


def test_an_answer_past_the_message_limit_is_refused_before_the_step_runs(rig):
    sc, eng, cfg, embed = rig
    R = MAX_REQS
    assert _answer_bytes(cfg, R) > MAX_MESSAGE  # the premise: 1.8 MB of hidden states
    req = _ids_step(eng, cfg, embed, R, 1, seed=1)
    assert req.ByteSize() < MAX_MESSAGE // 8
    before = _kv(eng)
    with pytest.raises(grpc.RpcError) as err:
        eng.stubs[0].DraftStep(req, timeout=TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    details = err.value.details()
    assert details.startswith("output: ") and "--max-message-bytes" in details and "output region" in details, details
    assert all(torch.equal(a, b) for a, b in zip(before, _kv(eng))), "refused, but the step wrote its K/V"

    # The largest R whose answer fits is answered.
    fits = next(r for r in range(R, 0, -1) if _answer_bytes(cfg, r) + 1024 <= MAX_MESSAGE)
    resp = eng.stubs[0].DraftStep(_ids_step(eng, cfg, embed, fits, 2, seed=2), timeout=TIMEOUT_S)
    assert tuple(resp.hidden_states.shape) == (layout.QPR * fits, cfg.hidden_size)


def test_the_stream_answers_a_too_large_step_with_a_step_error_and_goes_on(rig):
    sc, eng, cfg, embed = rig
    stream = DraftStream(eng.stubs[0])
    try:
        resp = stream.ask(_ids_step(eng, cfg, embed, MAX_REQS, 10, seed=3), TIMEOUT_S)
        assert resp is not None, f"the stream ended ({stream.end}) instead of answering the step"
        assert resp.HasField("error") and resp.step_id == 10, resp
        assert (resp.error.code, resp.error.field, resp.error.reason) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "output", "RESPONSE_TOO_LARGE"), resp.error
        resp = stream.ask(_ids_step(eng, cfg, embed, 3, 11, seed=4), TIMEOUT_S)
        assert resp is not None and resp.HasField("hidden_states") and resp.step_id == 11, (resp, stream.end)
    finally:
        stream.close()


def test_a_doorbell_answer_past_the_page_is_refused_before_the_step_runs(rig):
    from dspark_sidecar.client.dataplane import DoorbellChannel

    sc, eng, cfg, embed = rig
    assert _answer_bytes(cfg, 1) > page_words.MIN_CAPACITY
    bell = DoorbellChannel(eng.stubs[0], torch.device("cpu"), capacity=page_words.MIN_CAPACITY, gpu_word=False)
    try:
        before = _kv(eng)
        bell.send(_ids_step(eng, cfg, embed, 1, 20, seed=5))
        resp = bell.wait(0, TIMEOUT_S)
        assert resp is not None and resp.HasField("error"), resp
        assert (resp.error.code, resp.error.field, resp.error.reason) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], "output", "RESPONSE_TOO_LARGE"), resp.error
        assert all(torch.equal(a, b) for a, b in zip(before, _kv(eng))), "refused, but the step wrote its K/V"
    finally:
        bell.close()
    assert sc.health() == ["SERVING"]
