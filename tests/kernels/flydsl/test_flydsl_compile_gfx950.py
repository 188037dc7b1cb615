"""Every FlyDSL kernel, for 1..8 requests, compiled to a gfx950 code object on CPU and checked from its metadata/ISA.

No kernel is launched: a launch needs an AMD GPU (and aborts the process without one). The
compile-only toolchain is `pip install flydsl` + `apt-get install lld-19 rocm-device-libs`;
the tests skip, saying so, only when that toolchain is missing.
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import pytest
import torch

from dspark_sidecar.layout import LAUNCH_REQS
from dspark_sidecar.kernels.flydsl import toolchain

WHY_NOT = toolchain.compile_only_unavailable_reason()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"gfx950 compile-only toolchain missing: {WHY_NOT}")

REQS = list(range(1, LAUNCH_REQS + 1))
LDS_LIMIT = 160 * 1024


@lru_cache(maxsize=None)
def compiled(name: str, num_reqs: int):
    """The (single) kernel report of one catalog entry; compiled once per test session."""
    from dspark_sidecar.kernels.flydsl.catalog import KERNELS
    from dspark_sidecar.kernels.flydsl.isa_report import compile_reports

    spec = KERNELS[name]
    reports = compile_reports(spec.build(num_reqs), *spec.args(num_reqs))
    assert len(reports) == 1, [r.name for r in reports]
    return spec, reports[0]


def kernel_names() -> list[str]:
    if WHY_NOT is not None:
        return ["unavailable"]
    from dspark_sidecar.kernels.flydsl.catalog import KERNELS

    return list(KERNELS)


@pytest.mark.parametrize("num_reqs", REQS)
@pytest.mark.parametrize("name", kernel_names())
def test_code_object_within_design_budget(name, num_reqs):
    spec, rep = compiled(name, num_reqs)
    assert rep.scratch_bytes == 0, rep.summary()
    assert rep.vgpr_spill_count == 0 and rep.sgpr_spill_count == 0, rep.summary()
    assert rep.lds_bytes <= LDS_LIMIT, rep.summary()
    assert rep.waves_per_simd >= spec.min_waves_per_simd, (
        f"designed for >= {spec.min_waves_per_simd} waves/SIMD: {rep.summary()}"
    )
    for regex, at_least, why in spec.needs:
        n = rep.count_lines(regex)
        assert n >= at_least, f"{name}: {n} x /{regex}/ in the ISA, need {at_least} ({why})"


def test_isa_is_gfx950():
    _, rep = compiled("linear_qkv", 1)
    # gfx950-only instructions are present, so the compile did not fall back to gfx942 paths.
    assert rep.count("v_cvt_scalef32_pk_bf16_fp8") > 0
    assert rep.count("v_mfma_f32_16x16x32_bf16") > 0


def test_a_launcher_compiled_before_is_reported_again():
    """FlyDSL reuses a launcher's in-memory code object for the same arguments without compiling, so
    without dumping its ISA: a second report of one launcher (or of one the runner compiled) raised
    "FlyDSL produced no ISA dump"."""
    from dspark_sidecar.kernels.flydsl.catalog import KERNELS
    from dspark_sidecar.kernels.flydsl.isa_report import compile_reports

    spec = KERNELS["final_norm"]
    launcher = spec.build(1)
    (first,) = compile_reports(launcher, *spec.args(1))
    (again,) = compile_reports(launcher, *spec.args(1))
    assert again.summary() == first.summary()


def test_linear_mfma_count_follows_row_tiles():
    """One MFMA per (row tile, column tile, 32-column step) of a chunk: the row tiling follows R.

    LLVM may keep the chunk loop or unroll it fully (short trip counts); either way the count
    is the per-chunk count times 1 or times the chunks per workgroup.
    """
    from dspark_sidecar.kernels.flydsl.shapes import SCHEDULES, row_tiles

    for name in ("o", "gate_up"):
        sched = SCHEDULES[name]
        for num_reqs in (1, 3, 5, 8):
            _, rep = compiled(f"linear_{name}", num_reqs)
            per_chunk = row_tiles(num_reqs) * sched.nsub * 4
            assert rep.count("v_mfma_f32_16x16x32_bf16") in (per_chunk, per_chunk * sched.chunks_per_wg)
            # 4 scaled converts (8 weights) per MFMA step and column tile, shared by the row tiles.
            cvt = rep.count("v_cvt_scalef32_pk_bf16_fp8")
            assert cvt in (sched.nsub * 16, sched.nsub * 16 * sched.chunks_per_wg)


def test_report_summary_table(capsys):
    """Print the per-kernel figures (VGPRs, LDS, occupancy) at 1 and 8 requests for the record."""
    rows = []
    for name in kernel_names():
        for num_reqs in (1, LAUNCH_REQS):
            _, rep = compiled(name, num_reqs)
            rows.append(f"{name:18s} R={num_reqs}  {rep.summary()}")
    with capsys.disabled():
        print("\n" + "\n".join(rows))
    assert rows


@pytest.mark.parametrize("num_reqs", [1, LAUNCH_REQS])
@pytest.mark.parametrize("name", ["qkv_rope", "attention"])
def test_fp8_builds_keep_the_bf16_budget(name, num_reqs):
    """The fp8 builds change only how K/V bytes move: attention still does its 32+ MFMAs on bf16 K/V
    widened from 16 codes' converts per tile (the bf16 build has none), with the bf16 build's LDS and
    occupancy; qkv_rope stores two code bytes per lane where it stored two bf16 halves."""
    _, bf = compiled(name, num_reqs)
    _, f8 = compiled(f"{name}_fp8", num_reqs)
    assert f8.lds_bytes == bf.lds_bytes and f8.waves_per_simd >= bf.waves_per_simd, (bf.summary(), f8.summary())
    if name == "attention":
        assert f8.count("v_mfma_f32_16x16x32_bf16") == bf.count("v_mfma_f32_16x16x32_bf16")
        assert bf.count("v_cvt_scalef32_pk_bf16_fp8") == 0 and f8.count("v_cvt_scalef32_pk_bf16_fp8") >= 16
    else:
        assert bf.count("buffer_store_byte") == 0 and f8.count("buffer_store_byte") == 2
        assert f8.count("v_cvt_pk_fp8_f32") == 1


def mnemonics(rep) -> Counter:
    """How many of each instruction the ISA holds, operands aside."""
    return Counter(line.split()[0] for line in rep.isa.splitlines()
                   if line.startswith("\t") and line.strip() and not line.lstrip().startswith((";", ".")))


KV_KERNELS = [("qkv_rope", 8, torch.bfloat16), ("attention", 1, torch.bfloat16),
              ("qkv_rope_fp8", 8, torch.float8_e4m3fn), ("attention_fp8", 1, torch.float8_e4m3fn)]


@pytest.mark.parametrize("num_reqs", [1, LAUNCH_REQS])
@pytest.mark.parametrize("name, kv_arg, cache_dtype", KV_KERNELS)
def test_records_cache_compiles_to_the_planes_code(name, kv_arg, cache_dtype, num_reqs):
    """The K/V row addressing is runtime arguments: compiled over the runner's rows of a records cache
    (vLLM 0.34's, carved out of a larger allocation) with its (slot_rows, v_row0), a kernel has the
    planes build's resources and instructions, so the design budget above holds for both layouts,
    for a bf16 and for an fp8 cache (whose rows the runner hands over as uint8 codes).
    (Not its text: LLVM orders commutative operands differently from one compile to the next.)"""
    from dspark_sidecar.drafter.kv_cache import kv_planes
    from dspark_sidecar.kernels.flydsl.catalog import PAGE_SIZE, PLACEHOLDER_PAGES
    from dspark_sidecar.kernels.flydsl.isa_report import compile_reports
    from dspark_sidecar.kernels.flydsl.runner import KVRows

    spec, planes = compiled(name, num_reqs)
    storage = torch.zeros((PLACEHOLDER_PAGES + 1) * PAGE_SIZE * 256, dtype=cache_dtype)
    records = storage[PAGE_SIZE * 256 :].view(PLACEHOLDER_PAGES, 1, PAGE_SIZE, 256)
    kv = KVRows.of(kv_planes(records))
    args = list(spec.args(num_reqs))
    assert args[kv_arg].shape == kv.rows.shape and args[kv_arg].dtype == kv.rows.dtype
    args[kv_arg], args[-2:] = kv.rows, (kv.slot_rows, kv.v_row0)
    (rep,) = compile_reports(spec.build(num_reqs), *args)
    assert (kv.slot_rows, kv.v_row0) == (2, 1) and kv.rows.storage_offset() > 0
    assert rep.summary() == planes.summary()
    assert mnemonics(rep) == mnemonics(planes)


@pytest.mark.parametrize("num_reqs", [1, 3, 8])
@pytest.mark.parametrize("name", ["qkv_rope", "swiglu_reduce"])
def test_split_sums_of_squares_are_read_at_their_split_and_row(name, num_reqs):
    """qkv_rope and swiglu_reduce sum SS[s, row] over the splits s: the per-row 1/rms of the folded norm.

    The runner's SS is a [split, MP] slice of a [split, 64] workspace (row stride 64) that linear.py
    writes through SS[s] row views. Read from the compiled kernel's LLVM IR with those runtime strides,
    the kernel must load exactly bytes 4 (64 s + row): a flat index s * MP + row into the 2-D tensor is
    colexicographic in FlyDSL ((i % split, i // split)) and read other rows' and splits' sums."""
    from dspark_sidecar.kernels.flydsl.catalog import KERNELS
    from dspark_sidecar.kernels.flydsl.shapes import SCHEDULES, row_tiles
    from helpers.llvm_offsets import buffer_load_offsets, compiled_ir

    spec = KERNELS[name]
    sched = SCHEDULES["qkv" if name == "qkv_rope" else "gate_up"]
    mp = 16 * row_tiles(num_reqs)
    args = list(spec.args(num_reqs))
    args[0] = torch.zeros(sched.split, 64, sched.n)[:, :mp]  # ws["P_*"][:, :mp], as runner._calls passes it
    args[1] = torch.zeros(sched.split, 64)[:, :mp]  # ws["SS_*"][:, :mp]
    ir = compiled_ir(spec.build(num_reqs), *args)
    for row in sorted({0, 1, 5, 7 * num_reqs - 1}):
        got = buffer_load_offsets(ir, tuple(args), (row, 0, 0))[1]
        assert got == [4 * (64 * s + row) for s in range(sched.split)], (row, got)
