"""What the Triton kernels need to know about where they run: interpreter or GPU, SM count, dot helper."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: launches without PDL (pdl_of)
    gdc_launch_dependents = gdc_wait = None

# TRITON_INTERPRET=1 (read by triton when a kernel is decorated) runs every kernel in numpy on
# the CPU: that is how CI, which has no GPU, checks the kernels' indexing and maths. Triton's own
# reading of it (its knobs), not a second parse: one that took fewer spellings (triton's y/Y) said
# "compiled" while every kernel was interpreted (a CPU tensor refused, mma and cast unfixed).
INTERPRET: bool = bool(triton.knobs.runtime.interpret)


# Programmatic dependent launch (sm_90), a tunable: the step's Triton kernels are launched so that each
# may start while its predecessor in the stream drains. Each waits (griddepcontrol.wait) before it
# touches anything its predecessor may write, and lets its own successor launch once its main loop
# is done, so the successor's launch and prologue overlap this kernel's tail. What may come before
# the wait: reads of what the kernel before the predecessor wrote (by then it has finished: the
# predecessor released its successor only after its own wait). On an H200 the step's GPU time went
# from 357 to 348 us at 7 rows and 415.6 to 413.5 us at 56, the same bits (BENCHMARKS.md run 159).
# A kernel launched before its first release (run 22 released at once) only competed with it.
PDL = True
# Kernels launched without PDL where it is on, by the name their launch passes to pdl_kwargs ("gemm",
# "finalize", "prelude", "attention", "merge", "norm", "rope"), a tunable: microbench --tune times
# each boundary's share. Such a kernel starts only when its predecessor has finished, and its
# successor only when it has, so every kernel's reads before its wait stay ordered.
PDL_EXCEPT: frozenset[str] = frozenset()


def pdl_of(t: torch.Tensor) -> bool:
    """Whether launches on t's device use programmatic dependent launch (PDL, on sm_90)."""
    return PDL and gdc_wait is not None and sm90_of(t)


def pdl_kwargs(t: torch.Tensor, kernel: str) -> dict:
    """The PDL keywords of a launch of `kernel` on t's device: the kernel's PDL constexpr, and with it
    on, the launch_pdl launch option (only then: the interpreter takes no such keyword)."""
    return {"PDL": True, "launch_pdl": True} if pdl_of(t) and kernel not in PDL_EXCEPT else {"PDL": False}


@triton.jit
def dep_wait(PDL: tl.constexpr):
    """With PDL: wait until the predecessor kernel has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def dep_release(PDL: tl.constexpr):
    """With PDL: the successor kernel may launch (its programs then wait in dep_wait)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def mma(a, b, acc, INTERPRET: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b with fp32 accumulation; a [M, K], b [K, N] in the same dtype.

    Under the interpreter (triton 3.9) a bf16 dot multiplies the raw uint16 storage, so the
    operands are widened to fp32 there first: products of bf16 values are exact in fp32, so
    this is the same maths as the tensor-core dot. IEEE keeps fp32 operands out of tf32.
    """
    if INTERPRET:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def rms_inv(sum_sq, k, eps):
    """The Gemma RMSNorm's row scale rsqrt(mean(x^2) + eps) from a row's fp32 sum of squares over k
    elements: the one formula the norm, the folded GEMMs' epilogues, the finalize and the prelude use."""
    return tl.rsqrt(sum_sq / k + eps)


@triton.jit
def cast(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """x -> DTYPE rounding to nearest even, as the GPU does.

    The interpreter (triton 3.9) truncates fp32 -> bf16, a bias of half an ulp that the GPU does
    not have; there the bits are rounded here first (a bf16 value truncates exactly).
    """
    if DTYPE == tl.float8e4nv:
        # An fp8 KV cache (vLLM's kv_cache_dtype fp8, scale 1): saturated to the largest finite
        # e4m3 value, as the engine's own cache writes are, then rounded to nearest even. A NaN stays
        # NaN, as torch.clamp keeps it (tl.clamp's default leaves NaN to the hardware's min/max).
        x = tl.clamp(x.to(tl.float32), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        if INTERPRET:
            # The interpreter rounds ties away from zero and loses subnormals: round here to an
            # e4m3 value first (then its conversion is exact). Normals keep 3 of fp32's 23 mantissa
            # bits (ties to even on the bits); below 2^-6 the grid is 2^-9, rounded by adding and
            # subtracting 1.5 * 2^14 in fp32 (its own round-to-nearest-even does the work).
            b = x.to(tl.uint32, bitcast=True)
            b = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20) << 20
            normal = b.to(tl.float32, bitcast=True)
            tiny = (x + 24576.0) - 24576.0
            # That sum loses the sign of a value rounding to zero (+0, not -0 as the GPU's
            # conversion and torch give it): the sign bit is x's.
            sign = x.to(tl.uint32, bitcast=True) & 0x80000000
            tiny = (tiny.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
            x = tl.where(tl.abs(x) < 0.015625, tiny, normal)
            # Its conversion also turns NaN into a finite code: e4m3fn's NaN (0x7F) set by its bits.
            nan = tl.full(x.shape, 0x7F, tl.uint8).to(DTYPE, bitcast=True)
            return tl.where(x != x, nan, x.to(DTYPE, fp_downcast_rounding="rtne"))
        return x.to(DTYPE, fp_downcast_rounding="rtne")
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            if x.dtype == tl.float32:
                b = x.to(tl.uint32, bitcast=True)
                r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
                # A NaN is not rounded: the carry took one whose payload lies in the low 16 bits to
                # +-inf, and one with every mantissa bit set past the sign bit to +-0 (the GPU keeps
                # it NaN). With its quiet bit set, its truncation is a NaN too.
                r = tl.where(x != x, b | 0x400000, r)
                x = r.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


FP8_MAX = tl.constexpr(448.0)  # the largest finite float8 e4m3fn value


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton type of an activation dtype (kernels round their fp32 results to it once)."""
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def cache_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton type of a KV cache dtype: an activation dtype, or fp8 e4m3 (kv_cache.FP8_KV)."""
    return tl.float8e4nv if dtype == torch.float8_e4m3fn else tl_dtype(dtype)


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The tensor-core operand type for weights stored as `dtype` (fp8 is dequantized to bf16)."""
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
            torch.float8_e4m3fn: tl.bfloat16}[dtype]


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200); 4 stands in under the interpreter."""
    if device_index is None or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def max_shared_memory(device_index: int | None) -> int | None:
    """Shared memory one program may use on a device (227 KB on an H200, from Triton's driver);
    None under the interpreter or without a GPU (the planners' defaults apply)."""
    if device_index is None or INTERPRET or not torch.cuda.is_available():
        return None
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


@functools.lru_cache(maxsize=None)
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def nvidia_of(t: torch.Tensor) -> bool:
    """Whether t lives on an NVIDIA GPU and the kernels are compiled for it, not interpreted or built for AMD."""
    return t.device.type == "cuda" and not INTERPRET and not torch.version.hip


def sm90_of(t: torch.Tensor) -> bool:
    """nvidia_of, at compute capability 9.0 or later (Hopper: the Tensor Memory Accelerator)."""
    return nvidia_of(t) and _sm90(t.device.index or 0)


def smem_of(t: torch.Tensor) -> int | None:
    return max_shared_memory(t.device.index if t.device.type == "cuda" else None)


def sms_of(t: torch.Tensor) -> int:
    return num_sms(t.device.index if t.device.type == "cuda" else None)


def check_norm_weight(op: str, w: torch.Tensor, k: int, of: str) -> None:
    """ValueError unless the norm weight `w` is [k] (`of`: what k is, for the message). Every norm kernel
    loads (1 + w) at offsets masked by k alone, at unit stride: a shorter weight was read past its end, a
    longer one cut short (the reference raises on both); its callers pass it dense, as a strided view read
    its neighbours' elements."""
    if tuple(w.shape) != (k,):
        raise ValueError(f"{op}: norm weight {list(w.shape)} does not match {of}")


def check_device(*tensors: torch.Tensor) -> None:
    """The kernels run on CUDA tensors, or on CPU tensors only under the interpreter."""
    for t in tensors:
        if t.device.type == "cpu" and not INTERPRET:
            raise RuntimeError("Triton ops got a CPU tensor; run on a GPU, or set TRITON_INTERPRET=1 before "
                               "triton is imported to run the kernels in the interpreter")


def same_device(op: str, **operands: torch.Tensor) -> None:
    """ValueError naming the first operand not on the first one's device. The kernels take raw pointers
    and launch on the first operand's device: an operand elsewhere (another rank's GPU, through peer
    access or UVA) was read or written as if it were local, a fault that poisons the CUDA context or a
    silent read of another GPU's memory, where the reference's torch ops raise."""
    (first, x), *rest = operands.items()
    for name, t in rest:
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, {first} on {x.device}")
