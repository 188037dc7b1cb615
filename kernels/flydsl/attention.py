"""Paged sliding-window attention of the 7-row draft block (non-causal inside the block), GQA 16:1, split-KV.

Per request the 7 rows x 16 q heads share the rank's single KV head, so a workgroup takes all
112 query vectors of one request against one split of its keys: each K/V byte is read from HBM
once. Query tile t (16 heads of row t) is an MFMA M tile; wave w owns rows w and w + 4.

Keys of a request lie in [max(0, P - 4095), P + 7): the union of the rows' windows. The row at
position p = P + t sees keys k with p - 4095 <= k < P + 7 (the left edge differs per row; the
whole block is visible on the right). Splits of KPS keys go to separate workgroups; each writes
an unnormalized fp32 O and the softmax max/sum (log2 domain) that `build_attention_combine`
merges in split order.

Per 32-key tile: the workgroup stages K [32, 128] and V transposed [128, 32] in LDS (V's
contraction dim must be contiguous per lane for the MFMA B operand), then each wave computes
S = Q K^T with v_mfma_f32_16x16x32_bf16, an online softmax in fp32, passes P through a private
LDS tile into the MFMA A layout, and accumulates O += P V.

The cache's element type is a compile-time parameter (shapes.KV_DTYPES). An fp8 cache's rows are
e4m3fn codes (uint8): a thread loads 8 codes (8 bytes) where it loads 8 bf16 values of a bf16
cache, and v_cvt_scalef32_pk_bf16_fp8 at scale 1 widens them exactly to bf16 before the LDS
staging (every e4m3fn value is a bf16 value), so the MFMAs and everything after are the bf16 path's
and the result is the reference's over the widened K/V. The fp8 MFMA would need Q in fp8.
"""

# No `from __future__ import annotations`: fx.struct reads its field annotations as types.
import math

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, range_constexpr
from flydsl.expr.typing import Vector

from . import _device as dev
from ...layout import QPR
from .shapes import (
    HEAD_DIM,
    KPS,
    KV_DTYPES,
    KT,
    NEG,
    NSPLIT,
    Q_HEADS,
    SLIDING_WINDOW,
    SM_SCALE_LOG2,
    WAVES_PER_WG,
    rows_for,
)

QT_PER_WAVE = -(-QPR // WAVES_PER_WG)  # 2 query rows (MFMA M tiles) per wave
KS_STRIDE = HEAD_DIM + 8  # bf16 elements per K row in LDS (padding shifts banks per row)
VT_STRIDE = KT + 8  # bf16 elements per transposed V row (one head dim) in LDS
PW_STRIDE = KT + 8

@fx.struct
class AttnSmem:
    ks: fx.Array[fx.BFloat16, KT * KS_STRIDE, 16]
    vt: fx.Array[fx.BFloat16, HEAD_DIM * VT_STRIDE, 16]
    pw: fx.Array[fx.BFloat16, WAVES_PER_WG * 16 * PW_STRIDE, 16]


def build_attention(num_reqs: int, page_size: int, kv_dtype: str = "bf16"):
    """Launcher(Q bf16 [rows, 2048], KV [2 * num_slots, 128] (bf16, or uint8 e4m3fn codes for kv_dtype
    "fp8"), POS i64 [rows], BT i32 [num_reqs, max_pages], OP f32 [num_reqs * NSPLIT * 112, 128],
    ML f32 [num_reqs * NSPLIT * 112, 2], slot_rows i32, v_row0 i32). Grid: num_reqs x NSPLIT.

    K of slot s is KV row s * slot_rows, V row v_row0 + s * slot_rows (shapes.kv_row_map)."""
    rows_for(num_reqs)
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
    FP8 = kv_dtype == "fp8"

    @flyc.kernel
    def swa_attention(
        Q: fx.Tensor,
        KV: fx.Tensor,
        POS: fx.Tensor,
        BT: fx.Tensor,
        OP: fx.Tensor,
        ML: fx.Tensor,
        slot_rows: fx.Int32,
        v_row0: fx.Int32,
    ):
        req = fx.block_idx.x
        split = fx.block_idx.y
        tid = fx.thread_idx.x
        lane = tid % dev.WAVE
        wave = tid // dev.WAVE
        g = lane // 16
        r16 = lane % 16
        a16 = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), 16)
        a_u8x8 = fx.make_copy_atom(fx.rocdl.BufferCopy64b(), 8)
        a_i32 = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), 32)
        a_i64 = fx.make_copy_atom(fx.rocdl.BufferCopy64b(), 64)
        a_f32 = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), 32)
        lds = fx.SharedAllocator().allocate(AttnSmem).peek()
        ks = lds.ks.ptr
        vt = lds.vt.ptr
        pw = lds.pw.ptr + wave * (16 * PW_STRIDE)

        anchor = dev.load_vec(a_i64, fx.logical_divide(fx.rocdl.make_buffer_tensor(POS), fx.make_layout(1, 1)), req * QPR, 1, fx.Int64)[0]
        anchor = fx.Int32(anchor)
        kv_hi = anchor + QPR
        kv_lo = fx.max(anchor - (SLIDING_WINDOW - 1), 0)
        start = kv_lo + split * KPS
        end = fx.min(start + KPS, kv_hi)
        ntiles = fx.max(end - start + (KT - 1), 0) // KT

        kvb = fx.rocdl.make_buffer_tensor(KV)
        btr = fx.logical_divide(fx.slice(fx.rocdl.make_buffer_tensor(BT), (req, None)), fx.make_layout(1, 1))
        # Bounded: wave 3's second row tile (row 7) of the last request lies past the end of Q.
        qb = fx.rocdl.make_buffer_tensor(Q, max_size=False)

        # Q operands (MFMA A: lane -> head r16, dims 32 s + 8 g .. + 8) for this wave's rows.
        qrow = [wave + WAVES_PER_WG * i for i in range_constexpr(QT_PER_WAVE)]
        qa = []
        for i in range_constexpr(QT_PER_WAVE):
            qv = dev.rows_view(qb, req * QPR + qrow[i], 8)
            qa.append([dev.load_vec(a16, qv, (r16 * HEAD_DIM + s * 32 + g * 8) // 8, 8, fx.BFloat16) for s in range_constexpr(4)])

        def load_fp8x8(buf, row, d8):
            """Dims 8 d8 .. 8 d8 + 8 of an fp8 row: 8 codes (two words), widened exactly to 8 bf16."""
            words = dev.load_vec(a_u8x8, dev.rows_view(buf, row, 8), d8, 8, fx.Uint8).bitcast(fx.Uint32)
            return dev.fp8x8_to_bf16(words[0], words[1], fx.Float32(1.0))

        m = [[fx.Float32(NEG) for _ in range_constexpr(4)] for _ in range_constexpr(QT_PER_WAVE)]
        lsum = [[fx.Float32(0.0) for _ in range_constexpr(4)] for _ in range_constexpr(QT_PER_WAVE)]
        o = [[Vector.filled(4, 0.0, fx.Float32) for _ in range_constexpr(HEAD_DIM // 16)] for _ in range_constexpr(QT_PER_WAVE)]

        for tile in range(ntiles):
            t0 = start + tile * KT
            # Stage K rows and transposed V rows of 32 keys: 512 pieces of 8 dims each.
            for half in range_constexpr(2):
                piece = tid + half * (WAVES_PER_WG * dev.WAVE)
                key = piece // 16
                d8 = piece % 16
                kpos = t0 + key
                live = kpos < end
                kp = live.select(kpos, 0)
                page = dev.load_vec(a_i32, btr, kp // page_size, 1, fx.Int32)[0]
                krow = (page * page_size + kp % page_size) * slot_rows
                if const_expr(FP8):
                    kv8 = load_fp8x8(kvb, krow, d8)
                    vv8 = load_fp8x8(kvb, v_row0 + krow, d8)
                else:
                    kv8 = dev.load_vec(a16, dev.rows_view(kvb, krow, 8), d8, 8, fx.BFloat16)
                    vv8 = dev.load_vec(a16, dev.rows_view(kvb, v_row0 + krow, 8), d8, 8, fx.BFloat16)
                zero = Vector.filled(8, 0.0, fx.BFloat16)
                # Keys past the end may read any page: zero them so 0 * garbage cannot be NaN.
                kv8 = live.select(kv8, zero)
                vv8 = live.select(vv8, zero)
                fx.generic_store(ks + key * KS_STRIDE + d8 * 8, kv8)
                for e in range_constexpr(8):
                    fx.generic_store(vt + (d8 * 8 + e) * VT_STRIDE + key, vv8[e])
            fx.gpu.barrier()

            new_m = []
            new_l = []
            new_o = []
            for i in range_constexpr(QT_PER_WAVE):
                # S = Q K^T for keys [0, 16) and [16, 32) of the tile: lane holds heads 4g + v
                # of key 16 h + r16.
                sc = []
                for h in range_constexpr(2):
                    acc = Vector.filled(4, 0.0, fx.Float32)
                    for s in range_constexpr(4):
                        kb = fx.generic_load(ks + (h * 16 + r16) * KS_STRIDE + s * 32 + g * 8, dtype=fx.BFloat16, count=8)
                        acc = dev.mfma_16x16x32_bf16(qa[i][s], kb, acc)
                    kpos = t0 + h * 16 + r16
                    left = anchor + qrow[i] - (SLIDING_WINDOW - 1)
                    ok = (kpos < end) & (kpos >= left)
                    sc.append([ok.select(acc[v] * SM_SCALE_LOG2, fx.Float32(-math.inf)) for v in range_constexpr(4)])
                mi, li, pv = [], [], []
                for v in range_constexpr(4):
                    tmax = dev.xor_max(fx.max(sc[0][v], sc[1][v]), (1, 2, 4, 8))
                    mn = fx.max(m[i][v], tmax)
                    alpha = fx.math.exp2(m[i][v] - mn)
                    p0 = fx.math.exp2(sc[0][v] - mn)
                    p1 = fx.math.exp2(sc[1][v] - mn)
                    mi.append(mn)
                    li.append(lsum[i][v] * alpha + p0 + p1)
                    pv.append((p0, p1, alpha))
                    # P tile row = head 4g + v, column = key.
                    fx.generic_store(pw + (4 * g + v) * PW_STRIDE + r16, p0.to(fx.BFloat16))
                    fx.generic_store(pw + (4 * g + v) * PW_STRIDE + 16 + r16, p1.to(fx.BFloat16))
                # P in the MFMA A layout: lane -> head r16, keys 8 g .. 8 g + 8.
                pa = fx.generic_load(pw + r16 * PW_STRIDE + g * 8, dtype=fx.BFloat16, count=8)
                alpha4 = Vector.from_elements([pv[v][2] for v in range_constexpr(4)], fx.Float32)
                oi = []
                for nt in range_constexpr(HEAD_DIM // 16):
                    vb = fx.generic_load(vt + (nt * 16 + r16) * VT_STRIDE + g * 8, dtype=fx.BFloat16, count=8)
                    oi.append(dev.mfma_16x16x32_bf16(pa, vb, o[i][nt] * alpha4))
                new_m.append(mi)
                new_l.append(li)
                new_o.append(oi)
            m = new_m
            lsum = new_l
            o = new_o
            fx.gpu.barrier()

        # Partial O rows (t * 16 + head) of this split, unnormalized, and (max, sum) in log2 units.
        base = (req * NSPLIT + split) * (QPR * Q_HEADS)
        opb = fx.rocdl.make_buffer_tensor(OP)
        mlb = fx.rocdl.make_buffer_tensor(ML)
        for i in range_constexpr(QT_PER_WAVE):
            if qrow[i] < QPR:
                for v in range_constexpr(4):
                    orow = base + qrow[i] * Q_HEADS + 4 * g + v
                    ov = fx.logical_divide(fx.slice(opb, (orow, None)), fx.make_layout(1, 1))
                    for nt in range_constexpr(HEAD_DIM // 16):
                        dev.store_vec(a_f32, ov, nt * 16 + r16, Vector.from_elements([o[i][nt][v]], fx.Float32), 1, fx.Float32)
                    ltot = dev.xor_sum(lsum[i][v], (1, 2, 4, 8))
                    if r16 == 0:
                        mlv = fx.logical_divide(fx.slice(mlb, (orow, None)), fx.make_layout(1, 1))
                        dev.store_vec(a_f32, mlv, 0, Vector.from_elements([m[i][v]], fx.Float32), 1, fx.Float32)
                        dev.store_vec(a_f32, mlv, 1, Vector.from_elements([ltot], fx.Float32), 1, fx.Float32)

    @flyc.jit
    def launch(
        Q: fx.Tensor,
        KV: fx.Tensor,
        POS: fx.Tensor,
        BT: fx.Tensor,
        OP: fx.Tensor,
        ML: fx.Tensor,
        slot_rows: fx.Int32,
        v_row0: fx.Int32,
        stream: fx.Stream = fx.Stream(None),
    ):
        swa_attention(Q, KV, POS, BT, OP, ML, slot_rows, v_row0).launch(
            grid=(num_reqs, NSPLIT, 1), block=(dev.WAVE * WAVES_PER_WG, 1, 1), stream=stream
        )

    return launch


def build_attention_combine(num_reqs: int):
    """Launcher(OP f32 [num_reqs * NSPLIT * 112, 128], ML f32 [.., 2], Out bf16 [rows, 2048]).

    Merges the splits of each (row, head) in split order: O = sum_s 2^(m_s - m) O_s /
    sum_s 2^(m_s - m) l_s. One wave per (row, head); lane holds dims l and l + 64.
    """
    rows = rows_for(num_reqs)

    @flyc.kernel
    def swa_combine(OP: fx.Tensor, ML: fx.Tensor, Out: fx.Tensor):
        row = fx.block_idx.x
        head = fx.block_idx.y
        lane = fx.thread_idx.x
        req = row // QPR
        t = row % QPR
        a_f32 = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), 32)
        a_bf16 = fx.make_copy_atom(fx.rocdl.BufferCopy16b(), 16)
        opb = fx.rocdl.make_buffer_tensor(OP)
        mlb = fx.rocdl.make_buffer_tensor(ML)
        first = req * NSPLIT * (QPR * Q_HEADS) + t * Q_HEADS + head
        ms = []
        for s in range_constexpr(NSPLIT):
            mlv = fx.logical_divide(fx.slice(mlb, (first + s * (QPR * Q_HEADS), None)), fx.make_layout(1, 1))
            ms.append(dev.load_vec(a_f32, mlv, 0, 1, fx.Float32)[0])
        mx = ms[0]
        for s in range_constexpr(1, NSPLIT):
            mx = fx.max(mx, ms[s])
        den = fx.Float32(0.0)
        lo = fx.Float32(0.0)
        hi = fx.Float32(0.0)
        for s in range_constexpr(NSPLIT):
            orow = first + s * (QPR * Q_HEADS)
            w = fx.math.exp2(ms[s] - mx)
            mlv = fx.logical_divide(fx.slice(mlb, (orow, None)), fx.make_layout(1, 1))
            ov = fx.logical_divide(fx.slice(opb, (orow, None)), fx.make_layout(1, 1))
            den = den + w * dev.load_vec(a_f32, mlv, 1, 1, fx.Float32)[0]
            lo = lo + w * dev.load_vec(a_f32, ov, lane, 1, fx.Float32)[0]
            hi = hi + w * dev.load_vec(a_f32, ov, lane + 64, 1, fx.Float32)[0]
        inv = 1.0 / den
        out = fx.logical_divide(fx.slice(fx.rocdl.make_buffer_tensor(Out), (row, None)), fx.make_layout(1, 1))
        dev.store_vec(a_bf16, out, head * HEAD_DIM + lane, Vector.from_elements([(lo * inv).to(fx.BFloat16)], fx.BFloat16), 1, fx.BFloat16)
        dev.store_vec(a_bf16, out, head * HEAD_DIM + lane + 64, Vector.from_elements([(hi * inv).to(fx.BFloat16)], fx.BFloat16), 1, fx.BFloat16)

    @flyc.jit
    def launch(OP: fx.Tensor, ML: fx.Tensor, Out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        swa_combine(OP, ML, Out).launch(grid=(rows, Q_HEADS, 1), block=(dev.WAVE, 1, 1), stream=stream)

    return launch
