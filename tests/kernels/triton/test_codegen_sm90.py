"""The Triton kernels' machine code for an H100/H200 (sm_90), compiled on the CPU: the structure their speed rests on.

Without a GPU the parity tests run in the interpreter, which says nothing about how the kernel
streams its weights. Triton compiles for sm_90 without one, with its bundled ptxas, so this
checks, at the plans the real TP-4 shard gets: weight and x tiles stream into shared memory
through asynchronous copies in a multi-stage pipeline, the dots run on the tensor cores (wgmma
for 64-row tiles, mma.sync for 16-row ones), nothing spills, and the shared memory fits an
H200; and the attention's split kernel runs on wgmma without spilling.

The compile sees what the JIT would see at those shapes: 16-byte aligned pointers and sizes and
strides that are multiples of 16 (without those hints Triton cannot vectorise the loads and
does not pipeline them at all). It runs in a child process, because this folder's conftest
turns on the interpreter, under which kernels cannot be compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from dspark_sidecar.kernels.triton import gemm  # noqa: E402

H200_SMEM = 227 << 10
TESTS = Path(__file__).resolve().parents[2]  # the children import helpers.triton_compile from here

_CHILD = r"""
import json, re, subprocess, sys
from pathlib import Path
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from dspark_sidecar.kernels.triton import gemm
from helpers.triton_compile import DIV16, UNIT, compile_for, fp8_gemm

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def build(fn, consts, types, div16, name, num_warps, num_stages):
    # fn compiled for sm_90 as the JIT would at the shard's shapes -> PTX counts, shared and stack bytes.
    kern = compile_for(fn, consts, types, GPUTarget("cuda", 90, 32), num_warps, num_stages, div16)
    cubin = Path(sys.argv[1]) / f"{name}.cubin"
    cubin.write_bytes(kern.asm["cubin"])
    usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    ptx = kern.asm["ptx"]
    lines = ptx.splitlines()
    wait = next((i for i, l in enumerate(lines) if "griddepcontrol.wait" in l), -1)
    release = [i for i, l in enumerate(lines) if "griddepcontrol.launch_dependents" in l]
    dots = [i for i, l in enumerate(lines) if "wgmma.mma_async" in l or "mma.sync" in l]
    memory = re.compile(r"\b(ld\.global\S*|cp\.async\S*|atom\S*|st\.global\S*|red\.\S*)")
    regs = max(int(w.split(":")[1]) for w in usage.split() if w.startswith("REG:"))
    # Programs of it one SM holds: 228 KB of shared memory (1 KB reserved per program) and 64K
    # registers, allotted per warp in units of 256.
    per_warp = -(-regs * 32 // 256) * 256
    fit = min((228 << 10) // (kern.metadata.shared + 1024), 65536 // (per_warp * num_warps))
    return dict(shared=kern.metadata.shared, regs=regs, fit=fit,
                # PDL: the memory operations before griddepcontrol.wait (in text order: the wait
                # sits in the entry block), and whether every launch_dependents follows the dots.
                pdl_wait=wait, pdl_before_wait=[m.group(1) for l in lines[:max(wait, 0)] for m in [memory.search(l)] if m],
                pdl_release=len(release), pdl_release_after_dots=bool(release) and min(release) > max(dots, default=-1), stack=[int(w.split(":")[1]) for w in usage.split() if w.startswith("STACK:")],
                cp_async=ptx.count("cp.async.cg.shared.global"), wgmma=ptx.count("wgmma.mma_async"),
                mma_sync=ptx.count("mma.sync.aligned"), tma=ptx.count("cp.async.bulk.tensor"),
                # fp32 -> e4m3 conversions that saturate and round to nearest even (an fp8 KV cache)
                cvt_e4m3_satfinite=sum("cvt.rn.satfinite.e4m3x2" in l for l in lines),
                # wgmma's A operand after the accumulators: a {register list} or a shared-memory descriptor
                wgmma_reg_a=sum(l.split("},", 1)[1].lstrip().startswith("{")
                                for l in ptx.splitlines() if "wgmma.mma_async" in l))


def compile_case(rows, n, k, swiglu, norm, residual, folded=False, tma=True, sq_column=True, pdl=False):
    # tma: the weights through a tensor descriptor, as gemm._launch passes dense bf16 weights on
    # sm_90; else the pointer path (MXFP8 weights, AMD). sq_column: gemm.SQ_COLUMN (where a folded
    # split-K GEMM sums x^2).
    cfg = gemm.plan(rows, n, k, 132, swiglu=swiglu, max_smem=%(smem)d)
    partial = cfg.split_k > 1
    consts = dict(HAS_NORM=norm, FOLDED=folded, FP8=False, QBLOCK=1, SWIGLU=swiglu, PARTIAL=partial, HAS_RES=residual and not partial,
                  DOT=tl.bfloat16, IEEE=False, OUT=tl.bfloat16, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                  INTERPRET=False, TMA=tma, SQ_COL=sq_column and folded and norm and partial, SWAP_AB=False,
                  FP8_PTX=False, PDL=pdl, **UNIT)
    out = "*fp32" if partial else "*bf16"
    w = f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>" if tma else "*bf16"
    types = dict(x_ptr="*bf16", nw_ptr="*bf16", w_ptr=w, s_ptr="*bf16", res_ptr="*bf16", out_ptr=out,
                 sq_ptr=out, eps="fp32", alpha="fp32", limit="fp32")
    got = build(gemm._gemm_kernel, consts, types, DIV16, f"{rows}x{n}x{k}", cfg.num_warps, cfg.num_stages)
    return dict(got, stages=cfg.num_stages, block_m=cfg.block_m, tma_expected=tma,
                weight_tile=cfg.block_k * cfg.block_n * 2 * (2 if swiglu else 1))


def compile_fp8_case(rows, n, k, swiglu, norm, residual):
    # MXFP8 weights as gemm._launch passes them on sm_90: the bits by TMA, dequantized by inline PTX.
    cfg, consts, types = fp8_gemm(rows, n, k, swiglu, norm, residual, sms=132, max_smem=%(smem)d, tma=True,
                                  ptx=gemm.FP8_PACKED_DEQUANT)
    got = build(gemm._gemm_kernel, consts, types, DIV16, f"fp8_{rows}x{n}x{k}", cfg.num_warps, cfg.num_stages)
    return dict(got, stages=cfg.num_stages, block_m=cfg.block_m, swap=consts["SWAP_AB"])


def compile_attention(reqs, coop=False, pdl=False, fp8=False):
    # The split kernel at the shard's heads (16 q, 1 KV, d 128), as paged_window_attention plans it;
    # coop: with the splits' merge in the same (cooperative) launch; fp8: over an e4m3 cache.
    from dspark_sidecar.kernels.triton import attention
    splits = attention.num_splits(reqs, 1, 4096 - 1, 132)  # the tiled keys: all but the block's 7
    consts = dict(ROWS=7, GROUP=16, D=128, BLOCK_D=128, BM=128, BN=attention.BLOCK_N, BB=16, SPLITS=splits,
                  OUT=tl.bfloat16, DOT=tl.bfloat16, IEEE=False, INTERPRET=False, PAGE=16, stride_qd=1, stride_cd=1,
                  COOP=coop, RB=triton.cdiv(7 * 16, splits), PDL=pdl)
    types = dict(q_ptr="*bf16", kv_ptr="*fp8e4nv" if fp8 else "*bf16", pos_ptr="*i64", seq_ptr="*i32",
                 bt_ptr="*i32", out_ptr="*bf16", po_ptr="*fp32", pml_ptr="*fp32", cnt_ptr="*i32", qk_scale="fp32")
    div16 = {"stride_qn", "stride_qh", "stride_c0", "stride_cp", "stride_cs", "stride_ch", "stride_bt"}
    got = build(attention._split_kernel, consts, types, div16,
                f"attention{reqs}{'coop' if coop else ''}{pdl}{'fp8' if fp8 else ''}", 8, attention.NUM_STAGES)
    return dict(got, block_m=128)


def compile_prelude_pdl(fp8=False):
    # The prelude finishing the qkv GEMM's 7 split partials of the shard's heads, launched with PDL;
    # fp8: storing the block's K/V into an e4m3 cache.
    from dspark_sidecar.kernels.triton import prelude
    consts = dict(PAGE=16, SPLITS=7, Q_HEADS=16, KV_HEADS=1, D=128, HALF=32, BLOCK_D=128, OUT=tl.bfloat16,
                  CACHE=tl.float8e4nv if fp8 else tl.bfloat16, PARTIAL=True, INTERPRET=False, PDL=True, stride_xd=1,
                  stride_qd=1, stride_cd=1)
    types = dict(x_ptr="*fp32", qn_ptr="*bf16", kn_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", q_ptr="*bf16",
                 kv_ptr="*fp8e4nv" if fp8 else "*bf16", slot_ptr="*i64", eps="fp32", sq_ptr="*fp32", eps_in="fp32")
    return build(prelude._prelude_kernel, consts, types, set(), f"prelude_pdl{'fp8' if fp8 else ''}", 1, 3)


def compile_rope_pdl():
    # RoPE's table for a step's positions, launched with PDL: its fp64 pow may run before the wait.
    from dspark_sidecar.kernels.triton import rope
    consts = dict(HALF=32, HALF_P2=32, ROWS=rope.ROWS, INTERPRET=False, PDL=True)
    types = dict(pos_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", theta_bits="i64")
    return build(rope._rope_cos_sin_kernel, consts, types, set(), "rope_pdl", 4, 3)


def compile_norm_pdl():
    # The final norm of [56, 6144] in one pass, launched with PDL.
    from dspark_sidecar.kernels.triton import norm
    consts = dict(OUT=tl.bfloat16, BLOCK=8192, ONE_PASS=True, INTERPRET=False, PDL=True)
    types = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", eps="fp32")
    return build(norm._rms_norm_kernel, consts, types, set(), "norm_pdl", 8, 3)


def compile_finalize_pdl():
    # gate|up's finalize after the vendor product (squares from x itself), launched with PDL.
    consts = dict(SPLIT=1, HAS_NORM=True, SWIGLU=True, HAS_RES=False, OUT=tl.bfloat16, BLOCK_N=256,
                  INTERPRET=False, SQ_X=8192, PDL=True)
    types = dict(ws_ptr="*fp32", sq_ptr="*bf16", out_ptr="*bf16", res_ptr="*bf16", eps="fp32", alpha="fp32",
                 limit="fp32")
    return build(gemm._finalize_kernel, consts, types, set(), "finalize_pdl", 4, 3)


cases = {
    "qkv 56 rows": (56, 2304, 6144, False, True, False),
    "qkv 56 rows, norm folded": (56, 2304, 6144, False, True, False, True),
    "gate_up 56 rows (deep pipeline)": (56, 3072, 6144, True, True, False),
    "down 7 rows + residual": (7, 6144, 3072, False, False, True),
    "gate_up 56 rows, norm folded": (56, 3072, 6144, True, True, False, True),
    "gate_up 56 rows, norm folded, pointer path": (56, 3072, 6144, True, True, False, True, False),
    "qkv 56 rows, norm folded, squares in every program": (56, 2304, 6144, False, True, False, True, True, False),
    "down 7 rows + residual, pointer path": (7, 6144, 3072, False, False, True, False, False),
}
fp8_cases = {
    "mxfp8 qkv 56 rows": (56, 2304, 6144, False, True, False),
    "mxfp8 gate_up 56 rows": (56, 3072, 6144, True, True, False),
    "mxfp8 gate_up 7 rows": (7, 3072, 6144, True, True, False),
    "mxfp8 down 7 rows + residual": (7, 6144, 3072, False, False, True),
}
got = {name: compile_case(*args) for name, args in cases.items()}
got.update({name: compile_fp8_case(*args) for name, args in fp8_cases.items()})
got["attention 8 requests"] = compile_attention(8)
got["attention 8 requests, merged in the launch"] = compile_attention(8, coop=True)
got["attention 8 requests, merged in the launch, PDL"] = compile_attention(8, coop=True, pdl=True)
got["qkv 56 rows, norm folded, PDL"] = compile_case(56, 2304, 6144, False, True, False, True, pdl=True)
got["prelude, PDL"] = compile_prelude_pdl()
got["prelude, fp8 cache"] = compile_prelude_pdl(fp8=True)
got["attention 8 requests, fp8 cache"] = compile_attention(8, fp8=True)
got["rope, PDL"] = compile_rope_pdl()
got["final norm, PDL"] = compile_norm_pdl()
got["finalize, PDL"] = compile_finalize_pdl()
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def sm90(tmp_path_factory):
    nvidia = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (nvidia / "ptxas").exists() or not (nvidia / "cuobjdump").exists():
        pytest.skip("this Triton build has no bundled ptxas/cuobjdump (the NVIDIA backend's tools)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(TESTS), env.get("PYTHONPATH"))))  # helpers
    out = subprocess.run([sys.executable, "-c", _CHILD % {"smem": H200_SMEM}, str(tmp_path_factory.mktemp("sm90"))],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["qkv 56 rows", "qkv 56 rows, norm folded", "gate_up 56 rows (deep pipeline)",
                                  "down 7 rows + residual", "gate_up 56 rows, norm folded",
                                  "gate_up 56 rows, norm folded, pointer path", "down 7 rows + residual, pointer path",
                                  "qkv 56 rows, norm folded, squares in every program"])
def test_gemm_streams_through_a_pipeline_on_sm90(sm90, case):
    got = sm90[case]
    # x always, and the weights on the pointer path, arrive by cp.async; with a descriptor, the
    # weight tiles arrive by TMA bulk tensor copies (one per tile and stage in the pipeline).
    assert got["cp_async"] > 0, f"{case}: no asynchronous copies: the tiles go through registers, unpipelined"
    if got["tma_expected"]:
        assert got["tma"] >= got["stages"] - 1, f"{case}: weight tiles not pipelined through TMA: {got}"
    else:
        assert got["tma"] == 0, got
    # 64-row tiles use Hopper's wgmma; a 16-row tile (7 rows) is below wgmma's 64-row minimum and
    # runs on mma.sync, the tensor cores' warp-level form. Either way, not the FMA units.
    if got["block_m"] >= 64:
        assert got["wgmma"] > 0, f"{case}: no wgmma: the dot is not on Hopper's warpgroup tensor cores"
    else:
        assert got["mma_sync"] > 0, f"{case}: no mma.sync: the dot is not on the tensor cores"
    assert got["stack"] and max(got["stack"]) == 0, f"{case}: register spills ({got['stack']} bytes of stack)"
    # Multi-buffered: at least (stages - 1) weight tiles resident in shared memory at once.
    assert got["shared"] >= (got["stages"] - 1) * got["weight_tile"], got
    assert got["shared"] <= H200_SMEM, got


@pytest.mark.parametrize("case", ["mxfp8 qkv 56 rows", "mxfp8 gate_up 56 rows", "mxfp8 gate_up 7 rows",
                                  "mxfp8 down 7 rows + residual"])
def test_mxfp8_gemm_dequantizes_in_registers_without_spilling(sm90, case):
    """MXFP8 weight tiles arrive by TMA (one bulk copy per tile and stage) and are dequantized in
    registers (by inline PTX, gemm._dequant_sm90) before the tensor-core dot: from 64-row tiles
    as its left operand, straight from registers (wgmma's A), below on mma.sync with x on the
    left. At gemm.FP8_BLOCK_K = 128 the
    56-row gate|up launch (x on the left) held two [128, 128] tiles' values per thread and
    spilled 480 bytes of stack (run 151: 74 us against 45 without). The swapped gate|up holds both
    tiles and both accumulators across a wgmma and may keep a few words on the stack (8 bytes
    with Triton 3.9): up to 16 bytes pass, a tile's worth does not."""
    got = sm90[case]
    assert got["tma"] >= got["stages"] - 1, f"{case}: weight bits not pipelined through TMA: {got}"
    if got["block_m"] >= 64:
        assert got["swap"] and got["wgmma"] > 0 and got["wgmma_reg_a"] > 0, f"{case}: weights not wgmma's A: {got}"
    else:
        assert not got["swap"] and got["mma_sync"] > 0, got
    assert got["stack"] and max(got["stack"]) <= 16, f"{case}: register spills ({got['stack']} bytes of stack)"
    assert got["shared"] <= H200_SMEM, got


@pytest.mark.parametrize("case", ["mxfp8 qkv 56 rows", "mxfp8 gate_up 56 rows", "mxfp8 gate_up 7 rows",
                                  "mxfp8 down 7 rows + residual", "qkv 56 rows, norm folded"])
def test_an_sm_holds_as_many_gemm_programs_as_planned(sm90, case):
    """gemm.EXACT_RESIDENCY: the MXFP8 GEMMs of the step, every one a Triton launch released early by
    its predecessor under PDL, fit gemm.PROGRAMS_PER_SM programs on an SM at 7 and 56 rows, not more;
    so does the bf16 qkv at 56 rows. A grid launched while its predecessor drains is placed greedily:
    the MXFP8 programs at 7 rows (72-75 KB, 3 fitting) piled onto the first SMs free, and the step
    took 407-411 us against 347-352 with the guard (runs 171-173)."""
    got = sm90[case]
    assert got["fit"] == gemm.PROGRAMS_PER_SM, f"{case}: {got['fit']} programs fit on an SM: {got}"


@pytest.mark.parametrize("case", ["attention 8 requests", "attention 8 requests, merged in the launch"])
def test_attention_split_kernel_on_sm90(sm90, case):
    """The [112 -> 128 rows, 128] accumulator and a [128, 64] score tile in 8 warps: wgmma, no spills
    (also with the cooperative merge's tail)."""
    got = sm90[case]
    assert got["wgmma"] > 0, got
    assert got["stack"] and max(got["stack"]) == 0, f"register spills: {got['stack']} bytes of stack"
    assert got["shared"] <= H200_SMEM, got


def test_norm_gemms_feed_the_dot_from_registers(sm90):
    """A norm GEMM whose programs read each x tile into registers for its squares takes x from
    those registers for its dot too, folded norm or not. With the folded norm the compiler had fed
    the wgmma from the pipelined shared-memory buffer instead, and on an H200 (Triton 3.6) those
    64-row tiles gave wrong, run-to-run different sums (tests/kernels/triton/test_gemm.py, the
    folded real shapes). A plain linear reads no x into registers and keeps the shared-memory operand."""
    for case in ("qkv 56 rows", "qkv 56 rows, norm folded, squares in every program"):
        got = sm90[case]
        assert got["wgmma"] > 0 and got["wgmma_reg_a"] > 0, (case, got)


def test_folded_split_gemms_leave_the_squares_to_their_own_column(sm90):
    """With gemm.SQ_COLUMN a folded split-K GEMM's column tiles read no x into registers (an extra
    grid column of x-only programs sums x^2), so their dot takes x from shared memory, as a plain
    linear's does: the path that never read the same buffer both ways."""
    for case in ("qkv 56 rows, norm folded", "gate_up 56 rows, norm folded", "gate_up 56 rows, norm folded, pointer path"):
        got = sm90[case]
        assert got["wgmma"] > 0 and got["wgmma_reg_a"] == 0, (case, got)


def test_programmatic_dependent_launch_waits_before_the_step_data(sm90):
    """runtime.PDL: a kernel may start while its predecessor still runs, so nothing it reads before
    griddepcontrol.wait may be written by that predecessor. The GEMM, the prelude, the finalize, the
    final norm and RoPE's table (which forms its frequencies first) wait before any memory operation; the attention reads only the step's positions, sequence
    lengths and block table first (scalar loads, written before the first layer), never q or K/V
    (vector loads, cp.async). Each releases its successor after its dots, not at its start (run 22:
    released at once, the early programs only competed with the running kernel)."""
    for case in ("qkv 56 rows, norm folded, PDL", "prelude, PDL", "finalize, PDL", "rope, PDL", "final norm, PDL"):
        got = sm90[case]
        assert got["pdl_wait"] >= 0 and got["pdl_before_wait"] == [], (case, got)
        assert got["pdl_release"] >= 1 and got["pdl_release_after_dots"], (case, got)
    got = sm90["attention 8 requests, merged in the launch, PDL"]
    assert got["pdl_wait"] >= 0 and got["pdl_before_wait"], got
    assert set(got["pdl_before_wait"]) <= {"ld.global.b32", "ld.global.b64"}, got
    assert got["pdl_release"] >= 1 and got["pdl_release_after_dots"], got
    assert got["wgmma"] > 0 and max(got["stack"]) == 0, got
    # Without PDL no kernel carries the instructions at all.
    for case in ("qkv 56 rows, norm folded", "attention 8 requests, merged in the launch"):
        assert sm90[case]["pdl_wait"] == -1 and sm90[case]["pdl_release"] == 0, case


def test_an_fp8_cache_is_stored_saturated_and_read_through_bf16_tensor_cores(sm90):
    """vLLM's kv_cache_dtype fp8: the prelude's K/V stores convert with cvt.rn.satfinite (saturate,
    round to nearest even, NaN kept), and the attention widens the codes for bf16 wgmma, spilling
    nothing; the bf16 builds have no such conversion."""
    prelude, attention = sm90["prelude, fp8 cache"], sm90["attention 8 requests, fp8 cache"]
    assert prelude["cvt_e4m3_satfinite"] > 0 and sm90["prelude, PDL"]["cvt_e4m3_satfinite"] == 0
    assert max(prelude["stack"]) == 0
    assert attention["wgmma"] > 0 and max(attention["stack"]) == 0, attention
    assert attention["shared"] <= H200_SMEM
