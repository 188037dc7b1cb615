"""The capturable (static-shape) reference attention equals the loop form it stands in for."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.kernels.reference import paged_window_attention, paged_window_attention_static


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,window", [([1, 30, 7], 16), ([4200, 3, 100], 4096), ([60], 64)])
def test_static_form_equals_loop_form(lens, window, dtype):
    gen = torch.Generator().manual_seed(len(lens) + window)
    page = 16
    seq = torch.tensor([c + 7 for c in lens], dtype=torch.int32)
    pages = sum(scenario.pages_needed(int(s), page) for s in seq) + 2
    tables = scenario.allocate_block_tables(seq.tolist(), page, pages, gen)
    kv = torch.randn(2, pages, page, 2, 32, generator=gen).to(dtype)
    q = torch.randn(7 * len(lens), 6, 32, generator=gen).to(dtype)
    pos = (seq.to(torch.int64)[:, None] - 7 + torch.arange(7)).reshape(-1)
    ref = paged_window_attention(q, kv, pos, seq, tables, 7, window, 32 ** -0.5)
    out = paged_window_attention_static(q, kv, pos, seq, tables, 7, window, 32 ** -0.5)
    # Same fp32 maths over the same keys; only the einsum's reduction blocking differs.
    torch.testing.assert_close(out, ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
