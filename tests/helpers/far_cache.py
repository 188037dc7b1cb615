"""A small KV cache view whose far elements lie past 2^31 elements from its start, for the kernels' int64 offsets."""

from __future__ import annotations

import pytest
import torch

WRAP = 1 << 31  # elements: an int32 offset this far or farther wraps


def far_cache(shape: tuple, strides: tuple, device) -> torch.Tensor:
    """An fp8 cache view [2, pages, page_size, kv_heads, d] with the given strides (some element past WRAP
    from its start), random values, in a buffer with WRAP bytes before it: an offset that wrapped in int32
    reads there, not unmapped memory. On the CPU the untouched pages are never committed (a few MB of the
    buffer are written); where the buffer cannot be had, the test is skipped."""
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    assert extent > WRAP, extent
    try:
        buf = torch.empty(WRAP + extent, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as err:
        pytest.skip(f"cannot reserve {WRAP + extent} bytes: {err}")
    kv = buf[WRAP:].view(torch.float8_e4m3fn).as_strided(shape, strides)
    gen = torch.Generator().manual_seed(7)
    kv.copy_(torch.randn(shape, generator=gen).to(device, torch.float8_e4m3fn))
    return kv
