"""The doorbell's GPU word: its packing, and what the driver binding does where there is no GPU."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading

import numpy as np
import pytest
import torch

from dspark_sidecar.proto import driver_lib
from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto.gpu_word import DevicePointer, GpuWordError, GpuWordOps, RegisteredPage


def test_word_packs_sequence_high_and_key_low():
    w = bell.gpu_word(0x1234, 0xABCD)
    assert w >> 32 == 0x1234 and w & 0xFFFFFFFF == 0xABCD
    # The sidecar's wait is "word >= seq << 32": any key of that sequence passes it, the next
    # sequence's wait does not, and a sequence past 2^32 wraps as the driver's compare does.
    assert bell.gpu_word(7, bell.SKIP_KEY) >= bell.gpu_word(7, 0) > bell.gpu_word(6, bell.SKIP_KEY)
    assert bell.gpu_word(1 << 32, 3) == bell.gpu_word(0, 3)


def test_page_word_is_the_sixth_header_word():
    buf = np.zeros(bell.HEADER + 2 * 64, np.uint8)
    page = bell.Page(buf, 64)
    page.words[bell.GPU_WORD] = bell.gpu_word(5, 9)
    assert buf[bell.GPU_WORD_OFFSET : bell.GPU_WORD_OFFSET + 8].view(np.uint64)[0] == bell.gpu_word(5, 9)
    assert bell.GPU_WORD_OFFSET + 8 <= bell.HEADER


def test_no_ops_without_a_gpu():
    """On a CPU device (or a host without a driver) steps are simply not pre-launched."""
    assert GpuWordOps.load(torch.device("cpu")) is None
    if not torch.cuda.is_available():
        assert GpuWordOps.load(torch.device("cuda", 0)) is None


class _Ops:
    def __init__(self):
        self.calls = []

    def register(self, ptr, nbytes):
        self.calls.append(("register", ptr, nbytes))
        return ptr + 0x1000

    def unregister(self, ptr):
        self.calls.append(("unregister", ptr))


def test_registered_page_is_page_aligned_and_closed_once():
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    ops = _Ops()
    with pytest.raises(GpuWordError, match="page-aligned"):
        RegisteredPage(ops, base + 8)
    page = RegisteredPage(ops, base)
    assert page.device_ptr == base + 0x1000
    page.close()
    page.close()
    assert ops.calls == [("register", base, mmap.PAGESIZE), ("unregister", base)]



def test_registrations_of_the_same_pages_are_shared_until_the_last_close():
    """The driver refuses pages already registered: a second holder of the same pages (a replaced
    doorbell's pre-launch and its successor's, server/prelaunch.py) shares the first one's registration,
    and the last close ends it."""
    buf = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    ops = _Ops()
    old, new = RegisteredPage(ops, base, 4 * mmap.PAGESIZE), RegisteredPage(ops, base, 4 * mmap.PAGESIZE)
    assert new.device_ptr == old.device_ptr and ops.calls == [("register", base, 4 * mmap.PAGESIZE)]
    with pytest.raises(GpuWordError, match="registered for"):  # pages past the registration: not covered
        RegisteredPage(ops, base, 8 * mmap.PAGESIZE)
    old.close()
    old.close()
    assert ops.calls == [("register", base, 4 * mmap.PAGESIZE)]
    new.close()
    assert ops.calls[1:] == [("unregister", base)]
    RegisteredPage(ops, base).close()  # registered afresh once the last holder has closed
    assert ops.calls[2:] == [("register", base, mmap.PAGESIZE), ("unregister", base)]

def test_device_pointer_is_what_triton_reads():
    p = DevicePointer(0xDEAD000, torch.int64)
    assert p.data_ptr() == 0xDEAD000 and p.dtype == torch.int64


class _FakeCudaDriver:
    """The few driver entry points _bind uses, with a per-thread current context as CUDA keeps it.

    Contexts are 0x1000 + device: torch's `torch.cuda.device(i)` makes device i's primary context
    current on the thread, which `switch` stands in for.
    """

    def __init__(self):
        self._tls = __import__("threading").local()
        self.retained: list[int] = []
        self.ops: list[tuple[str, int]] = []  # (call, device of the context current when it ran)
        self.failing: set[str] = set()  # calls answered with an error
        for name in ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuDevicePrimaryCtxRetain", "cuCtxGetDevice",
                     "cuMemHostRegister_v2", "cuMemHostUnregister", "cuMemHostGetDevicePointer_v2",
                     "cuStreamWriteValue64_v2", "cuEventRecord", "cuStreamWaitValue64_v2", "cuStreamWaitEvent",
                     "cuMemcpyDtoDAsync_v2"):
            setattr(self, name, self._entry(name))

    def switch(self, device):
        self._tls.ctx = None if device is None else 0x1000 + device

    def _current(self):
        return getattr(self._tls, "ctx", None)

    def _entry(self, name):
        def call(*args):
            ctx = self._current()
            if name == "cuCtxGetCurrent":
                args[0]._obj.value = ctx
            elif name == "cuCtxSetCurrent":
                self._tls.ctx = args[0].value
            elif name == "cuDevicePrimaryCtxRetain":
                self.retained.append(args[1])
                args[0]._obj.value = 0x1000 + args[1]
            elif name == "cuCtxGetDevice":
                args[0]._obj.value = ctx - 0x1000
            else:
                self.ops.append((name, ctx - 0x1000))
                if name in self.failing:
                    return 1  # CUDA_ERROR_INVALID_VALUE
                if name == "cuMemHostGetDevicePointer_v2":
                    args[0]._obj.value = 0xD000
            return 0

        return call


def test_registrations_check_the_current_context_after_torch_switches_it():
    """One thread driving two GPUs: a context switch made behind the ops' back is seen, not cached."""
    drv = _FakeCudaDriver()
    gpu0, gpu1 = GpuWordOps(drv, hip=False, device_index=0), GpuWordOps(drv, hip=False, device_index=1)

    drv.switch(None)  # a fresh thread: gpu0 retains and binds device 0's primary context
    gpu0.register(0xA000, mmap.PAGESIZE)
    assert drv.retained == [0] and drv.ops[-1] == ("cuMemHostGetDevicePointer_v2", 0)

    drv.switch(1)  # torch.cuda.device(1): device 1's context is current now
    # gpu0 bound device 0 on this thread before; a cached "bound" would let this unregister run
    # in device 1's context. It must refuse with the device named instead.
    with pytest.raises(GpuWordError, match="device 1, not 0"):
        gpu0.unregister(0xA000)
    assert drv.ops[-1] == ("cuMemHostGetDevicePointer_v2", 0)
    gpu1.register(0xB000, mmap.PAGESIZE)
    assert drv.ops[-1] == ("cuMemHostGetDevicePointer_v2", 1)

    drv.switch(0)  # the `with torch.cuda.device(0)` a caller wraps around device 0's calls
    gpu0.unregister(0xA000)
    assert drv.ops[-1] == ("cuMemHostUnregister", 0)
    assert drv.retained == [0], "a context already current is used, not retained again"


def test_stream_operations_need_only_some_context_on_the_thread():
    """The driver runs a stream operation in its stream's context (run 132), so any current one will do."""
    drv = _FakeCudaDriver()
    gpu0 = GpuWordOps(drv, hip=False, device_index=0)
    drv.switch(1)  # another GPU's context is current: no refusal, nothing retained
    gpu0.write(0x5, 0xD000, 1)
    gpu0.record(type("E", (), {"cuda_event": 0})(), 0x5)
    gpu0.wait_event(0x5, type("E", (), {"cuda_event": 0})())
    gpu0.copy(0x5, 0xE000, 0xF000, 64)
    assert [op for op, _ in drv.ops] == ["cuStreamWriteValue64_v2", "cuEventRecord", "cuStreamWaitEvent",
                                         "cuMemcpyDtoDAsync_v2"]
    assert drv.retained == []


_EVENT = type("E", (), {"cuda_event": 0x77})()


def _null_stream_calls(ops):
    """Every stream operation, each on stream handle 0: torch's default stream, as _raw_stream gives it."""
    ops.write(0, 0xD000, 1)
    ops.record(_EVENT, 0)
    ops.wait_event(0, _EVENT)
    ops.wait_geq(0, 0xD000, 1)
    ops.copy(0, 0xE000, 0xF000, 64)


@pytest.mark.parametrize("known", [False, True], ids=["context_not_seen_yet", "context_seen_before"])
def test_null_stream_operations_run_with_this_device_s_context_current(known):
    """Stream handle 0 is the NULL stream of the thread's current context, not of the ops' GPU: with
    another GPU's context current the word's write went to that GPU (ahead of this one's input copies),
    and the engine's wait for the sidecar's outputs held up the other GPU's stream instead of its own."""
    drv = _FakeCudaDriver()
    gpu0 = GpuWordOps(drv, hip=False, device_index=0)
    if known:  # a registration made device 0's context current once
        drv.switch(0)
        gpu0.register(0xA000, mmap.PAGESIZE)
        drv.ops.clear()
    drv.switch(1)  # torch.cuda.device(1), or a thread torch bound to its default device
    _null_stream_calls(gpu0)
    assert drv.ops == [("cuStreamWriteValue64_v2", 0), ("cuEventRecord", 0), ("cuStreamWaitEvent", 0),
                       ("cuStreamWaitValue64_v2", 0), ("cuMemcpyDtoDAsync_v2", 0)]
    assert drv._current() == 0x1001, "the caller's context is current again after each call"
    assert drv.retained == ([] if known else [0]), "device 0's context is retained once, and only if unseen"

    drv.ops.clear()
    drv.switch(0)  # this device's context already current: nothing switched
    _null_stream_calls(gpu0)
    assert [dev for _, dev in drv.ops] == [0, 0, 0, 0, 0] and drv._current() == 0x1000


def test_a_null_stream_operation_refused_still_restores_the_caller_s_context():
    drv = _FakeCudaDriver()
    gpu0 = GpuWordOps(drv, hip=False, device_index=0)
    drv.switch(1)
    drv.failing.add("cuStreamWriteValue64_v2")
    with pytest.raises(GpuWordError, match="cuStreamWriteValue64_v2 failed"):
        gpu0.write(0, 0xD000, 1)
    assert drv.ops == [("cuStreamWriteValue64_v2", 0)] and drv._current() == 0x1001


class _FakeHipDriver:
    """HIP's entry points: the NULL stream is the thread's current device's (hipSetDevice)."""

    def __init__(self, device=0):
        self.device, self.ops = device, []
        for name in ("hipHostRegister", "hipHostUnregister", "hipHostGetDevicePointer", "hipStreamWriteValue64",
                     "hipEventRecord", "hipStreamWaitValue64", "hipStreamWaitEvent", "hipGetDevice", "hipSetDevice",
                     "hipMemcpyDtoDAsync"):
            setattr(self, name, self._entry(name))

    def _entry(self, name):
        def call(*args):
            if name == "hipGetDevice":
                args[0]._obj.value = self.device
            elif name == "hipSetDevice":
                self.device = args[0]
            else:
                self.ops.append((name, self.device))
            return 0

        return call


def test_hip_null_stream_operations_run_on_this_device():
    drv = _FakeHipDriver(device=1)
    gpu0 = GpuWordOps(drv, hip=True, device_index=0)
    _null_stream_calls(gpu0)
    assert drv.ops == [("hipStreamWriteValue64", 0), ("hipEventRecord", 0), ("hipStreamWaitEvent", 0),
                       ("hipStreamWaitValue64", 0), ("hipMemcpyDtoDAsync", 0)]
    assert drv.device == 1
    drv.ops.clear()
    gpu0.write(0x5, 0xD000, 1)  # a stream of its own: no device switch
    assert drv.ops == [("hipStreamWriteValue64", 1)]


# The probe's driver calls, whether it passes or fails at its wait or its read-back: the page registered, the word
# written and waited on, the stream synchronized, the page unregistered.
_PROBE_CALLS = ["cuMemHostRegister_v2", "cuMemHostGetDevicePointer_v2", "cuStreamWriteValue64_v2",
                "cuStreamWaitValue64_v2", "synchronize", "cuMemHostUnregister"]


def _probe_on_a_fake_stream(monkeypatch, drv) -> None:
    """The probe's stream and device as torch would give them, its synchronize recorded among the driver's calls."""
    class Stream:
        cuda_stream = 0x5

        def synchronize(self):
            drv.ops.append(("synchronize", 0))

    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())


def test_a_failed_probe_waits_for_its_queued_write_before_unregistering(monkeypatch):
    """The probe queues a write to its page, then a wait: a wait the driver refuses (a device without 64-bit
    waits, hipDeviceAttributeCanUseStreamWaitValue) left the write queued while the page was unregistered
    and unmapped under it."""
    drv = _FakeCudaDriver()
    ops = GpuWordOps(drv, hip=False, device_index=0)
    drv.switch(0)
    drv.failing.add("cuStreamWaitValue64_v2")
    _probe_on_a_fake_stream(monkeypatch, drv)
    with pytest.raises(GpuWordError, match="cuStreamWaitValue64_v2 failed"):
        ops._probe(torch.device("cuda", 0))
    assert [op for op, _ in drv.ops] == _PROBE_CALLS


def test_a_new_thread_binds_its_device_once():
    drv = _FakeCudaDriver()
    ops = GpuWordOps(drv, hip=False, device_index=3)
    seen = []

    def worker():
        drv.switch(None)  # a thread torch never bound: the first stream operation binds device 3
        ops.wait_geq(0, 0xD000, 5)
        ops.write(0, 0xD000, 6)
        ops.register(0xA000, mmap.PAGESIZE)
        seen.append(list(drv.ops))

    t = __import__("threading").Thread(target=worker)
    t.start()
    t.join()
    assert seen == [[("cuStreamWaitValue64_v2", 3), ("cuStreamWriteValue64_v2", 3), ("cuMemHostRegister_v2", 3),
                     ("cuMemHostGetDevicePointer_v2", 3)]]
    assert drv.retained == [3]


def test_a_thread_with_no_context_gets_one_before_its_first_operation_on_its_own_stream():
    """The driver refuses any call from a thread with no current context (_any_context): a thread torch never
    bound (an engine's own, the doorbell's before torch's first call there) retains the device's primary
    context for its first operation on a stream of its own, and a thread that has one keeps it."""
    drv = _FakeCudaDriver()
    ops = GpuWordOps(drv, hip=False, device_index=2)
    seen = []

    def worker(start):
        drv.switch(start)
        ops.write(0x5, 0xD000, 6)
        ops.wait_geq(0x5, 0xD000, 6)
        seen.append((list(drv.ops), list(drv.retained)))
        drv.ops.clear()

    for start in (None, 1):  # a fresh thread each: no context, then another GPU's (kept: the stream's own is used)
        t = __import__("threading").Thread(target=worker, args=(start,))
        t.start()
        t.join()
    assert seen == [([("cuStreamWriteValue64_v2", 2), ("cuStreamWaitValue64_v2", 2)], [2]),
                    ([("cuStreamWriteValue64_v2", 1), ("cuStreamWaitValue64_v2", 1)], [2])]


def test_a_registration_whose_device_address_cannot_be_read_is_undone():
    """register() page-locks, then asks the device address: a failure there raised with the pages still
    registered and no caller holding them to undo it."""
    drv = _FakeCudaDriver()
    ops = GpuWordOps(drv, hip=False, device_index=0)
    drv.switch(0)
    drv.failing.add("cuMemHostGetDevicePointer_v2")
    with pytest.raises(GpuWordError, match="cuMemHostGetDevicePointer_v2 failed with driver code 1"):
        ops.register(0xA000, mmap.PAGESIZE)
    assert [op for op, _ in drv.ops] == ["cuMemHostRegister_v2", "cuMemHostGetDevicePointer_v2",
                                         "cuMemHostUnregister"]


class _CDriver:
    """Entry points that are real C functions of the driver's own prototypes (ctypes callbacks), reached as
    foreign functions the way ctypes.CDLL hands them out: what GpuWordOps declares (argtypes) is what ctypes
    marshals by, and each entry records what C received. The Python fakes above take any argument as it is
    given, so a 64-bit value or pointer declared as (or left to default to) a C int passed them unchanged."""

    VP, U64, UINT, SIZE, INT = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_int
    CUDA = {
        "cuCtxGetCurrent": [ctypes.POINTER(VP)], "cuCtxSetCurrent": [VP],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(VP), INT], "cuCtxGetDevice": [ctypes.POINTER(INT)],
        "cuMemHostRegister_v2": [VP, SIZE, UINT], "cuMemHostUnregister": [VP],
        "cuMemHostGetDevicePointer_v2": [ctypes.POINTER(U64), VP, UINT],
        "cuStreamWriteValue64_v2": [VP, U64, U64, UINT], "cuEventRecord": [VP, VP],
        "cuStreamWaitValue64_v2": [VP, U64, U64, UINT], "cuStreamWaitEvent": [VP, VP, UINT],
        "cuMemcpyDtoDAsync_v2": [U64, U64, SIZE, VP],
    }
    HIP = {
        "hipHostRegister": [VP, SIZE, UINT], "hipHostUnregister": [VP],
        "hipHostGetDevicePointer": [ctypes.POINTER(VP), VP, UINT],
        "hipStreamWriteValue64": [VP, VP, U64, UINT], "hipEventRecord": [VP, VP],
        "hipStreamWaitValue64": [VP, VP, U64, UINT, U64], "hipStreamWaitEvent": [VP, VP, UINT],
        "hipMemcpyDtoDAsync": [VP, VP, SIZE, VP], "hipGetDevice": [ctypes.POINTER(INT)], "hipSetDevice": [INT],
    }
    CTX, PRIMARY, DEVICE_PTR = 0x7F88_0000_1000, 0x7F99_0000_2000, 0x7F77_0000_0000  # all past 4 GiB

    def __init__(self, hip: bool):
        self.calls: list[tuple] = []
        self.ctx, self.device = self.CTX, 1  # the thread's current context (HIP: device), another GPU's
        self._keep = []
        for name, proto in (self.HIP if hip else self.CUDA).items():
            cb = ctypes.CFUNCTYPE(ctypes.c_int, *proto)(self._entry(name))
            self._keep.append(cb)
            setattr(self, name, ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.cast(cb, ctypes.c_void_p).value))

    def _entry(self, name):
        def call(*args):
            if name in ("cuCtxGetCurrent",):
                args[0][0] = self.ctx
            elif name == "cuDevicePrimaryCtxRetain":
                args[0][0] = self.PRIMARY
            elif name == "cuCtxGetDevice":
                args[0][0] = 1 if self.ctx == self.CTX else 0
            elif name == "hipGetDevice":
                args[0][0] = self.device
            elif name in ("cuMemHostGetDevicePointer_v2", "hipHostGetDevicePointer"):
                args[0][0] = self.DEVICE_PTR
                self.calls.append((name, *args[1:]))
            else:
                if name == "cuCtxSetCurrent":
                    self.ctx = args[0]
                elif name == "hipSetDevice":
                    self.device = args[0]
                self.calls.append((name, *args))
            return 0

        return call


@pytest.mark.parametrize("hip", [False, True], ids=["cuda", "hip"])
def test_every_driver_call_gets_64_bit_values_and_pointers_past_4_gib_whole(hip):
    drv = _CDriver(hip)
    ops = GpuWordOps(drv, hip=hip, device_index=0)
    stream, addr, value = 0x7F12_0000_0010, 0x7F34_5678_9008, 0xFFFF_FFFE_0000_0007  # the value past 2^63
    event = type("E", (), {"cuda_event": 0x7F55_0000_0040})()
    host, nbytes = 0x7F66_0000_0000, 5 << 32
    drv.calls.clear()
    if not hip:
        drv.ctx = _CDriver.PRIMARY  # device 0's context current for the registration (_bind)
    assert ops.register(host, nbytes) == _CDriver.DEVICE_PTR
    ops.unregister(host)
    ops.write(stream, addr, value)
    ops.wait_geq(stream, addr, value)
    ops.record(event, stream)
    ops.wait_event(stream, event)
    ops.copy(stream, addr, addr + (1 << 33), nbytes)
    n = "hip" if hip else "cu"
    v2 = "" if hip else "_v2"
    wait = (f"{n}StreamWaitValue64{v2}", stream, addr, value, 0) + ((0xFFFF_FFFF_FFFF_FFFF,) if hip else ())
    assert drv.calls == [
        ("hipHostRegister" if hip else "cuMemHostRegister_v2", host, nbytes, 3),
        ("hipHostGetDevicePointer" if hip else "cuMemHostGetDevicePointer_v2", host, 0),
        ("hipHostUnregister" if hip else "cuMemHostUnregister", host),
        (f"{n}StreamWriteValue64{v2}", stream, addr, value, 0),
        wait,
        (f"{n}EventRecord", event.cuda_event, stream),
        (f"{n}StreamWaitEvent", stream, event.cuda_event, 0),
        ("hipMemcpyDtoDAsync" if hip else "cuMemcpyDtoDAsync_v2", addr, addr + (1 << 33), nbytes, stream),
    ]
    # Stream handle 0 with another GPU current: this device's context (HIP: device) for the call, the caller's after.
    drv.calls.clear()
    drv.ctx, drv.device = _CDriver.CTX, 1
    fresh = GpuWordOps(drv, hip=hip, device_index=0)
    fresh.write(0, addr, value)
    switch = [("hipSetDevice", 0)] if hip else [("cuCtxSetCurrent", _CDriver.PRIMARY)]
    back = [("hipSetDevice", 1)] if hip else [("cuCtxSetCurrent", _CDriver.CTX)]
    assert drv.calls == [*switch, (f"{n}StreamWriteValue64{v2}", None, addr, value, 0), *back]


def test_a_thread_asks_the_driver_for_its_context_once_not_at_every_stream_operation():
    """_any_context: once a thread has a context, a stream operation on a stream of its own pays a thread-local
    lookup, not the driver's cuCtxGetCurrent (0.6-0.9 us through ctypes, every step)."""
    drv = _FakeCudaDriver()
    asked = []
    real_get = drv.cuCtxGetCurrent
    drv.cuCtxGetCurrent = lambda *args: (asked.append(1), real_get(*args))[1]
    ops = GpuWordOps(drv, hip=False, device_index=0)
    counts = []

    def worker():  # a fresh thread: none of this process's earlier operations counted for it
        drv.switch(0)
        for _ in range(3):
            ops.write(0x5, 0xD000, 1)
            counts.append(len(asked))

    t = __import__("threading").Thread(target=worker)
    t.start()
    t.join()
    assert counts == [1, 1, 1] and [op for op, _ in drv.ops] == ["cuStreamWriteValue64_v2"] * 3


@pytest.fixture
def loading(monkeypatch):
    """GpuWordOps.load on a CPU-only host: a GPU said to be there, the libraries tried recorded, the probe passed."""
    from dspark_sidecar.proto import gpu_word

    tried, libs = [], {}

    def cdll(name):
        tried.append(name)
        if name not in libs:
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")
        return libs[name]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_word.ctypes, "CDLL", cdll)
    monkeypatch.setattr(GpuWordOps, "_probe", lambda self, device: None)
    return tried, libs


_BUNDLED_HIP = os.path.join(os.path.dirname(torch.__file__), "lib", "libamdhip64.so")


@pytest.mark.parametrize("bundled", [True, False], ids=["torch_lib", "system_only"])
def test_on_rocm_the_ops_go_to_torch_s_own_hip_runtime_first(loading, monkeypatch, bundled):
    """As gpu_alloc's query (test_gpu_alloc): a pip ROCm torch carries libamdhip64 in torch/lib, and by its bare name
    the loader may miss that copy and load the system's, a second HIP runtime whose null stream, devices and host
    registrations are not torch's (the engine's stream handles passed to it), or none, and the GPU word was off.
    The system's copy is the fallback where torch carries none."""
    tried, libs = loading
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    drv = _FakeHipDriver()
    libs[_BUNDLED_HIP if bundled else "libamdhip64.so"] = drv
    ops = GpuWordOps.load(torch.device("cuda", 0))
    assert ops is not None and ops.hip and ops._write.__name__ == "hipStreamWriteValue64"
    system = driver_lib.hip_runtime_candidates().index("libamdhip64.so")  # after torch/lib and $ROCM_PATH/lib
    assert tried == ([_BUNDLED_HIP] if bundled else driver_lib.hip_runtime_candidates()[:system + 1])


@pytest.mark.parametrize("hip", [False, True], ids=["cuda", "hip"])
def test_a_missing_driver_library_or_symbol_is_no_ops_and_a_warning_naming_it(loading, monkeypatch, caplog, hip):
    """No driver library (a CUDA torch on a host without libcuda, a container without the driver mounted), or
    one too old for a call: steps are not pre-launched, said once with the loader's words; not an exception out of
    AttachDoorbell or the engine's channel set-up."""
    tried, libs = loading
    monkeypatch.setattr(torch.version, "hip", "6.2.0" if hip else None)
    with caplog.at_level(logging.WARNING, logger="dspark_sidecar"):
        assert GpuWordOps.load(torch.device("cuda", 1)) is None
    assert "libamdhip64.so" in tried[-1] if hip else tried == ["libcuda.so.1"]
    assert "GPU word unavailable on cuda:1" in caplog.text and "cannot open shared object file" in caplog.text
    old, missing = (_FakeHipDriver(), "hipStreamWaitValue64") if hip else (_FakeCudaDriver(), "cuStreamWaitValue64_v2")
    delattr(old, missing)  # a driver or runtime without the call (CUDA's _v2 stream memory operations are 11.7's)
    libs[_BUNDLED_HIP if hip else "libcuda.so.1"] = old
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dspark_sidecar"):
        assert GpuWordOps.load(torch.device("cuda", 1)) is None
    assert "GPU word unavailable on cuda:1" in caplog.text and missing in caplog.text


@pytest.mark.parametrize("lands", [True, False], ids=["write_lands", "write_lost"])
def test_the_probe_reads_back_what_the_gpu_wrote(monkeypatch, lands):
    """The probe's own word: a driver whose write lands passes it (the ops load); one that accepts the write and
    stores nothing (a device without 64-bit stream memory operations that still says success) fails it, naming
    what was read, and load() turns that into no ops."""
    drv = _FakeCudaDriver()
    drv.switch(0)
    base_entry = drv.cuStreamWriteValue64_v2

    def devptr(out, host, flags):  # the registered page's device address is its host address here
        drv.ops.append(("cuMemHostGetDevicePointer_v2", 0))
        out._obj.value = host.value
        return 0

    def write(stream, addr, value, flags):
        base_entry(stream, addr, value, flags)
        if lands:
            ctypes.c_uint64.from_address(addr).value = value
        return 0

    drv.cuMemHostGetDevicePointer_v2, drv.cuStreamWriteValue64_v2 = devptr, write
    _probe_on_a_fake_stream(monkeypatch, drv)
    ops = GpuWordOps(drv, hip=False, device_index=0)
    if lands:
        ops._probe(torch.device("cuda", 0))
    else:
        with pytest.raises(GpuWordError, match="probe: the GPU wrote 0x0, not 0x700000000"):
            ops._probe(torch.device("cuda", 0))
    assert [op for op, _ in drv.ops] == _PROBE_CALLS


def test_a_refused_unregister_keeps_the_registration_held_for_a_later_close():
    """close() raises where the driver refuses the unregister, and the pages are still registered: the registration
    stays held, so a new holder of the same pages shares it (a second registration of them the driver refuses),
    and a later close tries the unregister again."""
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    ops, refuse = _Ops(), [True]
    recorded = ops.unregister

    def unregister(ptr):
        recorded(ptr)
        if refuse:
            refuse.pop()
            raise GpuWordError("cuMemHostUnregister failed with driver code 999")

    ops.unregister = unregister
    page = RegisteredPage(ops, base)
    with pytest.raises(GpuWordError, match="cuMemHostUnregister failed"):
        page.close()
    again = RegisteredPage(ops, base)
    assert again.device_ptr == page.device_ptr
    page.close()
    again.close()
    assert ops.calls == [("register", base, mmap.PAGESIZE), ("unregister", base), ("unregister", base)]


def test_a_registration_is_made_and_ended_under_the_lock():
    """Holders register on the doorbell thread and close wherever the device's release runs: two holders of the
    same pages at once must not both find none held and both register (the driver refuses the second), nor one
    close end a registration another just took."""
    class Locked(_Ops):
        def register(self, ptr, nbytes):
            assert RegisteredPage._lock.locked(), "registered outside the lock"
            return super().register(ptr, nbytes)

        def unregister(self, ptr):
            assert RegisteredPage._lock.locked(), "unregistered outside the lock"
            super().unregister(ptr)

    buf = mmap.mmap(-1, mmap.PAGESIZE)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    ops = Locked()
    RegisteredPage(ops, base).close()
    assert ops.calls == [("register", base, mmap.PAGESIZE), ("unregister", base)]


def test_hip_stream_operations_on_a_fresh_thread_ask_for_no_cuda_context():
    """HIP's runtime binds its own device: _any_context has nothing to do there (it has no CUDA context calls)."""
    drv = _FakeHipDriver(device=1)
    ops = GpuWordOps(drv, hip=True, device_index=0)
    errors = []

    def worker():
        try:
            ops.write(0x5, 0xD000, 1)
            ops.wait_geq(0x5, 0xD000, 1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert errors == [] and drv.ops == [("hipStreamWriteValue64", 1), ("hipStreamWaitValue64", 1)]


def test_a_thread_bound_by_a_null_stream_operation_is_not_asked_again():
    """A thread torch never bound gets this device's context at its first NULL-stream operation (_make_current); its
    later operations on a stream of its own know it has one, without the driver's query (_any_context)."""
    drv = _FakeCudaDriver()
    asked = []
    real_get = drv.cuCtxGetCurrent
    drv.cuCtxGetCurrent = lambda *args: (asked.append(1), real_get(*args))[1]
    ops = GpuWordOps(drv, hip=False, device_index=1)

    def worker():
        drv.switch(None)
        ops.write(0, 0xD000, 1)
        ops.write(0x5, 0xD000, 2)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert len(asked) == 1 and drv.retained == [1]
    assert drv.ops == [("cuStreamWriteValue64_v2", 1), ("cuStreamWriteValue64_v2", 1)]


def test_hip_null_stream_operations_give_device_0_back_to_a_caller_on_it():
    """The device to restore is an index, and 0 (the caller's usual one) is one too: left unrestored, the caller's
    later allocations and launches went to this ops' GPU."""
    drv = _FakeHipDriver(device=0)
    gpu1 = GpuWordOps(drv, hip=True, device_index=1)
    _null_stream_calls(gpu1)
    assert [dev for _, dev in drv.ops] == [1, 1, 1, 1, 1] and drv.device == 0
