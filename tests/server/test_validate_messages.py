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


def _refusal(ids=None, lens=None, edit=None) -> SidecarError:
    """validate_step's refusal of a valid two-request step with its input_ids or seq_lens replaced, or the
    request changed by edit(req)."""
    cfg = load_config("tiny")
    st = scenario.random_step(cfg, [5, 30], PS, PAGES, torch.randn(cfg.vocab_size, cfg.hidden_size), seed=1)
    req = pb.DraftStepRequest(step_id=1, binding_id=3, binding_generation=1, num_requests=2,
                              positions=codec.to_tensor_ref(st.positions),
                              input_ids=codec.to_tensor_ref(st.input_ids if ids is None else ids(st.input_ids.clone())),
                              seq_lens=codec.to_tensor_ref(st.meta.seq_lens if lens is None else lens(st.meta.seq_lens.clone())),
                              block_tables=codec.to_tensor_ref(st.meta.block_tables),
                              slot_mapping=codec.to_tensor_ref(st.meta.slot_mapping))
    if edit is not None:
        edit(req)
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


@pytest.mark.parametrize("row,value", [(9, 2048 + 5), (3, -1), (7, 2048)],
                         ids=["past the vocabulary", "negative", "first row of request 1"])
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


@pytest.mark.parametrize("count", [0, 9], ids=["none", "past --max-reqs"])
def test_a_request_count_outside_1_to_max_reqs_is_out_of_range(count):
    """sidecar.proto (StepError.code): OUT_OF_RANGE, field num_requests. A step of 0 requests let through has
    empty tensors, and the index checks' reductions over them raise a ValueError, which exits the rank."""
    def put(req):
        req.num_requests = count
    err = _refusal(edit=put)
    assert (err.code, err.field) == (grpc.StatusCode.OUT_OF_RANGE, "num_requests"), err.message
    assert f"{count} outside 1..8" in err.message, err.message


def test_positions_of_a_row_count_no_multiple_of_the_block_say_so():
    """15 rows for 2 requests: named as rows that no number of requests has, not only as the wrong shape."""
    def put(req):
        req.positions.CopyFrom(codec.to_tensor_ref(torch.arange(15, dtype=torch.int64)))
    err = _refusal(edit=put)
    assert (err.code, err.field) == (grpc.StatusCode.INVALID_ARGUMENT, "positions"), err.message
    assert "15 rows is not a multiple of 7" in err.message, err.message


@pytest.mark.parametrize("rows", [1, 3], ids=["one row for two requests", "three rows for two requests"])
def test_a_block_table_whose_row_count_is_not_num_requests_is_invalid_argument(rows):
    """[R, max_pages] (sidecar.proto): a table of another row count, its bytes matching its own shape, is refused
    as block_tables. Let through to the index checks, 3 rows met the 2 requests' lengths in a NumPy broadcast that
    raised ValueError (no SidecarError: the rank exits), and 1 row was broadcast: checked as both requests' row."""
    def put(req):
        tables = codec.from_tensor_ref(req.block_tables, "block_tables")
        req.block_tables.CopyFrom(codec.to_tensor_ref(tables[:1] if rows == 1 else torch.cat([tables, tables[:1]])))
    err = _refusal(edit=put)
    assert (err.code, err.field) == (grpc.StatusCode.INVALID_ARGUMENT, "block_tables"), err.message
    assert f"shape [{rows}, " in err.message and "expected [2, max_pages]" in err.message, err.message
