"""The step's attention metadata as the shim reads it from the engine's forward context."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dspark_sidecar.client.metadata import read_step_metadata, spans_kv_groups, tables_cover
from dspark_sidecar.drafter.kv_cache import StepMetadata
from helpers.engine_fakes import step_inputs, vllm_draft_metadata


@dataclass
class VllmLikeMetadata:
    """vLLM V1's attention metadata, as far as the shim reads it: padded for a CUDA graph, int64
    lengths on some backends, and `block_table` as wide as the longest context the engine allows."""

    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


def _padded(device: str = "cpu") -> VllmLikeMetadata:
    """Two requests of 20 and 35 keys (pages of 16: 2 and 3 pages), padded to 4, 8 table columns."""
    return VllmLikeMetadata(torch.tensor([20, 35, 0, 0], device=device),
                            torch.arange(32, dtype=torch.int32, device=device).reshape(4, 8),
                            torch.arange(28, device=device))


def test_a_step_s_own_host_tensors_pass_through_without_copies():
    seq = torch.tensor([20, 35], dtype=torch.int32)
    tables = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    slots = torch.arange(14, dtype=torch.int64)
    meta = read_step_metadata(StepMetadata(seq, tables, slots), 14, page_size=16)[0]
    # ceil(35 / 16) = 3 pages: nothing to trim, so the engine's own tensors, no copies
    assert meta.seq_lens is seq and meta.block_tables is tables and meta.slot_mapping is slots


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA GPU")])])
def test_padded_metadata_is_cut_to_the_step_and_converted_on_the_host(device):
    """vLLM's layout (a dict of per-layer metadata, padded, a wide table), on the host or on the GPU
    as vLLM's forward context holds it: the step's rows and pages, as contiguous host tensors."""
    padded = _padded(device)
    meta = read_step_metadata({"layers.0.attn": padded, "layers.1.attn": padded}, 14, page_size=16)[0]
    assert meta.seq_lens.is_cpu and meta.block_tables.is_cpu and meta.slot_mapping.is_cpu
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == [20, 35]
    assert meta.block_tables.tolist() == [[0, 1, 2], [8, 9, 10]] and meta.block_tables.is_contiguous()
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == list(range(14))


@pytest.mark.parametrize("broken", ["no slots", "too few rows", "too few table rows", "too few slots", "flat table",
                                    "empty dict"])
def test_metadata_without_what_the_step_needs_is_refused(broken):
    """A table with fewer rows than the step's requests, or fewer slots than its 7R rows, is refused here: cut
    to the step, it would describe fewer requests (or rows) than the step sends, and the sidecar would refuse
    it a round trip and a rendezvous later."""
    m = _padded()
    if broken == "no slots":
        m = StepMetadata(m.seq_lens, m.block_table, None)  # type: ignore[arg-type]
    elif broken == "too few rows":
        m.seq_lens = m.seq_lens[:1]
    elif broken == "too few table rows":
        m.block_table = m.block_table[:1]
    elif broken == "too few slots":
        m.slot_mapping = m.slot_mapping[:13]
    elif broken == "flat table":
        m.block_table = m.block_table.flatten()
    else:
        m = {}
    assert read_step_metadata(m, 14, page_size=16)[0] is None


@pytest.mark.parametrize("broken", ["scalar seq_lens", "scalar slots", "2-D seq_lens", "2-D slots"])
def test_metadata_of_the_wrong_rank_is_refused_not_raised(broken):
    """A 0-d tensor raised IndexError (shape[0]) and a 2-D seq_lens TypeError (max of lists) out of
    read_step_metadata, so out of maybe_forward into the engine's step. These fields are the step's
    replicated inputs: every rank refuses the same step here, before any agreement."""
    m = _padded()
    if broken == "scalar seq_lens":
        m.seq_lens = torch.tensor(35)
    elif broken == "scalar slots":
        m.slot_mapping = torch.tensor(3)
    elif broken == "2-D seq_lens":
        m.seq_lens = m.seq_lens[:, None].expand(4, 2)
    else:
        m.slot_mapping = m.slot_mapping[:, None]
    assert read_step_metadata(m, 14, page_size=16)[0] is None


@pytest.mark.parametrize("lens, cover", [([5, 32], True), ([32, 32], True), ([5, 33], False), ([33, 5], False)])
def test_tables_cover_is_ceil_of_the_longest_request_s_pages(lens, cover):
    """Two columns of 16-key pages hold 32 keys: a request of exactly 32 is covered (sent), one of 33 is
    not (the shim falls back unsent); the longest request decides, wherever it sits in the step."""
    meta = StepMetadata(torch.tensor(lens, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                        torch.zeros(14, dtype=torch.int64))
    assert tables_cover(meta, 16) is cover


def test_draft_layers_of_one_kv_cache_group_are_one_step():
    """vLLM 0.34's draft metadata with two attention groups (two backends) in one KV cache group: two metadata
    objects, one table and one slot mapping. Read as the step's, as before."""
    attn = vllm_draft_metadata(2, [[["layers.0.attn", "layers.2.attn"], ["layers.1.attn"]]])
    assert not spans_kv_groups(attn)
    meta = read_step_metadata(attn, 14, page_size=16)[0]
    assert meta.slot_mapping.tolist() == step_inputs(2)[1].tolist() and meta.block_tables.tolist() == [[0, 1]] * 2


def test_draft_layers_spanning_several_kv_cache_groups_are_told_apart():
    """vLLM 0.34 splits layers of one kind into KV cache groups of equal size (v1/core/kv_cache_planning.py
    _get_kv_cache_groups_uniform_page_size: layers[i::num_groups]), each with its own block table and slot mapping,
    and its DSpark speculator prepares the draft step's slots for each (dflash/speculator.py propose,
    draft_kv_cache_group_ids). The first layer's table and slots, sent for every layer, had the sidecar read and
    write the other groups' layers at pages their group does not own."""
    attn = vllm_draft_metadata(2, [[["layers.0.attn", "layers.2.attn"]], [["layers.1.attn", "layers.3.attn"]]])
    assert spans_kv_groups(attn)
    assert not spans_kv_groups({"layers.0.attn": attn["layers.0.attn"]})
    assert not spans_kv_groups(step_inputs(2)[2])  # one metadata object, not vLLM's dict


def test_a_draft_layer_whose_metadata_has_no_slot_mapping_is_not_taken_for_the_first_s_group():
    """Another layer's metadata object without a slot mapping cannot be told to share the first layer's KV cache
    group: read as one step, that layer would be written through the first layer's slots, so it counts as apart."""
    attn = vllm_draft_metadata(2, [[["layers.0.attn"]]])
    first = attn["layers.0.attn"]
    no_slots = VllmLikeMetadata(first.seq_lens, first.block_table, None)  # type: ignore[arg-type]
    assert spans_kv_groups({"layers.0.attn": first, "layers.1.attn": no_slots})


def test_a_field_name_that_holds_no_tensor_is_passed_over_for_the_next():
    """Each field is the first of its names that holds a tensor: a metadata class may keep `block_table` as
    something else (an object, a list) and its tensor under `block_table_tensor`. Taken as it is, the other
    value's missing .shape raised out of read_step_metadata, so out of maybe_forward into the engine's step."""
    padded = _padded()

    @dataclass
    class TensorUnderAnotherName:
        seq_lens: torch.Tensor
        block_table: object
        block_table_tensor: torch.Tensor
        slot_mapping: torch.Tensor

    m = TensorUnderAnotherName(padded.seq_lens, [[0, 1, 2]], padded.block_table, padded.slot_mapping)
    meta = read_step_metadata(m, 14, page_size=16)[0]
    assert meta is not None and meta.block_tables.tolist() == [[0, 1, 2], [8, 9, 10]]
    m.block_table_tensor = None  # type: ignore[assignment]  # no tensor under any name: unusable, not raised
    assert read_step_metadata(m, 14, page_size=16) == (None, None)


def test_the_longest_seq_len_read_is_returned_and_tables_cover_takes_it_as_given():
    """read_step_metadata hands the longest sequence length it read (with a page size) to tables_cover, which then
    reads no seq_lens again: the answer is the one for that length."""
    assert read_step_metadata(_padded(), 14, page_size=16)[1] == 35  # the step's rows only: not the padding's 0s
    assert read_step_metadata(_padded(), 14)[1] is None  # no page size: nothing trimmed, nothing read
    meta = StepMetadata(torch.tensor([5, 5], dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                        torch.zeros(14, dtype=torch.int64))
    assert tables_cover(meta, 16) and not tables_cover(meta, 16, longest=33)


def test_fields_missing_names_what_a_metadata_class_lacks_under_any_of_its_names():
    from dspark_sidecar.client.metadata import fields_missing

    assert fields_missing({"seq_lens", "block_table_tensor", "slot_mapping", "num_actual_tokens"}) == []
    assert fields_missing({"seq_lens", "block_tables", "slot_mapping"}) == []
    assert fields_missing({"slot_mapping", "paged_kv_indices"}) == ["seq_lens", "block table"]
    assert fields_missing(set()) == ["seq_lens", "block table", "slot_mapping"]


def test_every_layer_on_one_metadata_object_is_one_group_whatever_that_object_holds():
    """Layers mapped to one metadata object share its table and slots by identity: one KV cache group, even when
    it has no slot mapping to compare (that metadata is unusable, and the shim says so: BAD_METADATA, not a
    warning that vLLM placed the draft's layers in several KV cache groups)."""
    first = vllm_draft_metadata(2, [[["layers.0.attn"]]])["layers.0.attn"]
    no_slots = VllmLikeMetadata(first.seq_lens, first.block_table, None)  # type: ignore[arg-type]
    assert not spans_kv_groups(dict.fromkeys(["layers.0.attn", "layers.1.attn", "layers.2.attn"], no_slots))


@pytest.mark.parametrize("field", ["seq_lens", "block_table", "slot_mapping"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool])
def test_metadata_of_a_non_integer_dtype_is_refused_not_truncated(field, dtype):
    """Each field was cast to int32 / int64 whatever its dtype: a float seq_lens of 20.7 was sent as 20 and a
    bool table as pages 0 and 1, a step the engine never described that the sidecar's checks, reading the cast
    values, could pass. The sidecar refuses these dtypes by name (validate._tensor); the shim falls back."""
    m = _padded()
    setattr(m, field, getattr(m, field).to(dtype))
    assert read_step_metadata(m, 14, page_size=16) == (None, None)


def test_int64_tables_and_strided_fields_are_read_as_the_step_s_values():
    """vLLM keeps int32 tables, other engines int64; padded rows and strided views (a column of a wider buffer):
    the step's rows and pages, in the sidecar's dtypes, contiguous."""
    wide = torch.arange(64, dtype=torch.int64).reshape(8, 8)
    m = VllmLikeMetadata(torch.tensor([20, 9, 35, 9, 0, 9, 0, 9])[::2], wide[::2], torch.arange(56)[::2])
    meta, longest = read_step_metadata(m, 14, page_size=16)
    assert longest == 35 and meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == [20, 35]
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.tolist() == [[0, 1, 2], [16, 17, 18]]
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == list(range(0, 28, 2))
    assert all(t.is_contiguous() for t in (meta.seq_lens, meta.block_tables, meta.slot_mapping))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_metadata_of_any_integer_dtype_is_read_exactly(dtype):
    """Every integer dtype is an exact description of the step (cast to the sidecar's int32 / int64 without loss for
    these values): read, not refused. An engine keeping small tables in uint8 or int16 lost the sidecar on every
    step were one of them left out."""
    m = VllmLikeMetadata(torch.tensor([20, 35, 0, 0], dtype=dtype), torch.arange(32, dtype=dtype).reshape(4, 8),
                         torch.arange(28, dtype=dtype))
    meta, longest = read_step_metadata(m, 14, page_size=16)
    assert meta is not None and longest == 35
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == [20, 35]
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.tolist() == [[0, 1, 2], [8, 9, 10]]
    assert meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.tolist() == list(range(14))
