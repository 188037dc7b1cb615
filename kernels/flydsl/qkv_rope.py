"""The qkv epilogue: split-K sum, input-norm 1/rms, per-head Gemma q/k norm, partial NeoX RoPE, K/V cache write.

One wave per (row, head) of the rank's 16 q heads, 1 k head and 1 v head. Lane l holds head
dims l and l + 64, so the rotating dims [0, 64) sit one per lane and the RoPE partner of dim i
(i + 32) is lane l ^ 32: the rotation is one cross-lane swap.

RoPE uses the engine's cos/sin cache (f32 [max_positions, 64]: cos of the 32 frequencies, then
sin), so the angles are bit-identical to the stock layers' rather than recomputed in-kernel.
The block rows' K/V go to the paged cache, viewed as [2 * num_slots, 128] rows, at the row's
slot: K to row slot * slot_rows, V to row v_row0 + slot * slot_rows (shapes.kv_row_map: the
planes or the records layout); slot < 0 (padding) is skipped. The cache's element type is a
compile-time parameter (shapes.KV_DTYPES): bf16, or float8 e4m3fn codes (uint8 rows). An fp8 cache
gets the bf16-rounded K and V (the reference's K/V are bf16 tensors when it writes them) saturated
at +-448 and rounded to nearest even, the codes kv_cache.to_cache writes: one v_cvt_pk_fp8_f32
per lane converts its two dims, stored as two bytes.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import math as fmath
from flydsl.expr import const_expr, range_constexpr

from . import _device as dev
from .shapes import HEAD_DIM, HIDDEN, KV_DTYPES, Q_HEADS, RMS_EPS, ROTARY_DIM, SCHEDULES, rows_for

HEADS = Q_HEADS + 2  # q heads, then k, then v: the column order of the fused qkv projection
HALF = ROTARY_DIM // 2


def build_qkv_rope(num_reqs: int, kv_dtype: str = "bf16"):
    """Launcher(P f32 [split, MP, 2304], SS f32 [split, MP], QN bf16 [128], KN bf16 [128],
    CS f32 [max_pos, 64], POS i64 [rows], SLOT i64 [rows], Q bf16 [rows, 2048],
    KV [2 * num_slots, 128] (bf16, or uint8 e4m3fn codes for kv_dtype "fp8"), slot_rows i32, v_row0 i32)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
    FP8 = kv_dtype == "fp8"
    sched = SCHEDULES["qkv"]
    rows = rows_for(num_reqs)
    split = sched.split

    @flyc.kernel
    def qkv_rope_kernel(
        P: fx.Tensor,
        SS: fx.Tensor,
        QN: fx.Tensor,
        KN: fx.Tensor,
        CS: fx.Tensor,
        POS: fx.Tensor,
        SLOT: fx.Tensor,
        Q: fx.Tensor,
        KV: fx.Tensor,
        slot_rows: fx.Int32,
        v_row0: fx.Int32,
    ):
        row = fx.block_idx.x
        head = fx.block_idx.y
        lane = fx.thread_idx.x
        a_f32 = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), 32)
        a_bf16 = fx.make_copy_atom(fx.rocdl.BufferCopy16b(), 16)
        a_i64 = fx.make_copy_atom(fx.rocdl.BufferCopy64b(), 64)
        a_u8 = fx.make_copy_atom(fx.rocdl.BufferCopy8b(), 8)
        pb = fx.rocdl.make_buffer_tensor(P)
        ssb = fx.rocdl.make_buffer_tensor(SS)

        # Split-K sum in split order, then the input layernorm's 1/rms of the row.
        col = head * HEAD_DIM + lane
        ss = fx.Float32(0.0)
        lo = fx.Float32(0.0)
        hi = fx.Float32(0.0)
        for s in range_constexpr(split):
            # SS[s, row] through the split's row view, as linear.py writes it: a flat index into the
            # 2-D [split, MP] tensor is colexicographic in FlyDSL's layout algebra ((i % split, i // split)),
            # and SS's row stride is the workspace's 64, not MP.
            ssv = fx.logical_divide(fx.slice(ssb, (s, None)), fx.make_layout(1, 1))
            ss = ss + dev.load_vec(a_f32, ssv, row, 1, fx.Float32)[0]
            prow = fx.logical_divide(fx.slice(pb, (s, row, None)), fx.make_layout(1, 1))
            lo = lo + dev.load_vec(a_f32, prow, col, 1, fx.Float32)[0]
            hi = hi + dev.load_vec(a_f32, prow, col + 64, 1, fx.Float32)[0]
        rrms = fmath.rsqrt(ss * (1.0 / HIDDEN) + RMS_EPS)
        lo = lo * rrms
        hi = hi * rrms

        # Per-head Gemma RMSNorm over the 128 dims (q heads: q_norm, the k head: k_norm).
        is_q = head < Q_HEADS
        qn = fx.logical_divide(fx.rocdl.make_buffer_tensor(QN), fx.make_layout(1, 1))
        kn = fx.logical_divide(fx.rocdl.make_buffer_tensor(KN), fx.make_layout(1, 1))
        w_lo = is_q.select(
            dev.load_vec(a_bf16, qn, lane, 1, fx.BFloat16)[0].to(fx.Float32),
            dev.load_vec(a_bf16, kn, lane, 1, fx.BFloat16)[0].to(fx.Float32),
        )
        w_hi = is_q.select(
            dev.load_vec(a_bf16, qn, lane + 64, 1, fx.BFloat16)[0].to(fx.Float32),
            dev.load_vec(a_bf16, kn, lane + 64, 1, fx.BFloat16)[0].to(fx.Float32),
        )
        hrms = fmath.rsqrt(dev.wave_sum(lo * lo + hi * hi) * (1.0 / HEAD_DIM) + RMS_EPS)
        n_lo = lo * hrms * (w_lo + 1.0)
        n_hi = hi * hrms * (w_hi + 1.0)

        # Partial NeoX RoPE on dims [0, 64): lane l < 32 holds x1 = dim l, lane l + 32 holds
        # x2 = dim l + 32; out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin.
        pos = dev.load_vec(a_i64, fx.logical_divide(fx.rocdl.make_buffer_tensor(POS), fx.make_layout(1, 1)), row, 1, fx.Int64)[0]
        csrow = fx.logical_divide(fx.slice(fx.rocdl.make_buffer_tensor(CS), (fx.Int32(pos), None)), fx.make_layout(1, 1))
        i = lane % HALF
        cos = dev.load_vec(a_f32, csrow, i, 1, fx.Float32)[0]
        sin = dev.load_vec(a_f32, csrow, i + HALF, 1, fx.Float32)[0]
        partner = n_lo.shuffle_xor(HALF, dev.WAVE)
        sign = (lane < HALF).select(fx.Float32(-1.0), fx.Float32(1.0))
        r_lo = n_lo * cos + sign * partner * sin

        is_v = head == Q_HEADS + 1
        out_lo = is_v.select(lo, r_lo).to(fx.BFloat16)
        out_hi = is_v.select(hi, n_hi).to(fx.BFloat16)
        if is_q:
            qrow = fx.logical_divide(fx.slice(fx.rocdl.make_buffer_tensor(Q), (row, None)), fx.make_layout(1, 1))
            dev.store_vec(a_bf16, qrow, col, fx.Vector.from_elements([out_lo], fx.BFloat16), 1, fx.BFloat16)
            dev.store_vec(a_bf16, qrow, col + 64, fx.Vector.from_elements([out_hi], fx.BFloat16), 1, fx.BFloat16)
        else:
            slot = dev.load_vec(a_i64, fx.logical_divide(fx.rocdl.make_buffer_tensor(SLOT), fx.make_layout(1, 1)), row, 1, fx.Int64)[0]
            if slot >= 0:
                kv_row = (head - Q_HEADS) * v_row0 + fx.Int32(slot) * slot_rows
                kvr = fx.logical_divide(fx.slice(fx.rocdl.make_buffer_tensor(KV), (kv_row, None)), fx.make_layout(1, 1))
                if const_expr(FP8):
                    # Widening the bf16 values to f32 is exact, so the codes are to_cache's of the bf16 K/V.
                    codes = dev.e4m3_codes(out_lo.to(fx.Float32), out_hi.to(fx.Float32))
                    for half in range_constexpr(2):
                        code = (codes >> (8 * half)).to(fx.Uint8)
                        dev.store_vec(a_u8, kvr, lane + 64 * half, fx.Vector.from_elements([code], fx.Uint8), 1, fx.Uint8)
                else:
                    dev.store_vec(a_bf16, kvr, lane, fx.Vector.from_elements([out_lo], fx.BFloat16), 1, fx.BFloat16)
                    dev.store_vec(a_bf16, kvr, lane + 64, fx.Vector.from_elements([out_hi], fx.BFloat16), 1, fx.BFloat16)

    @flyc.jit
    def launch(
        P: fx.Tensor,
        SS: fx.Tensor,
        QN: fx.Tensor,
        KN: fx.Tensor,
        CS: fx.Tensor,
        POS: fx.Tensor,
        SLOT: fx.Tensor,
        Q: fx.Tensor,
        KV: fx.Tensor,
        slot_rows: fx.Int32,
        v_row0: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        qkv_rope_kernel(P, SS, QN, KN, CS, POS, SLOT, Q, KV, slot_rows, v_row0).launch(
            grid=(rows, HEADS, 1), block=(dev.WAVE, 1, 1), stream=stream
        )

    return launch
