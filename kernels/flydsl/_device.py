"""Device-side helpers shared by the FlyDSL kernels: vector loads/stores, E8M0 scales, FP8 dequant and quant."""

from __future__ import annotations

import flydsl.expr as fx
from flydsl._mlir import ir
from flydsl._mlir.dialects import rocdl as rocdl_ods
from flydsl.expr import range_constexpr
from flydsl.expr.typing import Vector

from .shapes import FP8_MAX

WAVE = 64


def rows_view(buf, row, vec: int):
    """Row `row` of a 2-D buffer tensor, divided into `vec`-element pieces."""
    return fx.logical_divide(fx.slice(buf, (row, None)), fx.make_layout(vec, 1))


def load_vec(atom, view, idx, vec: int, dtype):
    """Load piece `idx` (vec elements of dtype) of a divided view into registers."""
    r = fx.make_rmem_tensor(vec, dtype)
    fx.copy(atom, fx.slice(view, (None, idx)), r)
    return fx.memref_load_vec(r)


def store_vec(atom, view, idx, value, vec: int, dtype):
    """Store a register vector into piece `idx` of a divided view."""
    r = fx.make_rmem_tensor(vec, dtype)
    fx.memref_store_vec(value, r)
    fx.copy(atom, r, fx.slice(view, (None, idx)))


def e8m0_to_f32(byte):
    """E8M0 scale byte v -> 2^(v-127) as f32: v is exactly the f32 exponent field.

    The byte is masked because the buffer load of an 8-bit element sign-extends; without
    the mask a scale >= 128 would set the f32 sign bit.
    """
    bits = (byte.to(fx.Uint32) & 0xFF) << 23
    return Vector.from_elements([bits], fx.Uint32).bitcast(fx.Float32)[0]


def fp8x8_to_bf16(word_lo, word_hi, scale):
    """Eight E4M3 bytes (two u32 words) times an f32 power-of-two scale -> 8 bf16.

    v_cvt_scalef32_pk_bf16_fp8 converts two FP8 values of a word half and applies the scale
    in one instruction; an E4M3 value times 2^k is exact in bf16, so this dequant is
    lossless and the GEMM sees exactly the dequantized weight.
    """
    v2bf = ir.VectorType.get([2], ir.BF16Type.get())
    pieces = []
    for w in (word_lo, word_hi):
        for hi in range_constexpr(2):
            pieces.append(
                Vector(
                    rocdl_ods.cvt_scalef32_pk_bf16_fp8(v2bf, w.ir_value(), scale.ir_value(), bool(hi)),
                    dtype=fx.BFloat16,
                )
            )
    lo4 = pieces[0].shuffle(pieces[1], [0, 1, 2, 3])
    hi4 = pieces[2].shuffle(pieces[3], [0, 1, 2, 3])
    return lo4.shuffle(hi4, [0, 1, 2, 3, 4, 5, 6, 7])


def fp8_saturate(x):
    """x (f32) clamped to [-FP8_MAX, FP8_MAX] by compare-select, as kv_cache.to_cache clamps: +-inf
    saturate and NaN passes through (a min/max instruction would turn NaN into the bound)."""
    x = (x > FP8_MAX).select(fx.Float32(FP8_MAX), x)
    return (x < -FP8_MAX).select(fx.Float32(-FP8_MAX), x)


def e4m3_codes(a, b):
    """Two f32 values -> their float8 e4m3fn codes in bits [0, 8) and [8, 16) of an i32 word.

    Saturated at +-FP8_MAX first (fp8_saturate), then v_cvt_pk_fp8_f32 rounds to nearest even (the
    default MODE rounding): the codes vLLM's fp8 cache writes hold at scale 1 (kv_cache.to_cache). On
    gfx950 its fp8 is the OCP e4m3fn format (bias 7, max 448), as the MXFP8 weights' dequant reads.
    """
    i32 = ir.IntegerType.get_signless(32)
    word = rocdl_ods.cvt_pk_fp8_f32(i32, fp8_saturate(a).ir_value(), fp8_saturate(b).ir_value(),
                                    fx.Int32(0).ir_value(), False)
    return fx.Int32(word)


def mfma_16x16x32_bf16(a, b, acc):
    """acc[4] += A(16x32, this lane's 8 k of row lane%16) x B(32x16, 8 k of column lane%16)."""
    v4f = ir.VectorType.get([4], ir.F32Type.get())
    return Vector(fx.rocdl.mfma_f32_16x16x32_bf16(v4f, [a, b, acc]), dtype=fx.Float32)


def xor_sum(x, offsets):
    """Sum of x over the lanes reached by xor-ing the lane id with each offset (butterfly)."""
    for off in offsets:
        x = x + x.shuffle_xor(off, WAVE)
    return x


def wave_sum(x):
    """Sum of an f32 scalar over the 64 lanes of a wave; every lane gets the result."""
    return xor_sum(x, (32, 16, 8, 4, 2, 1))


def wave_max(x):
    """Max of an f32 scalar over the 64 lanes of a wave; every lane gets the result."""
    for off in (32, 16, 8, 4, 2, 1):
        x = fx.max(x, x.shuffle_xor(off, WAVE))
    return x


def xor_max(x, offsets):
    """Max of x over the lanes reached by xor-ing the lane id with each offset."""
    for off in offsets:
        x = fx.max(x, x.shuffle_xor(off, WAVE))
    return x
