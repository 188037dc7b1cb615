"""A CUDA IPC handle's storage must lie inside the GPU allocation it opens (proto/gpu_alloc.py)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.proto import memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.gpu_alloc import AllocationQueryError

FIELD = "regions[0].memory"


def _handle(size: int, offset: int = 0) -> pb.CudaIpcHandle:
    return pb.CudaIpcHandle(device_uuid="GPU-this", ipc_handle=b"h", storage_size_bytes=size,
                            storage_offset_bytes=offset)


@pytest.fixture
def opened(monkeypatch):
    """_open_cuda_ipc on a CPU-only host: torch's rebuild stood in by a storage at 0x10_0000 whose
    allocation (per the stood-in driver) ends 4096 bytes further."""
    from torch.multiprocessing import reductions

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-this"))
    gpu = torch.device("cuda", 1)
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor",
                        lambda *a: SimpleNamespace(data_ptr=lambda: 0x10_0000, device=gpu))
    current = []  # the device made current around the driver query: the mapping's, not the thread's
    monkeypatch.setattr(torch.cuda, "device", lambda d: (current.append(d), contextlib.nullcontext())[1])
    monkeypatch.setattr(memory, "bytes_left", lambda ptr: (current[-1] == gpu or pytest.fail(current)) and 0x10_1000 - ptr)
    monkeypatch.setattr(memory, "QuietStream", lambda device: contextlib.nullcontext)  # no CUDA stream here
    return lambda h: memory._open_cuda_ipc(h, FIELD, torch.device("cuda", 0))


@pytest.mark.parametrize("offset", [0, 0x800])
def test_a_storage_inside_its_allocation_is_opened(opened, offset):
    assert opened(_handle(4096, offset)).data_ptr() == 0x10_0000


@pytest.mark.parametrize("offset", [0, 0x800])
def test_a_storage_past_its_allocation_is_refused_naming_the_sizes(opened, offset):
    with pytest.raises(memory.HandleError, match=rf"{re.escape(FIELD)}: storage_size_bytes 4097 runs past the end "
                                                 rf"of the GPU allocation the handle opens \(4096 bytes from "
                                                 rf"storage_offset_bytes {offset}, {4096 + offset} in all\)"):
        opened(_handle(4097, offset))


def test_a_handle_whose_allocation_cannot_be_asked_is_refused(opened, monkeypatch):
    def fails(ptr):
        raise AllocationQueryError("cuMemGetAddressRange_v2(0x100000) failed with status 1")
    monkeypatch.setattr(memory, "bytes_left", fails)
    with pytest.raises(memory.HandleError, match="cannot check the handle's storage .* refused rather than mapped"):
        opened(_handle(16))


def _export(conn, nbytes: int) -> None:
    """The engine's side, in a process of its own (a process cannot open its own IPC handles)."""
    from dspark_sidecar.proto.memory import export_handle

    t = torch.arange(nbytes, device="cuda:0", dtype=torch.int32).to(torch.uint8)
    torch.cuda.synchronize()
    conn.send(export_handle(t).SerializeToString())
    conn.recv()  # keep the tensor alive until the opener is done


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_driver_bounds_a_real_handle_s_storage():
    """Two processes on one GPU: the storage as exported opens and reads the engine's bytes; the same
    handle claiming 1 GiB more, or an offset past its allocation, is refused before any kernel reads it."""
    nbytes = 4 << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_export, args=(child, nbytes))
    proc.start()
    try:
        h = pb.MemoryHandle.FromString(parent.recv()).cuda_ipc
        dev = torch.device("cuda", 0)
        t = memory._open_cuda_ipc(pb.CudaIpcHandle.FromString(h.SerializeToString()), FIELD, dev)
        assert t.numel() == nbytes and torch.equal(t[:256].cpu(), torch.arange(256, dtype=torch.uint8))
        del t
        for size, offset in ((h.storage_size_bytes + (1 << 30), h.storage_offset_bytes),
                             (h.storage_size_bytes, h.storage_offset_bytes + (1 << 30))):
            bad = pb.CudaIpcHandle.FromString(h.SerializeToString())
            bad.storage_size_bytes, bad.storage_offset_bytes = size, offset
            with pytest.raises(memory.HandleError, match="runs past the end of the GPU allocation"):
                memory._open_cuda_ipc(bad, FIELD, dev)
    finally:
        parent.send("done")
        proc.join(timeout=60)


def test_on_rocm_the_query_goes_to_torch_s_own_hip_runtime_first(monkeypatch):
    """A pip ROCm torch carries libamdhip64 in torch/lib. Loaded by its bare name, the library is found
    only on the system's paths: a second HIP runtime (which knows nothing of torch's IPC mappings) or
    none, and then every CUDA IPC handle was refused as "cannot check". kernels/flydsl/peers.py loads
    torch's copy first for the same reason."""
    from dspark_sidecar.proto import gpu_alloc

    tried = []

    def cdll(name):
        tried.append(name)
        return SimpleNamespace(hipMemGetAddressRange=lambda *a: 0)

    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    monkeypatch.setattr(gpu_alloc.ctypes, "CDLL", cdll)
    gpu_alloc._address_range.cache_clear()
    try:
        assert gpu_alloc._address_range()[0] == "hipMemGetAddressRange"
    finally:
        gpu_alloc._address_range.cache_clear()
    assert tried[0] == os.path.join(os.path.dirname(torch.__file__), "lib", "libamdhip64.so")


@pytest.mark.parametrize("why", ["past its allocation", "driver not asked"])
def test_a_refused_storage_is_unmapped_at_once_on_a_quiet_stream(opened, monkeypatch, why):
    """torch synchronizes the current stream when it unmaps a CUDA IPC storage, and a handler thread's
    current stream is the rank's (QuietStream). The refused tensor was left to the exception's
    traceback, to go wherever and whenever that was freed, outside any QuietStream."""
    from torch.multiprocessing import reductions

    quiet, freed = [False], []

    class Mapping:
        def data_ptr(self):
            return 0x10_0000

        def __del__(self):
            freed.append(quiet[0])

    class Quiet:
        def __init__(self, device):
            assert device == torch.device("cuda", 0)

        @contextlib.contextmanager
        def __call__(self):
            quiet[0] = True
            yield
            quiet[0] = False

    def fails(ptr):
        raise AllocationQueryError("cuMemGetAddressRange_v2(0x100000) failed with status 1")

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: Mapping())
    monkeypatch.setattr(memory, "QuietStream", Quiet)
    if why == "driver not asked":
        monkeypatch.setattr(memory, "bytes_left", fails)
    with pytest.raises(memory.HandleError) as err:
        opened(_handle(4097))
    assert freed == [True], err.value  # while the exception (and its traceback) is still alive
