"""The Triton ops on a records cache (vLLM 0.34: [pages, heads, page_size, 2 * head_dim]) through its planes view.

The kernels address the cache only through the view's strides, so on the same contents a records
cache must give the bits a planes cache gives (same arithmetic in the same order), and the K/V the
prelude writes must land in each token's record, K in its first head_dim values and V in the rest.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar import layout  # noqa: E402
from dspark_sidecar.drafter.kv_cache import kv_planes  # noqa: E402
from dspark_sidecar.kernels import reference  # noqa: E402
from dspark_sidecar.kernels.triton.ops import TRITON_OPS  # noqa: E402

Q = layout.QPR
EPS, THETA = 1e-6, 5_000_000.0
PAGE, PAGES = 8, 32


def _records_like(planes: torch.Tensor) -> torch.Tensor:
    """A records cache [pages, heads, page, 2 d] holding the contents of planes [2, pages, page, heads, d]."""
    _, pages, page, heads, d = planes.shape
    rec = torch.full((pages, heads, page, 2 * d), float("nan"), dtype=planes.dtype, device=planes.device)
    kv_planes(rec).copy_(planes)
    return rec


def _step(q_heads, kv_heads, d, rot, contexts, width, dtype, device, gen):
    """A step's prelude and attention inputs: qkv, q/k norm weights, rows at P..P+6 of each context
    through random pages (width per request), their slots, and the rows' RoPE angles."""
    reqs = len(contexts)
    qkv = (torch.randn(reqs * Q, (q_heads + 2 * kv_heads) * d, generator=gen) * 2.0).to(device, dtype)
    qn, kn = ((torch.randn(d, generator=gen) * 0.1).to(device, dtype) for _ in range(2))
    positions = torch.cat([torch.arange(c, c + Q) for c in contexts]).to(device)
    seq_lens = torch.tensor([c + Q for c in contexts], dtype=torch.int32, device=device)
    tables = torch.randperm(PAGES, generator=gen)[: reqs * width].view(reqs, width).to(device, torch.int32)
    slots = (tables.gather(1, (positions.view(reqs, Q) // PAGE).to(torch.int64)).to(torch.int64) * PAGE
             + positions.view(reqs, Q) % PAGE).reshape(-1)
    cos, sin = reference.rope_cos_sin(positions, rot, THETA)
    return qkv, qn, kn, positions, seq_lens, tables, slots, cos, sin


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_prelude_and_attention_on_records_match_planes_bit_for_bit(device, dtype, kv_heads, parity):
    q_heads, d = 4 * kv_heads, 64
    gen = torch.Generator().manual_seed(11 + kv_heads)
    qkv, qn, kn, positions, seq_lens, tables, slots, cos, sin = _step(q_heads, kv_heads, d, 32, [5, 40, 61], 9,
                                                                      dtype, device, gen)
    planes = torch.randn(2, PAGES, PAGE, kv_heads, d, generator=gen).to(device, dtype)
    raw = _records_like(planes)
    records = kv_planes(raw)
    assert records.data_ptr() == raw.data_ptr() and not records.is_contiguous()

    q_p = TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, planes, slots, q_heads, kv_heads)
    q_r = TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, records, slots, q_heads, kv_heads)
    assert torch.equal(q_p, q_r)
    assert torch.equal(records, planes), "the prelude's K/V must land in the records as in the planes"
    # Token t's record: K in values [0, d), V in [d, 2d); read from the engine's own tensor.
    t = int(slots[4])
    assert torch.equal(raw[t // PAGE, :, t % PAGE, :d], planes[0, t // PAGE, t % PAGE])
    assert torch.equal(raw[t // PAGE, :, t % PAGE, d:], planes[1, t // PAGE, t % PAGE])

    window, scale = 32, d ** -0.5
    out_p = TRITON_OPS.paged_window_attention(q_p, planes, positions, seq_lens, tables, Q, window, scale)
    out_r = TRITON_OPS.paged_window_attention(q_r, records, positions, seq_lens, tables, Q, window, scale)
    assert torch.equal(out_p, out_r)
    # And against the reference on the records view itself (reference first, then the kernel's bound).
    ref = reference.paged_window_attention(q_r, records, positions, seq_lens, tables, Q, window, scale)
    parity(out_r, ref)


def test_write_kv_on_records_touches_only_the_slots_records(device):
    gen = torch.Generator().manual_seed(4)
    raw = torch.randn(PAGES, 2, PAGE, 2 * 32, generator=gen).to(device, torch.bfloat16)
    before = raw.clone()
    k = torch.randn(6, 2, 32, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(6, 2, 32, generator=gen).to(device, torch.bfloat16)
    slots = torch.tensor([3, 17, -1, 40, 95, 100], device=device)  # -1: padding, skipped
    TRITON_OPS.write_kv(kv_planes(raw), k, v, slots)
    ref = before.clone()
    keep = slots >= 0
    reference.write_kv(kv_planes(ref), k[keep], v[keep], slots[keep])
    assert torch.equal(raw.cpu(), ref.cpu())
    changed = (raw != before).any(dim=-1).any(dim=1).cpu()  # [pages, page]: tokens whose record moved
    expect = torch.zeros(PAGES, PAGE, dtype=torch.bool)
    for s in slots[keep].tolist():
        expect[s // PAGE, s % PAGE] = True
    assert torch.equal(changed, expect)


@pytest.mark.parametrize("kv_layout", ["planes", "records"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_an_fp8_cache_is_written_saturated_and_read_widened_as_the_reference_does(device, dtype, kv_layout, parity):
    """vLLM's kv_cache_dtype fp8 (scale 1): the prelude stores e4m3 codes of its K (rounded to the
    activation dtype first) and of V, saturated at +-448; attention widens them exactly."""
    q_heads, kv_heads, d = 8, 1, 64
    gen = torch.Generator().manual_seed(21)
    qkv, qn, kn, positions, seq_lens, tables, slots, cos, sin = _step(q_heads, kv_heads, d, 32, [9, 50], 8,
                                                                      dtype, device, gen)
    qkv[3, -5:] = 1000.0  # V values past e4m3's range: saturated, not inf or NaN
    planes = (torch.randn(2, PAGES, PAGE, kv_heads, d, generator=gen) * 2).to(torch.float8_e4m3fn).to(device)
    raw = planes if kv_layout == "planes" else _records_like(planes.float()).to(torch.float8_e4m3fn)
    kv = kv_planes(raw)
    kv_ref = kv_planes(raw.clone())

    q_ref = reference.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv_ref, slots, q_heads, kv_heads)
    q = TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv, slots, q_heads, kv_heads)
    parity(q, q_ref)
    assert kv.dtype == torch.float8_e4m3fn
    # V is a plain copy: the same code to the bit. K may differ by one e4m3 step (3 mantissa bits,
    # rtol 1/8) where the kernel's K, before the cache's rounding, is an ulp off the reference's.
    assert torch.equal(kv[1].view(torch.uint8), kv_ref[1].view(torch.uint8))
    assert torch.allclose(kv[0].float(), kv_ref[0].float(), rtol=0.125, atol=2 ** -9)
    assert kv[1].float().abs().max() == 448.0 and torch.isfinite(kv.float()).all()

    window, scale = 40, d ** -0.5
    ref = reference.paged_window_attention(q_ref, kv_ref, positions, seq_lens, tables, Q, window, scale)
    out = TRITON_OPS.paged_window_attention(q_ref, kv_ref, positions, seq_lens, tables, Q, window, scale)
    parity(out, ref)
