"""Triton kernels compiled on the CPU for a GPU target, as the JIT would at the shard's shapes (the codegen tests' children)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.compiler import ASTSource

from dspark_sidecar.kernels.triton import gemm

# Arguments the JIT specialises as multiples of 16 at the shard's shapes (N, K, K per split and
# row strides are all multiples of 64 there); the unit strides it turns into constants.
DIV16 = {"N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_sn", "stride_os", "stride_om", "stride_rm"}
UNIT = {"stride_xk": 1, "stride_wk": 1, "stride_sk": 1, "stride_on": 1}


def compile_for(fn, consts: dict, types: dict, target, num_warps: int, num_stages: int, div16=DIV16):
    """fn compiled for `target`. types: the non-constexpr arguments' Triton types (others i32);
    pointers and the div16 names get the JIT's 16-divisibility hint (without it Triton neither
    vectorises nor pipelines the loads)."""
    # Constexprs left out take their defaults, as at a launch that does not pass them (e.g. PDL).
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in consts:
            sig[arg] = "constexpr"
            continue
        sig[arg] = types.get(arg, "i32")
        if sig[arg].startswith("*") or arg in div16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=target,
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def fp8_gemm(rows: int, n: int, k: int, swiglu: bool, norm: bool, residual: bool, *, sms: int, max_smem: int,
             tma: bool, ptx: bool) -> tuple[gemm.GemmConfig, dict, dict]:
    """(plan, constexprs, argument types) of `gemm._gemm_kernel` for MXFP8 weights as gemm._launch
    passes them: the u8 bits through a tensor descriptor (tma) or pointers, the E8M0 scales by
    pointers, dequantized by inline PTX (ptx) or integer ops, swapped from FP8_SWAP_MIN_ROWS rows."""
    cfg = gemm.plan(rows, n, k, sms, swiglu=swiglu, weight_bytes=1, max_smem=max_smem)
    partial = cfg.split_k > 1
    consts = dict(HAS_NORM=norm, FOLDED=False, FP8=True, QBLOCK=32, SWIGLU=swiglu, PARTIAL=partial,
                  HAS_RES=residual and not partial, DOT=tl.bfloat16, IEEE=False, OUT=tl.bfloat16, BM=cfg.block_m,
                  BN=cfg.block_n, BK=cfg.block_k, INTERPRET=False, TMA=tma, SQ_COL=False,
                  SWAP_AB=rows >= gemm.FP8_SWAP_MIN_ROWS, FP8_PTX=ptx, **UNIT)
    out = "*fp32" if partial else "*bf16"
    w = f"tensordesc<u8[{cfg.block_n}, {cfg.block_k}]>" if tma else "*u8"
    types = dict(x_ptr="*bf16", nw_ptr="*bf16", w_ptr=w, s_ptr="*u8", res_ptr="*bf16", out_ptr=out,
                 sq_ptr=out, eps="fp32", alpha="fp32", limit="fp32")
    return cfg, consts, types
