"""Skinny GEMM for 7..56 rows: y = [swiglu](rms_norm(x) @ W^T), bf16 or MXFP8 weights, split-K over all SMs.

With so few rows the step is bound by streaming the weights from HBM, so the grid has many
column tiles times `split_k` K-ranges (>= 2 programs per SM) and each program streams its
[block_k, block_n] weight tiles once (bf16/fp16 weights on an H100/H200: by TMA bulk copies).
The RMSNorm is fused by linearity: for row r,
  (x_r * inv_r * (1 + w)) @ W^T = inv_r * ((x_r * (1 + w)) @ W^T),  inv_r = rsqrt(mean(x_r^2) + eps),
so sum(x^2) is accumulated over each K-range as x is loaded and the per-row scale is applied
in the epilogue; no pass over x precedes the GEMM. (Who sums: every program, or, for a norm
folded into the weights with split_k > 1, one extra grid column of x-only programs: SQ_COLUMN.)
With split_k > 1 the programs write fp32 partials (and partial sums of squares) to a workspace that
`_finalize_kernel` sums in a fixed order (deterministic, no atomics), then scales, applies
SwiGLU-OAI or adds the residual stream (o_proj, down_proj: no separate add launch), and
rounds once to the activation dtype. MXFP8 weights stream 1 byte per weight
(+1/32 for the E8M0 exponents; the bits by TMA on an H100/H200) and are dequantized in registers,
tile by tile, to bf16 (exact; fp32 under fp32 activations) for the same dot: by integer ops into fp32 fields (_dequant), or on
NVIDIA by inline PTX on packed registers (_dequant_sm90); from 64-row tiles the dequantized tile
is the dot's left operand, straight from registers (SWAP_AB). (Scaling each 32-wide chunk's
partial after its own dot instead was measured slower on an H200: 4x at 56 rows, where the wgmma
of every chunk must finish before its scale.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dspark_sidecar.kernels.triton.runtime import (
    INTERPRET, cast, check_device, check_norm_weight, dep_release, dep_wait, dot_dtype, mma, nvidia_of, pdl_kwargs,
    rms_inv, same_device, sm90_of, sms_of, smem_of, tl_dtype,
)
from dspark_sidecar.kernels.weights import MxFp8Weight, NormFolded


@triton.jit
def _swiglu_oai(g, u, alpha, limit, OUT: tl.constexpr, INTERPRET: tl.constexpr):
    """The gate/up halves are first rounded to the activation dtype, as the reference's linear output is.
    The clamps keep NaN, as torch's do (tl.minimum's default returns the other operand: a NaN gate
    came out as the limit, a finite activation)."""
    g = tl.minimum(cast(g, OUT, INTERPRET).to(tl.float32), limit, propagate_nan=tl.PropagateNan.ALL)
    u = tl.clamp(cast(u, OUT, INTERPRET).to(tl.float32), -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    return g * tl.sigmoid(alpha * g) * (u + 1.0)


@triton.jit
def _add_residual(acc, res_ptrs, mask, OUT: tl.constexpr, INTERPRET: tl.constexpr):
    """residual + y with y rounded to the activation dtype first: the reference's x + linear(a)."""
    r = tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
    return r + cast(acc, OUT, INTERPRET).to(tl.float32)


@triton.jit
def row_norm_scale(sq_ptr, stride_s, row, k, eps, SPLITS: tl.constexpr):
    """rsqrt(mean(x_row^2) + eps) from the row's split partial sums of squares, summed in split
    order: the one computation every consumer of the partials (finalize, prelude) shares.
    SPLITS is a compile-time count so the loop unrolls and every load is in flight at once
    (a run-time loop waited one L2 round trip per split)."""
    ssq = tl.load(sq_ptr + row)
    for s in tl.static_range(1, SPLITS):
        ssq += tl.load(sq_ptr + s * stride_s + row)
    return rms_inv(ssq, k, eps)


@triton.jit
def _x_tile(x_ptr, offs_m, m_mask, offs_k, k_mask, stride_xm, stride_xk):
    """The [rows, K-step] tile of x, zeros outside the rows and the K-range (its dtype as stored)."""
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                   mask=m_mask[:, None] & k_mask[None, :], other=0.0)


@triton.jit
def _sq_program(x_ptr, sq_ptr, M, stride_xm, stride_xk, k_lo, k_hi, pid_s, offs_m, BM: tl.constexpr,
                BK: tl.constexpr):
    """sq[pid_s, m] = sum over the K-range of x[m, k]^2, in K-tile order: the tiles the column tiles'
    K loops load (x [M, K] read once more, from L2)."""
    m_mask = offs_m < M
    sq = tl.zeros((BM,), tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        x = _x_tile(x_ptr, offs_m, m_mask, offs_k, offs_k < k_hi, stride_xm, stride_xk).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
    tl.store(sq_ptr + pid_s * M + offs_m, sq, mask=m_mask)


@triton.jit
def _dequant(bits, e, BN: tl.constexpr, BK: tl.constexpr, QBLOCK: tl.constexpr, DOT: tl.constexpr):
    """A weight tile's F8_E4M3 bits (u8 [BN, BK], K contiguous) times 2^(e - 127) per 1 x QBLOCK
    block (e: u8 [BN, BK / QBLOCK]) -> [BN, BK] in DOT, exact (3 mantissa bits times a power of two).

    The byte's exponent and mantissa go into an fp32's fields by integer ops: that fp32 is the
    value times 2^-120 (the e4m3 subnormals land on fp32 subnormals, which sm_90's mul.f32 keeps),
    and one multiply by 2^120 restores the value exactly. The NaN code (S.1111.111) would read as
    +-480 * 2^(e - 127): MxFp8Weight.quantize and from_checkpoint refuse weights holding it, and a
    select per weight to keep it NaN made the 56-row gate|up launch spill. The hardware's
    fp8 -> fp32 conversion goes through f16 on the conversion unit, a fraction of the ALUs' rate.
    Each block's scale is e placed in an fp32 exponent field (e = 0: 2^-127, the subnormal
    0x00400000; e = 255, E8M0's NaN: inf, as the reference's exp2 gives), loaded once per block
    and broadcast over its QBLOCK weights instead of gathered per weight."""
    u = bits.to(tl.uint32)
    f = (((u & 0x7F) << 20) | ((u & 0x80) << 24)).to(tl.float32, bitcast=True) * 1.329227995784916e36
    eu = e.to(tl.uint32)
    scale = tl.where(eu == 0, 0x00400000, eu << 23).to(tl.float32, bitcast=True)
    w = tl.reshape(f, (BN, BK // QBLOCK, QBLOCK)) * scale[:, :, None]
    return tl.reshape(w, (BN, BK)).to(DOT)


# Four F8_E4M3 bytes (one 32-bit register) -> four bf16 (two registers) times their blocks'
# scales (two bf16x2 registers): each byte's sign, exponent and mantissa moved into a bf16's fields
# by a byte permute and masks (the value times 2^-120), then one packed bf16 multiply by
# 2^(e - 7) per pair, one rounding: the product is exact where it is a normal bf16, and rounded
# once to nearest as the fp32 path rounds it. About 3 instructions per weight against 7.
_DEQUANT_PTX = tl.constexpr("""{
    .reg .b32 z, t0, t1, s0, s1;
    mov.b32 z, 0;
    prmt.b32 t0, $2, z, 0x1404;
    prmt.b32 t1, $2, z, 0x3424;
    and.b32 s0, t0, 0x80008000;
    and.b32 t0, t0, 0x7F007F00;
    shr.b32 t0, t0, 4;
    or.b32 t0, t0, s0;
    and.b32 s1, t1, 0x80008000;
    and.b32 t1, t1, 0x7F007F00;
    shr.b32 t1, t1, 4;
    or.b32 t1, t1, s1;
    mul.rn.bf16x2 $0, t0, $3;
    mul.rn.bf16x2 $1, t1, $4;
}""")


@triton.jit
def _dequant_sm90(bits, e, BN: tl.constexpr, BK: tl.constexpr, QBLOCK: tl.constexpr):
    """_dequant's values, in bf16, four weights per inline-PTX instance (_DEQUANT_PTX): NVIDIA sm_90+.
    The block factor 2^(e - 7) is a bf16 (exponent field e + 120), so e <= 134 (a block scale up to
    2^7; MxFp8Weight.quantize and from_checkpoint refuse larger ones)."""
    factor = ((e.to(tl.uint16) + 120) << 7).to(tl.bfloat16, bitcast=True)
    factor = tl.broadcast_to(factor[:, :, None], (BN, BK // QBLOCK, QBLOCK))
    w = tl.inline_asm_elementwise(_DEQUANT_PTX, "=r,=r,r,r,r", [tl.reshape(bits, (BN, BK // QBLOCK, QBLOCK)), factor],
                                  dtype=tl.bfloat16, is_pure=True, pack=4)
    return tl.reshape(w, (BN, BK))


@triton.jit
def _fp8_scales(s_ptr, rows, r_mask, k0, k_hi, stride_sn, stride_sk, QBLOCK: tl.constexpr, BK: tl.constexpr):
    """The E8M0 exponents (u8 [BN, BK / QBLOCK]) of weight rows `rows`, K columns k0 .. k0 + BK;
    127 (a scale of 1) past k_hi or for rows that do not exist."""
    offs_b = k0 // QBLOCK + tl.arange(0, BK // QBLOCK)
    return tl.load(s_ptr + rows[:, None] * stride_sn + offs_b[None, :] * stride_sk,
                   mask=r_mask[:, None] & (offs_b * QBLOCK < k_hi)[None, :], other=127)


@triton.jit
def _fp8_tile(w_ptr, e, row0, offs_r, r_mask, k0, k_hi, stride_wn, stride_wk,
              QBLOCK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, TMA: tl.constexpr,
              PTX: tl.constexpr):
    """Weight rows row0 + offs_r (r_mask: the rows that exist), K columns k0 .. k0 + BK of an
    MXFP8 weight with exponents e (_fp8_scales), dequantized: [BN, BK] in DOT. TMA: w_ptr is a
    descriptor of the u8 bits with [BN, BK] blocks (rows and columns past the end arrive as
    zeros); else u8 pointers. PTX: dequantized by _dequant_sm90 (DOT is bf16)."""
    if TMA:
        bits = w_ptr.load([row0, k0])
    else:
        offs_k = k0 + tl.arange(0, BK)
        bits = tl.load(w_ptr + (row0 + offs_r)[:, None] * stride_wn + offs_k[None, :] * stride_wk,
                       mask=r_mask[:, None] & (offs_k < k_hi)[None, :], other=0)
    if PTX:
        return _dequant_sm90(bits, e, BN, BK, QBLOCK)
    return _dequant(bits, e, BN, BK, QBLOCK, DOT)


@triton.jit
def _fp8_dot(acc, a, w_ptr, s_ptr, e, row0, tile, r_mask, k0, k_hi, stride_wn, stride_wk, stride_sn, stride_sk,
             QBLOCK: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, TMA: tl.constexpr,
             PTX: tl.constexpr, SWAP_AB: tl.constexpr, INTERPRET: tl.constexpr, IEEE: tl.constexpr):
    """One K step of MXFP8 weight rows row0 + tile into acc ([BM, BN]; [BN, BM] with SWAP_AB): the
    next step's exponents are loaded first (see the loop), then this tile, dequantized with e, goes
    to the dot with x's tile `a`. -> (acc, the next step's exponents)."""
    e_next = _fp8_scales(s_ptr, row0 + tile, r_mask, k0 + BK, k_hi, stride_sn, stride_sk, QBLOCK, BK)
    w = _fp8_tile(w_ptr, e, row0, tile, r_mask, k0, k_hi, stride_wn, stride_wk, QBLOCK, BN, BK, DOT, TMA, PTX)
    if SWAP_AB:
        acc = mma(w, tl.trans(a), acc, INTERPRET, IEEE)
    else:
        acc = mma(a, tl.trans(w), acc, INTERPRET, IEEE)
    return acc, e_next


@triton.jit
def _gemm_kernel(
    x_ptr, nw_ptr, w_ptr, s_ptr, out_ptr, sq_ptr, res_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk,
    stride_os, stride_om, stride_on, stride_rm,
    eps, alpha, limit,
    HAS_NORM: tl.constexpr, FOLDED: tl.constexpr, FP8: tl.constexpr, QBLOCK: tl.constexpr,
    SWIGLU: tl.constexpr, PARTIAL: tl.constexpr, HAS_RES: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr,
    OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, INTERPRET: tl.constexpr,
    TMA: tl.constexpr, SQ_COL: tl.constexpr, SWAP_AB: tl.constexpr = False, FP8_PTX: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Program (column tile, K-range, row tile). x [M, K]; W [N or 2N, K] (gate rows first when SWIGLU).

    TMA (sm_90, dense weights): w_ptr is a tensor descriptor of W with [BN, BK] blocks and the
    weight tiles arrive by the Tensor Memory Accelerator: one bulk copy per tile instead of a
    16-byte copy per thread and element group, rows past the end filled with zeros by the copy.

    PARTIAL: out is the fp32 workspace [split, M, N or 2N] and sq_ptr [split, M]; else out [M, N]
    (+ the residual [M, N] when HAS_RES). FOLDED (with HAS_NORM): W already holds (1 + w)
    (weights.NormFolded), so x goes to the dot as loaded and only its squares are summed.
    SQ_COL (FOLDED and PARTIAL): the squares are summed by an extra grid column of x-only
    programs (see SQ_COLUMN), the column tiles at pid_n - 1.
    SWAP_AB (FP8): acc^T += W_tile @ x_tile^T, the dequantized tile the left operand (see
    FP8_SWAP_MIN_ROWS); the accumulators are transposed back before the epilogue.
    FP8_PTX (FP8, NVIDIA): tiles dequantized by inline PTX, four weights at a time (_dequant_sm90).
    PDL: launched as a programmatic dependent (runtime.PDL).
    """
    dep_wait(PDL)
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if SQ_COL:
        # Column 0 of the grid sums the K-range's x^2 per row, and only that; the column tiles are
        # pid_n - 1. So no GEMM program reads x into registers: each feeds its dot straight from
        # the pipelined shared-memory tile, the plain linear's path (see the note at the dot).
        if pid_n == 0:
            _sq_program(x_ptr, sq_ptr, M, stride_xm, stride_xk, k_lo, k_hi, pid_s, offs_m, BM, BK)
            return
        pid_n -= 1
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = offs_m < M, offs_n < N
    if SWAP_AB:  # transposed accumulators [BN, BM]: the weights are the dot's left operand
        acc = tl.zeros((BN, BM), tl.float32)
        acc_up = tl.zeros((BN, BM), tl.float32)
    else:
        acc = tl.zeros((BM, BN), tl.float32)
        acc_up = tl.zeros((BM, BN), tl.float32)
    sq = tl.zeros((BM,), tl.float32)
    if FP8:
        # Each step's exponents are loaded one step ahead: a load whose value only feeds registers
        # is left out of Triton's pipeline, and loaded in its own step each step waited one memory
        # round trip for them (twice for gate|up) before its dequantization could start.
        tile = tl.arange(0, BN)
        e_gate = _fp8_scales(s_ptr, pid_n * BN + tile, n_mask, k_lo, k_hi, stride_sn, stride_sk, QBLOCK, BK)
        if SWIGLU:
            e_up = _fp8_scales(s_ptr, N + pid_n * BN + tile, n_mask, k_lo, k_hi, stride_sn, stride_sk, QBLOCK, BK)
    for k0 in range(k_lo, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_mask = offs_k < k_hi
        x = _x_tile(x_ptr, offs_m, m_mask, offs_k, k_mask, stride_xm, stride_xk).to(tl.float32)
        if HAS_NORM and not SQ_COL:
            sq += tl.sum(x * x, axis=1)
            if not FOLDED:
                nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                x = x * (1.0 + nw)[None, :]
        if HAS_NORM and FOLDED and not SQ_COL:
            # The tile goes to the dot through registers, as the unfolded path's scaled x does.
            # Fed straight from its pipelined shared-memory buffer (the compiler's choice for a
            # loaded tile) while the same buffer is also read into registers for the squares,
            # the 64-row wgmma tiles got wrong, run-to-run different sums on an H200 (Triton
            # 3.6; 16- and 32-row tiles, on mma.sync, were right). `+ 0.0` keeps the compiler
            # from folding the round trip back to the shared-memory operand; it changes no
            # product (only a -0 input becomes +0).
            a = cast(x + 0.0, DOT, INTERPRET)
        else:
            a = cast(x, DOT, INTERPRET)
        if FP8:
            # A K-range ends on a BK boundary (or at K); gate rows past N are masked, or with TMA
            # read up rows into output columns that are never stored.
            acc, e_gate = _fp8_dot(acc, a, w_ptr, s_ptr, e_gate, pid_n * BN, tile, n_mask, k0, k_hi, stride_wn,
                                   stride_wk, stride_sn, stride_sk, QBLOCK, BN, BK, DOT, TMA, FP8_PTX, SWAP_AB,
                                   INTERPRET, IEEE)
            if SWIGLU:
                acc_up, e_up = _fp8_dot(acc_up, a, w_ptr, s_ptr, e_up, N + pid_n * BN, tile, n_mask, k0, k_hi,
                                        stride_wn, stride_wk, stride_sn, stride_sk, QBLOCK, BN, BK, DOT, TMA,
                                        FP8_PTX, SWAP_AB, INTERPRET, IEEE)
        elif TMA:
            # A K-range ends on a BK boundary (or at K, where the copy fills zeros); a gate tile
            # past N reads up rows into output columns that are never stored.
            acc = mma(a, tl.trans(w_ptr.load([pid_n * BN, k0])), acc, INTERPRET, IEEE)
            if SWIGLU:
                acc_up = mma(a, tl.trans(w_ptr.load([N + pid_n * BN, k0])), acc_up, INTERPRET, IEEE)
        else:
            # Weight tile as [BK, BN]: K is the contiguous dim, so each column is one coalesced run.
            wmask = k_mask[:, None] & n_mask[None, :]
            w_off = offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
            acc = mma(a, tl.load(w_ptr + w_off, mask=wmask, other=0.0).to(DOT), acc, INTERPRET, IEEE)
            if SWIGLU:
                wu = tl.load(w_ptr + N * stride_wn + w_off, mask=wmask, other=0.0)
                acc_up = mma(a, wu.to(DOT), acc_up, INTERPRET, IEEE)

    dep_release(PDL)
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    out_mask = m_mask[:, None] & n_mask[None, :]
    o_off = offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if PARTIAL:
        base = out_ptr + pid_s * stride_os
        tl.store(base + o_off, acc, mask=out_mask)
        if SWIGLU:
            tl.store(base + N * stride_on + o_off, acc_up, mask=out_mask)
        if HAS_NORM and not SQ_COL:
            if pid_n == 0:
                tl.store(sq_ptr + pid_s * M + offs_m, sq, mask=m_mask)
    else:
        if HAS_NORM:
            inv = rms_inv(sq, K, eps)
            acc = acc * inv[:, None]
            acc_up = acc_up * inv[:, None]
        if SWIGLU:
            acc = _swiglu_oai(acc, acc_up, alpha, limit, OUT, INTERPRET)
        if HAS_RES:
            acc = _add_residual(acc, res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], out_mask, OUT, INTERPRET)
        tl.store(out_ptr + o_off, cast(acc, OUT, INTERPRET), mask=out_mask)


@triton.jit
def _finalize_kernel(
    ws_ptr, sq_ptr, out_ptr, res_ptr, M, N, K, stride_ws_s, stride_ws_m, stride_om, stride_rm,
    eps, alpha, limit, SPLIT: tl.constexpr,
    HAS_NORM: tl.constexpr, SWIGLU: tl.constexpr, HAS_RES: tl.constexpr, OUT: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, SQ_X: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """Program (row, column block): sum the split partials in order, scale by inv_r, [SwiGLU], [+ residual], round.

    SPLIT is compile-time: the unrolled loop has all SPLIT loads in flight before the first add.
    SQ_X (a power of two >= K, with HAS_NORM): sq_ptr is x [M, K] itself (row stride K) and each
    program sums its row's squares (one load of the row, from L2) instead of reading partial sums:
    for products that came without them (blas.norm_linear)."""
    dep_wait(PDL)
    dep_release(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    acc = tl.zeros((BLOCK_N,), tl.float32)
    up = tl.zeros((BLOCK_N,), tl.float32)
    for s in tl.static_range(SPLIT):
        base = ws_ptr + s * stride_ws_s + row * stride_ws_m
        acc += tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        if SWIGLU:
            up += tl.load(base + N + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        if SQ_X:
            xk = tl.arange(0, SQ_X)
            xr = tl.load(sq_ptr + row * K + xk, mask=xk < K, other=0.0).to(tl.float32)
            inv = rms_inv(tl.sum(xr * xr, axis=0), K, eps)
        else:
            inv = row_norm_scale(sq_ptr, M, row, K, eps, SPLIT)
        acc = acc * inv
        up = up * inv
    if SWIGLU:
        acc = _swiglu_oai(acc, up, alpha, limit, OUT, INTERPRET)
    if HAS_RES:
        acc = _add_residual(acc, res_ptr + row * stride_rm + offs, mask, OUT, INTERPRET)
    tl.store(out_ptr + row * stride_om + offs, cast(acc, OUT, INTERPRET), mask=mask)


@dataclass(frozen=True)
class GemmConfig:
    """Tiling of one skinny GEMM launch (see `plan`)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        # A hand-made config (tests, microbench) no launch can run failed far from here: split_k 0 divided
        # by zero in _tiling, a tile that is no power of two inside Triton (tl.arange), a tile under 16
        # below the tensor-core dot's minimum on a GPU.
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"GemmConfig: {name} {v} is not a power of two >= 16")
        if self.split_k < 1 or self.num_stages < 1 or self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"GemmConfig: split_k {self.split_k} and num_stages {self.num_stages} must be >= 1, "
                             f"num_warps {self.num_warps} a power of two")


# The activation dtypes the kernels compute in and round to (runtime.tl_dtype).
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Tunables, read by `plan`: programs per SM to aim for, and the fewest K tiles a split may own
# (below that the partial traffic outweighs the extra parallelism).
PROGRAMS_PER_SM = 2
MIN_K_TILES_PER_SPLIT = 4
BLOCK_N = 128  # measured on an H200: 1-5% faster steps than 64 (x re-read from L2 once per column tile)
BLOCK_K = 64
SMEM_PER_PROGRAM = 100 << 10  # an H100/H200 SM has 228 KB
MAX_STAGES = 8
# A GEMM whose stage is so large that fewer than MIN_STAGES fit in SMEM_PER_PROGRAM (gate|up at
# column tile 128: x + two 16 KB weight tiles) runs one program per SM with up to DEEP_SMEM of
# pipeline instead (capped by the device's limit): deeper prefetch, the same bytes in flight
# per SM. Measured on an H200 (gate|up deep): step at 56 rows 534 -> 519 us, 7 rows unchanged;
# making every GEMM deep was no better. 0 turns it off.
MIN_STAGES = 3
DEEP_SMEM = 200 << 10
SMEM_RESERVE = 16 << 10  # left to the compiler (epilogue layout conversions) below the device limit
# Dense weights through tensor descriptors on sm_90+ (see _gemm_kernel). Measured on an H200
# (runs 25-26): the step 0-2% faster than per-thread pointer loads, never slower.
TMA = True
NUM_WARPS = 4  # one warp group per 64-row wgmma tile; 8 (two groups) made the step 6-9% slower (run 45)
# A folded-norm GEMM with split-K sums x^2 in one extra grid column of x-only programs instead of
# in every program's K loop: the column tiles then feed their dot from shared memory and skip the
# squares. Measured on an H200 (BENCHMARKS runs 72-73): the gate|up launch 27.2 -> 25.2 us and
# the qkv launch 12.7 -> 11.2 us without the squares in the loop; the step 2-3.5% faster at 56
# rows, 3% at 7. False: every program sums them (as before).
SQ_COLUMN = True
# MXFP8 weights' K tile. Their tiles are dequantized in registers ([BN, BK] values per tile, twice
# for gate|up), so the tile is sized for the registers, not for the bytes per stage: at 128 (the
# bf16 tile's bytes) the gate|up launch spilled 480 bytes per thread on sm_90 (test_codegen_sm90).
FP8_BLOCK_K = 64
FP8_NUM_WARPS = 4
# MXFP8 on NVIDIA GPUs: the tiles dequantized by inline PTX on packed registers (_dequant_sm90).
FP8_PACKED_DEQUANT = True
# MXFP8 from this many rows (64-row tiles): the dequantized weight tile as the dot's left operand,
# straight from registers (wgmma takes its A operand there), x^T from shared memory, and the
# [BN, BM] accumulators transposed once at the end. Below: x on the left and the dequantized tile
# stored to shared memory each step (16-row tiles on mma.sync). Measured on an H200 (run 152, the
# fp8 5-layer step): 56 rows 586-603 us swapped against 643-659; 7 rows 481-483 against 460.
FP8_SWAP_MIN_ROWS = 33
# PLAN_SQ_COLUMN: `plan` counts that column's programs among the slots it fills. Off, qkv at 56
# rows gets 14 K-ranges and 19 x 14 = 266 programs for 264 two-per-SM slots, so the last two
# start only as others finish; on, 12 K-ranges and 228 programs, all resident. Measured on an H200
# (run 91): 5-6 us faster at 56 rows, 0-6 us slower at 7, both inside the same run's spread, so off;
# with PDL and the attention's narrow tile (run 177, twice in one process each): 3-5 us faster at 56
# rows (392.8-397.3 against 397.7-402.8 us) and 1-2 us at 7 (331.5-333.9 against 333.6-336.2), so on.
PLAN_SQ_COLUMN = True
# MXFP8 plans: the programs per SM planned are also the most an SM can hold. Each program's
# pipeline gets more than an SM's shared memory over (programs per SM + 1), deepening it where
# needed. With PDL a grid is launched while its predecessor drains, and the first SMs free take as
# many programs as fit: MXFP8 programs at 7 rows (72-75 KB, 2 per SM planned, 3 fitting) piled 3
# onto some SMs, and the step took 407-411 us against 347-352 with this (runs 171-173, H200).
# Not for bf16 weights: the step's one bf16 Triton GEMM (qkv) follows a vendor GEMM, which does
# not release it early, and deepening it at 7 rows measured 4-10 us slower (runs 173-174).
# False: stages from SMEM_PER_PROGRAM alone.
EXACT_RESIDENCY = True


def stage_bytes(block_m: int, block_n: int, block_k: int, swiglu: bool, weight_bytes: int, x_bytes: int = 2) -> int:
    """Shared memory of one pipeline stage: the x tile (x_bytes an element: 4 under fp32 activations)
    and the weight tile(s, gate and up)."""
    return block_m * block_k * x_bytes + (2 if swiglu else 1) * block_k * block_n * weight_bytes


def plan(m: int, n: int, k: int, sms: int, block_n: int | None = None, block_k: int | None = None,
         programs_per_sm: int | None = None, swiglu: bool = False, weight_bytes: int = 2,
         max_smem: int | None = None, sq_column: bool = False, quant_block: int = 1, x_bytes: int = 2) -> GemmConfig:
    """Row tile from m (tensor-core dots need >= 16 rows), then split K until the grid covers the SMs.

    n: output columns per program's tile set (f for SwiGLU: each program streams gate and up tiles).
    Pipeline depth: as many stages of (x tile + weight tiles) as fit SMEM_PER_PROGRAM (and the
    device's max_smem less SMEM_RESERVE), so that two programs share an SM (one hides the other's
    load latency), at least 2 and at most MAX_STAGES;
    or, when fewer than MIN_STAGES fit (or programs_per_sm is 1), one program per SM with the deep
    budget (see DEEP_SMEM); then, for MXFP8 weights, deep enough that no more than the planned
    programs fit on an SM (EXACT_RESIDENCY).
    max_smem: the device's shared memory per program (default: DEEP_SMEM + SMEM_RESERVE).
    sq_column: a split launch will carry the x^2 column (a folded norm, SQ_COLUMN); with
    PLAN_SQ_COLUMN its programs count among the slots.
    quant_block: an MXFP8 weight's block; the K tile holds whole blocks (a config.json's
    weight_block_size [1, 128] needs a tile of 128).
    x_bytes: the activations' element size (stage_bytes).
    """
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn, bk = block_n or BLOCK_N, block_k or (max(FP8_BLOCK_K, quant_block) if weight_bytes == 1 else BLOCK_K)
    stage = stage_bytes(bm, bn, bk, swiglu, weight_bytes, x_bytes)
    # Never more than the device gives a program: an MI300X has 64 KB of LDS, where stages counted
    # from SMEM_PER_PROGRAM alone (the 7-row qkv: 5 of 18 KB) compiled to more than that and did not launch.
    stages = (SMEM_PER_PROGRAM if max_smem is None else min(SMEM_PER_PROGRAM, max_smem - SMEM_RESERVE)) // stage
    if DEEP_SMEM and (programs_per_sm == 1 or programs_per_sm is None and stages < MIN_STAGES):
        budget = min(DEEP_SMEM, (max_smem or DEEP_SMEM + SMEM_RESERVE) - SMEM_RESERVE)
        programs_per_sm, stages = 1, max(stages, budget // stage)
    stages = max(2, min(MAX_STAGES, stages))
    per_sm = programs_per_sm or PROGRAMS_PER_SM
    if EXACT_RESIDENCY and weight_bytes == 1 and per_sm > 1:  # one per SM: the deep budget is over half an SM
        # Triton allocates num_stages - 1 tiles, or num_stages with an epilogue's scratch beside them:
        # deepen while the first could let per_sm + 1 programs share the SM, never so far that the
        # second leaves room for fewer than per_sm (test_codegen_sm90 checks the step's GEMMs).
        sm_smem = max_smem or DEEP_SMEM + SMEM_RESERVE
        deeper = sm_smem // (per_sm + 1) // stage + 2
        if deeper * stage <= sm_smem // per_sm:
            stages = max(stages, deeper)
    # At least one tile: norm_linear_partials plans its workspace for 0 rows too (an empty step).
    tiles = max(1, (triton.cdiv(n, bn) + (sq_column and SQ_COLUMN and PLAN_SQ_COLUMN)) * triton.cdiv(m, bm))
    k_tiles = triton.cdiv(k, bk)
    want = per_sm * sms
    split = max(1, min(want // tiles, k_tiles // MIN_K_TILES_PER_SPLIT))
    k_per = triton.cdiv(k_tiles, split) * bk
    return GemmConfig(bm, bn, bk, triton.cdiv(k, k_per), num_warps=FP8_NUM_WARPS if weight_bytes == 1 else NUM_WARPS,
                      num_stages=stages)


def gemm(x: torch.Tensor, weight: torch.Tensor | MxFp8Weight, norm_weight: torch.Tensor | None = None,
         eps: float = 0.0, swiglu: tuple[float, float] | None = None,
         config: GemmConfig | None = None, residual: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> [M, N] in x.dtype; weight [N, K] (or [2N, K], gate rows first, with swiglu=(alpha, limit)).

    norm_weight: fuse the Gemma RMSNorm (1 + w) of x. weight: a dense bf16/fp16/fp32 tensor or an
    MxFp8Weight (dequantized tile by tile in the kernel). residual [M, N]: returned plus the
    product (rounded first, as the reference's `residual + linear`), in the same launches.
    out: where to write (a row-major [M, N] of x.dtype; it may be the residual itself: each element
    of the residual is read by the program that then writes that element).
    """
    m, n = _check(x, weight, swiglu, norm_weight)
    has_res = residual is not None
    if has_res and (swiglu or residual.shape != (m, n) or residual.stride(-1) != 1):
        raise ValueError(f"gemm: residual {list(residual.shape)} must be a row-major [{m}, {n}] without swiglu")
    # The sum is written in x.dtype: a wider residual (fp32 under bf16 x) came back rounded to bf16,
    # where the reference's `residual + y` promotes and returns the wider sum.
    if has_res and residual.dtype != x.dtype:
        raise ValueError(f"gemm: residual dtype {residual.dtype} is not the activations' {x.dtype}")
    if has_res:
        same_device("gemm", x=x, residual=residual)
    if out is not None:
        same_device("gemm", x=x, out=out)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride() != (n, 1):
        raise ValueError(f"gemm: out {list(out.shape)} {out.dtype} must be a contiguous [{m}, {n}] {x.dtype}")
    if m == 0 or n == 0:  # nothing to write; the finalize's column blocks were sized 0 for n = 0
        return out
    cfg, split, k_per = _tiling(x, weight, n, swiglu is not None, config, norm_weight is not None)
    if split == 1:
        _launch(x, weight, norm_weight, eps, swiglu, cfg, k_per, out, out, residual)
    else:
        ws, sq = _workspace(x, weight, split)
        _launch(x, weight, norm_weight, eps, swiglu, cfg, k_per, ws, sq, None)
        _finalize(ws, sq, out, n, x.shape[1], split, eps, *(swiglu or (0.0, 0.0)), norm_weight is not None,
                  swiglu is not None, residual)
    return out


@dataclass(frozen=True)
class Partials:
    """A norm_linear left unfinished for the kernel that consumes it (the attention prelude), one launch less.

    ws fp32 [split, m, n]: the K-range partials of (x * (1 + w)) @ W^T; sq fp32 [split, m]: the
    partial sums of x^2. Its value, as `_finalize_kernel` computes it:
    round_to(dtype)(sum_s ws[s] * row_norm_scale(sq, ..., k, eps)), partials summed in split order.
    """

    ws: torch.Tensor
    sq: torch.Tensor
    k: int
    eps: float
    dtype: torch.dtype


def norm_linear_partials(x: torch.Tensor, weight: torch.Tensor | MxFp8Weight, norm_weight: torch.Tensor,
                         eps: float, config: GemmConfig | None = None) -> Partials:
    """The GEMM of norm_linear without its finalize: x [M, K], weight [N, K] -> Partials of [M, N]."""
    m, n = _check(x, weight, None, norm_weight)
    cfg, split, k_per = _tiling(x, weight, n, False, config, True)
    ws, sq = _workspace(x, weight, split)
    if m:
        _launch(x, weight, norm_weight, eps, None, cfg, k_per, ws, sq, None)
    return Partials(ws, sq, x.shape[1], eps, x.dtype)


def _stored(weight: torch.Tensor | MxFp8Weight | NormFolded) -> torch.Tensor:
    """The tensor the kernel streams: the dense weight, an MxFp8Weight's F8_E4M3 bits, or the folded weight."""
    if isinstance(weight, MxFp8Weight):
        return weight.qweight
    return weight.weight if isinstance(weight, NormFolded) else weight


def _check(x: torch.Tensor, weight: torch.Tensor | MxFp8Weight, swiglu,
           norm_weight: torch.Tensor | None = None) -> tuple[int, int]:
    w = _stored(weight)
    check_device(x, w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemm: x {list(x.shape)} and weight {list(w.shape)} do not chain")
    if x.shape[1] == 0:  # no mean to normalize by, no K tile to plan (ZeroDivisionError in plan)
        raise ValueError(f"gemm: x {list(x.shape)} has no columns to reduce")
    # The kernels round to these (runtime.tl_dtype): another dtype failed at the launch with a bare KeyError.
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"gemm: x dtype {x.dtype} is not one of {ACT_DTYPES}")
    # The kernels take raw pointers: an operand on another device (another rank's GPU) was read as if it
    # were x's, where the reference's F.linear raises.
    same_device("gemm", x=x, weight=w, **({"weight scales": weight.scale} if isinstance(weight, MxFp8Weight) else {}),
                 **({"norm weight": norm_weight} if norm_weight is not None else {}))
    # A dense weight sets the dot's operand dtype (runtime.dot_dtype): fp32 x met a bf16 weight in a
    # bf16 dot (x rounded to 8 bits under an fp32 result), bf16 x an fp16 one (inf past 65504), where
    # the reference's F.linear raises. MXFP8 weights take any activation dtype (see _launch).
    if not isinstance(weight, MxFp8Weight) and w.dtype != x.dtype:
        raise ValueError(f"gemm: weight dtype {w.dtype} is not the activations' {x.dtype}")
    if norm_weight is not None:
        check_norm_weight("gemm", norm_weight, x.shape[1], f"x {list(x.shape)}")
    # An odd gate|up weight would drop its last row unseen.
    if swiglu and w.shape[0] % 2:
        raise ValueError(f"gemm: gate|up weight {list(w.shape)} has an odd number of rows")
    return x.shape[0], w.shape[0] // 2 if swiglu else w.shape[0]


def _tiling(x: torch.Tensor, weight, n: int, swiglu: bool, config: GemmConfig | None,
            norm: bool = False) -> tuple[GemmConfig, int, int]:
    """(config, K-ranges actually used, K per range: a multiple of block_k). norm: x is normalized."""
    m, k = x.shape
    wbytes = _stored(weight).element_size()
    qblock = weight.block if isinstance(weight, MxFp8Weight) else 1
    cfg = config or plan(m, n, k, sms_of(x), swiglu=swiglu, weight_bytes=wbytes, max_smem=smem_of(x),
                         sq_column=norm and isinstance(weight, NormFolded), quant_block=qblock,
                         # fp32 x: its tile is twice the bf16 one (o_proj at 56 rows planned 240 KB for 227)
                         x_bytes=x.element_size())
    if cfg.block_k % qblock:  # _dequant splits each [BN, BK] tile into whole blocks (BK // QBLOCK of them)
        raise ValueError(f"gemm: K tile {cfg.block_k} does not hold whole MXFP8 blocks of {qblock}")
    k_per = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    return cfg, triton.cdiv(k, k_per), k_per


def _workspace(x: torch.Tensor, weight, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partials [split, M, rows of weight] and partial sums of squares [split, M]."""
    n_tot = weight.shape[0]
    return (torch.empty((split, x.shape[0], n_tot), dtype=torch.float32, device=x.device),
            torch.empty((split, x.shape[0]), dtype=torch.float32, device=x.device))


def _launch(x, weight, norm_weight, eps, swiglu, cfg: GemmConfig, k_per: int, target: torch.Tensor,
            sq: torch.Tensor, residual: torch.Tensor | None) -> None:
    """One `_gemm_kernel` launch into target: out [M, N] (direct epilogue) or a workspace [split, M, N]."""
    fp8 = isinstance(weight, MxFp8Weight)
    if isinstance(weight, NormFolded):
        weight.check(norm_weight)
    w = _stored(weight)
    scale = weight.scale if fp8 else w
    m, k = x.shape
    n = w.shape[0] // 2 if swiglu else w.shape[0]
    partial = target.dim() == 3
    split = target.shape[0] if partial else 1
    alpha, limit = swiglu or (0.0, 0.0)
    so = target.stride() if partial else (0, target.stride(0), target.stride(1))
    res = x if residual is None else residual
    ddt = dot_dtype(w.dtype)
    if fp8:
        w = w.view(torch.uint8)  # the kernel takes the bits apart itself (_dequant)
        if x.dtype != torch.bfloat16:
            # The dequantized tile is exact in bf16, but an fp32 (or fp16) x is not: a bf16 dot would
            # round every activation to 8 bits (1e-3 relative, not the fp32 reference's 2e-5), so such
            # x meets the tile in an fp32 (IEEE) dot, where both are exact.
            ddt = tl.float32
    tma = TMA and w.dtype in (torch.bfloat16, torch.float16, torch.uint8) and sm90_of(x) and _tma_ready(w)
    sq_col = SQ_COLUMN and partial and norm_weight is not None and isinstance(weight, NormFolded)
    _gemm_kernel[(triton.cdiv(n, cfg.block_n) + sq_col, split, triton.cdiv(m, cfg.block_m))](
        # The kernel reads (1 + w) at unit stride: a strided view read its neighbours' elements.
        x, x if norm_weight is None else norm_weight.contiguous(),
        TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k]) if tma else w,
        scale, target, sq, res, m, n, k, k_per,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), scale.stride(0), scale.stride(1),
        so[0], so[1], so[2], res.stride(0), eps, alpha, limit,
        HAS_NORM=norm_weight is not None, FOLDED=isinstance(weight, NormFolded), FP8=fp8,
        QBLOCK=weight.block if fp8 else 1, SWIGLU=swiglu is not None,
        PARTIAL=partial, HAS_RES=residual is not None, DOT=ddt, IEEE=ddt == tl.float32, OUT=tl_dtype(x.dtype),
        BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, INTERPRET=INTERPRET, TMA=tma, SQ_COL=sq_col,
        SWAP_AB=fp8 and m >= FP8_SWAP_MIN_ROWS,
        # Inline PTX cannot run in the interpreter, where tests fake sm90_of for the TMA path: nvidia_of too.
        # The packed path yields bf16 tiles: only for a bf16 dot.
        FP8_PTX=fp8 and ddt == tl.bfloat16 and FP8_PACKED_DEQUANT and nvidia_of(x) and sm90_of(x),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(x, "gemm"),
    )


def _tma_ready(w: torch.Tensor) -> bool:
    """A tensor descriptor needs a 16-byte aligned base and row stride and unit column stride."""
    return w.stride(1) == 1 and (w.stride(0) * w.element_size()) % 16 == 0 and w.data_ptr() % 16 == 0


def _finalize(ws: torch.Tensor, sq: torch.Tensor, out: torch.Tensor, n: int, k: int, split: int, eps: float,
              alpha: float, limit: float, has_norm: bool, swiglu: bool, residual: torch.Tensor | None = None,
              sq_from_x: bool = False) -> None:
    """sq_from_x: sq is x [M, k] (contiguous), whose rows' squares the finalize sums itself (see SQ_X)."""
    m = out.shape[0]
    block = min(256, triton.next_power_of_2(n))  # many small programs: the sums are latency-bound
    res = out if residual is None else residual
    _finalize_kernel[(m, triton.cdiv(n, block))](
        ws, sq, out, res, m, n, k, ws.stride(0), ws.stride(1), out.stride(0), res.stride(0),
        eps, alpha, limit, SPLIT=split,
        HAS_NORM=has_norm, SWIGLU=swiglu, HAS_RES=residual is not None, OUT=tl_dtype(out.dtype),
        BLOCK_N=block, INTERPRET=INTERPRET, SQ_X=triton.next_power_of_2(k) if sq_from_x else 0, num_warps=4,
        **pdl_kwargs(out, "finalize"),
    )


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """Standalone SwiGLU-OAI: gate_up [n, 2f] (gate first) -> [n, f], through the finalize kernel."""
    check_device(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        # An odd width has no halves: gate column j was paired with column f + j of a floored f and
        # the last column dropped unseen, where the reference raises.
        raise ValueError(f"swiglu_oai: gate|up {list(gate_up.shape)} is not [n, 2f] (2-D, no odd width)")
    if gate_up.dtype not in ACT_DTYPES:
        raise ValueError(f"swiglu_oai: gate|up dtype {gate_up.dtype} is not one of {ACT_DTYPES}")
    g = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    m, f = g.shape[0], g.shape[1] // 2
    out = torch.empty((m, f), dtype=g.dtype, device=g.device)
    if m and f:  # f = 0: the finalize's column blocks were sized 0
        _finalize(g.unsqueeze(0), g, out, f, 1, 1, 0.0, alpha, limit, False, True)
    return out
