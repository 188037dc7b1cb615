"""Whether the FlyDSL path can exist here: gfx950 detection, FlyDSL import, compile-only setup."""

from __future__ import annotations

import importlib.util
import os
import shutil
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

TARGET_ARCH = "gfx950"

# ld.lld links the assembled object into a code object; the device bitcode (ockl/ocml)
# is linked into kernels that call library maths. A full ROCm install has both under
# $ROCM_PATH; a CPU-only machine gets them from Debian's lld-19 and rocm-device-libs.
_LLD_CANDIDATES = (
    "/usr/lib/llvm-19/bin/ld.lld",
    "/usr/lib/llvm-20/bin/ld.lld",
    "/usr/lib/llvm-18/bin/ld.lld",
)
_BITCODE_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/amdgcn/bitcode",
    "/usr/lib/aarch64-linux-gnu/amdgcn/bitcode",
    "/usr/share/amdgcn/bitcode",
)
INSTALL_HINT = (
    "pip install 'flydsl>=0.5' && apt-get install -y lld-19 rocm-device-libs"
)


def flydsl_unavailable_reason() -> str | None:
    """Why FlyDSL cannot be imported here, or None when it can (checked without importing it)."""
    try:
        spec = importlib.util.find_spec("flydsl")
    except (ImportError, ValueError) as exc:
        return f"FlyDSL not installed ({exc})"
    if spec is None:
        return "FlyDSL not installed"
    if spec.origin is None:
        # A bare `flydsl` folder on sys.path (an uninstall's leftovers, a checkout in the working
        # directory) imports as an empty namespace package: flydsl.compiler is not there.
        where = ", ".join(spec.submodule_search_locations or ())
        return f"FlyDSL not installed (only a folder without __init__.py at {where})"
    return None


def flydsl_available() -> bool:
    """True when the `flydsl` package is importable (feeds the 'FlyDSL not installed' refusal)."""
    return flydsl_unavailable_reason() is None


def on_gfx950(device: int | None = None) -> bool:
    """True when `device` is a gfx950 (MI350/MI355X) through a ROCm torch; False on CPU.

    `device` defaults to torch's current device: a rank asks after torch.cuda.set_device(its GPU), so
    the answer is about the GPU its kernels run on, not device 0 (another GPU model on a mixed host).
    """
    try:
        import torch
    except ImportError:
        return False
    if getattr(torch.version, "hip", None) is None or not torch.cuda.is_available():
        return False
    try:
        index = torch.cuda.current_device() if device is None else device
        arch = torch.cuda.get_device_properties(index).gcnArchName
    except (RuntimeError, AttributeError):
        return False
    # gcnArchName carries target features after a colon, e.g. "gfx950:sramecc+:xnack-".
    return arch.split(":", 1)[0] == TARGET_ARCH


def _has_toolkit(root: Path) -> bool:
    return (root / "llvm" / "bin" / "ld.lld").exists() and (root / "amdgcn" / "bitcode").is_dir()


def _first_existing(paths: tuple[str, ...]) -> Path | None:
    for p in paths:
        if Path(p).exists():
            return Path(p)
    return None


def _lite_root_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dspark_sidecar" / "rocm-lite"


def _system_lld() -> Path | None:
    """The system's ld.lld (lld-19's, or any on PATH), or None."""
    lld = _first_existing(_LLD_CANDIDATES)
    if lld is None:
        which = shutil.which("ld.lld-19") or shutil.which("ld.lld")
        lld = Path(which) if which else None
    return lld


def _link(link: Path, target: Path) -> None:
    """Point `link` at `target`. Another process may lay out the same root at the same time: the
    link is made under a private name and renamed over `link`, so neither sees a FileExistsError."""
    if (link.is_symlink() or link.exists()) and link.resolve() == target.resolve():
        return
    tmp = link.with_name(f"{link.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def _make_lite_root() -> tuple[Path | None, str | None]:
    """Build a ROCm-shaped folder of symlinks to the system lld and device bitcode."""
    lld = _system_lld()
    if lld is None:
        return None, f"no ld.lld for AMDGPU linking ({INSTALL_HINT})"
    bitcode = _first_existing(_BITCODE_CANDIDATES)
    if bitcode is None:
        return None, f"no AMDGPU device bitcode ({INSTALL_HINT})"
    root = _lite_root_dir()
    try:
        (root / "llvm" / "bin").mkdir(parents=True, exist_ok=True)
        (root / "amdgcn").mkdir(parents=True, exist_ok=True)
        _link(root / "llvm" / "bin" / "ld.lld", lld)
        _link(root / "amdgcn" / "bitcode", bitcode)
    except OSError as exc:
        # A reason, not a raise: the compile tests ask at import, and must skip saying why.
        return None, (f"cannot lay out the compile-only toolkit at {root} ({exc}); "
                      "set XDG_CACHE_HOME to a writable folder, or ROCM_PATH to a ROCm install")
    return root, None


@lru_cache(maxsize=1)
def _compile_root() -> tuple[str | None, str | None]:
    for cand in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if cand and _has_toolkit(Path(cand)):
            return cand, None
    root, why = _make_lite_root()
    return (str(root) if root else None), why


def amdgpu_linker() -> Path | None:
    """The ld.lld that links AMDGPU code objects here (a ROCm install's, lld-19's through the
    symlinked root, or lld-19's itself where that root cannot be made), or None; also what
    Triton's AMD backend takes as TRITON_HIP_LLD_PATH."""
    root, _ = _compile_root()
    if root is not None:
        return Path(root) / "llvm" / "bin" / "ld.lld"
    # Linking needs no device bitcode (Triton brings its own ocml/ockl) nor the symlinked root.
    return _system_lld()


def compile_only_unavailable_reason() -> str | None:
    """Why gfx950 code objects cannot be built on this machine, or None."""
    why = flydsl_unavailable_reason()
    if why is not None:
        return f"{why} ({INSTALL_HINT})"
    _, why = _compile_root()
    return why


def enable_compile_only(arch: str = TARGET_ARCH) -> None:
    """Point FlyDSL at a toolkit and make every compile target `arch` without a GPU.

    FLYDSL_GPU_ARCH matters beyond ARCH: kernels that ask get_rocm_arch() would otherwise
    fall back to gfx942 code paths. COMPILE_ONLY stops FlyDSL before any HIP call, so a
    compile never needs (or touches) a device. Raises RuntimeError with the reason when the
    toolchain is missing.
    """
    why = compile_only_unavailable_reason()
    if why is not None:
        raise RuntimeError(f"FlyDSL compile-only unavailable: {why}")
    os.environ.update(_compile_only_vars(arch))


def _compile_only_vars(arch: str) -> dict[str, str]:
    root, _ = _compile_root()
    return {"ROCM_PATH": str(root), "COMPILE_ONLY": "1", "ARCH": arch, "FLYDSL_GPU_ARCH": arch}


@contextmanager
def scoped_env(values: dict[str, str]):
    """Set environment variables for the duration of a block, then restore them as they were."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def compile_only(arch: str = TARGET_ARCH):
    """enable_compile_only() for the duration of a block, then the environment as it was.

    Scoped so that a process which also launches kernels (a gfx950 host running the compile
    tests and the hardware tests) is not left in compile-only mode.
    """
    why = compile_only_unavailable_reason()
    if why is not None:
        raise RuntimeError(f"FlyDSL compile-only unavailable: {why}")
    with scoped_env(_compile_only_vars(arch)):
        yield
