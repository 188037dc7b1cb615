"""Compile a FlyDSL launcher for gfx950 without a GPU and read its code object's metadata and ISA."""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import toolchain

# gfx950 (CDNA4): 512 unified VGPRs (arch + acc) per lane per SIMD, allocated in granules
# of 8; at most 8 waves per SIMD; 4 SIMDs and 160 KiB of LDS per CU.
VGPRS_PER_SIMD = 512
VGPR_GRANULE = 8
MAX_WAVES_PER_SIMD = 8
SIMDS_PER_CU = 4
LDS_PER_CU = 160 * 1024
WAVE_SIZE = 64


@dataclass
class KernelReport:
    """One kernel of a compiled code object: resource use from the AMDGPU metadata, and its ISA."""

    name: str
    vgpr_count: int
    agpr_count: int
    sgpr_count: int
    vgpr_spill_count: int
    sgpr_spill_count: int
    lds_bytes: int  # .group_segment_fixed_size
    scratch_bytes: int  # .private_segment_fixed_size
    workgroup_size: int  # .max_flat_workgroup_size
    isa: str = field(repr=False)

    @property
    def waves_per_simd(self) -> int:
        """Resident waves per SIMD allowed by registers and LDS (the occupancy)."""
        # No agpr_count added: on gfx90a and later (gfx950) AGPRs share the 512-entry file, and the code object's
        # .vgpr_count is already the total, align(VGPRs, 4) + AGPRs (LLVM's TotalNumVgprs).
        granules = -(-max(self.vgpr_count, 1) // VGPR_GRANULE) * VGPR_GRANULE
        by_vgpr = min(MAX_WAVES_PER_SIMD, VGPRS_PER_SIMD // granules)
        waves_per_wg = -(-self.workgroup_size // WAVE_SIZE)
        if self.lds_bytes:
            wgs_by_lds = LDS_PER_CU // self.lds_bytes
            by_lds = (wgs_by_lds * waves_per_wg) // SIMDS_PER_CU
            return min(by_vgpr, by_lds)
        return by_vgpr

    def count(self, mnemonic_regex: str) -> int:
        """How many instructions of the ISA match `mnemonic_regex` (anchored at the mnemonic;
        encoding suffixes such as _e32/_e64 are accepted)."""
        pat = re.compile(r"^\s+(?:" + mnemonic_regex + r")(?:_e32|_e64|_dpp|_sdwa)?\s", re.MULTILINE)
        return len(pat.findall(self.isa))

    def count_lines(self, line_regex: str) -> int:
        """How many ISA lines match `line_regex` anywhere (operands and cache bits included)."""
        pat = re.compile(line_regex)
        return sum(1 for line in self.isa.splitlines() if not line.lstrip().startswith(";") and pat.search(line))

    def summary(self) -> str:
        return (
            f"{self.name}: vgpr={self.vgpr_count} agpr={self.agpr_count} sgpr={self.sgpr_count} "
            f"spill(v/s)={self.vgpr_spill_count}/{self.sgpr_spill_count} lds={self.lds_bytes} "
            f"scratch={self.scratch_bytes} wg={self.workgroup_size} waves/SIMD={self.waves_per_simd}"
        )


_META_INT = (
    "vgpr_count",
    "agpr_count",
    "sgpr_count",
    "vgpr_spill_count",
    "sgpr_spill_count",
    "group_segment_fixed_size",
    "private_segment_fixed_size",
    "max_flat_workgroup_size",
)


def parse_isa(text: str) -> list[KernelReport]:
    """Split an ISA dump (assembly + amdgpu_metadata YAML) into per-kernel reports."""
    meta_start = text.find(".amdgpu_metadata")
    if meta_start < 0:
        raise ValueError("ISA dump has no .amdgpu_metadata section")
    meta = text[meta_start:]
    if "amdhsa.kernels:" not in meta:
        raise ValueError("ISA dump's .amdgpu_metadata has no amdhsa.kernels list")
    reports = []
    # Each kernel entry of amdhsa.kernels starts with "  - " at indent 2.
    kernels = meta.split("amdhsa.kernels:", 1)[1]
    kernels = re.split(r"\n(?=\S)", kernels, maxsplit=1)[0]  # up to the next top-level key
    for entry in re.split(r"\n  - ", kernels)[1:]:
        # The entry's own keys sit at indent 4 (its first one right after "  - "); deeper ones
        # belong to nested lists: an argument's .name is not the kernel's.
        entry = "    " + entry
        fields = {}
        for key in _META_INT + ("name",):
            m = re.search(r"^    \.?" + re.escape(key) + r":\s+(\S+)", entry, re.MULTILINE)
            if m:
                fields[key] = m.group(1)
        # Every field is required: a missing spill count or LDS size read as 0 would pass the
        # design-budget checks without the code object ever saying so.
        missing = [f".{key}" for key in _META_INT + ("name",) if key not in fields]
        if missing:
            raise ValueError(f"kernel {fields.get('name', '?')}: metadata lacks {', '.join(missing)}")
        name = fields["name"]
        body = _function_body(text, name)
        reports.append(
            KernelReport(
                name=name,
                vgpr_count=int(fields["vgpr_count"]),
                agpr_count=int(fields["agpr_count"]),
                sgpr_count=int(fields["sgpr_count"]),
                vgpr_spill_count=int(fields["vgpr_spill_count"]),
                sgpr_spill_count=int(fields["sgpr_spill_count"]),
                lds_bytes=int(fields["group_segment_fixed_size"]),
                scratch_bytes=int(fields["private_segment_fixed_size"]),
                workgroup_size=int(fields["max_flat_workgroup_size"]),
                isa=body,
            )
        )
    return reports


def _function_body(text: str, name: str) -> str:
    start = text.find(f"\n{name}:")
    end = text.find(".Lfunc_end", start)
    if start < 0 or end < 0:
        raise ValueError(f"no function body for {name} in the ISA dump")
    return text[start:end]


@contextlib.contextmanager
def _fresh_compile(launcher):
    """Compile `launcher` anew in this block, its earlier artifacts kept for afterwards.

    A FlyDSL launcher keeps each code object it built in memory and, called again with the same
    arguments, reuses it without compiling, so without dumping: the report of a launcher compiled
    before (an earlier report, the runner's compile_all) failed with "no ISA dump"."""
    cache = getattr(launcher, "_mem_cache", None)
    if not isinstance(cache, dict):
        yield
        return
    launcher._mem_cache = {}
    try:
        yield
    finally:
        launcher._mem_cache = {**cache, **launcher._mem_cache}


def compile_reports(launcher, *args, **kwargs) -> list[KernelReport]:
    """Compile `launcher` (a @flyc.jit function) for gfx950 with CPU tensors and parse its kernels.

    The final ISA is dumped through FLYDSL_DEBUG_DUMP_ASM into a private temporary folder; the
    dump carries the same metadata block the code object's note section holds.
    """
    import flydsl.compiler as flyc

    with tempfile.TemporaryDirectory(prefix="flydsl-isa-") as tmp, toolchain.compile_only():
        with toolchain.scoped_env({"FLYDSL_DEBUG_DUMP_ASM": "1", "FLYDSL_DUMP_DIR": tmp}), _fresh_compile(launcher):
            # FlyDSL prints one line per dump; keep test and tool output clean.
            with contextlib.redirect_stdout(io.StringIO()):
                flyc.compile(launcher, *args, **kwargs)
        dumps = sorted(Path(tmp).rglob("*final_isa.s"))
        if not dumps:
            # FlyDSL's ISA dump is best-effort: it logs its failure at debug level only.
            raise RuntimeError("FlyDSL produced no ISA dump (FLYDSL_DEBUG_LOG_LEVEL=DEBUG "
                               "FLYDSL_DEBUG_LOG_TO_CONSOLE=1 shows why)")
        reports = []
        for path in dumps:
            reports.extend(parse_isa(path.read_text()))
    return reports
