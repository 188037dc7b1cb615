"""A CUDA IPC handle's storage must lie inside the GPU allocation it opens (proto/gpu_alloc.py)."""

from __future__ import annotations

import contextlib
import ctypes
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
    def bytes_left(ptr, device_index=None):  # asked with the mapping's device current, naming its index
        assert current[-1] == gpu and device_index == gpu.index, (current, device_index)
        return 0x10_1000 - ptr

    monkeypatch.setattr(memory, "bytes_left", bytes_left)
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


def test_an_offset_past_its_allocation_s_end_is_refused_naming_the_offset(opened, monkeypatch):
    """An allocation of 4096 bytes from its start and a storage_offset_bytes of 8192: the refusal said "-4096 bytes
    from storage_offset_bytes 8192", a negative room, where the offset is what to fix."""
    monkeypatch.setattr(memory, "bytes_left", lambda ptr, device_index=None: 4096)
    with pytest.raises(memory.HandleError, match=rf"{re.escape(FIELD)}: storage_offset_bytes 8192 is past the end of "
                                                 r"the GPU allocation the handle opens \(4096 bytes in all\)"):
        opened(_handle(16, 8192))


def test_a_storage_of_2_63_minus_1_bytes_is_torch_s_to_open_and_the_driver_s_to_bound(opened):
    """2^63 - 1 is the largest size torch unpacks (int64): the int64 refusal is for what lies past it only, and
    such a storage is refused by the allocation it opens, naming its size."""
    with pytest.raises(memory.HandleError, match=rf"{re.escape(FIELD)}: storage_size_bytes {(1 << 63) - 1} runs past "
                                                 "the end of the GPU allocation"):
        opened(_handle((1 << 63) - 1))


def test_a_handle_whose_allocation_cannot_be_asked_is_refused(opened, monkeypatch):
    def fails(ptr, device_index=None):
        raise AllocationQueryError("cuMemGetAddressRange_v2(0x100000) failed with status 1")
    monkeypatch.setattr(memory, "bytes_left", fails)
    with pytest.raises(memory.HandleUncheckable, match="cannot check the handle's storage .* refused rather than mapped"):
        opened(_handle(16))


def test_a_driver_without_the_query_is_a_refusal_for_good_not_a_transient_one(opened, monkeypatch):
    """A failed query may pass next time (UNAVAILABLE, retried); a missing library or symbol never will, so
    it stays the plain refusal (INVALID_ARGUMENT, which the shim reads as permanent)."""
    def missing(ptr, device_index=None):
        raise AttributeError("libcuda.so.1: undefined symbol: cuMemGetAddressRange_v2")
    monkeypatch.setattr(memory, "bytes_left", missing)
    with pytest.raises(memory.HandleError, match="cannot check the handle's storage") as got:
        opened(_handle(16))
    assert not isinstance(got.value, memory.HandleUncheckable)


def _export(conn, nbytes: int) -> None:
    """The engine's side, in a process of its own (a process cannot open its own IPC handles)."""
    from dspark_sidecar.proto.memory import export_handle

    t = torch.arange(nbytes, device="cuda:0", dtype=torch.int32).to(torch.uint8)
    torch.cuda.synchronize()
    conn.send(export_handle(t).SerializeToString())
    conn.recv()  # keep the tensor alive until the opener is done


@contextlib.contextmanager
def _exported(nbytes: int):
    """A CudaIpcHandle of `nbytes` exported by an engine process that keeps it alive for the block."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_export, args=(child, nbytes))
    proc.start()
    try:
        yield pb.MemoryHandle.FromString(parent.recv()).cuda_ipc
    finally:
        parent.send("done")
        proc.join(timeout=60)


def _copy(h: pb.CudaIpcHandle) -> pb.CudaIpcHandle:
    return pb.CudaIpcHandle.FromString(h.SerializeToString())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_driver_bounds_a_real_handle_s_storage():
    """Two processes on one GPU: the storage as exported opens and reads the engine's bytes; the same
    handle claiming 1 GiB more, or an offset past its allocation, is refused before any kernel reads it."""
    nbytes, dev = 4 << 20, torch.device("cuda", 0)
    with _exported(nbytes) as h:
        t = memory._open_cuda_ipc(_copy(h), FIELD, dev)
        assert t.numel() == nbytes and torch.equal(t[:256].cpu(), torch.arange(256, dtype=torch.uint8))
        del t
        for size, offset in ((h.storage_size_bytes + (1 << 30), h.storage_offset_bytes),
                             (h.storage_size_bytes, h.storage_offset_bytes + (1 << 30))):
            bad = _copy(h)
            bad.storage_size_bytes, bad.storage_offset_bytes = size, offset
            with pytest.raises(memory.HandleError, match="past the end of the GPU allocation"):
                memory._open_cuda_ipc(bad, FIELD, dev)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_handle_one_byte_past_its_allocation_s_start_is_refused_for_wider_dtypes():
    """Two processes on one GPU: the exported handle with storage_offset_bytes + 1 maps (the offset lands in
    the storage's pointer, storage_offset() stays 0), its bytes read as the engine's from byte 1, and a bf16
    or int64 view of it is a HandleError, not a 'misaligned address' fault at the first step (helper 81)."""
    nbytes, dev = 4 << 20, torch.device("cuda", 0)
    with _exported(nbytes) as h:
        off = _copy(h)
        off.storage_offset_bytes += 1
        off.storage_size_bytes -= 1
        m = memory.MappedMemory(pb.MemoryHandle(cuda_ipc=off), FIELD, dev)
        try:
            assert m.storage.storage_offset() == 0 and m.storage.data_ptr() % 2 == 1
            got = m.view(torch.uint8, (255,), (1,), 0, "layers[0]")
            assert torch.equal(got.cpu(), torch.arange(1, 256, dtype=torch.uint8))
            for dtype in (torch.bfloat16, torch.int64):
                with pytest.raises(memory.HandleError, match="layers\\[0\\]: the region starts 1 bytes past"):
                    m.view(dtype, (2, 8), (8, 1), 0, "layers[0]")
            del got
        finally:
            m.close()


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
        device = torch.device("cuda", 1)  # the fixture's mapping device: without it `t.device` was the refusal

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

    def fails(ptr, device_index=None):
        raise AllocationQueryError("cuMemGetAddressRange_v2(0x100000) failed with status 1")

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: Mapping())
    monkeypatch.setattr(memory, "QuietStream", Quiet)
    if why == "driver not asked":
        monkeypatch.setattr(memory, "bytes_left", fails)
    refusal = "runs past the end" if why == "past its allocation" else "failed with status 1"
    with pytest.raises(memory.HandleError, match=refusal) as err:  # each refusal, not the stand-in's missing attribute
        opened(_handle(4097))
    assert freed == [True], err.value  # while the exception (and its traceback) is still alive


class _Counter:
    """torch's producer reference of a handle, as the stood-in torch and _discard_cuda_ipc give it back."""

    def __init__(self, monkeypatch):
        self.given_back = 0
        monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter", self.give_back, raising=False)

    def give_back(self, *args, **kw):
        self.given_back += 1


def _held(nbytes: int):
    return SimpleNamespace(nbytes=lambda: nbytes)


def test_a_handle_opened_before_claiming_more_than_its_storage_is_refused_before_torch(opened, monkeypatch):
    """torch serves a second open of a handle from its cache, gives back that open's producer reference,
    and then fails with a RuntimeError if the open claims more bytes than the cached storage: a generic
    status for the engine, and a reference already given back. Refused first, with the sizes named, and
    the reference given back once, here."""
    from torch.multiprocessing import reductions

    counter = _Counter(monkeypatch)
    monkeypatch.setattr(reductions, "storage_from_cache", lambda cls, key: _held(4096) if key == (b"h", 0) else None)
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: pytest.fail("torch asked to open it"))
    h = _handle(8192)
    h.ref_counter_handle = b"/torch_counter"  # torch names its counter files /torch_*
    with pytest.raises(memory.HandleError, match=rf"{re.escape(FIELD)}: storage_size_bytes 8192 exceeds the 4096 "
                                                 "bytes of the storage this handle opened"):
        opened(h)
    assert counter.given_back == 1


def test_a_handle_opened_before_within_its_storage_is_left_to_torch(opened, monkeypatch):
    """The cached storage is big enough: torch opens it (and gives the reference back itself); the
    storage is held across torch's lookup, so it cannot expire in between."""
    from torch.multiprocessing import reductions

    counter, looked_up, alive = _Counter(monkeypatch), [], []

    class Held:
        def nbytes(self):
            return 4096

        def __del__(self):
            alive.append(False)

    real_rebuild = reductions.rebuild_cuda_tensor  # the fixture's stand-in

    def rebuild(*a):
        looked_up.append(not alive)  # the held storage not yet freed when torch looks it up
        return real_rebuild(*a)

    monkeypatch.setattr(reductions, "storage_from_cache", lambda cls, key: Held())
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    assert opened(_handle(4096)).data_ptr() == 0x10_0000
    assert looked_up == [True] and counter.given_back == 0


@pytest.mark.parametrize("torch_mapped", [False, True])
def test_a_handle_torch_cannot_open_is_an_invalid_argument_given_back_once(opened, monkeypatch, torch_mapped):
    """Bytes the driver will not open: a HandleError (INVALID_ARGUMENT) naming the field, not torch's
    RuntimeError. The producer reference is given back here only if torch mapped nothing; a storage
    torch did create gives it back when freed."""
    from torch.multiprocessing import reductions

    counter, cache = _Counter(monkeypatch), {}

    def rebuild(*a):
        if torch_mapped:
            cache["k"] = _held(4096)
        raise RuntimeError("CUDA error: invalid argument")

    monkeypatch.setattr(reductions, "storage_from_cache", lambda cls, key: cache.get("k"))
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    h = _handle(4096)
    h.ref_counter_handle = b"/torch_counter"  # torch names its counter files /torch_*
    with pytest.raises(memory.HandleError, match=rf"{re.escape(FIELD)}: the CUDA/HIP IPC handle cannot be opened "
                                                 r"on cuda:0: CUDA error: invalid argument"):
        opened(h)
    assert counter.given_back == (0 if torch_mapped else 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_handle_still_mapped_claiming_more_is_refused_and_the_mapping_kept():
    """Two processes on one GPU: with the first open still alive, the same handle opens again as
    exported (torch's cache), and claiming 1 MiB more is an INVALID_ARGUMENT HandleError, while the
    first mapping still reads the engine's bytes."""
    nbytes, dev = 4 << 20, torch.device("cuda", 0)
    with _exported(nbytes) as h:
        first = memory._open_cuda_ipc(_copy(h), FIELD, dev)
        again = memory._open_cuda_ipc(_copy(h), FIELD, dev)
        assert again.data_ptr() == first.data_ptr()
        del again
        bigger = _copy(h)
        bigger.storage_size_bytes += 1 << 20
        with pytest.raises(memory.HandleError, match=f"storage_size_bytes {bigger.storage_size_bytes} exceeds the "
                                                     f"{nbytes} bytes"):
            memory._open_cuda_ipc(bigger, FIELD, dev)
        assert torch.equal(first[:256].cpu(), torch.arange(256, dtype=torch.uint8))
        del first


@pytest.mark.parametrize("current", [0, 0xC0FFEE], ids=["thread-without-context", "context-current"])
def test_a_thread_without_a_context_gets_the_device_s_primary_one_first(monkeypatch, current):
    """The driver refuses a thread with no current context (status 201); a gRPC handler thread that
    re-opened cached IPC handles had none, and BindKV was refused (run 266). bind_context makes the
    device's primary context current there, and leaves a current one alone."""
    from dspark_sidecar.proto import gpu_alloc

    calls = []

    def get(ptr):
        ptr._obj.value = current or None
        return 0

    def retain(ptr, index):
        calls.append(("retain", index))
        ptr._obj.value = 0xAB
        return 0

    def set_current(ctx):
        calls.append(("set", ctx.value))
        return 0

    monkeypatch.setattr(gpu_alloc.torch.version, "hip", None)
    monkeypatch.setattr(gpu_alloc, "_cuda_context_calls", lambda: (("cuCtxGetCurrent", get),
                                                                    ("cuDevicePrimaryCtxRetain", retain),
                                                                    ("cuCtxSetCurrent", set_current)))
    gpu_alloc.bind_context(3)
    assert calls == ([] if current else [("retain", 3), ("set", 0xAB)])


def test_a_failed_context_call_is_an_allocation_query_error_naming_it(monkeypatch):
    from dspark_sidecar.proto import gpu_alloc

    def get(ptr):
        ptr._obj.value = None
        return 0

    monkeypatch.setattr(gpu_alloc.torch.version, "hip", None)
    monkeypatch.setattr(gpu_alloc, "_cuda_context_calls", lambda: (("cuCtxGetCurrent", get),
                                                                    ("cuDevicePrimaryCtxRetain", lambda p, i: 101),
                                                                    ("cuCtxSetCurrent", lambda c: 0)))
    with pytest.raises(AllocationQueryError, match=r"cuDevicePrimaryCtxRetain\(7\) failed with status 101"):
        gpu_alloc.bind_context(7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_fresh_thread_asks_the_driver_with_the_device_named():
    """Run 266's BindKV: the query from a thread torch's runtime never bound. Named, the device's context
    is made current and the allocation's extent comes back."""
    import threading

    from dspark_sidecar.proto.gpu_alloc import allocation_extent

    t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda:0")
    got = []
    th = threading.Thread(target=lambda: got.append(allocation_extent(t.data_ptr() + 100, 0)))
    th.start()
    th.join(30)
    assert got and got[0][0] <= t.data_ptr() and got[0][0] + got[0][1] >= t.data_ptr() + (1 << 20), got


def _driver(monkeypatch, status: int, base: int = 0x10_0000, size: int = 0x1000):
    """gpu_alloc's address-range query stood in by a driver answering `status` and, on success, (base, size)."""
    from dspark_sidecar.proto import gpu_alloc

    def query(pbase, psize, ptr):
        if status == 0:
            pbase._obj.value, psize._obj.value = base, size
        return status

    monkeypatch.setattr(gpu_alloc, "_address_range", lambda: ("cuMemGetAddressRange_v2", query))
    return gpu_alloc


def test_bytes_left_counts_from_the_pointer_to_the_allocation_s_end(monkeypatch):
    """Not the allocation's size: a storage at an offset inside it has only the rest (memory.py's bound)."""
    gpu_alloc = _driver(monkeypatch, 0)
    assert gpu_alloc.allocation_extent(0x10_0800) == (0x10_0000, 0x1000)
    assert gpu_alloc.bytes_left(0x10_0800) == 0x800 and gpu_alloc.bytes_left(0x10_0000) == 0x1000


@pytest.mark.parametrize("status", [1, 201])  # CUDA_ERROR_INVALID_VALUE (no allocation holds it), INVALID_CONTEXT
def test_a_driver_status_other_than_success_is_an_allocation_query_error(monkeypatch, status):
    """Any non-zero status: taken as success, the untouched (0, 0) extent read as a zero-byte allocation."""
    gpu_alloc = _driver(monkeypatch, status)
    with pytest.raises(AllocationQueryError, match=rf"cuMemGetAddressRange_v2\(0x100800\) failed with status {status}"):
        gpu_alloc.bytes_left(0x10_0800)


def test_the_query_gets_and_gives_back_addresses_past_4_gib_whole(monkeypatch):
    """The driver's entry point as ctypes.CDLL hands it out (a C function of the driver's own prototype): what
    _address_range declares is what ctypes marshals by. A pointer declared as (or left to default to) a C int
    reached the driver cut to 32 bits, and the extent of some other address came back."""
    from dspark_sidecar.proto import gpu_alloc

    asked, base, size = [], 0x7F00_0000_0000, 5 << 32

    def query(pbase, psize, ptr):
        asked.append(ptr)
        pbase[0], psize[0] = base, size
        return 0

    c_query = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                               ctypes.c_uint64)(query)
    lib = SimpleNamespace(cuMemGetAddressRange_v2=ctypes.CFUNCTYPE(ctypes.c_int)(
        ctypes.cast(c_query, ctypes.c_void_p).value))
    monkeypatch.setattr(gpu_alloc.torch.version, "hip", None)
    monkeypatch.setattr(gpu_alloc.ctypes, "CDLL", lambda name: lib)
    gpu_alloc._address_range.cache_clear()
    try:
        ptr = 0x7F01_2345_6780
        assert gpu_alloc.allocation_extent(ptr) == (base, size) and gpu_alloc.bytes_left(ptr) == base + size - ptr
    finally:
        gpu_alloc._address_range.cache_clear()
    assert asked == [ptr, ptr]


def _context_driver(monkeypatch, device: int) -> list:
    """The context calls and the query of a driver that answers 201 (CUDA_ERROR_INVALID_CONTEXT) unless `device`'s
    primary context (0x1000 + device) is current; returns [the current context]."""
    from dspark_sidecar.proto import gpu_alloc

    current = [None]

    def get(ptr):
        ptr._obj.value = current[0]
        return 0

    def retain(ptr, index):
        ptr._obj.value = 0x1000 + index
        return 0

    def set_current(ctx):
        current[0] = ctx.value
        return 0

    def query(pbase, psize, ptr):
        if current[0] != 0x1000 + device:
            return 201
        pbase._obj.value, psize._obj.value = 0x10_0000, 0x1000
        return 0

    monkeypatch.setattr(gpu_alloc, "_cuda_context_calls", lambda: (("cuCtxGetCurrent", get),
                                                                    ("cuDevicePrimaryCtxRetain", retain),
                                                                    ("cuCtxSetCurrent", set_current)))
    monkeypatch.setattr(gpu_alloc, "_address_range", lambda: ("cuMemGetAddressRange_v2", query))
    return current


@pytest.mark.parametrize("device", [0, 2])
def test_a_named_device_s_context_is_current_before_the_query(monkeypatch, device):
    """Run 266's refusal (status 201 from a thread with no context) on every device, device 0 (the one most ranks
    run on, and a falsy index) included, and the context made current before the driver is asked, not after."""
    from dspark_sidecar.proto import gpu_alloc

    monkeypatch.setattr(gpu_alloc.torch.version, "hip", None)
    current = _context_driver(monkeypatch, device)
    assert gpu_alloc.bytes_left(0x10_0800, device) == 0x800
    assert current == [0x1000 + device]


def test_on_rocm_no_cuda_context_is_asked_for(monkeypatch):
    """HIP's runtime binds its own context: there is no libcuda to ask, and asking it refused every handle's check."""
    from dspark_sidecar.proto import gpu_alloc

    def query(pbase, psize, ptr):
        pbase._obj.value, psize._obj.value = 0x10_0000, 0x1000
        return 0

    monkeypatch.setattr(gpu_alloc.torch.version, "hip", "6.2.0")
    monkeypatch.setattr(gpu_alloc, "_cuda_context_calls", lambda: pytest.fail("libcuda's context calls asked on ROCm"))
    monkeypatch.setattr(gpu_alloc, "_address_range", lambda: ("hipMemGetAddressRange", query))
    assert gpu_alloc.bytes_left(0x10_0800, 1) == 0x800
