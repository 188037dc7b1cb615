"""A refused step's message names the request, row and value at fault, not only the rule it broke."""

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


def _refusal(ids=None, lens=None) -> SidecarError:
    """validate_step's refusal of a valid two-request step with its input_ids or seq_lens replaced."""
    cfg = load_config("tiny")
    st = scenario.random_step(cfg, [5, 30], PS, PAGES, torch.randn(cfg.vocab_size, cfg.hidden_size), seed=1)
    req = pb.DraftStepRequest(step_id=1, binding_id=3, binding_generation=1, num_requests=2,
                              positions=codec.to_tensor_ref(st.positions),
                              input_ids=codec.to_tensor_ref(st.input_ids if ids is None else ids(st.input_ids.clone())),
                              seq_lens=codec.to_tensor_ref(st.meta.seq_lens if lens is None else lens(st.meta.seq_lens.clone())),
                              block_tables=codec.to_tensor_ref(st.meta.block_tables),
                              slot_mapping=codec.to_tensor_ref(st.meta.slot_mapping))
    kv = SimpleNamespace(page_size=PS, num_pages=PAGES)
    mem = SimpleNamespace(check=lambda binding_id, generation: kv, layouts={}, resolve=None)
    with pytest.raises(SidecarError) as err:
        validate_step(req, cfg, mem, 8)
    return err.value


def _set(i: int, v: int):
    def put(t: torch.Tensor) -> torch.Tensor:
        t[i] = v
        return t
    return put


@pytest.mark.parametrize("row,value", [(9, 2048 + 5), (3, -1)], ids=["past the vocabulary", "negative"])
def test_an_input_id_outside_the_vocabulary_is_named_with_its_row_request_and_value(row, value):
    """It said "input_ids: ids must be in [0, 2048)": which of the step's n ids, of which request, the
    engine was left to find out itself."""
    err = _refusal(ids=_set(row, value))
    assert (err.code, err.field) == (grpc.StatusCode.OUT_OF_RANGE, "input_ids"), err.message
    assert f"row {row} (request {row // 7})" in err.message and f"id {value}" in err.message, err.message
    assert "[0, 2048)" in err.message, err.message


def test_a_sequence_length_below_the_block_is_named_with_its_request():
    """It said "every sequence length must be >= 7 (P + 7), got 3": not which request's; every other
    index refusal names it (positions, block_tables, slot_mapping)."""
    err = _refusal(lens=_set(1, 3))
    assert (err.code, err.field) == (grpc.StatusCode.INVALID_ARGUMENT, "seq_lens"), err.message
    assert "seq_lens[1] = 3" in err.message and ">= 7" in err.message, err.message
