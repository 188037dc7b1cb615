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

TESTS = Path(__file__).resolve().parents[2]  # the child imports helpers.triton_compile from here

_CHILD = r"""
import json
from triton.backends.compiler import GPUTarget
from dspark_sidecar.kernels.triton import gemm
from helpers.triton_compile import compile_for, fp8_gemm

got = {}
for name, (rows, n, k, swiglu, plain) in {
    "gate_up 56 rows": (56, 3072, 6144, True, False),
    "qkv 7 rows": (7, 2304, 6144, False, False),
    "down 7 rows + residual": (7, 6144, 3072, False, True),
}.items():
    cfg, consts, types = fp8_gemm(rows, n, k, swiglu, not plain, plain, sms=256, max_smem=160 << 10, tma=False,
                                  ptx=False)
    kern = compile_for(gemm._gemm_kernel, consts, types, GPUTarget("hip", "gfx950", 64), cfg.num_warps, 2)
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
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(TESTS), env.get("PYTHONPATH"))))
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["gate_up 56 rows", "qkv 7 rows", "down 7 rows + residual"])
def test_mxfp8_gemm_compiles_for_gfx950_without_spilling(gfx950, case):
    got = gfx950[case]
    assert got["hsaco"] > 0, got
    assert int(got[".vgpr_spill_count"]) == 0 and int(got[".sgpr_spill_count"]) == 0, f"{case}: spills {got}"
    assert int(got[".vgpr_count"]) <= 512, got  # a gfx950 wave's VGPR budget (arch VGPRs + AGPRs)
