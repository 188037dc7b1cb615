"""Pure-torch models of the FlyDSL kernels: same split/tile decomposition, accumulation order and roundings.

The kernels cannot run without a gfx950, so these models stand in for them on CPU: each mirrors
its kernel's structure (which K columns one MFMA step sums, the split order, where fp32 is
rounded to bf16, the log2-domain online softmax) and is checked against kernels/reference.py.
Inside one MFMA step the hardware's summation order is not modelled (fp32 either way).
"""

from __future__ import annotations

import math

import torch

from ...drafter.kv_cache import FP8_KV
from ...layout import QPR
from .shapes import (
    FFN,
    FP8_MAX,
    HEAD_DIM,
    HIDDEN,
    K_CHUNK,
    KPS,
    KT,
    NEG,
    NSPLIT,
    SM_SCALE_LOG2,
    MX_BLOCK,
    Q_HEADS,
    RMS_EPS,
    ROTARY_DIM,
    SLIDING_WINDOW,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    TP,
    LinearSchedule,
    row_tiles,
)


def dequant_like_kernel(w_bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bits [N, K] and E8M0 bytes [N, K/32] -> fp32, as v_cvt_scalef32_pk_bf16_fp8
    with scale bits (v << 23): exact, and bf16-representable."""
    w = w_bits.view(torch.float8_e4m3fn).float()
    s = (scale.to(torch.int32) << 23).view(torch.float32)
    n, k = w.shape
    return (w.view(n, k // MX_BLOCK, MX_BLOCK) * s[..., None]).view(n, k)


def _step_columns(kc: int, j: int) -> torch.Tensor:
    """K columns one MFMA step j of the chunk at kc sums: lane group g supplies kc+32g+8j..+8."""
    return torch.tensor([kc + 32 * g + 8 * j + t for g in range(4) for t in range(8)])


def linear_model(x, w_bits, scale, norm_w, sched: LinearSchedule, num_reqs: int):
    """The mxfp8_linear kernel: x bf16 [rows, K] -> (P f32 [split, MP, N], SS f32 [split, MP])."""
    mp = 16 * row_tiles(num_reqs)
    xf = torch.zeros(mp, sched.k)
    xf[: x.shape[0]] = x.float()
    wd = dequant_like_kernel(w_bits, scale)
    a = xf
    if sched.norm:
        # The MFMA operand is bf16(x * (1 + w)); 1/rms is left to the partials' consumer.
        a = (xf * (norm_w.float() + 1.0)).to(torch.bfloat16).float()
    p = torch.zeros(sched.split, mp, sched.n)
    ss = torch.zeros(sched.split, mp)
    cpw = sched.chunks_per_wg
    for ks in range(sched.split):
        acc = torch.zeros(mp, sched.n)
        for c in range(cpw):
            kc = (ks * cpw + c) * K_CHUNK
            for j in range(4):
                cols = _step_columns(kc, j)
                acc += a[:, cols] @ wd[:, cols].T
            ss[ks] += (xf[:, kc : kc + K_CHUNK] ** 2).sum(dim=1)
        p[ks] = acc
    return p, ss


def split_sum(p: torch.Tensor) -> torch.Tensor:
    """Sum of split-K partials in split order (the consumers' fixed order)."""
    out = p[0].clone()
    for s in range(1, p.shape[0]):
        out += p[s]
    return out


def row_rrms(ss: torch.Tensor, k: int = HIDDEN) -> torch.Tensor:
    """1/rms per row from the per-split sums of squares: rsqrt(sum(SS)/K + eps)."""
    return torch.rsqrt(split_sum(ss) / k + RMS_EPS)


def swiglu_reduce_model(p: torch.Tensor, ss: torch.Tensor, rows: int) -> torch.Tensor:
    """swiglu_reduce_kernel: gate_up partials -> bf16 [rows, FFN]."""
    y = split_sum(p)[:rows] * row_rrms(ss)[:rows, None]
    g = y[:, :FFN].clamp(max=SWIGLU_LIMIT)
    u = y[:, FFN:].clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (g * (1.0 / (1.0 + torch.exp(-SWIGLU_ALPHA * g))) * (u + 1.0)).to(torch.bfloat16)


def e4m3_codes_like_kernel(x: torch.Tensor) -> torch.Tensor:
    """qkv_rope's fp8 K/V write (_device.e4m3_codes): bf16 values -> uint8 e4m3fn codes.

    Compare-select saturation at +-FP8_MAX (+-inf saturate, NaN passes), then v_cvt_pk_fp8_f32's
    rounding to nearest even, spelled out on the e4m3fn grid rather than borrowed from torch's cast:
    a magnitude in [2^e, 2^(e+1)) has 3 fraction bits, quantum 2^(e-3); below 2^-6 (subnormals) the
    quantum is 2^-9. torch.round breaks ties to even; the rounded value is on the grid, so the final
    cast to e4m3fn only encodes it. Tests compare these codes with kv_cache.to_cache's."""
    f = x.float()
    f = torch.where(f > FP8_MAX, FP8_MAX, torch.where(f < -FP8_MAX, -FP8_MAX, f))
    mag = f.abs()
    _, e = torch.frexp(mag)  # mag = m 2^e, m in [0.5, 1): the binade is [2^(e-1), 2^e)
    quantum = torch.exp2((e - 1).clamp(min=-6).float() - 3)
    rounded = torch.round(mag / quantum) * quantum
    return torch.copysign(rounded, f).to(FP8_KV).view(torch.uint8)


def kv_values_like_kernel(rows: torch.Tensor) -> torch.Tensor:
    """attention's K/V load: bf16 rows as they are, uint8 e4m3fn codes widened by
    v_cvt_scalef32_pk_bf16_fp8 at scale 1 (exact: every e4m3fn value is a bf16 value); -> fp32."""
    if rows.dtype == torch.uint8:
        return rows.view(FP8_KV).to(torch.bfloat16).float()
    return rows.float()


def qkv_rope_model(p, ss, q_norm, k_norm, cos_sin, positions, slots, kv_flat, slot_rows, v_row0, rows):
    """qkv_rope_kernel: returns q bf16 [rows, 2048] and writes K/V rows of kv_flat in place
    (K of slot s at row s * slot_rows, V at v_row0 + s * slot_rows: shapes.kv_row_map). kv_flat is
    bf16, or uint8 for an fp8 cache: the bf16 K/V's e4m3fn codes (e4m3_codes_like_kernel)."""
    y = (split_sum(p)[:rows] * row_rrms(ss)[:rows, None]).view(rows, Q_HEADS + 2, HEAD_DIM)
    w = torch.stack([q_norm.float()] * Q_HEADS + [k_norm.float()])  # [17, 128]
    qk = y[:, : Q_HEADS + 1]
    hrms = torch.rsqrt((qk**2).mean(dim=-1, keepdim=True) + RMS_EPS)
    normed = qk * hrms * (w + 1.0)
    half = ROTARY_DIM // 2
    cs = cos_sin[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = normed[..., :half], normed[..., half:ROTARY_DIM]
    roped = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, normed[..., ROTARY_DIM:]), dim=-1)
    q = roped[:, :Q_HEADS].to(torch.bfloat16).reshape(rows, Q_HEADS * HEAD_DIM)
    keep = slots >= 0
    krow = slots[keep] * slot_rows
    k, v = roped[keep, Q_HEADS].to(torch.bfloat16), y[keep, Q_HEADS + 1].to(torch.bfloat16)
    if kv_flat.dtype == torch.uint8:
        k, v = e4m3_codes_like_kernel(k), e4m3_codes_like_kernel(v)
    kv_flat[krow] = k
    kv_flat[v_row0 + krow] = v
    return q


def attention_model(q, kv_flat, slot_rows, v_row0, positions, block_table, page_size, num_reqs):
    """swa_attention + swa_combine: split-KV over KPS keys, 32-key tiles, log2-domain online
    softmax with a finite running-max floor, P rounded to bf16 for the PV product. K/V rows of
    kv_flat (bf16, or uint8 e4m3fn codes) are addressed and widened as the kernel does
    (shapes.kv_row_map, kv_values_like_kernel)."""
    kps, kt, neg, scale = KPS, KT, NEG, SM_SCALE_LOG2
    out = torch.empty(num_reqs * QPR, Q_HEADS * HEAD_DIM, dtype=torch.bfloat16)
    for r in range(num_reqs):
        anchor = int(positions[r * QPR])
        hi, lo = anchor + QPR, max(anchor - (SLIDING_WINDOW - 1), 0)
        qf = q[r * QPR : (r + 1) * QPR].float().view(QPR, Q_HEADS, HEAD_DIM)
        left = (anchor + torch.arange(QPR) - (SLIDING_WINDOW - 1))[:, None, None]
        parts = []
        for split in range(NSPLIT):
            start, end = lo + split * kps, min(lo + (split + 1) * kps, hi)
            m = torch.full((QPR, Q_HEADS, 1), neg)
            l_sum = torch.zeros(QPR, Q_HEADS, 1)
            o = torch.zeros(QPR, Q_HEADS, HEAD_DIM)
            for t0 in range(start, end, kt):
                kpos = torch.arange(t0, t0 + kt)
                live = kpos < end
                kp = torch.where(live, kpos, torch.zeros_like(kpos))
                krow = (block_table[r, kp // page_size].long() * page_size + kp % page_size) * slot_rows
                k = torch.where(live[:, None], kv_values_like_kernel(kv_flat[krow]), 0.0)
                v = torch.where(live[:, None], kv_values_like_kernel(kv_flat[v_row0 + krow]), 0.0)
                s = torch.einsum("thd,kd->thk", qf, k) * scale
                ok = live[None, None, :] & (kpos[None, None, :] >= left)
                s = s.masked_fill(~ok, -math.inf)
                mn = torch.maximum(m, s.amax(dim=-1, keepdim=True))
                alpha = torch.exp2(m - mn)
                pr = torch.exp2(s - mn)
                l_sum = l_sum * alpha + pr.sum(dim=-1, keepdim=True)
                o = o * alpha + torch.einsum("thk,kd->thd", pr.to(torch.bfloat16).float(), v)
                m = mn
            parts.append((m, l_sum, o))
        mx = torch.stack([pm for pm, _, _ in parts]).amax(dim=0)
        den = torch.zeros_like(mx)
        num = torch.zeros(QPR, Q_HEADS, HEAD_DIM)
        for pm, pl, po in parts:
            w = torch.exp2(pm - mx)
            den += w * pl
            num += w * po
        out[r * QPR : (r + 1) * QPR] = (num / den).to(torch.bfloat16).view(QPR, -1)
    return out


def exchange_model(rank_partials: list[torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
    """reduce_exchange on every rank: split sums per rank, rank-ordered sum 0..3, + residual."""
    if len(rank_partials) != TP:
        raise ValueError(f"expected {TP} ranks' partials")
    rows = residual.shape[0]
    ys = [split_sum(p)[:rows] for p in rank_partials]
    acc = ys[0] + ys[1]
    acc = acc + ys[2]
    acc = acc + ys[3]
    return (residual.float() + acc).to(torch.bfloat16)


def final_norm_model(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gemma_rmsnorm: per-thread sums of 24 squares (3 x 8 columns strided by 2048), wave then
    cross-wave totals in fp32, one bf16 rounding of x * rrms * (1 + w)."""
    xf = x.float()
    per_thread = (xf.view(x.shape[0], 3, 256, 8) ** 2).sum(dim=(1, 3))  # [rows, 256 threads]
    tot = per_thread.view(x.shape[0], 4, 64).sum(dim=2).sum(dim=1, keepdim=True)
    rrms = torch.rsqrt(tot / HIDDEN + RMS_EPS)
    return (xf * rrms * (weight.float() + 1.0)).to(torch.bfloat16)
