"""The engine's paged draft KV cache layout and a draft step's attention metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.config import DrafterConfig


@dataclass(frozen=True)
class StepMetadata:
    """Attention metadata of one draft step of R requests (n = 7R rows), as the engine builds it.

    seq_lens int32 [R]: absolute sequence length P + 7 of each request;
    block_tables int32 [R, max_pages]: page ids of each request's draft KV;
    slot_mapping int64 [n]: the cache slot (page * page_size + offset) of each query row.
    """

    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])

    def requests(self, start: int, end: int) -> StepMetadata:
        """The metadata of requests [start, end): one launch's share."""
        q = layout.QPR
        return StepMetadata(self.seq_lens[start:end], self.block_tables[start:end],
                            self.slot_mapping[start * q : end * q])

    def to(self, device: torch.device | str) -> StepMetadata:
        return StepMetadata(self.seq_lens.to(device), self.block_tables.to(device), self.slot_mapping.to(device))


# How an engine lays one layer's cache out in memory. Every op addresses a layer through the same
# 5-D view [2 (K, V), num_pages, page_size, kv_heads, head_dim] (`kv_planes`); the layouts differ
# only in that view's strides.
#   planes:  [2, num_pages, page_size, kv_heads, head_dim], contiguous: all K pages, then all V
#            pages (spec section 4; vLLM's FlashAttention layout before 0.34).
#   records: [num_pages, kv_heads, page_size, 2 * head_dim], contiguous: each (page, head, token)
#            holds a record K | V of 2 * head_dim (vLLM 0.34's FLASH_ATTN / FLASHINFER caches).
KV_LAYOUTS = ("planes", "records")
# An engine may store K/V as float8 e4m3 (vLLM's kv_cache_dtype "fp8", held as uint8 there): values
# x / scale, saturated. Served at scale 1 only (the DSpark checkpoint has no KV scales); reads widen
# exactly to the compute dtype.
FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0
KV_DTYPE_CHOICES = ("auto", "fp8")  # --kv-dtype of demo and bench: the compute dtype, or FP8_KV


def kv_cache_dtype(choice: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The element type an engine allocates its cache in for a KV_DTYPE_CHOICES entry."""
    return FP8_KV if choice == "fp8" else compute_dtype


def kv_layer_shape(cfg: DrafterConfig, tp_size: int, num_pages: int, page_size: int) -> tuple[int, ...]:
    """One layer's cache on one rank as the ops see it: [2 (K, V), num_pages, page_size, kv_heads / tp, head_dim]."""
    return (2, num_pages, page_size, cfg.num_key_value_heads // tp_size, cfg.head_dim)


def kv_storage_shape(cfg: DrafterConfig, tp_size: int, num_pages: int, page_size: int,
                     kv_layout: str = "planes") -> tuple[int, ...]:
    """One layer's cache on one rank as the engine allocates it in `kv_layout`."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"KV layout {kv_layout!r}: expected one of {', '.join(KV_LAYOUTS)}")
    two, pages, page, heads, d = kv_layer_shape(cfg, tp_size, num_pages, page_size)
    return (two, pages, page, heads, d) if kv_layout == "planes" else (pages, heads, page, two * d)


def kv_planes(t: torch.Tensor) -> torch.Tensor:
    """An engine's layer cache -> the view [2, num_pages, page_size, kv_heads, head_dim] of the same
    memory: a 5-D planes tensor as it is; a 4-D records tensor [pages, heads, page, 2 d] with its
    last axis split into K | V and moved to the front (strides (d, heads*page*2d, 2d, page*2d, 1)).
    Writes through the view land in the engine's tensor."""
    if t.dim() == 5:
        return t
    if t.dim() == 4 and t.shape[-1] % 2 == 0:
        return t.unflatten(-1, (2, t.shape[-1] // 2)).permute(3, 0, 2, 1, 4)
    raise ValueError(f"KV cache of shape {list(t.shape)}: expected planes [2, pages, page_size, heads, head_dim] "
                     "or records [pages, heads, page_size, 2 * head_dim]")


def kv_paging(t: torch.Tensor) -> tuple[int, int] | None:
    """(num_pages, page_size) of an engine's layer cache in either layout, read from its shape alone
    (no view built: the shim asks once a step), or None for a shape neither layout has."""
    shape = t.shape  # read once: each read builds a torch.Size
    if len(shape) == 5:
        return shape[1], shape[2]
    if len(shape) == 4:
        return shape[0], shape[2]
    return None


def kv_view_problem(shape: Sequence[int], strides: Sequence[int]) -> str | None:
    """Why a 5-D cache view cannot be written through, or None: head_dim must be unit-stride (the
    kernels load a head's row as one vector), and no two elements may share memory. The check is
    the sufficient one: sorted by stride, each dimension steps past everything the smaller ones
    span. Both KV_LAYOUTS pass; so does any other dense permutation of them."""
    if len(shape) != len(strides):
        return f"{len(strides)} strides for {len(shape)} dimensions"
    if shape[-1] > 1 and strides[-1] != 1:
        return f"head_dim stride {strides[-1]}: a head's {shape[-1]} values must be adjacent"
    span = 0  # highest element offset the dimensions seen so far reach
    for n, s in sorted(((n, s) for n, s in zip(shape, strides) if n > 1), key=lambda p: p[1]):
        if s <= span:
            return f"strides {list(strides)} over shape {list(shape)}: K/V elements would overlap"
        span += (n - 1) * s
    return None


def _page_offset(kv_layer: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat slots -> (page, offset) indices. A negative slot (padding) would index the last page as
    torch's negative indices do: it is made page num_pages instead, out of range, so the access
    fails as the flat index_copy_ did (the ops take valid slots only; the kernels skip padding)."""
    page = kv_layer.shape[2]
    return (slots // page).masked_fill(slots < 0, kv_layer.shape[1]), slots % page


def kv_rows(kv_layer: torch.Tensor, plane: int, slots: torch.Tensor) -> torch.Tensor:
    """K (plane 0) or V (plane 1) rows at flat slots (page * page_size + offset): slots [...] ->
    [..., kv_heads, head_dim], a copy. Indexes page and offset separately, so any layout's view works."""
    return kv_layer[plane][_page_offset(kv_layer, slots)]


def to_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows as a cache of `dtype` stores them: a cast; into fp8 e4m3 (FP8_KV) saturated to +-448
    first, as vLLM's own fp8 cache writes are (at scale 1), then rounded to nearest even."""
    if dtype == FP8_KV:
        return rows.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return rows.to(dtype)


def write_kv_rows(kv_layer: torch.Tensor, plane: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Store rows [m, kv_heads, head_dim] at flat slots int64 [m], in place through any layout's view
    (index_put_: no host reads, so a CUDA graph can capture it)."""
    kv_layer[plane].index_put_(_page_offset(kv_layer, slots), to_cache(rows, kv_layer.dtype))


def allocate_kv_cache(cfg: DrafterConfig, tp_size: int, num_pages: int, page_size: int,
                      dtype: torch.dtype, device: torch.device | str = "cpu",
                      kv_layout: str = "planes") -> list[torch.Tensor]:
    """Zeroed per-layer caches for one rank in `kv_layout` (the engine owns and allocates these)."""
    shape = kv_storage_shape(cfg, tp_size, num_pages, page_size, kv_layout)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]


def block_slots(block_table_row: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Flat slots of absolute positions through one request's block-table row (int64)."""
    return block_table_row[positions // page_size].to(torch.int64) * page_size + positions % page_size


def window_metadata(positions: torch.Tensor, meta: StepMetadata, page_size: int, window: int,
                    rows: int = layout.QPR) -> tuple[torch.Tensor, StepMetadata]:
    """Window-relative attention metadata of fixed width, so a step's shapes depend on R alone.

    Request i only reads keys at positions >= L - (window + rows - 1) (L its sequence length).
    Shifting its positions and length by a whole number of pages, off = first_page * page_size,
    and cutting its block-table row to the pages from first_page on, addresses the same keys:
    the table is [R, ceil((window + rows - 1) / page_size) + 1] whatever the context length.
    Slots are unchanged (absolute). Returns (positions - off [n], metadata).
    """
    span = window + rows - 1
    width = window_width(page_size, window, rows)
    L = meta.seq_lens.to(torch.int64)
    first_page = (L - span).clamp(min=0) // page_size  # [R]
    idx = first_page[:, None] + torch.arange(width, device=L.device)[None, :]
    # Entries past a request's last page are never read; clamp keeps the gather in bounds.
    table = meta.block_tables.gather(1, idx.clamp(max=meta.block_tables.shape[1] - 1))
    off = first_page * page_size
    rel = positions - off.repeat_interleave(rows)
    return rel, StepMetadata((L - off).to(meta.seq_lens.dtype), table.to(meta.block_tables.dtype), meta.slot_mapping)


def window_width(page_size: int, window: int, rows: int = layout.QPR) -> int:
    """Pages per request in window-relative block tables (see `window_metadata`)."""
    return -(-(window + rows - 1) // page_size) + 1


def window_metadata_into(positions: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, page_size: int,
                         window: int, rel_out: np.ndarray, lens_out: np.ndarray, table_out: np.ndarray,
                         rows: int = layout.QPR) -> None:
    """`window_metadata` in NumPy, written into caller-owned arrays (the sidecar's pinned staging).

    positions int64 [n] (or [R, rows]), seq_lens [R], block_tables [R, max_pages] -> rel_out int64 [n],
    lens_out int32 [R], table_out int32 [R, window_width]. Same numbers as the torch version;
    a few microseconds where torch's per-op dispatch costs tens, on every step.
    """
    R = seq_lens.shape[0]
    span = window + rows - 1
    L = seq_lens.astype(np.int64)
    first = np.maximum(L - span, 0) // page_size  # [R]
    idx = np.minimum(first[:, None] + np.arange(table_out.shape[1]), block_tables.shape[1] - 1)
    table_out[...] = block_tables[np.arange(R)[:, None], idx]
    off = first * page_size
    lens_out[...] = L - off
    np.subtract(positions.reshape(R, rows), off[:, None], out=rel_out.reshape(R, rows))
