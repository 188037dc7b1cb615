"""The doorbell's GPU word: host memory both processes map on their GPU, written by one stream and waited on by another.

A stream memory operation (CUDA driver `cuStreamWriteValue64` / `cuStreamWaitValue64`, HIP
`hipStreamWriteValue64` / `hipStreamWaitValue64`) is queued on a stream like a kernel: the
engine's stream writes the word right after its copies of a step's inputs, and the sidecar's
stream, queued ahead of time behind a wait on that word, starts the step the moment the write
lands. Neither host is on that path. The word lives in the doorbell page (POSIX shm), so the
sidecar's host can also store to it (to release a wait it no longer wants) and both processes
register it with their own GPU context (`cuMemHostRegister`): host memory needs no IPC handle.

torch exposes none of these calls, so they go through ctypes to the driver library torch has
already loaded. The same binding queues the answer's copy out of the output region on the engine's
step path: with torch's clone there the copy was 1.26-1.42x the answer's decode in host time, with
the driver's call 1.05-1.11x, 4-8 us less (BENCHMARKS.md runs 296-297). `GpuWordOps.load` returns
None where they are not available (no driver, an old one, a device without 64-bit stream memory
operations): the doorbell then works as before.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import weakref

import torch

from dspark_sidecar.proto.driver_lib import cuda_driver, hip_runtime

log = logging.getLogger("dspark_sidecar")

_REGISTER_PORTABLE, _REGISTER_DEVICEMAP = 0x1, 0x2  # CU_MEMHOSTREGISTER_* (hipHostRegister* match)
# CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0, cyclic. hipStreamWaitValueGte (same 0x0) is a plain
# (*addr & mask) >= value, wrong at the sequence's wrap: server/prelaunch.py queues no step near it (WRAP_GUARD).
_WAIT_GEQ = 0x0


class GpuWordError(RuntimeError):
    """A stream memory operation or a registration failed; the message has the driver's code."""


class DevicePointer:
    """A raw device address Triton can take as a pointer argument (it reads data_ptr() and dtype)."""

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address, self.dtype = address, dtype

    def data_ptr(self) -> int:
        return self.address


class GpuWordOps:
    """Host registration, 64-bit stream write/wait, event record/wait and a device copy, for one vendor's driver
    (CUDA or HIP)."""

    def __init__(self, lib: ctypes.CDLL, hip: bool, device_index: int = 0) -> None:
        self.hip, self.device_index = hip, device_index
        self._ctx: int | None = None  # this device's context handle, once seen current (CUDA)
        u64, vp, uint = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint
        if hip:
            self._register = self._fn(lib, "hipHostRegister", [vp, ctypes.c_size_t, uint])
            self._unregister = self._fn(lib, "hipHostUnregister", [vp])
            self._devptr = self._fn(lib, "hipHostGetDevicePointer", [ctypes.POINTER(vp), vp, uint])
            self._write = self._fn(lib, "hipStreamWriteValue64", [vp, vp, u64, uint])
            self._record = self._fn(lib, "hipEventRecord", [vp, vp])
            self._wait = self._fn(lib, "hipStreamWaitValue64", [vp, vp, u64, uint, u64])
            self._wait_event = self._fn(lib, "hipStreamWaitEvent", [vp, vp, uint])
            self._copy = self._fn(lib, "hipMemcpyDtoDAsync", [vp, vp, ctypes.c_size_t, vp])
            self._get_device = self._fn(lib, "hipGetDevice", [ctypes.POINTER(ctypes.c_int)])
            self._set_device = self._fn(lib, "hipSetDevice", [ctypes.c_int])
        else:
            # The driver acts on the calling thread's current context, which torch's runtime binds
            # lazily; each thread makes the device's primary context current before its first call.
            self._ctx_get = self._fn(lib, "cuCtxGetCurrent", [ctypes.POINTER(vp)])
            self._ctx_set = self._fn(lib, "cuCtxSetCurrent", [vp])
            self._ctx_retain = self._fn(lib, "cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), ctypes.c_int])
            self._ctx_device = self._fn(lib, "cuCtxGetDevice", [ctypes.POINTER(ctypes.c_int)])
            self._register = self._fn(lib, "cuMemHostRegister_v2", [vp, ctypes.c_size_t, uint])
            self._unregister = self._fn(lib, "cuMemHostUnregister", [vp])
            self._devptr = self._fn(lib, "cuMemHostGetDevicePointer_v2", [ctypes.POINTER(u64), vp, uint])
            self._write = self._fn(lib, "cuStreamWriteValue64_v2", [vp, u64, u64, uint])
            self._record = self._fn(lib, "cuEventRecord", [vp, vp])
            self._wait = self._fn(lib, "cuStreamWaitValue64_v2", [vp, u64, u64, uint])
            self._wait_event = self._fn(lib, "cuStreamWaitEvent", [vp, vp, uint])
            self._copy = self._fn(lib, "cuMemcpyDtoDAsync_v2", [u64, u64, ctypes.c_size_t, vp])

    @staticmethod
    def _fn(lib: ctypes.CDLL, name: str, argtypes: list):
        f = getattr(lib, name)
        f.argtypes, f.restype = argtypes, ctypes.c_int
        f.__name__ = name
        return f

    @classmethod
    def load(cls, device: torch.device) -> GpuWordOps | None:
        """The ops for `device` after a probe (one write and one wait on a registered word), or None."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        hip = torch.version.hip is not None
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            # On ROCm torch's own HIP runtime (driver_lib): the system's copy knows nothing of torch's streams.
            ops = cls(hip_runtime() if hip else cuda_driver(), hip, index)
            ops._probe(device)
        except (OSError, AttributeError, GpuWordError) as exc:
            log.warning("GPU word unavailable on %s (%s): steps are not pre-launched", device, exc)
            return None
        return ops

    _thread = threading.local()  # .has_context: this thread has made a context current for us

    def _bind(self) -> None:
        """Make this device's context current on the calling thread, if it is not (CUDA), for a registration.

        Asked on every call, not cached per thread: torch switches the thread's context under
        `torch.cuda.device(...)` without telling us, and a registration's device address is the
        current context's. Registrations are rare (a page per channel), so the check's cost
        (0.6-0.9 us through ctypes on an H200 host, run 132) does not matter here.
        """
        if self.hip:
            return
        cur = self._current_context()
        if cur and cur == self._ctx:
            return
        if cur:  # torch's runtime (or the caller) made a context current: it must be this device's
            dev = self._current_device()
            if dev != self.device_index:
                raise GpuWordError(f"this thread's CUDA context is device {dev}, not {self.device_index}")
            self._ctx = cur
        else:
            self._retain_primary()

    def _current_device(self) -> int:
        """The device of the calling thread's current context (HIP: its current device)."""
        dev = ctypes.c_int()
        self._check(self._get_device if self.hip else self._ctx_device, ctypes.byref(dev))
        return dev.value

    def _stream_call(self, stream: int, fn, *args) -> None:
        """fn(*args), an operation queued on `stream`, with a context current that the driver reads `stream` in.

        Stream handle 0 (torch's default stream, as the engine's raw handle gives it) is the NULL stream of
        the thread's *current* context (HIP: current device), not of this device: with another GPU's current
        (torch.cuda.device(...), or a thread torch bound to its default device) the word's write went to that
        GPU's stream, ahead of this one's input copies, and the engine's wait for the sidecar's outputs held
        up the other GPU. So on handle 0 this device is made current for the call, as torch's Event.record
        does under its device guard, and the caller's is restored after (0.6-0.9 us more, that stream only).
        """
        if stream:
            self._any_context()
            self._check(fn, *args)
            return
        prev = self._make_current()
        try:
            self._check(fn, *args)
        finally:
            if prev is not None:
                self._check(self._set_device if self.hip else self._ctx_set, prev)

    def _make_current(self):
        """Make this device current on the calling thread; returns what to restore after, or None."""
        if self.hip:
            dev = self._current_device()
            if dev == self.device_index:
                return None
            self._check(self._set_device, self.device_index)
            return dev
        cur = self._current_context()
        if not cur:  # a thread torch has not bound yet: bound now, as _any_context would
            self._retain_primary()
            self._thread.has_context = True
            return None
        if cur == self._ctx:
            return None
        if self._current_device() == self.device_index:  # another context of this GPU (torch's primary)
            self._ctx = cur
            return None
        if self._ctx is None:
            self._retain_primary()
        else:
            self._check(self._ctx_set, ctypes.c_void_p(self._ctx))
        return ctypes.c_void_p(cur)

    def _any_context(self) -> None:
        """Give the calling thread a current context if it has none, for a stream operation (CUDA).

        A stream operation acts on its stream's own context whatever context is current (run 132:
        a write, a wait and an event record on a primary-context stream, issued with a second
        context of the GPU current, returned success and the word landed), but the driver refuses
        any call from a thread with no context at all. So once per thread is enough, and the
        per-step path pays a thread-local lookup (0.14 us) rather than the driver query. Not for
        stream handle 0, which names the current context's NULL stream (_stream_call).
        """
        if self.hip or getattr(self._thread, "has_context", False):
            return
        if not self._current_context():  # a thread torch has not bound yet
            self._retain_primary()
        self._thread.has_context = True

    def _current_context(self) -> int | None:
        """The calling thread's current CUDA context handle, None when it has none."""
        cur = ctypes.c_void_p()
        self._check(self._ctx_get, ctypes.byref(cur))
        return cur.value

    def _retain_primary(self) -> None:
        ctx = ctypes.c_void_p()
        self._check(self._ctx_retain, ctypes.byref(ctx), self.device_index)
        self._check(self._ctx_set, ctx)
        self._ctx = ctx.value

    def _check(self, fn, *args) -> None:
        rc = fn(*args)
        if rc != 0:
            raise GpuWordError(f"{fn.__name__} failed with driver code {rc}")

    def _probe(self, device: torch.device) -> None:
        buf = mmap.mmap(-1, mmap.PAGESIZE)
        try:
            word = torch.frombuffer(buf, dtype=torch.int64, count=1)
            with torch.cuda.device(device):
                page = RegisteredPage(self, word.data_ptr())
                try:
                    stream = torch.cuda.current_stream(device)
                    try:
                        self.write(stream.cuda_stream, page.device_ptr, 7 << 32)
                        self.wait_geq(stream.cuda_stream, page.device_ptr, 7 << 32)
                    finally:  # also when the wait is refused: the queued write lands before the unregister and unmap
                        stream.synchronize()  # this stream only: the engine's other streams go on
                    if int(word[0]) != 7 << 32:
                        raise GpuWordError(f"probe: the GPU wrote {int(word[0]):#x}, not {7 << 32:#x}")
                finally:
                    del word
                    page.close()
        finally:
            buf.close()

    def register(self, host_ptr: int, nbytes: int) -> int:
        """Page-lock host memory for every GPU of this process; returns its device address."""
        self._bind()
        self._check(self._register, ctypes.c_void_p(host_ptr), nbytes, _REGISTER_PORTABLE | _REGISTER_DEVICEMAP)
        out = ctypes.c_void_p() if self.hip else ctypes.c_uint64()
        try:
            self._check(self._devptr, ctypes.byref(out), ctypes.c_void_p(host_ptr), 0)
        except GpuWordError:
            # No caller holds the registration yet to undo it: left, the page stayed page-locked after its
            # memory was freed, and a later registration of the same pages failed as already registered.
            self.unregister(host_ptr)
            raise
        return int(out.value or 0)

    def unregister(self, host_ptr: int) -> None:
        self._bind()
        self._check(self._unregister, ctypes.c_void_p(host_ptr))

    def write(self, stream: int, addr: int, value: int) -> None:
        """Queue `*addr = value` on `stream` (after the work queued before it)."""
        self._stream_call(stream, self._write, ctypes.c_void_p(stream), ctypes.c_void_p(addr) if self.hip else addr,
                          value, 0)

    def record(self, event: torch.cuda.Event, stream: int) -> None:
        """event.record() on a raw stream handle (torch's current_stream() costs ~15-25 us at a step's start)."""
        self._stream_call(stream, self._record, ctypes.c_void_p(event.cuda_event), ctypes.c_void_p(stream))

    def wait_event(self, stream: int, event: torch.cuda.Event) -> None:
        """Queue on `stream` a wait for `event`'s last record: stream.wait_event(event) on a raw handle."""
        self._stream_call(stream, self._wait_event, ctypes.c_void_p(stream), ctypes.c_void_p(event.cuda_event), 0)

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy of `nbytes` from device address `src` to `dst` on `stream`: dst.copy_(src) of two
        contiguous tensors of one dtype on this device, without torch's dispatch."""
        if self.hip:
            self._stream_call(stream, self._copy, ctypes.c_void_p(dst), ctypes.c_void_p(src), nbytes,
                              ctypes.c_void_p(stream))
        else:
            self._stream_call(stream, self._copy, dst, src, nbytes, ctypes.c_void_p(stream))

    def wait_geq(self, stream: int, addr: int, value: int) -> None:
        """Queue a wait on `stream` until (int64)(*addr - value) >= 0 (HIP: *addr >= value, see _WAIT_GEQ);
        later work on it starts after."""
        if self.hip:
            self._stream_call(stream, self._wait, ctypes.c_void_p(stream), ctypes.c_void_p(addr), value, _WAIT_GEQ,
                              0xFFFFFFFFFFFFFFFF)
        else:
            self._stream_call(stream, self._wait, ctypes.c_void_p(stream), addr, value, _WAIT_GEQ)


class RegisteredPage:
    """The first page of a mapping registered with the GPU (the doorbell header, the word's home), or its
    first `nbytes` (an engine's region, server/prelaunch.py).

    One registration per host address (and ops), shared by every RegisteredPage of it and ended by the last
    close: the driver refuses pages already registered, and two holders of the same pages overlap in time.
    A replaced doorbell's pre-launch ends its registrations of the engine's regions only once the device has
    done its queued work, which at TP > 1 nothing waits for (Doorbell._drop_prelaunch), and the new doorbell's
    pre-launch registers the same regions at its first queued step: refused, that rank exited.
    """

    _held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ops -> {host_ptr: [nbytes, device_ptr, holders]}
    _lock = threading.Lock()  # holders register on the doorbell thread, close wherever the device's release runs

    def __init__(self, ops: GpuWordOps, host_ptr: int, nbytes: int = mmap.PAGESIZE) -> None:
        if host_ptr % mmap.PAGESIZE:
            raise GpuWordError(f"{host_ptr:#x} is not page-aligned")
        self.ops, self.host_ptr = ops, 0
        with self._lock:
            held = self._held.setdefault(ops, {})
            entry = held.get(host_ptr)
            if entry is None:
                entry = held[host_ptr] = [nbytes, ops.register(host_ptr, nbytes), 0]
            elif nbytes > entry[0]:  # another mapping at a reused address while the old registration lives
                raise GpuWordError(f"{host_ptr:#x} is registered for {entry[0]} bytes, not the {nbytes} asked for")
            entry[2] += 1
        self.host_ptr, self.device_ptr = host_ptr, entry[1]

    def close(self) -> None:
        if not self.host_ptr:
            return
        with self._lock:
            held = self._held[self.ops]
            entry = held[self.host_ptr]
            if entry[2] == 1:
                self.ops.unregister(self.host_ptr)  # raises: still held, a later close tries again
                del held[self.host_ptr]
            else:
                entry[2] -= 1
            self.host_ptr = 0
