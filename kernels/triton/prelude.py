"""Attention prelude: per-head q/k Gemma RMSNorm + partial NeoX RoPE, and block K/V written through the slots.

One program per (row, head) of the fused qkv output [n, (hq + 2 hk) * d]: a q head is normed,
rotated and stored to q [n, hq, d]; a k head is normed and rotated and, with the matching v
head, stored into the paged cache at the row's slot (slot < 0: a padding row, nothing written).
The whole head (d = 128) sits in one program, so the norm's reduction and RoPE's pairing
(i, i + rotary_dim/2) never leave registers. No host syncs: graph-capturable.

The qkv input may also be the split-K partials of the qkv GEMM (`gemm.Partials`): each program
then finishes its own head as the GEMM's finalize would (sum the partials in order, scale by
the row's input-norm factor, round to the activation dtype), and the finalize launch is saved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_sidecar.kernels.triton.gemm import Partials, row_norm_scale
from dspark_sidecar.kernels.triton.runtime import (
    INTERPRET, cache_dtype, cast, check_device, check_norm_weight, dep_release, dep_wait, pdl_kwargs, rms_inv,
    same_device, tl_dtype,
)


@triton.jit
def _load_head(head_ptr, idx, mask, stride_d, stride_s, inv_in,
               SPLITS: tl.constexpr, PARTIAL: tl.constexpr, OUT: tl.constexpr, INTERPRET: tl.constexpr):
    """Elements idx of one head of qkv, fp32: loaded, or finished from the GEMM's SPLITS split
    partials (unrolled: all SPLITS loads in flight at once)."""
    if PARTIAL:
        acc = tl.zeros(idx.shape, tl.float32)
        for sp in tl.static_range(SPLITS):
            acc += tl.load(head_ptr + sp * stride_s + idx * stride_d, mask=mask, other=0.0)
        x = cast(acc * inv_in, OUT, INTERPRET).to(tl.float32)
    else:
        x = tl.load(head_ptr + idx * stride_d, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _norm_rope(head_ptr, stride_d, stride_s, inv_in, w_ptr, cos_row, sin_row, eps, SPLITS: tl.constexpr,
               D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, PARTIAL: tl.constexpr,
               OUT: tl.constexpr, INTERPRET: tl.constexpr):
    """One head [D] -> fp32 normed and rotated: dims [0, 2 HALF) rotate in pairs (i, i + HALF)."""
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D
    first = offs < HALF
    in_rot = offs < 2 * HALF
    partner = tl.where(first, offs + HALF, tl.where(in_rot, offs - HALF, offs))
    x = _load_head(head_ptr, offs, dmask, stride_d, stride_s, inv_in, SPLITS, PARTIAL, OUT, INTERPRET)
    xp = _load_head(head_ptr, partner, dmask, stride_d, stride_s, inv_in, SPLITS, PARTIAL, OUT, INTERPRET)
    w = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=dmask, other=0.0).to(tl.float32)
    inv = rms_inv(tl.sum(x * x, axis=0), D, eps)
    xn = x * inv * (1.0 + w)
    xpn = xp * inv * (1.0 + wp)
    ci = tl.where(first, offs, offs - HALF)
    c = tl.load(cos_row + ci, mask=in_rot & dmask, other=1.0)
    s = tl.load(sin_row + ci, mask=in_rot & dmask, other=0.0)
    # first half: x1 c - x2 s; second half: x2 c + x1 s; beyond the rotary dims: s = 0, c = 1.
    return xn * c + tl.where(first, -1.0, 1.0) * xpn * s


@triton.jit
def _prelude_kernel(
    x_ptr, stride_xn, stride_xh, stride_xd,
    qn_ptr, kn_ptr, cos_ptr, sin_ptr, stride_cn,
    q_ptr, stride_qn, stride_qh, stride_qd,
    kv_ptr, stride_c0, stride_cp, stride_cs, stride_ch, stride_cd,
    slot_ptr, eps, stride_xs, sq_ptr, stride_sq, k_in, eps_in, PAGE: tl.constexpr, SPLITS: tl.constexpr,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, OUT: tl.constexpr, CACHE: tl.constexpr, PARTIAL: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (row, head j): j < Q_HEADS a q head, else k head j - Q_HEADS (and its v head).

    PARTIAL: x_ptr is the fp32 workspace [SPLITS, n, width] (stride_xs apart) and sq_ptr the
    partial sums of squares [SPLITS, n] of the GEMM's input rows (k_in wide, norm eps_in).
    PAGE (the cache's page size) is compile-time: slot // PAGE is a shift, not a 64-bit division.
    PDL (runtime.PDL): the attention after it may launch as soon as every program is past the wait,
    and read the step's metadata there while this launch runs.
    """
    dep_wait(PDL)
    dep_release(PDL)
    row, j = tl.program_id(0), tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D
    cos_row, sin_row = cos_ptr + row * stride_cn, sin_ptr + row * stride_cn
    head_ptr = x_ptr + row * stride_xn + j * stride_xh
    inv_in = 1.0
    if PARTIAL:
        inv_in = row_norm_scale(sq_ptr, stride_sq, row, k_in, eps_in, SPLITS)
    if j < Q_HEADS:
        y = _norm_rope(head_ptr, stride_xd, stride_xs, inv_in, qn_ptr, cos_row, sin_row, eps, SPLITS, D, HALF,
                       BLOCK_D, PARTIAL, OUT, INTERPRET)
        tl.store(q_ptr + row * stride_qn + j * stride_qh + offs * stride_qd, cast(y, OUT, INTERPRET), mask=dmask)
    if KV_HEADS > 0:  # compiled only where there is a cache to write (not for qk_norm_rope alone)
        if j >= Q_HEADS:
            kh = j - Q_HEADS
            y = _norm_rope(head_ptr, stride_xd, stride_xs, inv_in, kn_ptr, cos_row, sin_row, eps, SPLITS, D, HALF,
                           BLOCK_D, PARTIAL, OUT, INTERPRET)
            # int64 whatever the slots' dtype: int32 slots (the reference takes them) made (slot % PAGE) *
            # stride_cs int32, which wrapped where the page slot's stride is the large one.
            slot = tl.load(slot_ptr + row).to(tl.int64)
            if slot >= 0:
                # int64 throughout (kh too): a dense permutation of the cache may put the heads outermost,
                # and kh * stride_ch in int32 wrapped past 2^31 elements (attention._split_kernel).
                base = kv_ptr + (slot // PAGE) * stride_cp + (slot % PAGE) * stride_cs + kh.to(tl.int64) * stride_ch
                # Rounded to the activation dtype first, as the reference's k is before write_kv.
                tl.store(base + offs * stride_cd, cast(cast(y, OUT, INTERPRET), CACHE, INTERPRET), mask=dmask)
                v = _load_head(head_ptr + KV_HEADS * stride_xh, offs, dmask, stride_xd, stride_xs, inv_in,
                               SPLITS, PARTIAL, OUT, INTERPRET)
                tl.store(base + stride_c0 + offs * stride_cd, cast(v, CACHE, INTERPRET), mask=dmask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, stride_km, stride_kh, stride_kd, stride_vm, stride_vh, stride_vd,
    kv_ptr, stride_c0, stride_cp, stride_cs, stride_ch, stride_cd, slot_ptr, PAGE: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, CACHE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program (row, kv head): copy one K and one V head into the cache at the row's slot."""
    row, h = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + row).to(tl.int64)  # int64 whatever the slots' dtype (_prelude_kernel)
    if slot >= 0:
        offs = tl.arange(0, BLOCK_D)
        dmask = offs < D
        base = kv_ptr + (slot // PAGE) * stride_cp + (slot % PAGE) * stride_cs + h.to(tl.int64) * stride_ch
        k = tl.load(k_ptr + row * stride_km + h * stride_kh + offs * stride_kd, mask=dmask, other=0.0)
        v = tl.load(v_ptr + row * stride_vm + h * stride_vh + offs * stride_vd, mask=dmask, other=0.0)
        tl.store(base + offs * stride_cd, cast(k, CACHE, INTERPRET), mask=dmask)
        tl.store(base + stride_c0 + offs * stride_cd, cast(v, CACHE, INTERPRET), mask=dmask)


def _check_cache_rows(op: str, kv_layer: torch.Tensor, kv_heads: int, d: int, slots: torch.Tensor, n: int) -> None:
    """ValueError unless the cache is [2, pages, page_size, kv_heads, d] and slots has one slot per row:
    the kernels index by these counts unchecked, so a mismatch wrote into a neighbouring slot's K/V
    or at a slot read past the end of `slots`, and into a cache without its V plane (a K plane
    alone) each V row went one plane past the tensor's end, where the reference raises."""
    if (kv_layer.dim() != 5 or kv_layer.shape[0] != 2 or tuple(kv_layer.shape[-2:]) != (kv_heads, d)
            or tuple(slots.shape) != (n,)):
        raise ValueError(f"{op}: {n} rows of {kv_heads} heads of {d} into a cache of {list(kv_layer.shape)} "
                         f"at slots {list(slots.shape)} (expected [2, pages, page_size, {kv_heads}, {d}] and [{n}])")


def _check_rope(op: str, cos: torch.Tensor, sin: torch.Tensor, n: int, d: int) -> None:
    """ValueError unless cos and sin are [n, half] with 2 half <= d: the kernel reads row r's table at
    r * cos.stride(0), unchecked, and pairs dim i with i + half inside the head, so fewer rows read past
    the tables and a rotary dim above d paired dims with the next head's, where the reference raises."""
    half = cos.shape[-1] if cos.dim() == 2 else -1
    if cos.dim() != 2 or tuple(cos.shape) != (n, half) or tuple(sin.shape) != (n, half) or 2 * half > d:
        raise ValueError(f"{op}: cos {list(cos.shape)} and sin {list(sin.shape)} for {n} rows of heads of {d}: "
                         f"expected both [{n}, rotary_dim / 2] with rotary_dim <= {d}")


def _norm_weights(op: str, d: int, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The q/k norm weights, each checked to be [d] and dense (runtime.check_norm_weight)."""
    for w in weights:
        check_norm_weight(op, w, d, f"heads of {d}")
    return tuple(w.contiguous() for w in weights)


def _cache_args(kv_layer: torch.Tensor) -> tuple:
    s = kv_layer.stride()
    return (kv_layer, s[0], s[1], s[2], s[3], s[4])


def attn_prelude(qkv: torch.Tensor | Partials, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float, kv_layer: torch.Tensor, slots: torch.Tensor,
                 q_heads: int, kv_heads: int) -> torch.Tensor:
    """qkv [n, (q_heads + 2 kv_heads) * d] (or the qkv GEMM's Partials of it) -> q [n, q_heads, d];
    K/V rows written at slots (int64 [n])."""
    partial = isinstance(qkv, Partials)
    x = qkv.ws if partial else qkv
    dtype = qkv.dtype
    check_device(x, kv_layer)
    same_device("attn_prelude", qkv=x, **({"qkv sums of squares": qkv.sq} if partial else {}), kv_cache=kv_layer,
                q_norm=q_norm, k_norm=k_norm, cos=cos, sin=sin, slots=slots)
    d = kv_layer.shape[-1]
    n, width = x.shape[-2:]
    if width != (q_heads + 2 * kv_heads) * d:
        raise ValueError(f"attn_prelude: qkv width {width} != ({q_heads} + 2 * {kv_heads}) * {d}")
    _check_cache_rows("attn_prelude", kv_layer, kv_heads, d, slots, n)
    _check_rope("attn_prelude", cos, sin, n, d)
    q_norm, k_norm = _norm_weights("attn_prelude", d, q_norm, k_norm)
    q = torch.empty((n, q_heads, d), dtype=dtype, device=x.device)
    if n:
        # The kernel reads row r's slot at r: a strided view of the slots (every other element of a
        # wider tensor) wrote rows at their neighbours' slots. Dense ones are not copied.
        cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.contiguous()
        # Partials: workspace [splits, n, width] and sums of squares [splits, n]; else one plain tensor.
        xs, splits, sq, k_in, eps_in = ((x.stride(0), x.shape[0], qkv.sq, qkv.k, qkv.eps) if partial
                                        else (0, 1, x, 1, 0.0))
        _prelude_kernel[(n, q_heads + kv_heads)](
            x, x.stride(-2), d * x.stride(-1), x.stride(-1),
            q_norm, k_norm, cos, sin, cos.stride(0),
            q, q.stride(0), q.stride(1), q.stride(2),
            *_cache_args(kv_layer), slots, eps, xs, sq, sq.stride(0), k_in, eps_in,
            PAGE=kv_layer.shape[2], SPLITS=splits, Q_HEADS=q_heads, KV_HEADS=kv_heads, D=d, HALF=cos.shape[-1],
            BLOCK_D=triton.next_power_of_2(d), OUT=tl_dtype(dtype), CACHE=cache_dtype(kv_layer.dtype),
            PARTIAL=partial, INTERPRET=INTERPRET, num_warps=1, **pdl_kwargs(x, "prelude"),
        )
    return q


def qk_norm_rope(x: torch.Tensor, norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """x [n, heads, d] -> same shape and dtype: per-head norm then partial RoPE (the q-head path)."""
    check_device(x)
    same_device("qk_norm_rope", x=x, norm_weight=norm_weight, cos=cos, sin=sin)
    n, heads, d = x.shape
    _check_rope("qk_norm_rope", cos, sin, n, d)
    (norm_weight,) = _norm_weights("qk_norm_rope", d, norm_weight)
    out = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
    if n:
        cos, sin = cos.contiguous(), sin.contiguous()
        _prelude_kernel[(n, heads)](
            x, x.stride(0), x.stride(1), x.stride(2),
            norm_weight, norm_weight, cos, sin, cos.stride(0),
            out, out.stride(0), out.stride(1), out.stride(2),
            x, 0, 0, 0, 0, 0, x, eps, 0, x, 0, 1, 0.0, PAGE=1, SPLITS=1,
            Q_HEADS=heads, KV_HEADS=0, D=d, HALF=cos.shape[-1],
            BLOCK_D=triton.next_power_of_2(d), OUT=tl_dtype(x.dtype), CACHE=tl_dtype(x.dtype),
            PARTIAL=False, INTERPRET=INTERPRET, num_warps=1,
        )
    return out


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [m, kv_heads, d] into kv_layer [2, pages, page_size, kv_heads, d] (any KV_LAYOUTS view)
    at slots; slot < 0 skipped.

    Unlike the reference, padding rows are masked in the kernel: no host sync.
    """
    check_device(kv_layer, k, v)
    same_device("write_kv", kv_cache=kv_layer, k=k, v=v, slots=slots)
    m, heads, d = k.shape
    if v.shape != k.shape:
        raise ValueError(f"write_kv: k {list(k.shape)} and v {list(v.shape)} differ")
    _check_cache_rows("write_kv", kv_layer, heads, d, slots, m)
    if m:
        slots = slots.contiguous()  # read as dense (attn_prelude)
        _write_kv_kernel[(m, heads)](
            k, v, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            *_cache_args(kv_layer), slots, PAGE=kv_layer.shape[2],
            D=d, BLOCK_D=triton.next_power_of_2(d), CACHE=cache_dtype(kv_layer.dtype), INTERPRET=INTERPRET,
            num_warps=1,
        )
