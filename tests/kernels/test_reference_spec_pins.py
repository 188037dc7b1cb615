"""Spec draft-step.md section 1, pinned on the reference ops with hand-computed values.

The step-level tests compare the reference against tests/helpers/f64_drafter.py, written from the
same reading of the spec, and at bf16 within a 3e-2 relative tolerance. These pin single spec
statements with inputs chosen so the expected numbers can be worked out by hand (or with `math`
on the spec's formula), so that a misreading shared by the two implementations, or one that hides
under the bf16 tolerance, still fails here.
"""

from __future__ import annotations

import math

import pytest
import torch

from dspark_sidecar.drafter.checkpoint import dequantize_mxfp8
from dspark_sidecar.kernels import reference
from dspark_sidecar.kernels.weights import MxFp8Weight, NormFolded


def test_gemma_norm_forms_one_plus_w_in_fp32():
    """`y = x * rsqrt(mean(x^2) + eps) * (1 + w)`, "the 1 + w formed in fp32".

    x = [3, 3, 1, 1, 0]: mean(x^2) = 4, so with eps 0 the normed x is [1.5, 1.5, 0.5, 0.5, 0] exactly.
    w = 2^-8 (a bf16 value): 1 + w = 1.00390625 is a tie between the bf16 neighbours 1 and 1 + 2^-7,
    so formed in bf16 it would be 1.0 and y[0] = 1.5; formed in fp32, 1.5 * 1.00390625 = 1.505859375
    rounds once to the bf16 1.5078125. 0.5 * 1.00390625 = 0.501953125 is a tie rounding to 0.5.
    """
    x = torch.tensor([[3.0, 3.0, 1.0, 1.0, 0.0]], dtype=torch.bfloat16)
    w = torch.full((5,), 2.0 ** -8, dtype=torch.bfloat16)
    y = reference.rms_norm(x, w, 0.0)
    assert y.dtype == torch.bfloat16
    assert y.float().tolist() == [[1.5078125, 1.5078125, 0.5, 0.5, 0.0]]


def test_gemma_norm_adds_eps_inside_the_root():
    """x = [1, 1], w = 0, eps = 3: y = 1 / sqrt(1 + 3) = 0.5 (not 1 / (1 + 3), not 1 / sqrt(1) + 3)."""
    y = reference.rms_norm(torch.tensor([[1.0, 1.0]]), torch.zeros(2), 3.0)
    assert y.tolist() == [[0.5, 0.5]]


def test_qk_norm_is_gemma_per_head_before_rope():
    """Per-head norm over head_dim with the same fp32 (1 + w), then RoPE (position 0: identity).

    Head 0 = [3, 3, 3, 3, 1, 1, 1, 1, 0, 0]: mean(x^2) = 40 / 10 = 4, normed [1.5 x4, 0.5 x4, 0, 0];
    head 1 is twice head 0, normed the same (each head by its own rms). w = 2^-8 as above.
    """
    head = torch.tensor([3.0] * 4 + [1.0] * 4 + [0.0] * 2)
    x = torch.stack([head, 2 * head])[None].to(torch.bfloat16)  # [1, 2 heads, 10]
    cos, sin = reference.rope_cos_sin(torch.tensor([0]), 4, 5e6)
    y = reference.qk_norm_rope(x, torch.full((10,), 2.0 ** -8, dtype=torch.bfloat16), cos, sin, 0.0)
    want = [1.5078125] * 4 + [0.5] * 4 + [0.0] * 2
    assert y.float().tolist() == [[want, want]]


def test_partial_neox_rope_pairs_dims_i_and_i_plus_half_and_passes_the_rest():
    """head_dim 8, rotary_dim 4, theta 100, position 3: inv_freq = 100^(-2i/4) = [1, 0.1];
    pairs (0, 2) at angle 3 and (1, 3) at angle 0.3 (NeoX half-split, not interleaved (0, 1));
    dims 4..7 pass through unchanged."""
    cos, sin = reference.rope_cos_sin(torch.tensor([3]), 4, 100.0)
    assert cos.dtype == torch.float32 and cos.shape == (1, 2)
    x = torch.arange(1.0, 9.0).view(1, 1, 8)
    y = reference.apply_partial_rope(x, cos, sin).flatten().tolist()
    a, b = 3.0, 0.3
    want = [1 * math.cos(a) - 3 * math.sin(a), 2 * math.cos(b) - 4 * math.sin(b),
            3 * math.cos(a) + 1 * math.sin(a), 4 * math.cos(b) + 2 * math.sin(b), 5.0, 6.0, 7.0, 8.0]
    assert y == pytest.approx(want, abs=1e-6)


def test_rope_angle_uses_theta_five_million_at_large_positions():
    """theta = 5e6, rotary 64: the last pair's inv_freq is 5e6^(-62/64); at position 10^6 its angle is
    10^6 * 5e6^(-62/64), whose cosine fp32 angles would miss (formed in float64 here)."""
    p, theta = 1_000_000, 5_000_000.0
    cos, sin = reference.rope_cos_sin(torch.tensor([p]), 64, theta)
    for i in (0, 1, 17, 31):
        ang = p * theta ** (-2.0 * i / 64)
        assert cos[0, i].item() == pytest.approx(math.cos(ang), abs=1e-6)
        assert sin[0, i].item() == pytest.approx(math.sin(ang), abs=1e-6)


def test_qk_norm_and_rope_are_computed_in_fp32_and_rounded_once():
    """Per-head Gemma norm then partial NeoX RoPE, the whole in fp32 and rounded once to bf16 (the module's
    contract, which the kernels' prelude is held to): against float64 of the spec's formula rounded once,
    every value agrees. Rounded to bf16 between the norm and the RoPE, 31 of these 240 come out an ulp or
    more off: within the step's bf16 tolerance, so only a pin of the op sees it. The case is checked to
    have no float64 value within 1e-6 of its head's max of a bf16 rounding boundary, so fp32's own
    rounding cannot flip one."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(5, 3, 16, generator=gen) * 3).to(torch.bfloat16)  # [rows, heads, head_dim]
    w = (torch.randn(16, generator=gen) * 0.3).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 7, 1000, 123457])
    cos, sin = reference.rope_cos_sin(pos, 8, 10_000.0)
    got = reference.qk_norm_rope(x, w, cos, sin, 1e-6)
    assert got.dtype == torch.bfloat16

    xd = x.double()
    n = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * (1 + w.double())
    ang = pos.double()[:, None] * 10_000.0 ** (-2.0 * torch.arange(4, dtype=torch.float64) / 8)
    c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    a, b = n[..., :4], n[..., 4:8]
    want = torch.cat([a * c - b * s, b * c + a * s, n[..., 8:]], -1)
    margin = 1e-6 * want.abs().amax(-1, keepdim=True)
    assert torch.equal((want + margin).to(torch.bfloat16), (want - margin).to(torch.bfloat16))
    assert torch.equal(got, want.to(torch.bfloat16))


def test_a_norm_folded_weight_computes_the_spec_norm_then_linear():
    """kernels.weights.NormFolded (the Triton backend's qkv and gate|up weights): W' = W * (1 + w) along
    the input dim, and the reference's norm_linear(_swiglu) over it must still be the spec's
    linear(gemma_norm(x)) (and its SwiGLU-OAI): fp32 against float64, a non-square weight. Without this
    pin only the Triton tests (which skip where triton is not installed) held the reference's folded form.
    Folding in bf16 forms (1 + w) in fp32 and rounds the product once: W = 1.5, w = 2^-8 gives 1.5078125
    (1.5 if 1 + w were rounded to bf16 first, as in the Gemma norm pin above)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(7, 64, generator=gen) * 2
    nw = torch.randn(64, generator=gen) * 0.3
    w = torch.randn(40, 64, generator=gen) / 8
    eps = 1e-6
    xd = x.double()
    normed = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps) * (1 + nw.double())
    want = normed @ w.double().T
    got = reference.norm_linear(x, nw, eps, NormFolded.fold(w, nw))
    assert float((got.double() - want).abs().max()) < 1e-5 * float(want.abs().max())
    g, u = want[:, :20].clamp(max=7.0), want[:, 20:].clamp(-7.0, 7.0)
    want_act = g * torch.sigmoid(1.702 * g) * (u + 1)
    got_act = reference.norm_linear_swiglu(x, nw, eps, NormFolded.fold(w, nw), 1.702, 7.0)
    assert float((got_act.double() - want_act).abs().max()) < 1e-5 * float(want_act.abs().max())

    bf16 = torch.bfloat16
    folded = NormFolded.fold(torch.full((1, 2), 1.5, dtype=bf16), torch.full((2,), 2.0 ** -8, dtype=bf16))
    assert folded.weight.dtype == torch.bfloat16 and folded.weight.float().tolist() == [[1.5078125, 1.5078125]]


def test_swiglu_oai_clamps_and_the_plus_one_on_the_up_half():
    """g = min(gate, 7) (no lower clamp), u = clamp(up, -7, 7), out = g * sigmoid(1.702 g) * (u + 1).

    gate | up halves: (gate, up) = (-10, -10): g stays -10, u = -7; (10, 10): g = 7, u = 7;
    (1, 0.5): both as they are; (2, -1): u + 1 = 0 so the output is exactly 0."""
    gate, up = [-10.0, 10.0, 1.0, 2.0], [-10.0, 10.0, 0.5, -1.0]
    out = reference.swiglu_oai(torch.tensor([gate + up]), 1.702, 7.0)[0].tolist()

    def f(g, u):
        return g / (1.0 + math.exp(-1.702 * g)) * (u + 1.0)

    want = [f(-10.0, -7.0), f(7.0, 7.0), f(1.0, 0.5), 0.0]
    assert out == pytest.approx(want, rel=1e-6, abs=1e-12)
    # A lower clamp on the gate at -7 would give f(-7, -7), over 100x larger: the check above tells them apart.
    assert abs(f(-7.0, -7.0)) > 100 * abs(want[0])


def test_swiglu_oai_is_computed_in_fp32_and_rounded_once():
    """The spec's SwiGLU-OAI is "fp32": bf16 gate|up in, the whole formula in fp32, one rounding to bf16.
    Against float64 rounded once (the exact products here are nowhere near a bf16 tie), every output
    agrees; computed in bf16 op by op, 22 of these 49 come out one or more ulps off (within the step's
    bf16 tolerance, so only a pin of the op sees it)."""
    gate = torch.linspace(-6, 6, 49).to(torch.bfloat16)
    up = torch.linspace(-3, 5, 49).to(torch.bfloat16)
    out = reference.swiglu_oai(torch.cat([gate, up])[None], 1.702, 7.0)[0]
    assert out.dtype == torch.bfloat16

    def f(g, u):
        return g / (1.0 + math.exp(-1.702 * g)) * (u + 1.0)

    want = torch.tensor([f(g, u) for g, u in zip(gate.tolist(), up.tolist())], dtype=torch.float64)
    assert torch.equal(out, want.to(torch.bfloat16))


def _position_valued_cache(table: torch.Tensor, seq_lens: list[int], page: int, num_pages: int,
                           kv_heads: int) -> torch.Tensor:
    """A planes cache whose V of KV head k at absolute position p is [p + 100 k, 1]; K is 0."""
    kv = torch.zeros(2, num_pages, page, kv_heads, 2)
    for r, seq in enumerate(seq_lens):
        for p in range(seq):
            pg, off = int(table[r, p // page]), p % page
            for k in range(kv_heads):
                kv[1, pg, off, k] = torch.tensor([p + 100.0 * k, 1.0])
    return kv


@pytest.mark.parametrize("form", [reference.paged_window_attention, reference.paged_window_attention_static],
                         ids=["loop", "static"])
def test_window_edge_per_row_block_non_causal_and_gqa_group_mapping(form):
    """With q = 0 every visible key gets the same weight, so a row's output is the mean of the V of
    the keys it sees: [lo, P + 6] averages to (lo + P + 6) / 2, lo = max(0, p - (window - 1)).

    window 4: request 0 (P = 10) has per-row left edges 7..13 (no causal mask: every row reaches
    P + 6 = 16); request 1 (P = 1) has edges max(0, -2..4) = 0, 0, 0, 1, 2, 3, 4. Output head h of
    6 carries KV head h // 3's V (+ 100 k); which query feeds it is pinned by the GQA test below.
    """
    page, window, P = 4, 4, [10, 1]
    seq = [p + 7 for p in P]
    table = torch.tensor([[4, 2, 0, 3, 1], [5, 6, 0, 0, 0]], dtype=torch.int32)
    kv = _position_valued_cache(table, seq, page, 7, kv_heads=2)
    q = torch.zeros(14, 6, 2)
    positions = torch.cat([torch.arange(p, p + 7) for p in P])
    out = form(q, kv, positions, torch.tensor(seq, dtype=torch.int32), table, 7, window, 0.5)
    for r, p0 in enumerate(P):
        for t in range(7):
            lo = max(0, p0 + t - (window - 1))
            for h in range(6):
                want = (lo + p0 + 6) / 2 + 100.0 * (h // 3)
                got = out[7 * r + t, h]
                assert got[0].item() == pytest.approx(want, abs=1e-4), f"request {r} row {t} head {h}"
                assert got[1].item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("form", [reference.paged_window_attention, reference.paged_window_attention_static],
                         ids=["loop", "static"])
def test_gqa_query_head_h_reads_kv_head_h_over_group(form):
    """64 / 4 heads is group 16 and query head h reads KV head h // 16 (vLLM's and HF's repeat_kv
    mapping; at TP 4 rank r holds query heads 16r..16r+15 and KV head r). Here 6 query heads over 2
    KV heads (group 3), one request at P = 0 (keys 0..6, all visible to every row). K at position p
    is [p, 0] for both KV heads, V of KV head k is [p + 100 k, 1]; query head h is [a_h, 0] with
    a_h = (h + 1) / 4 and scale 1, so head h's output is sum p e^(a_h p) / sum e^(a_h p) + 100 (h // 3):
    each query head's own slope, each KV head's own offset."""
    page = 8
    table = torch.tensor([[0]], dtype=torch.int32)
    kv = torch.zeros(2, 1, page, 2, 2)
    for p in range(7):
        for k in range(2):
            kv[0, 0, p, k] = torch.tensor([float(p), 0.0])
            kv[1, 0, p, k] = torch.tensor([p + 100.0 * k, 1.0])
    q = torch.zeros(7, 6, 2)
    for h in range(6):
        q[:, h, 0] = (h + 1) / 4
    out = form(q, kv, torch.arange(7), torch.tensor([7], dtype=torch.int32), table, 7, 16, 1.0)
    for h in range(6):
        a = (h + 1) / 4
        want = sum(p * math.exp(a * p) for p in range(7)) / sum(math.exp(a * p) for p in range(7)) + 100.0 * (h // 3)
        assert out[:, h, 0].tolist() == pytest.approx([want] * 7, abs=1e-4), f"query head {h}"


def test_attention_scale_multiplies_the_scores():
    """Two visible keys with scores q.k = 0 and 1: with scale s, weights 1 : e^s. One request at P = 0 whose
    only non-zero key is position 6 (row 6's own): each row sees keys 0..6, six of score 0, one of score s."""
    page, window = 8, 16
    table = torch.tensor([[0]], dtype=torch.int32)
    kv = torch.zeros(2, 1, page, 1, 2)
    kv[0, 0, 6, 0] = torch.tensor([1.0, 0.0])  # K at position 6
    kv[1, 0, :7, 0, 0] = torch.arange(7.0)  # V = position
    q = torch.zeros(7, 1, 2)
    q[:, 0, 0] = 1.0
    s = 128 ** -0.5
    out = reference.paged_window_attention(q, kv, torch.arange(7), torch.tensor([7], dtype=torch.int32), table, 7,
                                           window, s)
    e = math.exp(s)
    want = (sum(range(6)) + 6 * e) / (6 + e)
    assert out[:, 0, 0].tolist() == pytest.approx([want] * 7, abs=1e-5)


def test_linear_rounds_the_product_before_the_residual_add_and_accumulates_in_place():
    """reference.linear's contract (the Triton GEMM's epilogue is held to it): with a residual, y = x @ W^T is
    rounded to x.dtype first, then added (two roundings, as `residual + linear(x)`); with accumulate the sum is
    written over the residual, which is returned (the layers rely on it to skip a copy), same bits.

    bf16: x @ W^T = 1 + 2^-8 is a tie that rounds to 1, and 1 + 2^-8 (the residual) again to 1; rounded once,
    1 + 2^-8 + 2^-8 = 1 + 2^-7 is a bf16 value. Two roundings give 1.0, one gives 1.0078125."""
    bf16 = torch.bfloat16
    x = torch.tensor([[1.0, 1.0]], dtype=bf16)
    w = torch.tensor([[1.0, 2.0 ** -8]], dtype=bf16)
    res = torch.tensor([[2.0 ** -8]], dtype=bf16)
    y = reference.linear(x, w, res)
    assert y.dtype == bf16 and y.float().tolist() == [[1.0]]
    assert res.float().tolist() == [[2.0 ** -8]]  # not accumulating: the residual is left as it was
    acc = res.clone()
    out = reference.linear(x, w, acc, accumulate=True)
    assert out is acc and acc.dtype == bf16 and acc.float().tolist() == [[1.0]]


def test_mxfp8_blocks_run_along_the_input_dim_with_bias_127():
    """weight [2, 64] = 2 rows x 2 blocks of 32 along the input (column) dim; scale [2, 2] U8 E8M0,
    value v meaning 2^(v - 127): row 0 blocks x 1 and x 8, row 1 blocks x 2^-7 and x 1."""
    codes = torch.tensor([[1.5] * 32 + [-0.25] * 32, [448.0] * 32 + [0.5] * 32]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[127, 130], [120, 127]], dtype=torch.uint8)
    want = torch.tensor([[1.5] * 32 + [-2.0] * 32, [3.5] * 32 + [0.5] * 32])
    assert torch.equal(dequantize_mxfp8(codes, scale, 32), want)
    assert torch.equal(MxFp8Weight(codes, scale, 32).dequantize(torch.bfloat16), want.to(torch.bfloat16))
    # and reference.linear computes with those values: x = one-hot columns 0 and 63
    x = torch.zeros(2, 64)
    x[0, 0], x[1, 63] = 1.0, 1.0
    y = reference.linear(x, MxFp8Weight(codes, scale, 32))
    assert y.tolist() == [[1.5, 3.5], [-2.0, 0.5]]
