"""The TP-4 rank shard of the draft step and the per-linear tile schedules the FlyDSL kernels use."""

from __future__ import annotations

from dataclasses import dataclass

from ...drafter.kv_cache import FP8_MAX, KV_LAYOUTS  # noqa: F401  (re-exported: the fp8 bound, the layouts)
from ...layout import LAUNCH_REQS, QPR

TP = 4
HIDDEN = 6144
HEAD_DIM = 128
Q_HEADS = 64 // TP  # 16 query heads per rank
KV_HEADS = 4 // TP  # 1 KV head per rank (GQA 16:1)
FFN = 12288 // TP  # 3072 gate (and up) columns per rank
QKV_N = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM  # 2304: q | k | v columns of the fused projection
O_K = Q_HEADS * HEAD_DIM  # 2048: o_proj input columns per rank
ROTARY_DIM = 64  # partial NeoX RoPE: dims [0, 64) rotate, pairs (i, i + 32)
SLIDING_WINDOW = 4096
RMS_EPS = 1e-6
ROPE_THETA = 5_000_000.0
SWIGLU_LIMIT = 7.0
SWIGLU_ALPHA = 1.702

# MXFP8: one E8M0 scale per 32 consecutive input columns of a weight row.
MX_BLOCK = 32
# The GEMM consumes K in chunks of 128: each of the 4 lane groups of a wave owns one
# 32-column scale block of the chunk (see DESIGN.md).
K_CHUNK = 128
WAVES_PER_WG = 4
MFMA_M = 16  # rows of one MFMA tile (v_mfma_f32_16x16x32_bf16)

# Attention: a request's keys lie in [max(0, P - 4095), P + 7), at most 4102 of them; splits of
# KPS keys go to separate workgroups, which stage KT keys at a time in LDS.
KPS = 256
KT = 32
NSPLIT = -(-(SLIDING_WINDOW + QPR - 1) // KPS)  # 17
NEG = -1.0e30  # finite floor of the running max: exp2(NEG - NEG) is 1, never NaN
SM_SCALE_LOG2 = 1.4426950408889634 / HEAD_DIM**0.5  # softmax scale 1/sqrt(128), in log2 units


# The kernels address a layer's KV cache as rows [2 * num_slots, HEAD_DIM] (one KV head per
# rank): K of slot s is row s * slot_rows, V is row v_row0 + s * slot_rows. Both are runtime int32
# arguments, so one compiled kernel serves either layout of the engine's cache (drafter/kv_cache.py):
# planes hold all K rows, then all V rows; records (vLLM 0.34) hold K | V per slot, one row each.
# (KV_LAYOUTS: drafter/kv_cache.py's, imported above.)


# The K/V element type is a compile-time parameter of the two kernels that touch the cache (KV_KERNELS):
# bf16, or float8 e4m3fn codes (vLLM's kv_cache_dtype "fp8" at scale 1, drafter/kv_cache.py FP8_KV) that
# qkv_rope writes saturated at +-FP8_MAX and rounded to nearest even, and attention widens exactly to bf16
# before its MFMAs. Rows are then 128 one-byte codes, which the kernels take as uint8 (as the MXFP8 weights).
KV_DTYPES = ("bf16", "fp8")
KV_KERNELS = ("qkv_rope", "attention")


def kv_variant(name: str, kv_dtype: str) -> str:
    """The catalog name of kernel `name` built for a `kv_dtype` cache: the bf16 builds keep the plain names."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"KV dtype {kv_dtype!r}: the FlyDSL kernels take {' or '.join(KV_DTYPES)}")
    return f"{name}_{kv_dtype}" if name in KV_KERNELS and kv_dtype != "bf16" else name


def kv_row_map(kv_layout: str, num_slots: int) -> tuple[int, int]:
    """(slot_rows, v_row0) of a `kv_layout` cache of `num_slots` slots, as the kernels take them."""
    if kv_layout == "planes":
        return 1, num_slots
    if kv_layout == "records":
        return 2, 1
    raise ValueError(f"KV layout {kv_layout!r}: the FlyDSL kernels address {' or '.join(KV_LAYOUTS)}")


def rows_for(num_reqs: int) -> int:
    """Query rows of a launch of `num_reqs` requests (7 per request)."""
    if not 1 <= num_reqs <= LAUNCH_REQS:
        raise ValueError(f"a launch holds 1..{LAUNCH_REQS} requests, got {num_reqs}")
    return QPR * num_reqs


def row_tiles(num_reqs: int) -> int:
    """16-row MFMA tiles covering the launch's rows (1 for 1-2 requests ... 4 for 7-8)."""
    return -(-rows_for(num_reqs) // MFMA_M)


@dataclass(frozen=True)
class LinearSchedule:
    """How one MXFP8 linear of the rank shard is split over workgroups.

    A wave owns `nsub` 16-column tiles (all row tiles), a workgroup 4 waves side by side
    (64 * nsub columns), and the grid splits K into `split` contiguous ranges whose fp32
    partials a reduce/exchange kernel sums in a fixed order.
    """

    name: str
    n: int
    k: int
    nsub: int
    split: int
    norm: bool  # the Gemma RMSNorm of the input is folded in (input/post-attention norm)

    @property
    def wg_cols(self) -> int:
        return 16 * self.nsub * WAVES_PER_WG

    @property
    def chunks_per_wg(self) -> int:
        return self.k // K_CHUNK // self.split

    @property
    def grid(self) -> tuple[int, int]:
        return self.n // self.wg_cols, self.split

    def validate(self) -> None:
        if self.k % (K_CHUNK * self.split):
            raise ValueError(f"{self.name}: K {self.k} is not a multiple of {K_CHUNK} x split {self.split}")
        if self.n % self.wg_cols:
            raise ValueError(f"{self.name}: N {self.n} is not a multiple of the workgroup width {self.wg_cols}")


# Splits chosen so each linear launches 192..288 workgroups on the 256 CUs of an MI355X
# while the fp32 partials stay a fraction of the weight bytes (DESIGN.md, "Tiles").
SCHEDULES = {
    "qkv": LinearSchedule("qkv", QKV_N, HIDDEN, nsub=1, split=8, norm=True),
    "o": LinearSchedule("o", HIDDEN, O_K, nsub=2, split=4, norm=False),
    "gate_up": LinearSchedule("gate_up", 2 * FFN, HIDDEN, nsub=2, split=6, norm=True),
    "down": LinearSchedule("down", HIDDEN, FFN, nsub=2, split=4, norm=False),
}
for _s in SCHEDULES.values():
    _s.validate()
