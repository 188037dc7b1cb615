"""Gemma RMSNorm of whole hidden rows (the drafter's final_norm): y = x * rsqrt(mean(x^2) + eps) * (1 + w).

One workgroup per row: each of 256 threads holds 24 of the 6144 values (three 16-byte loads),
the sum of squares is reduced across the wave with butterflies and across the 4 waves through
LDS, and everything is fp32 with one bf16 rounding of the output. (The layers' input and
post-attention norms are folded into the linears instead: linear.py.)
"""

# No `from __future__ import annotations`: fx.struct reads its field annotations as types.
import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import math as fmath
from flydsl.expr import range_constexpr

from . import _device as dev
from .shapes import HIDDEN, RMS_EPS, WAVES_PER_WG, rows_for

THREADS = dev.WAVE * WAVES_PER_WG
VEC = 8
PER_THREAD = HIDDEN // (THREADS * VEC)  # 3


@fx.struct
class NormSmem:
    partial: fx.Array[fx.Float32, WAVES_PER_WG, 16]


def build_rmsnorm(num_reqs: int):
    """Launcher(X bf16 [rows, 6144], Wt bf16 [6144], Out bf16 [rows, 6144])."""
    rows = rows_for(num_reqs)

    @flyc.kernel
    def gemma_rmsnorm(X: fx.Tensor, Wt: fx.Tensor, Out: fx.Tensor):
        row = fx.block_idx.x
        tid = fx.thread_idx.x
        lane = tid % dev.WAVE
        wave = tid // dev.WAVE
        atom = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), 16)
        xv = dev.rows_view(fx.rocdl.make_buffer_tensor(X), row, VEC)
        ov = dev.rows_view(fx.rocdl.make_buffer_tensor(Out), row, VEC)
        wv = fx.logical_divide(fx.rocdl.make_buffer_tensor(Wt), fx.make_layout(VEC, 1))
        xs = [dev.load_vec(atom, xv, tid + i * THREADS, VEC, fx.BFloat16).to(fx.Float32) for i in range_constexpr(PER_THREAD)]
        ss = fx.Float32(0.0)
        for i in range_constexpr(PER_THREAD):
            ss = ss + (xs[i] * xs[i]).reduce(fx.ReductionOp.ADD)
        ss = dev.wave_sum(ss)
        lds = fx.SharedAllocator().allocate(NormSmem).peek()
        part = lds.partial.ptr
        if lane == 0:
            fx.generic_store(part + wave, ss)
        fx.gpu.barrier()
        tot = fx.generic_load(part, dtype=fx.Float32)
        for w in range_constexpr(1, WAVES_PER_WG):
            tot = tot + fx.generic_load(part + w, dtype=fx.Float32)
        rrms = fmath.rsqrt(tot * (1.0 / HIDDEN) + RMS_EPS)
        for i in range_constexpr(PER_THREAD):
            g = dev.load_vec(atom, wv, tid + i * THREADS, VEC, fx.BFloat16).to(fx.Float32) + 1.0
            dev.store_vec(atom, ov, tid + i * THREADS, (xs[i] * rrms * g).to(fx.BFloat16), VEC, fx.BFloat16)

    @flyc.jit
    def launch(X: fx.Tensor, Wt: fx.Tensor, Out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        gemma_rmsnorm(X, Wt, Out).launch(grid=(rows, 1, 1), block=(THREADS, 1, 1), stream=stream)

    return launch
