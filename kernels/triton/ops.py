"""TRITON_OPS: the draft step's Ops bundle backed by the Triton kernels (NVIDIA and AMD GPUs, or the interpreter).

Signatures and output dtypes are the reference's. Every `weight` argument of the linear ops may
also be an `MxFp8Weight` (FP8 E4M3 + 1x32 E8M0 scales, dequantized inside the kernel). The linear
ops go to the vendor BLAS where blas.py's tunables say it is faster (dense weights on a GPU).
rope_cos_sin is rope.py's one launch where the reference takes about ten small torch kernels.
"""

from __future__ import annotations

import torch

from dspark_sidecar.kernels.ops import Ops
from dspark_sidecar.kernels.triton import attention, blas, gemm, norm, prelude, rope
from dspark_sidecar.kernels.weights import MxFp8Weight


def linear(x: torch.Tensor, weight: torch.Tensor | MxFp8Weight, residual: torch.Tensor | None = None,
           accumulate: bool = False) -> torch.Tensor:
    """x [n, in] @ weight^T [+ residual [n, out], added in the GEMM's epilogue] -> [n, out] in x.dtype;
    accumulate: written over the residual (reference.linear)."""
    if blas.plain_applies(x, weight):
        return blas.linear(x, weight, residual, accumulate)
    return gemm.gemm(x, weight, residual=residual, out=residual if accumulate else None)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                weight: torch.Tensor | MxFp8Weight) -> torch.Tensor:
    """linear(rms_norm(x)) in one GEMM (the norm's row scale applied in the epilogue): [n, in] -> [n, out]."""
    if blas.norm_applies(x, weight):
        return blas.norm_linear(x, weight, norm_weight, eps)
    return gemm.gemm(x, weight, norm_weight, eps)


def norm_linear_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor | MxFp8Weight, alpha: float, limit: float) -> torch.Tensor:
    """swiglu_oai(linear(rms_norm(x))): weight [2f, in] gate rows first -> [n, f]."""
    if blas.norm_applies(x, weight):
        return blas.norm_linear(x, weight, norm_weight, eps, swiglu=(alpha, limit))
    return gemm.gemm(x, weight, norm_weight, eps, swiglu=(alpha, limit))


def norm_qkv_prelude(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor | MxFp8Weight,
                     q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     kv_layer: torch.Tensor, slots: torch.Tensor, q_heads: int, kv_heads: int) -> torch.Tensor:
    """The qkv GEMM without its finalize; the prelude finishes each head from the split partials."""
    qkv = gemm.norm_linear_partials(x, weight, norm_weight, eps)
    return prelude.attn_prelude(qkv, q_norm, k_norm, cos, sin, eps, kv_layer, slots, q_heads, kv_heads)


TRITON_OPS = Ops(
    name="triton",
    linear=linear,
    rms_norm=norm.rms_norm,
    rope_cos_sin=rope.rope_cos_sin,
    qk_norm_rope=prelude.qk_norm_rope,
    swiglu_oai=gemm.swiglu_oai,
    write_kv=prelude.write_kv,
    paged_window_attention=attention.paged_window_attention,
    norm_linear=norm_linear,
    norm_linear_swiglu=norm_linear_swiglu,
    attn_prelude=prelude.attn_prelude,
    norm_qkv_prelude=norm_qkv_prelude,
)

__all__ = ["TRITON_OPS", "MxFp8Weight"]
