"""The Triton GEMM's MXFP8 path compiled for an MI355X (gfx950) on the CPU: Triton is the backend
there when FlyDSL is off, and its fp8 tiles take the pointer path and the fp32 dequantization
(gemm._dequant; the packed PTX one is NVIDIA's).

Checked at the plans the real TP-4 shard gets on 256 CUs: the kernel compiles to a code object,
without VGPR or SGPR spills. Compiled in a child process (this folder's conftest turns on the
interpreter), linked with the ld.lld the FlyDSL toolchain finds (Debian's lld-19, as `.ci/run`
installs it, or a ROCm install's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_sidecar.kernels.flydsl.toolchain import amdgpu_linker

triton = pytest.importorskip("triton")

_CHILD = r"""
import json
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from dspark_sidecar.kernels.triton import gemm

DIV16 = {"N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_sn", "stride_os", "stride_om", "stride_rm"}
UNIT = {"stride_xk": 1, "stride_wk": 1, "stride_sk": 1, "stride_on": 1}
got = {}
for name, (rows, n, k, swiglu, plain) in {
    "gate_up 56 rows": (56, 3072, 6144, True, False),
    "qkv 7 rows": (7, 2304, 6144, False, False),
    "down 7 rows + residual": (7, 6144, 3072, False, True),
}.items():
    cfg = gemm.plan(rows, n, k, 256, swiglu=swiglu, weight_bytes=1, max_smem=160 << 10)
    partial = cfg.split_k > 1
    consts = dict(HAS_NORM=not plain, FOLDED=False, FP8=True, QBLOCK=32, SWIGLU=swiglu, PARTIAL=partial,
                  HAS_RES=plain and not partial, DOT=tl.bfloat16, IEEE=False, OUT=tl.bfloat16, BM=cfg.block_m,
                  BN=cfg.block_n, BK=cfg.block_k, INTERPRET=False, TMA=False, SQ_COL=False,
                  SWAP_AB=rows >= gemm.FP8_SWAP_MIN_ROWS, FP8_PTX=False, **UNIT)
    out = "*fp32" if partial else "*bf16"
    types = dict(x_ptr="*bf16", nw_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", res_ptr="*bf16", out_ptr=out,
                 sq_ptr=out, eps="fp32", alpha="fp32", limit="fp32")
    fn = gemm._gemm_kernel
    sig, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in consts:
            sig[arg] = "constexpr"
            continue
        sig[arg] = types.get(arg, "i32")
        if sig[arg].startswith("*") or arg in DIV16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    kern = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("hip", "gfx950", 64),
                          options=dict(num_warps=cfg.num_warps, num_stages=2))
    meta = {l.split(":")[0].strip(): l.split(":")[1].strip() for l in kern.asm["amdgcn"].splitlines()
            if l.strip().startswith((".vgpr_spill_count:", ".sgpr_spill_count:", ".vgpr_count:"))}
    got[name] = dict(meta, hsaco=len(kern.asm["hsaco"]))
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def gfx950():
    lld = amdgpu_linker()
    if lld is None:
        pytest.skip("no ld.lld for AMDGPU code objects (apt-get install lld-19 rocm-device-libs, as .ci/run does)")
    if not (Path(triton.__file__).parent / "backends" / "amd").is_dir():
        pytest.skip("this Triton build has no AMD backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_HIP_LLD_PATH"] = str(lld)
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["gate_up 56 rows", "qkv 7 rows", "down 7 rows + residual"])
def test_mxfp8_gemm_compiles_for_gfx950_without_spilling(gfx950, case):
    got = gfx950[case]
    assert got["hsaco"] > 0, got
    assert int(got[".vgpr_spill_count"]) == 0 and int(got[".sgpr_spill_count"]) == 0, f"{case}: spills {got}"
    assert int(got[".vgpr_count"]) <= 512, got  # a gfx950 wave's VGPR budget (arch VGPRs + AGPRs)
