"""The torch models of the FlyDSL kernels (their tiling, accumulation order, roundings) against the reference ops."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_sidecar.drafter.checkpoint import dequantize_mxfp8, quantize_mxfp8
from dspark_sidecar.drafter.kv_cache import FP8_KV, to_cache
from dspark_sidecar.kernels import reference as ref
from dspark_sidecar.kernels.flydsl import shapes
from dspark_sidecar.kernels.flydsl import tiling_model as tm

PAGE = 16
# Relative L2 error of bf16 outputs: the models round where the kernels do (one bf16 rounding
# of the MFMA operand, one of the output) and the reference rounds at every op boundary, each
# ~2^-9 relative; measured ~3e-3 on these shapes, bound at 1e-2.
TOL_BF16 = 1e-2


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def mx_weight(n: int, k: int, gen: torch.Generator, std: float = 0.02):
    """Random MXFP8 weight: (E4M3 bits uint8 [n, k], E8M0 uint8 [n, k/32], dequantized fp32)."""
    w = torch.randn(n, k, generator=gen) * std
    q, scale = quantize_mxfp8(w, shapes.MX_BLOCK)
    return q.view(torch.uint8), scale, dequantize_mxfp8(q, scale, shapes.MX_BLOCK)


def bf16(shape, gen, std=1.0):
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def test_kernel_dequant_matches_checkpoint_dequant():
    gen = torch.Generator().manual_seed(0)
    bits, scale, wd = mx_weight(64, 256, gen)
    got = tm.dequant_like_kernel(bits, scale)
    assert torch.equal(got, wd)
    # Exact in bf16: the MFMA sees exactly the dequantized weight.
    assert torch.equal(got.to(torch.bfloat16).float(), got)


@pytest.mark.parametrize("n, k, nsub, split, why", [
    (256, 6144, 1, 5, "not a multiple of 128 x split 5"),  # 48 chunks over 5 splits: 9 each, 3 chunks never summed
    (288, 6144, 1, 8, "workgroup width 64"),  # 4.5 workgroups: the grid's 4 leave 32 columns unwritten
])
def test_schedule_that_leaves_columns_out_is_refused(n, k, nsub, split, why):
    """chunks_per_wg and grid floor their divisions: a schedule they do not divide would drop K chunks or
    output columns from the GEMM without a word."""
    with pytest.raises(ValueError, match=why):
        shapes.LinearSchedule("x", n, k, nsub, split, norm=False).validate()


@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("num_reqs", [1, 8])
def test_linear_model_matches_reference(name, num_reqs):
    sched = shapes.SCHEDULES[name]
    gen = torch.Generator().manual_seed(hash((name, num_reqs)) % 2**31)
    rows = shapes.rows_for(num_reqs)
    x = bf16((rows, sched.k), gen)
    nw = bf16((sched.k,), gen, 0.1)
    bits, scale, wd = mx_weight(sched.n, sched.k, gen)
    p, ss = tm.linear_model(x, bits, scale, nw, sched, num_reqs)
    y = tm.split_sum(p)[:rows]
    if sched.norm:
        y = y * tm.row_rrms(ss)[:rows, None]
        want = ref.norm_linear(x, nw, shapes.RMS_EPS, wd.to(torch.bfloat16))
    else:
        want = ref.linear(x, wd.to(torch.bfloat16))
    assert rel_l2(y, want) < TOL_BF16
    # Padding rows of the last MFMA tile stay exactly zero.
    assert torch.count_nonzero(p[:, rows:]) == 0


@pytest.mark.parametrize("num_reqs", [2, 8])
def test_swiglu_reduce_model_matches_reference(num_reqs):
    sched = shapes.SCHEDULES["gate_up"]
    gen = torch.Generator().manual_seed(10 + num_reqs)
    rows = shapes.rows_for(num_reqs)
    x = bf16((rows, sched.k), gen)
    nw = bf16((sched.k,), gen, 0.1)
    # Large weights (gate/up std ~8) so the 7 limits on gate and up really clip.
    bits, scale, wd = mx_weight(sched.n, sched.k, gen, std=0.1)
    p, ss = tm.linear_model(x, bits, scale, nw, sched, num_reqs)
    got = tm.swiglu_reduce_model(p, ss, rows)
    want = ref.norm_linear_swiglu(x, nw, shapes.RMS_EPS, wd.to(torch.bfloat16), shapes.SWIGLU_ALPHA, shapes.SWIGLU_LIMIT)
    gate = tm.split_sum(p)[:rows, : shapes.FFN] * tm.row_rrms(ss)[:rows, None]
    assert float(gate.max()) > shapes.SWIGLU_LIMIT  # the clip is exercised
    assert got.shape == (rows, shapes.FFN)
    assert rel_l2(got, want) < TOL_BF16


def cos_sin_cache(max_pos: int) -> torch.Tensor:
    cos, sin = ref.rope_cos_sin(torch.arange(max_pos), shapes.ROTARY_DIM, shapes.ROPE_THETA)
    return torch.cat([cos, sin], dim=-1)


@pytest.mark.parametrize("num_reqs", [1, 5])
def test_qkv_rope_model_matches_reference(num_reqs):
    sched = shapes.SCHEDULES["qkv"]
    gen = torch.Generator().manual_seed(20 + num_reqs)
    rows = shapes.rows_for(num_reqs)
    x = bf16((rows, sched.k), gen)
    nw = bf16((sched.k,), gen, 0.1)
    qn, kn = bf16((128,), gen, 0.1), bf16((128,), gen, 0.1)
    bits, scale, wd = mx_weight(sched.n, sched.k, gen)
    anchors = torch.randint(0, 5000, (num_reqs,), generator=gen)
    positions = (anchors[:, None] + torch.arange(7)).reshape(-1)
    pages = 8 * num_reqs
    slots = torch.randperm(pages * PAGE, generator=gen)[:rows]
    slots[3] = -1  # a padding row: its K/V must not be written
    kv_ref = torch.zeros(2, pages, PAGE, 1, 128, dtype=torch.bfloat16)
    kv_model = kv_ref.clone()

    p, ss = tm.linear_model(x, bits, scale, nw, sched, num_reqs)
    q = tm.qkv_rope_model(p, ss, qn, kn, cos_sin_cache(5100), positions, slots, kv_model.view(-1, 128),
                          *shapes.kv_row_map("planes", pages * PAGE), rows)

    qkv = ref.norm_linear(x, nw, shapes.RMS_EPS, wd.to(torch.bfloat16))
    cos, sin = ref.rope_cos_sin(positions, shapes.ROTARY_DIM, shapes.ROPE_THETA)
    # The reference writes every slot it is given (padding is dropped before it, in the context
    # commit): q for all rows through a scratch cache, then the valid rows' K/V into kv_ref.
    scratch = torch.zeros(2, -(-rows // PAGE), PAGE, 1, 128, dtype=torch.bfloat16)
    q_ref = ref.attn_prelude(qkv, qn, kn, cos, sin, shapes.RMS_EPS, scratch, torch.arange(rows), shapes.Q_HEADS,
                             shapes.KV_HEADS)
    keep = slots >= 0
    ref.attn_prelude(qkv[keep], qn, kn, cos[keep], sin[keep], shapes.RMS_EPS, kv_ref, slots[keep], shapes.Q_HEADS,
                     shapes.KV_HEADS)
    assert rel_l2(q, q_ref.reshape(rows, -1)) < TOL_BF16
    written = kv_ref.view(2, -1, 128)[:, slots[slots >= 0]]
    assert rel_l2(kv_model.view(2, -1, 128)[:, slots[slots >= 0]], written) < TOL_BF16
    # Nothing else was written (the padding row included).
    untouched = torch.ones(pages * PAGE, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.count_nonzero(kv_model.view(2, -1, 128)[:, untouched]) == 0


def _attention_requests(num_reqs: int, gen: torch.Generator):
    """(rows, anchors, seq_lens, pages, block_tables) of an attention case: request 0 runs past the
    4096 window (so the per-row left edge bites), the others are short; pages shuffled."""
    rows = shapes.rows_for(num_reqs)
    anchors = [4300] + torch.randint(0, 700, (num_reqs - 1,), generator=gen).tolist()
    seq_lens = torch.tensor([a + 7 for a in anchors])
    max_pages = max(-(-int(s) // PAGE) for s in seq_lens)
    pages = max_pages * num_reqs
    block_tables = torch.randperm(pages, generator=gen).view(num_reqs, max_pages).to(torch.int32)
    return rows, anchors, seq_lens, pages, block_tables


@pytest.mark.parametrize("num_reqs", [1, 3])
def test_attention_model_matches_reference(num_reqs):
    gen = torch.Generator().manual_seed(30 + num_reqs)
    rows, anchors, seq_lens, pages, block_tables = _attention_requests(num_reqs, gen)
    kv = bf16((2, pages, PAGE, 1, 128), gen)
    q = bf16((rows, shapes.Q_HEADS * 128), gen, 2.0)
    positions = (torch.tensor(anchors)[:, None] + torch.arange(7)).reshape(-1)

    got = tm.attention_model(q, kv.view(-1, 128), *shapes.kv_row_map("planes", pages * PAGE), positions, block_tables,
                             PAGE, num_reqs)
    want = ref.paged_window_attention(
        q.view(rows, shapes.Q_HEADS, 128), kv, positions, seq_lens, block_tables, 7,
        shapes.SLIDING_WINDOW, 1 / math.sqrt(128),
    )
    assert rel_l2(got, want.reshape(rows, -1)) < TOL_BF16


def test_attention_model_window_edge_is_per_row():
    """Only the anchor row sees the key at P - 4095; a value planted there moves only that row."""
    gen = torch.Generator().manual_seed(40)
    anchor = 4200
    pages = -(-(anchor + 7) // PAGE)
    bt = torch.arange(pages, dtype=torch.int32)[None]
    kv = torch.zeros(2, pages, PAGE, 1, 128, dtype=torch.bfloat16)
    q = bf16((7, shapes.Q_HEADS * 128), gen)
    positions = anchor + torch.arange(7)
    rows = shapes.kv_row_map("planes", pages * PAGE)
    base = tm.attention_model(q, kv.view(-1, 128), *rows, positions, bt, PAGE, 1)
    kv.view(2, -1, 128)[1, anchor - 4095] = 100.0  # V of the oldest key only row 0 can see
    moved = tm.attention_model(q, kv.view(-1, 128), *rows, positions, bt, PAGE, 1)
    changed = (moved.float() - base.float()).abs().amax(dim=1) > 0
    assert changed.tolist() == [True] + [False] * 6


def bound_rows(kv_layout: str, pages: int, dtype: torch.dtype = torch.bfloat16):
    """A fresh (zeroed) cache allocated in kv_layout as the engine does, its planes view, and the rows
    the runner hands the kernels (runner.KVRows: the rows, slot_rows, v_row0; uint8 codes for fp8)."""
    from dspark_sidecar.drafter.kv_cache import kv_planes
    from dspark_sidecar.kernels.flydsl.runner import KVRows

    shape = (2, pages, PAGE, 1, 128) if kv_layout == "planes" else (pages, 1, PAGE, 256)
    view = kv_planes(torch.zeros(shape, dtype=dtype))
    kv = KVRows.of(view)
    return view, (kv.rows, kv.slot_rows, kv.v_row0)


KV_DTYPES = [torch.bfloat16, FP8_KV]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two caches (torch.equal compares float8 tensors on CPU only as codes)."""
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8_KV else torch.equal(a, b)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("num_reqs", [1, 5])
def test_records_cache_is_written_as_a_planes_cache(num_reqs, dtype):
    """qkv_rope's K/V writes through the records rows (K | V per slot) leave the same cache, seen
    through its planes view, as the writes through planes rows: same q, same K/V, nothing else."""
    sched = shapes.SCHEDULES["qkv"]
    gen = torch.Generator().manual_seed(70 + num_reqs)
    rows = shapes.rows_for(num_reqs)
    p = torch.randn(sched.split, 16 * shapes.row_tiles(num_reqs), sched.n, generator=gen)
    ss = torch.rand(p.shape[:2], generator=gen) * 100 + 1
    qn, kn = bf16((128,), gen, 0.1), bf16((128,), gen, 0.1)
    positions = (torch.randint(0, 5000, (num_reqs,), generator=gen)[:, None] + torch.arange(7)).reshape(-1)
    pages = 8 * num_reqs
    slots = torch.randperm(pages * PAGE, generator=gen)[:rows]
    slots[2] = -1
    out = {}
    for kv_layout in ("planes", "records"):
        view, kv = bound_rows(kv_layout, pages, dtype)
        q = tm.qkv_rope_model(p, ss, qn, kn, cos_sin_cache(5100), positions, slots, *kv, rows)
        out[kv_layout] = q, view
    (q_p, planes), (q_r, records) = out["planes"], out["records"]
    assert records.stride() != planes.stride()  # the engine's tensors really are laid out differently
    assert torch.equal(q_r, q_p)
    assert same_bits(records, planes)
    written = torch.zeros(pages * PAGE, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    by_slot = planes.reshape(2, -1, 128).float()
    assert bool(by_slot[:, written].any(dim=-1).all())  # every kept row's K and V landed
    assert torch.count_nonzero(by_slot[:, ~written]) == 0  # and nothing else (the padding row included)


@pytest.mark.parametrize("dtype", KV_DTYPES)
@pytest.mark.parametrize("num_reqs", [1, 3])
def test_records_cache_is_read_as_a_planes_cache(num_reqs, dtype):
    """attention over the records rows of a cache gives the same bits as over the planes rows of a
    cache holding the same K/V."""
    gen = torch.Generator().manual_seed(80 + num_reqs)
    rows = shapes.rows_for(num_reqs)
    anchors = [4300] + torch.randint(0, 700, (num_reqs - 1,), generator=gen).tolist()
    max_pages = max(-(-(a + 7) // PAGE) for a in anchors)
    pages = max_pages * num_reqs
    block_tables = torch.randperm(pages, generator=gen).view(num_reqs, max_pages).to(torch.int32)
    contents = to_cache(bf16((2, pages, PAGE, 1, 128), gen), dtype)
    q = bf16((rows, shapes.Q_HEADS * 128), gen, 2.0)
    positions = (torch.tensor(anchors)[:, None] + torch.arange(7)).reshape(-1)
    got = {}
    for kv_layout in ("planes", "records"):
        view, kv = bound_rows(kv_layout, pages, dtype)
        view.copy_(contents)
        got[kv_layout] = tm.attention_model(q, kv[0], *kv[1:], positions, block_tables, PAGE, num_reqs)
    assert torch.equal(got["records"], got["planes"])
    # And a records row map over planes memory reads other values: the addressing really differs.
    view, kv = bound_rows("planes", pages, dtype)
    view.copy_(contents)
    wrong = tm.attention_model(q, kv[0], *shapes.kv_row_map("records", pages * PAGE), positions, block_tables, PAGE,
                               num_reqs)
    assert not torch.equal(wrong, got["planes"])


def every_bf16() -> torch.Tensor:
    """All 65536 bf16 bit patterns: zeros, subnormals, normals, +-inf and the NaNs."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_fp8_write_codes_are_to_cache_codes_for_every_bf16_value():
    """qkv_rope's fp8 conversion (compare-select saturation, then round to nearest even) gives, for
    every bf16 value, the code kv_cache.to_cache stores: the reference's and vLLM's fp8 cache writes."""
    x = every_bf16()
    got = tm.e4m3_codes_like_kernel(x)
    want = to_cache(x, FP8_KV).view(torch.uint8)
    nan = x.isnan()
    assert torch.equal(got[~nan], want[~nan])
    assert bool(got[nan].view(FP8_KV).float().isnan().all())  # NaN stays NaN (the code's sign may differ)
    # What the comparison covers: saturation of finite values and infinities, and exact ties.
    big = torch.tensor([448.0, 464.0, 480.0, 1e4, math.inf, -464.0, -math.inf], dtype=torch.bfloat16)
    assert tm.e4m3_codes_like_kernel(big).view(FP8_KV).float().abs().eq(448.0).all()
    ties = torch.tensor([0.53125, 0.59375, 2.0**-10, 3 * 2.0**-10], dtype=torch.bfloat16)  # halfway on the grid
    assert tm.e4m3_codes_like_kernel(ties).view(FP8_KV).float().tolist() == [0.5, 0.625, 0.0, 2.0**-8]


def test_fp8_read_widens_every_code_exactly():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = tm.kv_values_like_kernel(codes)
    want = codes.view(FP8_KV).float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("kv_layout", shapes.KV_LAYOUTS)
@pytest.mark.parametrize("num_reqs", [1, 5])
def test_qkv_rope_model_writes_to_cache_codes_into_an_fp8_cache(num_reqs, kv_layout):
    """Over an fp8 cache the model stores exactly to_cache(K/V it stores into a bf16 cache), V's
    saturated values included, at the same slots, and the same q."""
    sched = shapes.SCHEDULES["qkv"]
    gen = torch.Generator().manual_seed(90 + num_reqs)
    rows = shapes.rows_for(num_reqs)
    # Partials ~100x larger than a layer's: V (not normed) then often exceeds 448 and saturates.
    p = torch.randn(sched.split, 16 * shapes.row_tiles(num_reqs), sched.n, generator=gen) * 100
    ss = torch.rand(p.shape[:2], generator=gen) * 100 + 1
    qn, kn = bf16((128,), gen, 0.1), bf16((128,), gen, 0.1)
    positions = (torch.randint(0, 5000, (num_reqs,), generator=gen)[:, None] + torch.arange(7)).reshape(-1)
    pages = 8 * num_reqs
    slots = torch.randperm(pages * PAGE, generator=gen)[:rows]
    slots[1] = -1
    out = {}
    for dtype in KV_DTYPES:
        view, kv = bound_rows(kv_layout, pages, dtype)
        out[dtype] = tm.qkv_rope_model(p, ss, qn, kn, cos_sin_cache(5100), positions, slots, *kv, rows), view
    (q_bf16, kv_bf16), (q_fp8, kv_fp8) = out[torch.bfloat16], out[FP8_KV]
    assert torch.equal(q_fp8, q_bf16)
    assert same_bits(kv_fp8, to_cache(kv_bf16, FP8_KV))  # unwritten slots: zeros in both
    v_written = kv_fp8[1].reshape(-1, 128)[slots[slots >= 0]].float()
    assert bool((v_written.abs() == 448.0).any())  # the saturation was exercised


@pytest.mark.parametrize("num_reqs", [1, 3])
def test_attention_model_over_an_fp8_cache_matches_reference(num_reqs):
    """The model reads e4m3fn codes as the reference reads an fp8 cache (widened exactly)."""
    gen = torch.Generator().manual_seed(100 + num_reqs)
    rows, anchors, seq_lens, pages, block_tables = _attention_requests(num_reqs, gen)
    view, kv = bound_rows("records", pages, FP8_KV)
    view.copy_(to_cache(bf16((2, pages, PAGE, 1, 128), gen, 4.0), FP8_KV))
    q = bf16((rows, shapes.Q_HEADS * 128), gen, 2.0)
    positions = (torch.tensor(anchors)[:, None] + torch.arange(7)).reshape(-1)
    got = tm.attention_model(q, *kv, positions, block_tables, PAGE, num_reqs)
    want = ref.paged_window_attention(q.view(rows, shapes.Q_HEADS, 128), view, positions, seq_lens, block_tables, 7,
                                      shapes.SLIDING_WINDOW, 1 / math.sqrt(128))
    assert rel_l2(got, want.reshape(rows, -1)) < TOL_BF16


def test_exchange_model_rank_order_sum():
    gen = torch.Generator().manual_seed(50)
    sched = shapes.SCHEDULES["down"]
    rows, mp = shapes.rows_for(4), 32
    partials = [torch.randn(sched.split, mp, shapes.HIDDEN, generator=gen) for _ in range(shapes.TP)]
    residual = bf16((rows, shapes.HIDDEN), gen)
    got = tm.exchange_model(partials, residual)
    want = (residual.double() + sum(p.double().sum(0)[:rows] for p in partials)).to(torch.bfloat16)
    # One bf16 rounding of the same sum (fp32 vs fp64 accumulation can flip a last bit).
    assert rel_l2(got, want) < 4e-3
    with pytest.raises(ValueError):
        tm.exchange_model(partials[:3], residual)


def test_final_norm_model_matches_reference():
    gen = torch.Generator().manual_seed(60)
    x = bf16((shapes.rows_for(8), shapes.HIDDEN), gen, 3.0)
    w = bf16((shapes.HIDDEN,), gen, 0.1)
    got = tm.final_norm_model(x, w)
    want = ref.rms_norm(x, w, shapes.RMS_EPS)
    # Same single rounding; only the fp32 summation order of the mean differs.
    assert rel_l2(got, want) < 1e-3
    assert (got.float() - want.float()).abs().max() <= 2 ** -6 * want.float().abs().max()
