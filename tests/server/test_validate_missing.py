"""A step missing one of its tensors is refused with that field named as missing, whichever it is."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.validate import validate_step

PS, PAGES = 16, 32


def _request(input_field: str) -> tuple[pb.DraftStepRequest, object]:
    cfg = load_config("tiny")
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size)
    st = scenario.random_step(cfg, [5, 30], PS, PAGES, embed, seed=1)
    inputs = {"inputs_embeds": st.inputs_embeds, "input_ids": st.input_ids}
    req = pb.DraftStepRequest(step_id=1, binding_id=3, binding_generation=1, num_requests=2,
                              positions=codec.to_tensor_ref(st.positions),
                              seq_lens=codec.to_tensor_ref(st.meta.seq_lens),
                              block_tables=codec.to_tensor_ref(st.meta.block_tables),
                              slot_mapping=codec.to_tensor_ref(st.meta.slot_mapping))
    getattr(req, input_field).CopyFrom(codec.to_tensor_ref(inputs[input_field]))
    return req, cfg


@pytest.mark.parametrize("input_field", ["inputs_embeds", "input_ids"])
@pytest.mark.parametrize("field", ["positions", "seq_lens", "block_tables", "slot_mapping", "input"])
def test_a_missing_tensor_is_named_as_missing(field, input_field):
    """block_tables alone was refused as "shape [], expected [R, max_pages]": an engine that sent no table
    read that it had sent a scalar one."""
    req, cfg = _request(input_field)
    req.ClearField(input_field if field == "input" else field)
    kv = SimpleNamespace(page_size=PS, num_pages=PAGES)
    mem = SimpleNamespace(check=lambda binding_id, generation: kv, layouts={}, resolve=None)
    with pytest.raises(SidecarError) as err:
        validate_step(req, cfg, mem, 8, out_dtype=torch.float32)
    want = "inputs_embeds" if field == "input" else field
    assert (err.value.code, err.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, want), err.value.message
    assert err.value.message.startswith(f"{want}: missing"), err.value.message
