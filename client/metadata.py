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


def _first_attr(obj: Any, names: tuple[str, ...]) -> torch.Tensor | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, torch.Tensor):
            return v
    return None


def step_metadata_from(attn_metadata: Any, num_rows: int, page_size: int | None = None) -> StepMetadata | None:
    """StepMetadata for a step of `num_rows` = 7R rows, on CPU, or None when the metadata lacks a field.

    vLLM pads its metadata for CUDA graphs: only the first R sequence lengths and block-table rows
    and the first n slots belong to the step. vLLM V1 passes a dict of per-layer metadata; the
    drafter's layers share one, so the first entry is used. With `page_size`, block-table rows are
    trimmed to the pages the longest request reaches (the rest are never read).
    """
    if isinstance(attn_metadata, dict):
        if not attn_metadata:
            return None
        attn_metadata = next(iter(attn_metadata.values()))
    seq_lens = _first_attr(attn_metadata, _SEQ_LENS)
    tables = _first_attr(attn_metadata, _BLOCK_TABLES)
    slots = _first_attr(attn_metadata, _SLOTS)
    if seq_lens is None or tables is None or slots is None:
        return None
    r = num_rows // layout.QPR
    if seq_lens.shape[0] < r or tables.dim() != 2 or tables.shape[0] < r or slots.shape[0] < num_rows:
        return None
    seq_lens = seq_lens[:r].to(device="cpu", dtype=torch.int32)
    tables = tables[:r]
    if page_size:
        pages = -(-int(seq_lens.max()) // page_size) if r else 0
        tables = tables[:, : max(pages, 1)]
    return StepMetadata(seq_lens.contiguous(), tables.to(device="cpu", dtype=torch.int32).contiguous(),
                        slots[:num_rows].to(device="cpu", dtype=torch.int64).contiguous())
