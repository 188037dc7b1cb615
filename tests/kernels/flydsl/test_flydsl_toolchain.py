"""Toolchain detection: FlyDSL availability, gfx950 detection on CPU, scoped compile-only environment, ISA parsing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_sidecar.kernels.flydsl import isa_report, toolchain


def test_on_gfx950_is_false_without_an_amd_gpu():
    import torch

    if getattr(torch.version, "hip", None) is not None and torch.cuda.is_available():
        pytest.skip("a ROCm GPU is present; this checks the CPU answer")
    assert toolchain.on_gfx950() is False


def test_on_gfx950_asks_the_ranks_gpu_not_device_0(monkeypatch):
    """A rank asks after torch.cuda.set_device(its GPU): on a host whose device 0 is a gfx950 and device 1
    is not, the rank on device 1 was told gfx950 (the FlyDSL path on a GPU its code objects do not fit),
    and the other way round a gfx950 rank was refused with "not gfx950"."""
    import torch

    archs = {0: "gfx950:sramecc+:xnack-", 1: "gfx942:sramecc+:xnack-"}
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"gcnArchName": archs[i]}))
    current = [1]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    assert toolchain.on_gfx950() is False
    current[0] = 0
    assert toolchain.on_gfx950() is True
    assert toolchain.on_gfx950(1) is False


def test_flydsl_missing_reason_is_the_seed_words():
    code = (
        "import sys; sys.modules['flydsl'] = None\n"
        "from dspark_sidecar.kernels.flydsl import toolchain as t\n"
        "print(t.flydsl_available()); print(t.flydsl_unavailable_reason())\n"
        "print(t.compile_only_unavailable_reason())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    available, reason, compile_reason = out.stdout.strip().splitlines()
    assert available == "False"
    assert reason.startswith("FlyDSL not installed")
    assert "pip install" in compile_reason  # says how to fix it


@pytest.mark.skipif(not toolchain.flydsl_available(), reason="flydsl not installed")
def test_amdgpu_linker_is_the_compile_roots_ld_lld():
    """Where gfx950 code objects can be built, the linker is an executable ld.lld under the root the
    compile-only setup uses (what Triton's AMD backend is pointed at in test_codegen_gfx950.py)."""
    if toolchain._compile_root()[0] is None:
        assert toolchain.amdgpu_linker() == toolchain._system_lld()
        return
    lld = toolchain.amdgpu_linker()
    assert lld.name == "ld.lld" and lld.parent.parent.parent == Path(toolchain._compile_root()[0])
    assert os.access(lld.resolve(), os.X_OK)


def test_compile_only_scope_restores_environment(monkeypatch):
    if toolchain.compile_only_unavailable_reason() is not None:
        pytest.skip(toolchain.compile_only_unavailable_reason())
    monkeypatch.delenv("COMPILE_ONLY", raising=False)
    monkeypatch.setenv("FLYDSL_GPU_ARCH", "gfx942")
    with toolchain.compile_only():
        assert os.environ["COMPILE_ONLY"] == "1"
        assert os.environ["FLYDSL_GPU_ARCH"] == "gfx950" and os.environ["ARCH"] == "gfx950"
        root = os.environ["ROCM_PATH"]
        assert os.path.exists(os.path.join(root, "llvm", "bin", "ld.lld"))
        assert os.path.isdir(os.path.join(root, "amdgcn", "bitcode"))
    assert "COMPILE_ONLY" not in os.environ
    assert os.environ["FLYDSL_GPU_ARCH"] == "gfx942"


ISA = """\t.amdgcn_target "amdgcn-amd-amdhsa-unknown-gfx950"
k_0:
\tv_mfma_f32_16x16x32_bf16 v[0:3], v[4:7], v[8:11], v[0:3]
\tbuffer_store_dwordx4 v[4:7], v1, s[8:11], 0 offen sc0 sc1
\tv_exp_f32_e32 v1, v2
\ts_endpgm
.Lfunc_end0:
\t.amdgpu_metadata
---
amdhsa.kernels:
  - .agpr_count:     0
    .args:
      - .offset:         0
        .size:           8
    .group_segment_fixed_size: 40960
    .max_flat_workgroup_size: 256
    .name:           k_0
    .private_segment_fixed_size: 0
    .sgpr_count:     20
    .sgpr_spill_count: 0
    .vgpr_count:     130
    .vgpr_spill_count: 0
amdhsa.target:   amdgcn-amd-amdhsa-unknown-gfx950
amdhsa.version:
  - 1
  - 2
...
\t.end_amdgpu_metadata
"""


def test_parse_isa_metadata_and_occupancy():
    (rep,) = isa_report.parse_isa(ISA)
    assert (rep.name, rep.vgpr_count, rep.lds_bytes, rep.workgroup_size) == ("k_0", 130, 40960, 256)
    # 130 VGPRs -> 136 allocated -> 3 waves/SIMD; 40 KB LDS -> 4 WGs/CU x 4 waves / 4 SIMDs = 4.
    assert rep.waves_per_simd == 3
    assert rep.count("v_mfma_f32_16x16x32_bf16") == 1
    assert rep.count("v_exp_f32") == 1  # the _e32 encoding suffix is accepted
    assert rep.count_lines(r"buffer_store_dwordx4\s.*\bsc0 sc1\b") == 1
    assert rep.count("v_mfma_scale_f32_16x16x128_f8f6f4") == 0


def kernel_report(vgprs: int, lds: int, threads: int) -> isa_report.KernelReport:
    return isa_report.KernelReport("k", vgprs, 0, 16, 0, 0, lds, 0, threads, isa="")


@pytest.mark.parametrize("vgprs, lds, threads, waves", [
    (100, 0, 256, 4),  # allocated in granules of 8: 104 VGPRs, 512 // 104 = 4 (not 512 // 100 = 5)
    (64, 64 * 1024, 256, 2),  # LDS-bound: 2 workgroups of 4 waves per CU, 2 waves per SIMD (VGPRs allow 8)
    (32, 16 * 1024, 64, 2),  # 10 one-wave workgroups per CU over 4 SIMDs
], ids=["vgpr-granule", "lds-bound", "one-wave-workgroups"])
def test_occupancy_counts_vgpr_granules_and_lds_per_workgroup(vgprs, lds, threads, waves):
    """waves_per_simd is what the compile test holds each kernel's design minimum against: an estimate
    that ignored the allocation granule or the LDS bound passed kernels that cannot reach that occupancy."""
    assert kernel_report(vgprs, lds, threads).waves_per_simd == waves


def test_count_lines_skips_comment_lines():
    """The budget's instruction checks count instructions; a comment that names one is not one."""
    commented = "\t; buffer_store_dwordx4 v[4:7], v1 sc0 sc1\n\ts_endpgm\n"
    (rep,) = isa_report.parse_isa(ISA.replace("\ts_endpgm\n", commented))
    assert rep.count_lines(r"buffer_store_dwordx4\s.*\bsc0 sc1\b") == 1


def test_parse_isa_gives_each_kernel_its_own_body():
    """A dump of two kernels: each report's ISA runs from its own label to its own .Lfunc_end."""
    second = ("k_1:\n\tv_exp_f32_e32 v1, v2\n\tv_exp_f32_e32 v3, v4\n\ts_endpgm\n.Lfunc_end1:\n"
              "\t.amdgpu_metadata")
    entry = ISA[ISA.index("  - .agpr_count"):ISA.index("amdhsa.target")].replace("k_0", "k_1")
    dump = ISA.replace("\t.amdgpu_metadata", second, 1).replace("amdhsa.target", entry + "amdhsa.target", 1)
    first, other = isa_report.parse_isa(dump)
    assert (first.name, other.name) == ("k_0", "k_1")
    assert (first.count("v_exp_f32"), other.count("v_exp_f32")) == (1, 2)
    assert other.count("v_mfma_f32_16x16x32_bf16") == 0


def test_parse_isa_rejects_a_dump_without_metadata():
    with pytest.raises(ValueError):
        isa_report.parse_isa("\tv_nop\n")


def test_hbm_floor_figures():
    from dspark_sidecar.kernels.flydsl import bench

    # 5 layers x (2304x6144 + 6144x2048 + 6144x6144 + 6144x3072) FP8 bytes, plus 1/32 of scales.
    assert bench.weight_bytes_per_rank() == 5 * 83_361_792 * 33 // 32
    assert bench.KV_BYTES_PER_TOKEN == 2560
    one = bench.hbm_floor_seconds(1, 100)
    assert one == pytest.approx((bench.weight_bytes_per_rank() + 107 * 2560) / 8e12)
    # The window caps the KV a request reads at 4102 keys.
    assert bench.hbm_floor_seconds(8, 100_000) == bench.hbm_floor_seconds(8, 4095)
    assert 60e-6 < bench.hbm_floor_seconds(8, 4096) < 70e-6


def test_bench_builds_the_attention_for_its_page_size(monkeypatch):
    """bench_rank(page_size=P) builds a block table of P-slot pages; the attention it timed was compiled for
    the catalog's 16 (its page size is compiled in), so it read past each request's block-table row."""
    pytest.importorskip("flydsl")  # attention.py is FlyDSL code: the optional `flydsl` extra
    from dspark_sidecar.kernels.flydsl import attention, bench

    built = []
    monkeypatch.setattr(attention, "build_attention", lambda num_reqs, page_size, kv_dtype="bf16": built.append(
        (num_reqs, page_size)))
    bench.launcher("attention", 3, 32)
    assert built == [(3, 32)]


@pytest.mark.parametrize("argv, words", [
    (["--iters", "0"], "--iters"),
    (["--context", "-1"], "--context"),
    (["--reqs", "1", "9"], "--reqs"),
    (["--reqs", "0"], "--reqs"),
])
def test_bench_refuses_figures_it_cannot_time(argv, words, capsys):
    """Refused before anything is compiled or timed: --iters 0 divided by zero after every compile, a
    request count past a launch raised from launch_plan, a negative context gave negative positions."""
    from dspark_sidecar.kernels.flydsl import bench

    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("key", isa_report._META_INT)
def test_parse_isa_refuses_metadata_missing_a_budget_field(key):
    """A field the budget test asserts on must be read, never assumed: a kernel entry without
    .vgpr_spill_count (or scratch, LDS, ...) parsed as 0 and passed the spill/scratch/LDS checks."""
    lines = ISA.splitlines()
    (i,) = [i for i, line in enumerate(lines) if line.lstrip(" -").startswith(f".{key}:")]
    if lines[i].startswith("  - "):  # the entry's first field: the next one opens the entry instead
        lines[i + 1] = "  - " + lines[i + 1].lstrip()
    dump = "\n".join(lines[:i] + lines[i + 1 :])
    with pytest.raises(ValueError, match=rf"k_0.*\.{key}"):
        isa_report.parse_isa(dump)


def test_parse_isa_reads_the_kernels_own_fields_not_its_args():
    """Kernel arguments may carry their own .name (LLVM emits one for each named IR argument);
    the kernel's name is the entry's top-level key, not the first argument's."""
    named = ISA.replace("      - .offset:         0\n", "      - .offset:         0\n        .name:           x\n")
    assert named != ISA
    (rep,) = isa_report.parse_isa(named)
    assert rep.name == "k_0" and rep.vgpr_count == 130


def test_parse_isa_rejects_metadata_without_a_kernel_list():
    with pytest.raises(ValueError, match="amdhsa.kernels"):
        isa_report.parse_isa(ISA.replace("amdhsa.kernels:", "amdhsa.kernelz:"))


def test_an_empty_flydsl_directory_is_not_an_installed_flydsl(tmp_path):
    """A `flydsl` directory without __init__.py on sys.path (a pip uninstall's leftovers, a checkout in
    the working directory) imports as an empty namespace package: FlyDSL is not installed, and the
    host check must say so, not report it available and fail at the first compile."""
    (tmp_path / "flydsl").mkdir()
    code = (
        "import importlib.util, os, sys\n"
        "spec = importlib.util.find_spec('flydsl')\n"
        "if spec is not None and spec.origin:\n"  # hide a real install: only the empty directory is left
        "    real = os.path.dirname(os.path.dirname(spec.origin))\n"
        "    sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != real]\n"
        f"sys.path.append({str(tmp_path)!r})\n"
        "from dspark_sidecar.kernels.flydsl import toolchain as t\n"
        "print(t.flydsl_available()); print(t.flydsl_unavailable_reason())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    available, reason = out.stdout.strip().splitlines()
    assert available == "False"
    assert reason.startswith("FlyDSL not installed")


@pytest.fixture
def lite_host(tmp_path, monkeypatch):
    """A host without a ROCm install whose system ld.lld (and, unless removed, device bitcode) lie
    under tmp_path; the rocm-lite root goes under tmp_path/cache. _compile_root is recomputed here
    and again afterwards, so the other tests see this machine's real answer."""
    lld = tmp_path / "llvm-19" / "bin" / "ld.lld"
    lld.parent.mkdir(parents=True)
    lld.write_text("#!/bin/sh\n")
    bitcode = tmp_path / "amdgcn" / "bitcode"
    bitcode.mkdir(parents=True)
    monkeypatch.setattr(toolchain, "_has_toolkit", lambda root: False)
    monkeypatch.setattr(toolchain, "_LLD_CANDIDATES", (str(lld),))
    monkeypatch.setattr(toolchain, "_BITCODE_CANDIDATES", (str(bitcode),))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    toolchain._compile_root.cache_clear()
    yield lld, bitcode
    toolchain._compile_root.cache_clear()


def test_amdgpu_linker_does_not_need_the_device_bitcode(lite_host, monkeypatch):
    """Triton's AMD backend brings its own ocml/ockl: it needs only ld.lld. With lld-19 installed and
    rocm-device-libs not, the linker is there (FlyDSL's compile-only setup is not): None sent the
    Triton gfx950 test to skip with 'no ld.lld for AMDGPU code objects'."""
    lld, _ = lite_host
    monkeypatch.setattr(toolchain, "_BITCODE_CANDIDATES", ("/nonexistent/amdgcn/bitcode",))
    assert toolchain._compile_root() == (None, f"no AMDGPU device bitcode ({toolchain.INSTALL_HINT})")
    assert toolchain.amdgpu_linker() is not None and toolchain.amdgpu_linker().resolve() == lld.resolve()


def test_lite_root_tolerates_a_concurrent_process_laying_it_out(lite_host, monkeypatch):
    """Two processes (two pytest runs, a test's child) lay out the same ~/.cache root: the other one
    may create a link between this one's check and its own symlink call. That raised FileExistsError
    out of compile_only_unavailable_reason() instead of using the (correct) link."""
    lld, bitcode = lite_host
    root = toolchain._lite_root_dir()
    (root / "llvm" / "bin").mkdir(parents=True)
    (root / "amdgcn").mkdir(parents=True)
    (root / "llvm" / "bin" / "ld.lld").symlink_to(lld)  # the other process's links, made
    (root / "amdgcn" / "bitcode").symlink_to(bitcode)  # just after this one looked
    real_exists, real_is_symlink = Path.exists, Path.is_symlink
    monkeypatch.setattr(Path, "exists", lambda p, *a, **k: root not in p.parents and real_exists(p, *a, **k))
    monkeypatch.setattr(Path, "is_symlink", lambda p: root not in p.parents and real_is_symlink(p))
    assert toolchain._compile_root() == (str(root), None)
    monkeypatch.undo()
    assert (root / "llvm" / "bin" / "ld.lld").resolve() == lld.resolve()
    assert (root / "amdgcn" / "bitcode").resolve() == bitcode.resolve()
    assert sorted(p.name for p in (root / "llvm" / "bin").iterdir()) == ["ld.lld"]  # no temporary left


def test_unwritable_cache_is_a_reason_not_a_crash(lite_host, monkeypatch, tmp_path):
    """compile_only_unavailable_reason() runs at the compile tests' import: a cache folder that cannot
    be written (read-only home, XDG_CACHE_HOME a file) must make them skip saying so, not raise."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    root, why = toolchain._compile_root()
    assert root is None and "XDG_CACHE_HOME" in why and str(blocker) in why
    assert toolchain.amdgpu_linker().resolve() == lite_host[0].resolve()  # linking needs no cache folder


def test_rocm_path_is_the_toolkit_only_with_both_linker_and_bitcode(tmp_path, monkeypatch):
    """A ROCm install at $ROCM_PATH (not /opt/rocm) is used as it is; one without the device bitcode
    (a partial install) is not: compiles that link ocml/ockl would fail there."""
    rocm = tmp_path / "rocm"
    (rocm / "llvm" / "bin").mkdir(parents=True)
    (rocm / "llvm" / "bin" / "ld.lld").write_text("#!/bin/sh\n")
    monkeypatch.setenv("ROCM_PATH", str(rocm))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    toolchain._compile_root.cache_clear()
    try:
        assert toolchain._compile_root()[0] != str(rocm)
        (rocm / "amdgcn" / "bitcode").mkdir(parents=True)
        toolchain._compile_root.cache_clear()
        assert toolchain._compile_root() == (str(rocm), None)
    finally:
        toolchain._compile_root.cache_clear()
