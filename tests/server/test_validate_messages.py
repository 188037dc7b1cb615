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


def _shape(field: str, shape: tuple[int, ...]):
    """An edit giving `field` a tensor of `shape` (zeros of its own dtype): bytes that match the shape sent."""
    def put(req):
        ref = getattr(req, field)
        dtype = codec.dtype_from_proto(ref.dtype, field)
        ref.CopyFrom(codec.to_tensor_ref(torch.zeros(shape, dtype=dtype)))
    return put


def _requests(count: int):
    def put(req):
        req.num_requests = count
    return put


@pytest.mark.parametrize("edit,field,want", [
    (_requests(3), "positions", "shape [14], expected [21] (7 rows for each of num_requests = 3)"),
    (_shape("seq_lens", (3,)), "seq_lens", "shape [3], expected [2] (one per request, num_requests = 2)"),
    (_shape("block_tables", (3, 4)), "block_tables", "shape [3, 4], expected [2, max_pages] (a row per request, "
                                                     "num_requests = 2)"),
    (_shape("slot_mapping", (21,)), "slot_mapping", "shape [21], expected [14] (7 rows for each of num_requests = 2)"),
    (_shape("input_ids", (7,)), "input_ids", "shape [7], expected [14] (7 rows for each of num_requests = 2)"),
], ids=["num_requests past the tensors", "seq_lens", "block_tables", "slot_mapping", "input_ids"])
def test_a_shape_that_num_requests_decides_names_num_requests(edit, field, want):
    """"positions: shape [14], expected [21]" was all an engine that miscounted its step's requests (num_requests 3
    for two requests' tensors) read: the field named was right, and nothing said that 21 came from num_requests."""
    err = _refusal(edit=edit)
    assert (err.code, err.field) == (grpc.StatusCode.INVALID_ARGUMENT, field), err.message
    assert err.message == f"{field}: {want}", err.message


def test_inputs_embeds_of_another_width_name_the_drafters_hidden_size():
    def put(req):
        req.ClearField("input_ids")
        req.inputs_embeds.CopyFrom(codec.to_tensor_ref(torch.zeros(14, 128)))
    err = _refusal(edit=put)
    assert (err.code, err.field) == (grpc.StatusCode.INVALID_ARGUMENT, "inputs_embeds"), err.message
    assert err.message == ("inputs_embeds: shape [14, 128], expected [14, 256] (7 rows for each of num_requests = 2, "
                           "each of the drafter's hidden_size 256)"), err.message


@pytest.mark.parametrize("rows", [-1, -(2**63)], ids=["-1", "int64 min"])
def test_positions_of_a_negative_row_count_are_not_called_rows(rows):
    """A negative first dimension was refused as "-1 rows is not a multiple of 7": no count of rows at all."""
    def put(req):
        req.positions.ClearField("shape")
        req.positions.shape.append(rows)
    err = _refusal(edit=put)
    assert (err.code, err.field) == (grpc.StatusCode.INVALID_ARGUMENT, "positions"), err.message
    assert err.message.startswith(f"positions: shape [{rows}], expected [14]"), err.message


def _slot(row: int, value):
    """An edit setting slot_mapping[row] to value(slots, cache slots)."""
    def put(req):
        slots = codec.from_tensor_ref(req.slot_mapping, "slot_mapping", writable=True)
        slots[row] = value(slots, PS * PAGES)
        req.slot_mapping.CopyFrom(codec.to_tensor_ref(slots))
    return put


# Row 7: request 1's first row (a count of 8 rows a request would say request 0).
@pytest.mark.parametrize("edit,code,rest", [
    (_slot(7, lambda s, n: n), grpc.StatusCode.OUT_OF_RANGE, f"slot {PS * PAGES} outside the bound cache's"),
    (_slot(7, lambda s, n: -1), grpc.StatusCode.OUT_OF_RANGE, "slot -1 outside the bound cache's"),
    (_slot(7, lambda s, n: (int(s[7]) + PS) % n), grpc.StatusCode.INVALID_ARGUMENT, "does not match block_tables"),
], ids=["past the cache", "negative", "another page's"])
def test_a_wrong_slot_is_named_with_its_row_and_request(edit, code, rest):
    """The slot refusals named a row of the step's 7R only ("row 7 slot ..."); every other refusal of a row names its
    request too (input_ids, two rows naming one slot), which the engine otherwise works out from 7 rows a request."""
    err = _refusal(edit=edit)
    assert (err.code, err.field) == (code, "slot_mapping"), err.message
    assert err.message.startswith("slot_mapping: row 7 (request 1) slot "), err.message
    assert rest in err.message, err.message


@pytest.mark.parametrize("field,sent,want", [
    ("positions", torch.int32, "DTYPE_INT64"), ("input_ids", torch.int32, "DTYPE_INT64"),
    ("seq_lens", torch.int64, "DTYPE_INT32"), ("block_tables", torch.int64, "DTYPE_INT32"),
    ("slot_mapping", torch.int32, "DTYPE_INT64"),
])
def test_an_index_tensor_of_another_dtype_is_refused_naming_both(field, sent, want):
    """Bytes that match the shape in the dtype sent: only the dtype check stands between them and a step whose
    metadata the checks and the kernels read in another width than the engine wrote."""
    def put(req):
        t = codec.from_tensor_ref(getattr(req, field), field)
        getattr(req, field).CopyFrom(codec.to_tensor_ref(t.to(sent)))
    err = _refusal(edit=put)
    assert (err.code, err.field) == (grpc.StatusCode.INVALID_ARGUMENT, field), err.message
    got = codec.pb.DType.Name(codec.dtype_to_proto(sent))
    assert err.message == f"{field}: dtype must be {want}, got {got}", err.message


def test_a_step_of_exactly_max_reqs_requests_is_served():
    """1..max_reqs: the bound itself is a step the sidecar takes (its graphs are captured up to it)."""
    cfg = load_config("tiny")
    st = scenario.random_step(cfg, [5, 30], PS, PAGES, torch.randn(cfg.vocab_size, cfg.hidden_size), seed=1)
    req = pb.DraftStepRequest(step_id=1, binding_id=3, binding_generation=1, num_requests=2,
                              positions=codec.to_tensor_ref(st.positions), input_ids=codec.to_tensor_ref(st.input_ids),
                              seq_lens=codec.to_tensor_ref(st.meta.seq_lens),
                              block_tables=codec.to_tensor_ref(st.meta.block_tables),
                              slot_mapping=codec.to_tensor_ref(st.meta.slot_mapping))
    kv = SimpleNamespace(page_size=PS, num_pages=PAGES)
    mem = SimpleNamespace(check=lambda binding_id, generation: kv, layouts={}, resolve=None)
    assert validate_step(req, cfg, mem, 2).num_reqs == 2


def test_of_several_short_sequence_lengths_the_first_is_named():
    """As every other index refusal names its first offending row: request 0's 6, not request 1's smaller 3."""
    err = _refusal(lens=lambda t: torch.tensor([6, 3], dtype=torch.int32))
    assert (err.code, err.field) == (grpc.StatusCode.INVALID_ARGUMENT, "seq_lens"), err.message
    assert "seq_lens[0] = 6" in err.message, err.message
