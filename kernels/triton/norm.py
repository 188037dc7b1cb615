"""Standalone Gemma RMSNorm over rows (final norm, hidden norm): y = x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_sidecar.kernels.triton.runtime import INTERPRET, cast, check_device, tl_dtype


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, K, stride_x, stride_o, eps,
                     OUT: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """One program per row; two passes over the row in BLOCK chunks (any width, bounded registers)."""
    row = tl.program_id(0)
    sq = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
        sq += x * x
    inv = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, cast(x * inv * (1.0 + w), OUT, INTERPRET), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., K] -> same shape and dtype."""
    check_device(x, weight)
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(2048, triton.next_power_of_2(k))
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, k, x2.stride(0), out.stride(0), eps,
                                         OUT=tl_dtype(x.dtype), BLOCK=block, INTERPRET=INTERPRET,
                                         num_warps=8)
    return out.view(x.shape)
