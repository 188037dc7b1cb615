"""The GPU driver libraries the data plane and the FlyDSL exchange call through ctypes, found one way for all.

torch exposes neither the CUDA driver's calls we need (address ranges, host registration, stream memory
operations) nor HIP's IPC of uncached memory, so `proto/gpu_alloc.py`, `proto/gpu_word.py` and
`kernels/flydsl/peers.py` reach them through ctypes. On ROCm the library must be torch's own HIP runtime:
a pip ROCm torch carries libamdhip64 in torch/lib, and loaded by its bare name the loader may miss that
copy and take the system's, a second runtime whose contexts, streams and IPC mappings are not torch's
(or find none). So every caller takes the same list, torch's copy first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

CUDA_DRIVER = "libcuda.so.1"  # the driver API's soname; the toolkit's unversioned libcuda.so is a build-time stub


def hip_runtime_candidates() -> list[str]:
    """Where libamdhip64 may be, in the order to try: torch/lib, $ROCM_PATH/lib, the loader's paths."""
    out = [os.path.join(os.path.dirname(torch.__file__), "lib", "libamdhip64.so"),
           os.path.join(os.environ.get("ROCM_PATH", "/opt/rocm"), "lib", "libamdhip64.so"), "libamdhip64.so"]
    found = ctypes.util.find_library("amdhip64")
    return out + ([found] if found and found not in out else [])


def hip_runtime() -> ctypes.CDLL:
    """The first of `hip_runtime_candidates` that loads; OSError naming each one tried and why where none does."""
    tried = []
    for name in hip_runtime_candidates():
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            tried.append(f"{name}: {exc}")
    raise OSError(f"HIP runtime (libamdhip64) not found; tried {'; '.join(tried)}")


def cuda_driver() -> ctypes.CDLL:
    """The CUDA driver library (OSError where the host has no driver mounted)."""
    return ctypes.CDLL(CUDA_DRIVER)
