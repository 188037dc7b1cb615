"""Parity of the Triton prelude (q/k norm + partial RoPE + K/V write), write_kv and rms_norm with the reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.kernels import reference  # noqa: E402
from dspark_sidecar.kernels.triton import gemm  # noqa: E402
from dspark_sidecar.kernels.triton.ops import TRITON_OPS  # noqa: E402
from helpers.far_cache import WRAP, far_cache  # noqa: E402

EPS, THETA = 1e-6, 5_000_000.0
# (q_heads, kv_heads, head_dim, rotary_dim): the TP-4 rank shard's heads with a small head,
# and the tiny preset's 128-wide head (64 rotary dims) with GQA group 2.
# A head of 96 (not a power of two: masked tails) rotated over all its dims (rotary_dim == head_dim,
# which the config allows).
HEADS = [(4, 1, 32, 16), (2, 1, 128, 64), (8, 4, 128, 64), (2, 1, 96, 96)]
PAGE, PAGES = 16, 12


def _case(q_heads, kv_heads, d, rot, rows, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(rows, (q_heads + 2 * kv_heads) * d, generator=gen) * 3.0).to(device, dtype)
    qn = (torch.randn(d, generator=gen) * 0.1).to(device, dtype)
    kn = (torch.randn(d, generator=gen) * 0.1).to(device, dtype)
    # Positions in the millions: the fp64 angles matter there.
    positions = torch.randint(0, 3_000_000, (rows,), generator=gen).to(device)
    cos, sin = reference.rope_cos_sin(positions, rot, THETA)
    kv = torch.randn(2, PAGES, PAGE, kv_heads, d, generator=gen).to(device, dtype)
    slots = torch.randperm(PAGES * PAGE, generator=gen)[:rows].to(device)
    return qkv, qn, kn, cos, sin, kv, slots


@pytest.mark.parametrize("seed,pad", [(0, False), (1, True)], ids=["s0", "s1-pad"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "h{}-{}d{}r{}".format(*h))
def test_attn_prelude(device, heads, dtype, seed, pad, parity):
    """pad: one row's slot is -1. The reference's write_kv takes valid slots only, so it runs on
    the other rows; the kernel must write those and leave the cache alone for the padding row."""
    q_heads, kv_heads = heads[:2]
    qkv, qn, kn, cos, sin, kv, slots = _case(*heads, 14, dtype, device, seed)
    if pad:
        slots[7] = -1
    keep = slots >= 0
    kv_ref = kv.clone()
    q_ref = reference.attn_prelude(qkv[keep], qn, kn, cos[keep], sin[keep], EPS, kv_ref, slots[keep],
                                   q_heads, kv_heads)
    q = TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv, slots, q_heads, kv_heads)
    parity(q[keep], q_ref)
    parity(kv, kv_ref)
    written = torch.zeros(PAGES * PAGE, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    flat, flat_ref = kv.view(2, -1, kv_heads, heads[2]).cpu(), kv_ref.view(2, -1, kv_heads, heads[2]).cpu()
    assert torch.equal(flat[:, ~written], flat_ref[:, ~written]), "a slot outside the mapping was touched"
    assert torch.equal(flat[1], flat_ref[1]), "V is a plain copy: it must match bit for bit"


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_norm_qkv_prelude(device, dtype, split, parity):
    """The qkv GEMM's partials finished inside the prelude: the same bits as the GEMM with its own
    finalize followed by the prelude (same sums in the same order, same roundings), and the
    reference's norm_linear + attn_prelude within the usual tolerance; the cache rows too."""
    q_heads, kv_heads, d, rot = 4, 1, 64, 32
    gen = torch.Generator().manual_seed(3)
    hidden, rows = 192, 14
    x = (torch.randn(rows, hidden, generator=gen) * 2).to(device, dtype)
    nw = (torch.randn(hidden, generator=gen) * 0.1).to(device, dtype)
    w = (torch.randn((q_heads + 2 * kv_heads) * d, hidden, generator=gen) * hidden ** -0.5).to(device, dtype)
    qn, kn = ((torch.randn(d, generator=gen) * 0.1).to(device, dtype) for _ in range(2))
    cos, sin = reference.rope_cos_sin(torch.randint(0, 100_000, (rows,), generator=gen).to(device), rot, THETA)
    kv = torch.randn(2, PAGES, PAGE, kv_heads, d, generator=gen).to(device, dtype)
    slots = torch.randperm(PAGES * PAGE, generator=gen)[:rows].to(device)
    cfg = gemm.GemmConfig(16, 64, 64, split)
    args = (qn, kn, cos, sin, EPS)
    kv_fused, kv_unfused, kv_ref = kv.clone(), kv.clone(), kv.clone()
    parts = gemm.norm_linear_partials(x, w, nw, EPS, config=cfg)
    assert parts.ws.shape == (split, rows, w.shape[0])
    q_fused = TRITON_OPS.attn_prelude(parts, *args, kv_fused, slots, q_heads, kv_heads)
    q_unfused = TRITON_OPS.attn_prelude(gemm.gemm(x, w, nw, EPS, config=cfg), *args, kv_unfused, slots,
                                        q_heads, kv_heads)
    assert torch.equal(q_fused, q_unfused) and torch.equal(kv_fused, kv_unfused)
    q_ref = reference.norm_qkv_prelude(x, nw, EPS, w, *args[:4], kv_ref, slots, q_heads, kv_heads)
    parity(TRITON_OPS.norm_qkv_prelude(x, nw, EPS, w, *args[:4], kv, slots, q_heads, kv_heads), q_ref)
    parity(kv, kv_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_qk_norm_rope_strided(device, dtype, parity):
    """The context commit's K: a strided view (the k half of a k|v projection)."""
    gen = torch.Generator().manual_seed(2)
    kv_rows = (torch.randn(9, 2 * 2 * 128, generator=gen) * 2.0).to(device, dtype)
    k = kv_rows[:, : 2 * 128].view(9, 2, 128)
    w = (torch.randn(128, generator=gen) * 0.1).to(device, dtype)
    cos, sin = reference.rope_cos_sin(torch.arange(100, 109, device=device), 64, THETA)
    parity(TRITON_OPS.qk_norm_rope(k, w, cos, sin, EPS), reference.qk_norm_rope(k, w, cos, sin, EPS))


def test_write_kv_exact(device):
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(2, PAGES, PAGE, 2, 64, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(10, 2, 64, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(10, 2, 64, generator=gen).to(device, torch.bfloat16)
    slots = torch.randperm(PAGES * PAGE, generator=gen)[:10].to(device)
    slots[[0, 7]] = -1  # padding rows: skipped by the kernel (the reference takes valid slots only)
    keep = slots >= 0
    kv_ref = kv.clone()
    reference.write_kv(kv_ref, k[keep], v[keep], slots[keep])
    TRITON_OPS.write_kv(kv, k, v, slots)
    assert torch.equal(kv.cpu(), kv_ref.cpu())
    assert not torch.equal(kv_ref.cpu(), kv.clone().zero_().cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("width", [256, 300, 4100, 8200])
def test_rms_norm(device, width, dtype, parity):
    """Rows held in registers (a power of two, ragged, 6144-like) and, past norm.ONE_PASS_MAX, read
    twice in 2048-wide chunks with a ragged last one."""
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(7, width, generator=gen) * 5.0).to(device, dtype)
    w = (torch.randn(width, generator=gen) * 0.1).to(device, dtype)
    parity(TRITON_OPS.rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS))


def test_norm_eps_counts_for_rows_of_small_magnitude(device, parity):
    """rsqrt(mean(x^2) + eps) with heads and rows whose mean square is about eps (values ~ 1e-3) and a
    zero row: at unit-size activations an eps dropped from the q/k norm, the qkv input norm finished in
    the prelude, or rms_norm is invisible."""
    qkv, qn, kn, cos, sin, kv, slots = _case(4, 1, 32, 16, 6, torch.float32, device, seed=24)
    qkv = qkv * 3e-4
    qkv[1] = 0.0
    kv_ref = kv.clone()
    q_ref = reference.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv_ref, slots, 4, 1)
    parity(TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv, slots, 4, 1), q_ref)
    parity(kv, kv_ref)
    gen = torch.Generator().manual_seed(25)
    x = (torch.randn(6, 192, generator=gen) * 1e-3).to(device)
    x[4] = 0.0
    nw = (torch.randn(192, generator=gen) * 0.1).to(device)
    parity(TRITON_OPS.rms_norm(x, nw, EPS), reference.rms_norm(x, nw, EPS))
    w = (torch.randn(6 * 32, 192, generator=gen) * 192 ** -0.5).to(device)
    kv_ref = kv.clone()
    parts = gemm.norm_linear_partials(x, w, nw, EPS, config=gemm.GemmConfig(16, 64, 64, 3))
    q_ref = reference.norm_qkv_prelude(x, nw, EPS, w, qn, kn, cos, sin, kv_ref, slots, 4, 1)
    parity(TRITON_OPS.attn_prelude(parts, qn, kn, cos, sin, EPS, kv, slots, 4, 1), q_ref)
    parity(kv, kv_ref)


def test_rms_norm_weight_must_match_the_row(device, parity):
    """The kernel loads (1 + w) at the row's offsets, masked by the row's width alone: a shorter
    weight was read past its end and a longer one cut short, where the reference raises; a strided
    view of the right width was read as if contiguous (its neighbours' values), where the reference
    takes it."""
    gen = torch.Generator().manual_seed(21)
    x = (torch.randn(7, 64, generator=gen) * 5.0).to(device)
    w = (torch.randn(128, generator=gen) * 0.1).to(device)
    for bad in (w[:48], w):
        with pytest.raises(RuntimeError):
            reference.rms_norm(x, bad, EPS)
        with pytest.raises(ValueError, match="norm weight"):
            TRITON_OPS.rms_norm(x, bad, EPS)
    parity(TRITON_OPS.rms_norm(x, w[::2], EPS), reference.rms_norm(x, w[::2], EPS))


@pytest.mark.parametrize("view", ["columns", "transposed"])
def test_rms_norm_of_a_strided_x(device, view, parity):
    """x as the first columns of a wider buffer (rows read at r * stride(0), the output dense: its own row
    stride) and as a transposed view (a row's elements not adjacent: copied first, as the kernel reads them at
    unit stride), where the reference takes both."""
    gen = torch.Generator().manual_seed(26)
    wide = (torch.randn(7, 200, generator=gen) * 5.0).to(device)
    x = wide[:, :96] if view == "columns" else wide[:, :96].t().contiguous().t()
    assert not x.is_contiguous()
    w = (torch.randn(96, generator=gen) * 0.1).to(device)
    out = TRITON_OPS.rms_norm(x, w, EPS)
    assert out.is_contiguous()
    parity(out, reference.rms_norm(x, w, EPS))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [7, 56])
def test_real_shapes(cuda, rows, parity):
    """TP-4 rank: 16 q heads, 1 KV head of 128 (64 rotary), hidden 6144 for the final norm."""
    qkv, qn, kn, cos, sin, kv, slots = _case(16, 1, 128, 64, rows, torch.bfloat16, cuda, seed=4)
    kv_ref = kv.clone()
    q_ref = reference.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv_ref, slots, 16, 1)
    parity(TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv, slots, 16, 1), q_ref)
    parity(kv, kv_ref)
    x = torch.randn(rows, 6144, device=cuda).to(torch.bfloat16)
    w = (torch.randn(6144, device=cuda) * 0.1).to(torch.bfloat16)
    parity(TRITON_OPS.rms_norm(x, w, EPS), reference.rms_norm(x, w, EPS))


def test_rows_that_do_not_fit_the_cache_are_refused(device):
    """The kernels index the cache by the caller's head count and read one slot per row unchecked:
    kv_heads above the cache's wrote each row's second head into the next slot's K/V (silently, where
    the reference raises), and a short `slots` was read past its end for a slot to write at."""
    qkv, qn, kn, cos, sin, kv, slots = _case(4, 2, 32, 16, 6, torch.float32, device, 0)
    one_head = kv[:, :, :, :1].clone()
    before = one_head.clone()
    with pytest.raises(ValueError, match="attn_prelude: 6 rows of 2 heads of 32 into a cache of"):
        TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, one_head, slots, 4, 2)
    with pytest.raises(ValueError, match="at slots \\[5\\]"):
        TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv, slots[:5], 4, 2)
    k = v = torch.randn(6, 2, 32, device=device)
    with pytest.raises(ValueError, match="write_kv: 6 rows of 2 heads of 32"):
        TRITON_OPS.write_kv(one_head, k, v, slots)
    with pytest.raises(ValueError, match="at slots \\[5\\]"):
        TRITON_OPS.write_kv(kv, k, v, slots[:5])
    with pytest.raises(ValueError, match="write_kv: k \\[6, 2, 32\\] and v \\[6, 1, 32\\] differ"):
        TRITON_OPS.write_kv(kv, k, v[:, :1], slots)
    assert torch.equal(one_head, before)


@pytest.mark.parametrize("cache", ["k_plane_only", "no_planes"])
def test_a_cache_without_its_two_planes_is_refused(device, cache):
    """The kernels write V one plane (stride 0) past K, unchecked: into a cache of its K plane alone (here
    a view of a wider buffer's first plane) each V row went past the tensor's end, where the reference
    raises; a 4-D cache failed on a stride lookup (IndexError) rather than with the shapes named."""
    qkv, qn, kn, cos, sin, kv, slots = _case(4, 1, 32, 16, 6, torch.float32, device, 0)
    store = torch.zeros_like(kv)
    bad = store[:1] if cache == "k_plane_only" else store[0]
    k = v = torch.randn(6, 1, 32, device=device)
    with pytest.raises((RuntimeError, IndexError)):
        reference.attn_prelude(qkv, qn, kn, cos, sin, EPS, bad.clone(), slots, 4, 1)
    with pytest.raises(ValueError, match=r"attn_prelude: 6 rows of 1 heads of 32 into a cache of .*expected \[2, "):
        TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, bad, slots, 4, 1)
    with pytest.raises(ValueError, match=r"write_kv: 6 rows of 1 heads of 32 into a cache of .*expected \[2, "):
        TRITON_OPS.write_kv(bad, k, v, slots)
    assert not store.any(), "a refused write reached the buffer"


def test_cache_offsets_past_2_31_elements(device):
    """The K/V writes address the cache in int64 in every term: in a cache whose heads' stride is the
    outermost (a permutation of the planes view the server binds), head 2 lies 2 * (2^30 + 16) elements
    in, and kh * stride_ch in int32 wrapped: head 2's K and V went 2^32 elements before the cache and
    the cache kept its old values there (attn_prelude and write_kv alike)."""
    heads, d = 3, 16
    kv = far_cache((2, 2, 4, heads, d), (d, 2 * d, 4 * d, WRAP // 2 + d, 1), device)
    qkv, qn, kn, cos, sin, _, _ = _case(heads, heads, d, 8, 5, torch.float32, device, seed=6)
    slots = torch.tensor([6, 1, 3, 4, 0], device=device)
    want = kv.clone()  # a dense copy: the reference writes there
    reference.attn_prelude(qkv, qn, kn, cos, sin, EPS, want, slots, heads, heads)
    TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv, slots, heads, heads)
    assert torch.equal(kv.float().cpu(), want.float().cpu())
    k, v = (torch.randn(5, heads, d, generator=torch.Generator().manual_seed(i)).to(device) for i in (1, 2))
    reference.write_kv(want, k, v, slots)
    TRITON_OPS.write_kv(kv, k, v, slots)
    assert torch.equal(kv.float().cpu(), want.float().cpu())


def test_int32_slots_past_2_31_elements(device):
    """Slots given as int32 (the reference indexes with them as with int64): the kernels formed
    (slot % page) * stride in the slots' own dtype, so with the page slot's stride the large one
    (a dense permutation the server binds) slot 15's offset wrapped in int32 and its K/V went 2^32
    elements before the cache, the cache keeping its old values (attn_prelude and write_kv alike)."""
    d = 16
    kv = far_cache((2, 2, 16, 1, d), (d, 2 * d, -(-WRAP // 15), d, 1), device)
    qkv, qn, kn, cos, sin, _, _ = _case(1, 1, d, 8, 3, torch.float32, device, seed=7)
    slots = torch.tensor([15, 31, 2], dtype=torch.int32, device=device)
    want = kv.clone()
    reference.attn_prelude(qkv, qn, kn, cos, sin, EPS, want, slots, 1, 1)
    TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv, slots, 1, 1)
    assert torch.equal(kv.float().cpu(), want.float().cpu())
    k, v = (torch.randn(3, 1, d, generator=torch.Generator().manual_seed(i)).to(device) for i in (1, 2))
    reference.write_kv(want, k, v, slots)
    TRITON_OPS.write_kv(kv, k, v, slots)
    assert torch.equal(kv.float().cpu(), want.float().cpu())


@pytest.mark.parametrize("bad", ["rows", "rotary_dim", "sin"])
def test_rope_tables_that_do_not_fit_are_refused(device, bad):
    """The kernel reads each row's cos/sin at row * stride and pairs dim i with i + rotary_dim / 2,
    unchecked: tables of fewer rows than q were read past their end, and a rotary dim above head_dim
    paired a head's dims with the next head's (a finite, wrong q and K) where the reference raises."""
    qkv, qn, kn, cos, sin, kv, slots = _case(4, 1, 32, 16, 6, torch.float32, device, 0)
    if bad == "rows":
        cos, sin = cos[:5], sin[:5]
    elif bad == "rotary_dim":
        cos, sin = reference.rope_cos_sin(torch.arange(6, device=device), 48, THETA)
    else:
        sin = sin[:, :4]
    with pytest.raises(RuntimeError):
        reference.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv.clone(), slots, 4, 1)
    with pytest.raises(ValueError, match="attn_prelude: cos"):
        TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv, slots, 4, 1)
    with pytest.raises(ValueError, match="qk_norm_rope: cos"):
        TRITON_OPS.qk_norm_rope(qkv[:, :128].view(6, 4, 32), qn, cos, sin, EPS)


def test_strided_slots(device):
    """The kernels read row r's slot at r: slots as a strided view (every other element of a wider tensor)
    wrote each row's K/V at a neighbour's slot, where the reference indexes the view."""
    qkv, qn, kn, cos, sin, kv, slots = _case(4, 1, 32, 16, 6, torch.float32, device, 0)
    strided = torch.stack([slots, slots.flip(0)], dim=1)[:, 0]
    assert torch.equal(strided, slots) and not strided.is_contiguous()
    kv_ref = kv.clone()
    reference.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv_ref, slots, 4, 1)
    TRITON_OPS.attn_prelude(qkv, qn, kn, cos, sin, EPS, kv, strided, 4, 1)
    torch.testing.assert_close(kv, kv_ref, rtol=1e-5, atol=1e-5)
    k, v = (torch.randn(6, 1, 32, generator=torch.Generator().manual_seed(i)).to(device) for i in (1, 2))
    reference.write_kv(kv_ref, k, v, slots)
    TRITON_OPS.write_kv(kv, k, v, strided)
    assert torch.equal(kv.cpu(), kv_ref.cpu())


def test_qk_norm_weights_must_match_the_head(device, parity):
    """The prelude loads (1 + w) at the head's offsets, masked by head_dim alone, at unit stride: a shorter
    q/k norm weight was read past its end and a longer one cut short, where the reference raises; a
    strided view of the right length was read as if contiguous (its neighbours' values), where the
    reference takes it. As rms_norm's weight (norm.py)."""
    q_heads, kv_heads, d, rot = 4, 1, 32, 16
    qkv, qn, kn, cos, sin, kv, slots = _case(q_heads, kv_heads, d, rot, 9, torch.float32, device, seed=22)
    wide = (torch.randn(2 * d, generator=torch.Generator().manual_seed(23)) * 0.1).to(device)
    for bad in (wide[: d - 8], wide):
        for args in ((bad, kn), (qn, bad)):
            with pytest.raises(RuntimeError):
                reference.attn_prelude(qkv, *args, cos, sin, EPS, kv.clone(), slots, q_heads, kv_heads)
            with pytest.raises(ValueError, match="norm weight"):
                TRITON_OPS.attn_prelude(qkv, *args, cos, sin, EPS, kv.clone(), slots, q_heads, kv_heads)
        x = qkv[:, : q_heads * d].reshape(-1, q_heads, d)
        with pytest.raises(RuntimeError):
            reference.qk_norm_rope(x, bad, cos, sin, EPS)
        with pytest.raises(ValueError, match="norm weight"):
            TRITON_OPS.qk_norm_rope(x, bad, cos, sin, EPS)
    for args in ((wide[::2], kn), (qn, wide[1::2])):
        kv_ref, kv_got = kv.clone(), kv.clone()
        q_ref = reference.attn_prelude(qkv, *args, cos, sin, EPS, kv_ref, slots, q_heads, kv_heads)
        parity(TRITON_OPS.attn_prelude(qkv, *args, cos, sin, EPS, kv_got, slots, q_heads, kv_heads), q_ref)
        parity(kv_got, kv_ref)
    x = qkv[:, : q_heads * d].reshape(-1, q_heads, d)
    parity(TRITON_OPS.qk_norm_rope(x, wide[::2], cos, sin, EPS), reference.qk_norm_rope(x, wide[::2], cos, sin, EPS))


def test_operands_on_another_device_are_refused(device):
    """The prelude, write_kv and rms_norm kernels take raw pointers and launch on their first operand's
    device: a norm weight, RoPE table, slot list or cache elsewhere (another rank's GPU) was read or
    written as if local. Each is refused by name (meta tensors stand for the other device here)."""
    q_heads, kv_heads, d, rot = 4, 1, 32, 16
    qkv, qn, kn, cos, sin, kv, slots = _case(q_heads, kv_heads, d, rot, 9, torch.float32, device, seed=31)
    meta = torch.device("meta")
    args = {"q_norm": qn, "k_norm": kn, "cos": cos, "sin": sin, "kv_cache": kv, "slots": slots}
    for name in args:
        moved = {**args, name: args[name].to(meta)}
        with pytest.raises(ValueError, match=f"attn_prelude: {name} is on meta"):
            TRITON_OPS.attn_prelude(qkv, moved["q_norm"], moved["k_norm"], moved["cos"], moved["sin"], EPS,
                                    moved["kv_cache"], moved["slots"], q_heads, kv_heads)
    x = qkv[:, : q_heads * d].reshape(-1, q_heads, d)
    for name, call in {"norm_weight": lambda: TRITON_OPS.qk_norm_rope(x, qn.to(meta), cos, sin, EPS),
                       "sin": lambda: TRITON_OPS.qk_norm_rope(x, qn, cos, sin.to(meta), EPS)}.items():
        with pytest.raises(ValueError, match=f"qk_norm_rope: {name} is on meta"):
            call()
    k = qkv[:, q_heads * d: (q_heads + 1) * d].reshape(-1, 1, d)
    for name in ("k", "v", "slots"):
        ops = {"k": k, "v": k, "slots": slots}
        ops[name] = ops[name].to(meta)
        with pytest.raises(ValueError, match=f"write_kv: {name} is on meta"):
            TRITON_OPS.write_kv(kv.clone(), ops["k"], ops["v"], ops["slots"])
    with pytest.raises(ValueError, match="rms_norm: weight is on meta"):
        TRITON_OPS.rms_norm(qkv, torch.ones(qkv.shape[1], device=meta), EPS)
