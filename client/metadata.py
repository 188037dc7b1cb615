"""The step's seq lens, block-table rows and query slots, read from whatever attention metadata the engine set."""

from __future__ import annotations

from typing import Any

import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.kv_cache import StepMetadata

# Attribute names, in order of preference: this package's StepMetadata, then vLLM V1's attention
# metadata classes (FlashAttention, Triton, ROCm backends all carry these three).
_SEQ_LENS = ("seq_lens",)
_BLOCK_TABLES = ("block_tables", "block_table", "block_table_tensor")
_SLOTS = ("slot_mapping",)
# What the fields may hold: each is cast to int32 / int64 for the sidecar, exactly only from an integer dtype.
_INTEGER = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def fields_missing(field_names: set[str]) -> list[str]:
    """What read_step_metadata needs that a metadata class with these fields lacks: of "seq_lens", "block table",
    "slot_mapping", in that order (empty: it can be read)."""
    return [what for what, names in (("seq_lens", _SEQ_LENS), ("block table", _BLOCK_TABLES),
                                      ("slot_mapping", _SLOTS)) if field_names.isdisjoint(names)]


def _first_attr(obj: Any, names: tuple[str, ...]) -> torch.Tensor | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, torch.Tensor):
            return v
    return None


def read_step_metadata(attn_metadata: Any, num_rows: int,
                       page_size: int | None = None) -> tuple[StepMetadata | None, int | None]:
    """StepMetadata for a step of `num_rows` = 7R rows, on CPU, or None when the metadata lacks a field (or
    holds one of another rank, too few rows or a non-integer dtype);
    and the longest sequence length it read (with a page size, else None), which `tables_cover` then
    need not read again.

    vLLM pads its metadata for CUDA graphs: only the first R sequence lengths and block-table rows
    and the first n slots belong to the step. vLLM V1 passes a dict of per-layer metadata; the
    drafter's layers share one, so the first entry is used. With `page_size`, block-table rows are
    trimmed to the pages the longest request reaches (the rest are never read).

    Once per draft step, on the shim's host path before the ring: each tensor's shape is read once
    (every read of it builds a torch.Size), and nothing is called for a field it leaves as it is.
    """
    if isinstance(attn_metadata, dict):
        if not attn_metadata:
            return None, None
        attn_metadata = next(iter(attn_metadata.values()))
    seq_lens = _first_attr(attn_metadata, _SEQ_LENS)
    tables = _first_attr(attn_metadata, _BLOCK_TABLES)
    slots = _first_attr(attn_metadata, _SLOTS)
    if seq_lens is None or tables is None or slots is None:
        return None, None
    r = num_rows // layout.QPR
    seq_shape, table_shape, slot_shape = seq_lens.shape, tables.shape, slots.shape
    # Ranks checked first: a 0-d tensor has no shape[0] (IndexError) and a 2-D seq_lens no max
    # (TypeError), which raised out of maybe_forward into the engine's step instead of refusing it.
    if len(seq_shape) != 1 or len(table_shape) != 2 or len(slot_shape) != 1:
        return None, None
    if seq_shape[0] < r or table_shape[0] < r or slot_shape[0] < num_rows:
        return None, None
    # A float or bool field was cast like an integer one: a seq_len of 20.7 sent as 20, a bool table as pages
    # 0 and 1, a step the engine never described, which the sidecar (refusing these dtypes by name) never saw.
    if seq_lens.dtype not in _INTEGER or tables.dtype not in _INTEGER or slots.dtype not in _INTEGER:
        return None, None
    # A step's own tensors are not padded: no view to make.
    seq_lens = _host(seq_lens if seq_shape[0] == r else seq_lens[:r], torch.int32)
    if table_shape[0] != r:
        tables = tables[:r]
    longest = None
    if page_size:
        longest = max(seq_lens.tolist(), default=0)
        pages = max(-(-longest // page_size), 1)
        if table_shape[1] != pages:
            tables = tables[:, :pages]
    if slot_shape[0] != num_rows:
        slots = slots[:num_rows]
    return StepMetadata(seq_lens, _host(tables, torch.int32), _host(slots, torch.int64)), longest


def spans_kv_groups(attn_metadata: Any) -> bool:
    """Whether vLLM's per-layer metadata of the draft step comes from more than one KV cache group.

    vLLM 0.34 may put the draft's layers in several groups (v1/core/kv_cache_planning.py splits layers of one kind
    into groups of equal size), each with its own block table and slot mapping (its row of BlockTables.slot_mappings),
    and its DSpark speculator prepares the step's slots for each. A step carries one table and one slot mapping for
    every layer: sent, the other groups' layers would be read and written at pages their group does not own. The
    layers of one attention group share one metadata object, and those of one KV cache group one slot mapping
    (v1/worker/gpu/attn_utils.py build_attn_metadata), so the usual case is settled by identity alone."""
    if not isinstance(attn_metadata, dict) or len(attn_metadata) < 2:
        return False
    values = iter(attn_metadata.values())
    first = next(values)
    ptr = None
    for m in values:
        if m is first:
            continue
        if ptr is None:
            s = _first_attr(first, _SLOTS)
            ptr = s.data_ptr() if s is not None else None
        s = _first_attr(m, _SLOTS)
        if ptr is None or s is None or s.data_ptr() != ptr:  # one without slots: no telling, so not one group
            return True
    return False


def _host(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as a contiguous host tensor of `dtype`; itself when it is one already. The checks cost a
    fraction of `.to()` and `.contiguous()` on a tensor they leave alone (run per step, per field)."""
    if not t.is_cpu or t.dtype != dtype:
        t = t.to(device="cpu", dtype=dtype)
    return t if t.is_contiguous() else t.contiguous()


def tables_cover(meta: StepMetadata, page_size: int, longest: int | None = None) -> bool:
    """Whether every request's block-table row holds the ceil(seq_len / page_size) pages its keys span.

    A narrower table is the engine's metadata at fault, not the sidecar: sent, the sidecar refuses the
    step (INVALID_ARGUMENT, block_tables), a round trip and a rendezvous for nothing on every such step
    (the shim takes a refusal naming the step's metadata as that step's fault: no breaker failure, the link
    kept; see reasons.ENGINE_METADATA). The shim asks this after the pre-flight: the page size comes
    from this rank's KV cache, which only a ready rank is sure to have read, and the answer must be the
    same on every rank (see DrafterShim.maybe_forward). longest: the longest of meta's seq_lens, where the
    caller has it (read_step_metadata's)."""
    if longest is None:
        longest = max(meta.seq_lens.tolist(), default=0)
    return meta.block_tables.shape[1] * page_size >= longest
