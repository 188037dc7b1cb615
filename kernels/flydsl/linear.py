"""Split-K MXFP8 linear for the draft step's skinny GEMMs (7..56 rows), optionally Gemma-norm folded.

Y[m, n] = sum_k A[m, k] * dequant(W)[n, k], with W F8_E4M3 [N, K] and an E8M0 scale per 1x32
block of K. Weights are dequantized in registers by v_cvt_scalef32_pk_bf16_fp8 (exact) and
multiplied by v_mfma_f32_16x16x32_bf16 against the bf16 activations, so the activations are
never quantized. With `norm`, the Gemma RMSNorm of A is folded in: the MFMA operand is
bf16(x * (1 + w)) and the per-row 1/rms, a scalar per row, is applied by the consumer of the
partials from the per-split sums of squares this kernel also writes.

Outputs (fp32): P [split, MP, N] partial products, SS [split, MP] partial sums of x^2, where
MP = 16 * row_tiles. A consumer sums the `split` partials in index order.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, range_constexpr
from flydsl.expr.typing import Vector

from . import _device as dev
from .shapes import K_CHUNK, MFMA_M, MX_BLOCK, WAVES_PER_WG, LinearSchedule, row_tiles

# An element offset past every weight (<= 37.7 M bytes) and scale tensor: with a bounded
# descriptor the load returns 0 without touching memory.
OOB = 1 << 26


def build_linear(sched: LinearSchedule, num_reqs: int):
    """The @flyc.jit launcher of one linear for a launch of `num_reqs` requests.

    Launcher args: X bf16 [rows, K], W uint8 (E4M3 bits) [N, K], S uint8 (E8M0) [N, K/32],
    NW bf16 [K] (norm weight; any 1-element tensor when not sched.norm), P f32 [split, MP, N],
    SS f32 [split, MP].
    """
    sched.validate()
    MT = row_tiles(num_reqs)
    NSUB = sched.nsub
    CPW = sched.chunks_per_wg
    NW = MFMA_M * NSUB
    NWG = NW * WAVES_PER_WG
    NORM = sched.norm

    @flyc.kernel
    def mxfp8_linear(X: fx.Tensor, W: fx.Tensor, S: fx.Tensor, NWt: fx.Tensor, P: fx.Tensor, SS: fx.Tensor):
        tid = fx.thread_idx.x
        lane = tid % dev.WAVE
        wave = tid // dev.WAVE
        ntile = fx.block_idx.x
        ks = fx.block_idx.y
        g = lane // 16  # lane group: owns one 32-column scale block of each 128-column chunk
        r16 = lane % 16
        # Bounded descriptors (max_size=False): loads past the tensor return 0 instead of
        # reading whatever memory follows (the padding rows of the last row tile, and the
        # dropped prefetch after the last chunk).
        xb = fx.rocdl.make_buffer_tensor(X, max_size=False)
        wb = fx.rocdl.make_buffer_tensor(W, max_size=False)
        sb = fx.rocdl.make_buffer_tensor(S, max_size=False)
        pb = fx.rocdl.make_buffer_tensor(P)
        a_bf16 = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), 16)
        a_u8x16 = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), 8)
        a_u8 = fx.make_copy_atom(fx.rocdl.BufferCopy8b(), 8)
        a_f32x4 = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), 32)
        a_f32 = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), 32)
        n_base = ntile * NWG + wave * NW
        # Rows past the launch's rows read as zero (bounded descriptor).
        x_rows = [dev.rows_view(xb, mt * MFMA_M + r16, 8) for mt in range_constexpr(MT)]
        w_rows = [dev.rows_view(wb, n_base + s * MFMA_M + r16, 16) for s in range_constexpr(NSUB)]
        s_rows = [dev.rows_view(sb, n_base + s * MFMA_M + r16, 1) for s in range_constexpr(NSUB)]
        if const_expr(NORM):
            nwb = fx.logical_divide(fx.rocdl.make_buffer_tensor(NWt), fx.make_layout(8, 1))
        sumsq = [fx.Float32(0.0) for _ in range_constexpr(MT)]  # carried; used only with NORM
        acc = [[Vector.filled(4, 0.0, fx.Float32) for _ in range_constexpr(NSUB)] for _ in range_constexpr(MT)]

        def load_w(kl, ok):
            """Issue the loads of one chunk's weights: NSUB x 8 words of E4M3 and NSUB scales.
            ok False: an offset past the bounded tensor, so the load returns 0 and reads nothing."""
            words, scales = [], []
            for s in range_constexpr(NSUB):
                for h in range_constexpr(2):
                    idx = kl // 16 + h if ok is None else ok.select(kl // 16 + h, OOB // 16)
                    wv = dev.load_vec(a_u8x16, w_rows[s], idx, 16, fx.Uint8).bitcast(fx.Uint32)
                    words += [wv[q] for q in range_constexpr(4)]
                idx = kl // MX_BLOCK if ok is None else ok.select(kl // MX_BLOCK, OOB)
                scales.append(dev.e8m0_to_f32(dev.load_vec(a_u8, s_rows[s], idx, 1, fx.Uint8)[0]))
            return [words, scales]

        # Lane group g covers columns [kl, kl + 32) of a chunk: MFMA step j takes the 8 columns
        # kl + 8j .. kl + 8j + 7, the same mapping for both operands.
        k_first = ks * (CPW * K_CHUNK) + g * MX_BLOCK
        w_cur = load_w(k_first, None)
        # A runtime loop over the chunks with the next chunk's weights in flight while this one
        # is multiplied (a fully unrolled loop let the scheduler hoist every load and spilled).
        for c in range(CPW):
            kl = k_first + c * K_CHUNK
            w_next = load_w(kl + K_CHUNK, c + 1 < CPW)
            new_sumsq = []
            if const_expr(NORM):
                gam = [dev.load_vec(a_bf16, nwb, kl // 8 + j, 8, fx.BFloat16).to(fx.Float32) + 1.0 for j in range_constexpr(4)]
            xs = []
            for mt in range_constexpr(MT):
                parts = []
                part_ss = fx.Float32(0.0)
                for j in range_constexpr(4):
                    v = dev.load_vec(a_bf16, x_rows[mt], kl // 8 + j, 8, fx.BFloat16)
                    if const_expr(NORM):
                        xf = v.to(fx.Float32)
                        part_ss = part_ss + (xf * xf).reduce(fx.ReductionOp.ADD)
                        v = (xf * gam[j]).to(fx.BFloat16)
                    parts.append(v)
                new_sumsq.append(sumsq[mt] + part_ss)
                xs.append(parts)
            sumsq = new_sumsq
            new_acc = [list(row) for row in acc]
            words, scales = w_cur
            for s in range_constexpr(NSUB):
                for j in range_constexpr(4):
                    wj = dev.fp8x8_to_bf16(words[8 * s + 2 * j], words[8 * s + 2 * j + 1], scales[s])
                    for mt in range_constexpr(MT):
                        new_acc[mt][s] = dev.mfma_16x16x32_bf16(wj, xs[mt][j], new_acc[mt][s])
            acc = new_acc
            w_cur = w_next

        # W is the MFMA A operand (rows = n) and X the B operand (columns = m), so lane l
        # holds Y[m = mt*16 + l%16, n = n_base + 16s + 4(l//16) + i], i = 0..3: one 16-byte
        # store of four consecutive columns.
        for mt in range_constexpr(MT):
            prow = fx.logical_divide(fx.slice(pb, (ks, mt * MFMA_M + r16, None)), fx.make_layout(4, 1))
            for s in range_constexpr(NSUB):
                dev.store_vec(a_f32x4, prow, (n_base + s * MFMA_M) // 4 + g, acc[mt][s], 4, fx.Float32)

        if const_expr(NORM):
            # Every workgroup of the split sees the same rows and columns of X; the first
            # column tile's first wave publishes the sums of squares.
            if ntile == 0:
                if wave == 0:
                    ssb = fx.logical_divide(fx.slice(fx.rocdl.make_buffer_tensor(SS), (ks, None)), fx.make_layout(1, 1))
                    for mt in range_constexpr(MT):
                        tot = dev.xor_sum(sumsq[mt], (16, 32))
                        if g == 0:
                            dev.store_vec(a_f32, ssb, mt * MFMA_M + r16, Vector.from_elements([tot], fx.Float32), 1, fx.Float32)

    @flyc.jit
    def launch(
        X: fx.Tensor,
        W: fx.Tensor,
        S: fx.Tensor,
        NWt: fx.Tensor,
        P: fx.Tensor,
        SS: fx.Tensor,
        stream: fx.Stream = fx.Stream(None),
    ):
        gx, gy = sched.grid
        mxfp8_linear(X, W, S, NWt, P, SS).launch(grid=(gx, gy, 1), block=(64 * WAVES_PER_WG, 1, 1), stream=stream)

    return launch
