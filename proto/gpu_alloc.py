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

import torch

from dspark_sidecar.proto.driver_lib import cuda_driver, hip_runtime


class AllocationQueryError(RuntimeError):
    """The driver could not say which allocation holds a pointer."""


@functools.cache
def _address_range():
    """The driver's address-range query as a ctypes function (base*, size*, ptr) -> status."""
    if torch.version.hip:
        lib, name = hip_runtime(), "hipMemGetAddressRange"
    else:
        lib, name = cuda_driver(), "cuMemGetAddressRange_v2"
    fn = getattr(lib, name)
    fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return name, fn


@functools.cache
def _cuda_context_calls() -> tuple:
    """(cuCtxGetCurrent, cuDevicePrimaryCtxRetain, cuCtxSetCurrent) as ctypes functions returning a status."""
    lib, vp = cuda_driver(), ctypes.c_void_p
    calls = []
    for name, argtypes in (("cuCtxGetCurrent", [ctypes.POINTER(vp)]),
                           ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), ctypes.c_int]),
                           ("cuCtxSetCurrent", [vp])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        calls.append((name, fn))
    return tuple(calls)


def bind_context(device_index: int) -> None:
    """Make the device's primary context current on the calling thread if the thread has none (CUDA).

    The driver answers a thread with no current context CUDA_ERROR_INVALID_CONTEXT (201), and torch's
    runtime binds a thread's context lazily, at the thread's first runtime call that needs one: a gRPC
    handler thread whose BindKV re-opened IPC handles torch had cached made no such call, and its
    query failed, refusing the bind (run 266). A context already current is left alone (after
    `torch.cuda.device(d)` it is d's). HIP's runtime binds its own: nothing to do there."""
    if torch.version.hip:
        return
    (get_name, get), (retain_name, retain), (set_name, set_current) = _cuda_context_calls()
    ctx = ctypes.c_void_p()
    _check(get_name, get(ctypes.byref(ctx)))
    if ctx.value:
        return
    _check(f"{retain_name}({device_index})", retain(ctypes.byref(ctx), device_index))
    _check(set_name, set_current(ctx))


def _check(what: str, status: int) -> None:
    if status != 0:
        raise AllocationQueryError(f"{what} failed with status {status}")


def allocation_extent(ptr: int, device_index: int | None = None) -> tuple[int, int]:
    """(base, size) of the device allocation (or IPC mapping) that holds `ptr`, in this process's
    current GPU context; with device_index, that device's primary context is made current first
    where the thread has none (bind_context)."""
    if device_index is not None:
        bind_context(device_index)
    name, fn = _address_range()
    base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    _check(f"{name}(0x{ptr:x})", fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)))
    return base.value, size.value


def bytes_left(ptr: int, device_index: int | None = None) -> int:
    """How many bytes from `ptr` to the end of its allocation (device_index: see allocation_extent)."""
    base, size = allocation_extent(ptr, device_index)
    return base + size - ptr
