"""Every FlyDSL kernel of the draft step: its builder, CPU placeholder arguments, and the design budget CI checks.

A kernel's budget says what its compiled gfx950 code object must show: the occupancy its
design assumes (waves per SIMD, from VGPRs and LDS), the instructions it is built around, and
for the exchange, system-scope memory operations. tests/kernels/flydsl compiles every entry for
1..8 requests and asserts these from the code object's metadata and ISA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .shapes import (FFN, HEAD_DIM, HIDDEN, NSPLIT, O_K, Q_HEADS, QKV_N, SCHEDULES, kv_row_map, kv_variant, rows_for,
                     row_tiles)

BF16 = torch.bfloat16
# The kernels' view of a cache's rows per K/V dtype (shapes.KV_DTYPES): fp8 e4m3fn codes as bytes.
KV_ROW_DTYPES = {"bf16": BF16, "fp8": torch.uint8}
PAGE_SIZE = 16  # placeholder cache geometry for compiling; the code does not depend on it
# (nor on the KV layout: its row addressing is runtime arguments, shapes.kv_row_map)
PLACEHOLDER_PAGES = 64
PLACEHOLDER_MAX_POS = 8192
LDS_LIMIT = 160 * 1024


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: build(num_reqs) -> @flyc.jit launcher; args(num_reqs) -> CPU placeholders.
    A paged kernel's build takes the cache's page size too: build(num_reqs, page_size)."""

    name: str
    build: Callable[[int], object]
    args: Callable[[int], tuple]
    min_waves_per_simd: int
    # (regex over full ISA lines, minimum count, why the kernel needs it)
    needs: tuple[tuple[str, int, str], ...] = field(default=())
    paged: bool = False


def _linear(name: str) -> KernelSpec:
    sched = SCHEDULES[name]

    def build(num_reqs: int):
        from .linear import build_linear

        return build_linear(sched, num_reqs)

    def args(num_reqs: int):
        rows, mp = rows_for(num_reqs), 16 * row_tiles(num_reqs)
        return (
            torch.zeros(rows, sched.k, dtype=BF16),
            torch.zeros(sched.n, sched.k, dtype=torch.uint8),
            torch.zeros(sched.n, sched.k // 32, dtype=torch.uint8),
            torch.zeros(sched.k if sched.norm else 1, dtype=BF16),
            torch.zeros(sched.split, mp, sched.n),
            torch.zeros(sched.split, mp),
        )

    return KernelSpec(
        f"linear_{name}",
        build,
        args,
        min_waves_per_simd=2,
        needs=(
            (r"v_mfma_f32_16x16x32_bf16\b", 1, "bf16 MFMA on the dequantized weights"),
            (r"v_cvt_scalef32_pk_bf16_fp8\b", 1, "exact E4M3 x E8M0 -> bf16 dequant in one instruction"),
            (r"buffer_load_dwordx4\b", 1, "16-byte weight loads"),
        ),
    )


def _swiglu_reduce() -> KernelSpec:
    sched = SCHEDULES["gate_up"]

    def build(num_reqs: int):
        from .swiglu import build_swiglu_reduce

        return build_swiglu_reduce(num_reqs)

    def args(num_reqs: int):
        rows, mp = rows_for(num_reqs), 16 * row_tiles(num_reqs)
        return (torch.zeros(sched.split, mp, sched.n), torch.zeros(sched.split, mp), torch.zeros(rows, FFN, dtype=BF16))

    return KernelSpec("swiglu_reduce", build, args, 4, ((r"v_exp_f32", 1, "sigmoid"),))


def _swiglu() -> KernelSpec:
    def build(num_reqs: int):
        from .swiglu import build_swiglu

        return build_swiglu(num_reqs)

    def args(num_reqs: int):
        rows = rows_for(num_reqs)
        return (torch.zeros(rows, 2 * FFN, dtype=BF16), torch.zeros(rows, FFN, dtype=BF16))

    return KernelSpec("swiglu", build, args, 4, ((r"v_exp_f32", 1, "sigmoid"),))


def _qkv_rope(kv_dtype: str) -> KernelSpec:
    sched = SCHEDULES["qkv"]

    def build(num_reqs: int):
        from .qkv_rope import build_qkv_rope

        return build_qkv_rope(num_reqs, kv_dtype)

    def args(num_reqs: int):
        rows, mp = rows_for(num_reqs), 16 * row_tiles(num_reqs)
        slots = PLACEHOLDER_PAGES * PAGE_SIZE
        return (
            torch.zeros(sched.split, mp, QKV_N),
            torch.zeros(sched.split, mp),
            torch.zeros(HEAD_DIM, dtype=BF16),
            torch.zeros(HEAD_DIM, dtype=BF16),
            torch.zeros(PLACEHOLDER_MAX_POS, 64),
            torch.zeros(rows, dtype=torch.int64),
            torch.zeros(rows, dtype=torch.int64),
            torch.zeros(rows, O_K, dtype=BF16),
            torch.zeros(2 * slots, HEAD_DIM, dtype=KV_ROW_DTYPES[kv_dtype]),
            *kv_row_map("planes", slots),
        )

    if kv_dtype == "fp8":
        needs = (
            (r"buffer_store_short\b", 1, "bf16 q stores"),
            (r"v_cvt_pk_fp8_f32\b", 1, "K/V -> e4m3fn codes, round to nearest even, two dims per instruction"),
            (r"buffer_store_byte\b", 2, "paged K,V code stores (two dims per lane)"),
        )
    else:
        needs = ((r"buffer_store_short\b", 1, "bf16 q / paged K,V stores"),)
    return KernelSpec(kv_variant("qkv_rope", kv_dtype), build, args, 4, needs)


def _attention(kv_dtype: str) -> KernelSpec:
    def build(num_reqs: int, page_size: int = PAGE_SIZE):
        from .attention import build_attention

        return build_attention(num_reqs, page_size, kv_dtype)

    def args(num_reqs: int):
        rows = rows_for(num_reqs)
        slots = PLACEHOLDER_PAGES * PAGE_SIZE
        parts = num_reqs * NSPLIT * 7 * Q_HEADS
        return (
            torch.zeros(rows, O_K, dtype=BF16),
            torch.zeros(2 * slots, HEAD_DIM, dtype=KV_ROW_DTYPES[kv_dtype]),
            torch.zeros(rows, dtype=torch.int64),
            torch.zeros(num_reqs, PLACEHOLDER_PAGES, dtype=torch.int32),
            torch.zeros(parts, HEAD_DIM),
            torch.zeros(parts, 2),
            *kv_row_map("planes", slots),
        )

    needs = (
        (r"v_mfma_f32_16x16x32_bf16\b", 32, "QK^T and PV on the matrix cores (2 row tiles x 16 per key tile)"),
        (r"ds_read_b128\b", 1, "K, V^T and P operands read from LDS 16 bytes at a time"),
        (r"v_exp_f32", 1, "exp2 of the online softmax"),
        (r"s_barrier\b", 1, "LDS tile hand-off between waves"),
    )
    if kv_dtype == "fp8":
        needs += (
            (r"buffer_load_dwordx2\b", 1, "8 K or V codes (8 bytes) per thread and piece"),
            (r"v_cvt_scalef32_pk_bf16_fp8\b", 16, "exact e4m3fn -> bf16 widening of the staged K/V (2 x 2 x 4 per tile)"),
        )
    return KernelSpec(kv_variant("attention", kv_dtype), build, args, 2, needs, paged=True)


def _combine() -> KernelSpec:
    def build(num_reqs: int):
        from .attention import build_attention_combine

        return build_attention_combine(num_reqs)

    def args(num_reqs: int):
        parts = num_reqs * NSPLIT * 7 * Q_HEADS
        return (torch.zeros(parts, HEAD_DIM), torch.zeros(parts, 2), torch.zeros(rows_for(num_reqs), O_K, dtype=BF16))

    return KernelSpec("attention_combine", build, args, 4, ((r"v_exp_f32", 1, "split weights 2^(m_s - m)"),))


# The first exchange of each kind in a launch (runner.launch_plan: o is 2 * layer, down 2 * layer + 1).
# The index is compiled into the tag, and with it the RX/flag half (parity) the kernel addresses:
# o and down compile different code, and each entry must be one the runner launches.
_FIRST_EXCHANGE = {"o": 0, "down": 1}


def _exchange(which: str) -> KernelSpec:
    sched = SCHEDULES[which]

    def build(num_reqs: int):
        from .exchange import build_reduce_exchange

        return build_reduce_exchange(num_reqs, which, _FIRST_EXCHANGE[which])

    def args(num_reqs: int):
        from .exchange import MP_MAX, NBLK

        rows, mp = rows_for(num_reqs), 16 * row_tiles(num_reqs)
        rx = [torch.zeros(2 * 4 * MP_MAX, HIDDEN) for _ in range(5)]
        fl = [torch.zeros(2 * 4 * NBLK, dtype=torch.int32) for _ in range(5)]
        return (
            torch.zeros(sched.split, mp, HIDDEN),
            torch.zeros(rows, HIDDEN, dtype=BF16),
            torch.zeros(rows, HIDDEN, dtype=BF16),
            *rx[:4],
            *fl[:4],
            rx[4],
            fl[4],
            torch.zeros(1, dtype=torch.int32),
            0,
        )

    return KernelSpec(
        f"exchange_{which}",
        build,
        args,
        4,
        (
            (r"buffer_store_dwordx4\s.*\bsc0 sc1\b", 4, "rank partials pushed to the 4 ranks' RX, system-coherent"),
            (r"buffer_wbl2 sc0 sc1", 1, "system-scope release before the flags"),
            (r"global_store_dword\s.*\bsc0 sc1\b", 4, "the 4 flag stores at system scope"),
            (r"global_load_dword\s.*\bsc0 sc1\b", 1, "system-scope acquire polling of the flags"),
            (r"buffer_inv sc0 sc1", 1, "acquire invalidation before reading RX"),
        ),
    )


def _final_norm() -> KernelSpec:
    def build(num_reqs: int):
        from .rmsnorm import build_rmsnorm

        return build_rmsnorm(num_reqs)

    def args(num_reqs: int):
        rows = rows_for(num_reqs)
        return (torch.zeros(rows, HIDDEN, dtype=BF16), torch.zeros(HIDDEN, dtype=BF16), torch.zeros(rows, HIDDEN, dtype=BF16))

    return KernelSpec("final_norm", build, args, 4, ((r"s_barrier\b", 1, "cross-wave sum of squares through LDS"),))


KERNELS: dict[str, KernelSpec] = {
    k.name: k
    for k in (
        _linear("qkv"),
        _qkv_rope("bf16"),
        _attention("bf16"),
        _combine(),
        _linear("o"),
        _exchange("o"),
        _linear("gate_up"),
        _swiglu_reduce(),
        _linear("down"),
        _exchange("down"),
        _final_norm(),
        _swiglu(),
        _qkv_rope("fp8"),
        _attention("fp8"),
    )
}
