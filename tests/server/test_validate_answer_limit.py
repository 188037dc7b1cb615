"""validate_step's answer limit: refused exactly when the inline answer would not fit, and its hint is true."""

from __future__ import annotations

import re
from types import SimpleNamespace

import grpc
import pytest
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.validate import ANSWER_OVERHEAD, validate_step

PS, PAGES = 16, 32


def _validate(R: int, limit: int, output: bool = False):
    """validate_step of a valid R-request input_ids step whose fp32 answer goes inline (output: into an output
    region slice), under `limit`."""
    cfg = load_config("tiny")
    st = scenario.random_step(cfg, [5] * R, PS, PAGES, torch.randn(cfg.vocab_size, cfg.hidden_size), seed=R)
    req = pb.DraftStepRequest(step_id=1, binding_id=3, binding_generation=1, num_requests=R,
                              positions=codec.to_tensor_ref(st.positions), input_ids=codec.to_tensor_ref(st.input_ids),
                              seq_lens=codec.to_tensor_ref(st.meta.seq_lens),
                              block_tables=codec.to_tensor_ref(st.meta.block_tables),
                              slot_mapping=codec.to_tensor_ref(st.meta.slot_mapping))
    if output:
        req.output.CopyFrom(pb.RegionSlice(region_id=7, offset_bytes=0))
    kv = SimpleNamespace(page_size=PS, num_pages=PAGES)
    mem = SimpleNamespace(check=lambda binding_id, generation: kv, layouts={},
                          resolve=lambda region, dtype, shape, field: torch.empty(shape, dtype=dtype))
    return validate_step(req, cfg, mem, 8, out_dtype=torch.float32, answer_limit=limit)


def test_a_step_is_refused_exactly_when_its_answer_and_header_pass_the_limit_and_the_hint_fits():
    """The answer carries a header besides its hidden states (ANSWER_OVERHEAD): a limit the states alone fit
    but not with it must refuse the step before it runs (else gRPC fails the answer after the K/V writes),
    and the refusal's "at most N requests per step" must name a step size the same limit serves."""
    R = 2
    states = layout.QPR * R * load_config("tiny").hidden_size * 4
    assert _validate(R, states + ANSWER_OVERHEAD).num_reqs == R  # fits, header included
    with pytest.raises(SidecarError) as err:
        _validate(R, states + ANSWER_OVERHEAD - 1)  # the states fit; with the header they do not
    assert (err.value.code, err.value.field) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "output"), err.value.message
    most = int(re.search(r"at most (\d+) requests per step", err.value.message).group(1))
    assert most == R - 1, err.value.message
    assert _validate(most, states + ANSWER_OVERHEAD - 1).num_reqs == most  # the hint is served


def test_a_step_answering_into_an_output_slice_is_not_held_to_the_inline_limit():
    """The refusal tells the engine to send an output region slice: such a step's answer carries no hidden
    states, whatever their size, and must be served under a limit the inline ones pass."""
    R = 2
    step = _validate(R, ANSWER_OVERHEAD, output=True)
    assert step.num_reqs == R and step.output is not None
