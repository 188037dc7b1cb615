"""The extent of the GPU allocation a device pointer lies in, asked of the CUDA or HIP driver.

Why: a CUDA/HIP IPC handle opens the exporter's whole allocation, and the engine's message says how
many bytes of it, from which offset, are the registered storage (`storage_size_bytes`,
`storage_offset_bytes`). torch's `rebuild_cuda_tensor` takes both on trust, so a storage that runs
past the allocation would be read and written past the mapping by the step's kernels: an illegal
address that, under MPS, can take the engine's CUDA context down with the sidecar's. The driver
knows the mapping's true extent (cuMemGetAddressRange / hipMemGetAddressRange).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch


class AllocationQueryError(RuntimeError):
    """The driver could not say which allocation holds a pointer."""


def _hip_library() -> ctypes.CDLL:
    """torch's own HIP runtime: the copy a pip ROCm torch carries in torch/lib first, then the system's.
    By its bare name the loader may miss torch's copy and search the system's paths: a second runtime,
    which knows nothing of torch's IPC mappings, or none (kernels/flydsl/peers.py loads the same way)."""
    bundled = os.path.join(os.path.dirname(torch.__file__), "lib", "libamdhip64.so")
    try:
        return ctypes.CDLL(bundled)
    except OSError:
        return ctypes.CDLL("libamdhip64.so")


@functools.cache
def _address_range():
    """The driver's address-range query as a ctypes function (base*, size*, ptr) -> status."""
    if torch.version.hip:
        lib, name = _hip_library(), "hipMemGetAddressRange"
    else:
        lib, name = ctypes.CDLL("libcuda.so.1"), "cuMemGetAddressRange_v2"
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return name, fn


def allocation_extent(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation (or IPC mapping) that holds `ptr`, in this process's
    current GPU context."""
    name, fn = _address_range()
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    status = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
    if status != 0:
        raise AllocationQueryError(f"{name}(0x{ptr:x}) failed with status {status}")
    return base.value, size.value


def bytes_left(ptr: int) -> int:
    """How many bytes from `ptr` to the end of its allocation."""
    base, size = allocation_extent(ptr)
    return base + size - ptr
