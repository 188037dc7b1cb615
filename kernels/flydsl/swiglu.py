"""SwiGLU-OAI for the rank's 3072 FFN columns: standalone (bf16 gate|up) and fused with the gate_up split-K sum.

out = g * sigmoid(1.702 g) * (u + 1), g = min(gate, 7), u = clamp(up, -7, 7), all in fp32. The
fused form also applies the post-attention Gemma norm's per-row 1/rms that the gate_up linear
left out (linear.py), which must happen before the non-linearity.
"""

from __future__ import annotations

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import math as fmath
from flydsl.expr import range_constexpr

from . import _device as dev
from .shapes import FFN, HIDDEN, RMS_EPS, SCHEDULES, SWIGLU_ALPHA, SWIGLU_LIMIT, rows_for

THREADS = 256
VEC = 4  # columns per thread and piece: one 16-byte fp32 load, one 8-byte bf16 store


def swiglu_oai(g, u):
    """SwiGLU-OAI of fp32 vectors (gate, up) -> fp32."""
    g = fx.min(g, SWIGLU_LIMIT)
    u = fx.max(fx.min(u, SWIGLU_LIMIT), -SWIGLU_LIMIT)
    sig = 1.0 / (1.0 + fmath.exp(g * -SWIGLU_ALPHA))
    return g * sig * (u + 1.0)


def build_swiglu(num_reqs: int):
    """Launcher(GU bf16 [rows, 2*FFN] = gate | up, Out bf16 [rows, FFN]); one workgroup per row."""
    rows = rows_for(num_reqs)
    per_row = FFN // VEC

    @flyc.kernel
    def swiglu_oai_kernel(GU: fx.Tensor, Out: fx.Tensor):
        row = fx.block_idx.x
        tid = fx.thread_idx.x
        gu = dev.rows_view(fx.rocdl.make_buffer_tensor(GU), row, VEC)
        out = dev.rows_view(fx.rocdl.make_buffer_tensor(Out), row, VEC)
        a_in = fx.make_copy_atom(fx.rocdl.BufferCopy64b(), 16)
        for t in range_constexpr(per_row // THREADS):
            idx = tid + t * THREADS
            g = dev.load_vec(a_in, gu, idx, VEC, fx.BFloat16).to(fx.Float32)
            u = dev.load_vec(a_in, gu, idx + per_row, VEC, fx.BFloat16).to(fx.Float32)
            dev.store_vec(a_in, out, idx, swiglu_oai(g, u).to(fx.BFloat16), VEC, fx.BFloat16)

    @flyc.jit
    def launch(GU: fx.Tensor, Out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        swiglu_oai_kernel(GU, Out).launch(grid=(rows, 1, 1), block=(THREADS, 1, 1), stream=stream)

    return launch


def build_swiglu_reduce(num_reqs: int):
    """Launcher(P f32 [split, MP, 2*FFN], SS f32 [split, MP], Out bf16 [rows, FFN]).

    Sums the gate_up linear's split-K partials in split order, scales by the row's
    1/rms = rsqrt(sum(SS)/6144 + eps), then applies SwiGLU-OAI. Grid: rows x (FFN / 1024).
    """
    sched = SCHEDULES["gate_up"]
    rows = rows_for(num_reqs)
    split = sched.split
    per_row = FFN // VEC

    @flyc.kernel
    def swiglu_reduce_kernel(P: fx.Tensor, SS: fx.Tensor, Out: fx.Tensor):
        row = fx.block_idx.x
        tid = fx.thread_idx.x
        idx = fx.block_idx.y * THREADS + tid
        pb = fx.rocdl.make_buffer_tensor(P)
        ssb = fx.rocdl.make_buffer_tensor(SS)
        out = dev.rows_view(fx.rocdl.make_buffer_tensor(Out), row, VEC)
        a_f32x4 = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), 32)
        a_f32 = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), 32)
        a_bf16x4 = fx.make_copy_atom(fx.rocdl.BufferCopy64b(), 16)
        ss = fx.Float32(0.0)
        gs, us = [], []
        for s in range_constexpr(split):
            # SS[s, row] through the split's row view (qkv_rope.py says why not a flat index).
            ssv = fx.logical_divide(fx.slice(ssb, (s, None)), fx.make_layout(1, 1))
            ss = ss + dev.load_vec(a_f32, ssv, row, 1, fx.Float32)[0]
            prow = fx.logical_divide(fx.slice(pb, (s, row, None)), fx.make_layout(VEC, 1))
            gs.append(dev.load_vec(a_f32x4, prow, idx, VEC, fx.Float32))
            us.append(dev.load_vec(a_f32x4, prow, idx + per_row, VEC, fx.Float32))
        g, u = gs[0], us[0]
        for s in range_constexpr(1, split):  # split order, as every consumer of partials
            g = g + gs[s]
            u = u + us[s]
        rrms = fmath.rsqrt(ss * (1.0 / HIDDEN) + RMS_EPS)
        dev.store_vec(a_bf16x4, out, idx, swiglu_oai(g * rrms, u * rrms).to(fx.BFloat16), VEC, fx.BFloat16)

    @flyc.jit
    def launch(P: fx.Tensor, SS: fx.Tensor, Out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        swiglu_reduce_kernel(P, SS, Out).launch(grid=(rows, per_row // THREADS, 1), block=(THREADS, 1, 1), stream=stream)

    return launch
