"""The step's GEMMs handed to the vendor BLAS (cuBLAS, or hipBLASLt on ROCm, through torch) where it streams faster.

A Triton GEMM launch costs 5-7 us on top of its bytes at a shard's shapes, and cuBLAS 4-6 us
(BENCHMARKS.md run 38). So the plain linears (o_proj, down_proj) run as one cuBLAS addmm,
the residual added in its epilogue (in place where the caller's residual is dead), instead of the
split-K GEMM plus its finalize. The folded-norm GEMMs (gate|up with SwiGLU, norm_linear) go the same way: the
vendor's product in fp32, then gemm's finalize kernel, which sums each row's squares from x
itself, scales, applies SwiGLU and rounds once, as the Triton path does (runs 80-86). Dense
bf16/fp16 weights on an NVIDIA GPU only; MXFP8 weights and unfolded norms stay on the Triton
GEMM (ops.py decides on every call, from the row count and the tunables below).
"""

from __future__ import annotations

import torch

from dspark_sidecar.kernels import reference
from dspark_sidecar.kernels.triton import gemm
from dspark_sidecar.kernels.triton.runtime import nvidia_of
from dspark_sidecar.kernels.weights import MxFp8Weight, NormFolded

# Tunables, read by the *_applies checks: the vendor GEMM from this many rows (0: never).
# PLAIN_MIN_ROWS: plain linears. NORM_MIN_ROWS: folded-norm GEMMs. Session 11 kept both at 17: at 7
# rows the plain linears on cuBLAS were 4-10 us slower, because addmm into a new tensor first
# copies the residual there. With the residual written in place (Ops.linear's accumulate) the
# step on an H200 (BENCHMARKS.md runs 102-103, GPU time) was 15 us faster at 7 rows and 13 us at
# 14 with the plain linears on cuBLAS, and 3-4 us more with the folded-norm GEMMs there too; at
# 56 rows they were already on it (9 us faster than Triton, gate|up 7 us).
# ADDMM: a plain linear's residual added in the vendor GEMM's epilogue (one launch, the sum rounded
# once) instead of by a second launch after the product is rounded (the reference's two
# roundings): 4.6 us faster at 56 rows.
PLAIN_MIN_ROWS = 1
NORM_MIN_ROWS = 1
ADDMM = True


def _mm_has_out_dtype() -> bool:
    """torch.mm's out_dtype (bf16 x bf16 -> fp32; newer torch than the project's lower bound),
    probed once on meta tensors: without it the folded-norm GEMMs stay on Triton."""
    a = torch.empty(1, 1, dtype=torch.bfloat16, device="meta")
    try:
        torch.mm(a, a, out_dtype=torch.float32)
    except TypeError:  # this torch's mm has no out_dtype argument
        return False
    return True


MM_OUT_DTYPE = _mm_has_out_dtype()


def _dense(x: torch.Tensor, w) -> bool:
    # NVIDIA, compiled (runtime.nvidia_of: not ROCm, not the interpreter). hipBLASLt on gfx950 has
    # not been measured against the Triton GEMM (nor torch.mm's fp32 output checked there), so ROCm
    # keeps the Triton GEMMs.
    return (isinstance(w, torch.Tensor) and not isinstance(w, MxFp8Weight) and nvidia_of(x)
            and w.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16))


def plain_applies(x: torch.Tensor, weight) -> bool:
    return 0 < PLAIN_MIN_ROWS <= x.shape[0] and _dense(x, weight)


def norm_applies(x: torch.Tensor, weight) -> bool:
    return (MM_OUT_DTYPE and 0 < NORM_MIN_ROWS <= x.shape[0] and isinstance(weight, NormFolded)
            and _dense(x, weight.weight))


def linear(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
           accumulate: bool = False) -> torch.Tensor:
    """x [n, in] @ weight^T [+ residual [n, out]] -> [n, out]. Without ADDMM the reference's own maths
    (the product rounded before the add), so the reference layers' bits on the same GPU; with it,
    residual + the fp32 product rounded once: apart from the reference's sum by at most the
    product's own rounding and one output ulp (tests/kernels/triton/test_blas.py).

    accumulate: the sum written over the residual. addmm into a new tensor first copies the
    residual there (a device-to-device copy of 1.4 us at 56 rows, run 99); in place, cuBLAS reads
    and writes the same C."""
    if residual is not None and ADDMM:
        return torch.addmm(residual, x, weight.t(), out=residual if accumulate else None)
    return reference.linear(x, weight, residual, accumulate)


def product_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T with fp32 output, unrounded: the vendor's mixed-precision GEMM on a GPU
    (bf16 products are exact in fp32); on the CPU, the same maths in fp32 (for the interpreter tests)."""
    if x.is_cuda:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return x.float() @ w.float().t()


def norm_linear(x: torch.Tensor, weight: NormFolded, norm_weight: torch.Tensor, eps: float,
                swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """rms_norm(x) then the linear [then SwiGLU-OAI] with a folded weight: x [M, K] -> [M, N or f]."""
    weight.check(norm_weight)
    # An odd gate|up weight has no halves: the floored f paired gate j with column f + j and dropped
    # the last row unseen, where the Triton GEMM (gemm._check) and the reference refuse it.
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"norm_linear: gate|up weight {list(weight.shape)} has an odd number of rows")
    x = x.contiguous()
    m, k = x.shape
    ws = product_fp32(x, weight.weight)  # [M, N or 2f], fp32
    n = ws.shape[1] // 2 if swiglu else ws.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        gemm._finalize(ws.unsqueeze(0), x, out, n, k, 1, eps, *(swiglu or (0.0, 0.0)), True, swiglu is not None,
                       sq_from_x=True)
    return out
