"""TP exchange memory: this rank's uncached RX/flags buffers, HIP IPC handles swapped over the rank group, peers mapped.

Protocol (every rank runs `map_peers` once, collectively, at start-up):

1. The group must have exactly 4 ranks (the exchange kernel's TP); checked before anything is
   allocated, identically on every rank.
2. Each rank allocates RX f32 [2 parity x 4 src x 64 rows, 6144] and flags i32 [2 x 4 x 96] as
   uncached device memory (hipExtMallocWithFlags + hipDeviceMallocUncached: the peers' system-scope
   stores must land in HBM, never in a remote L2), zeroes the flags (tag 0 is never a live tag)
   and exports both as HIP IPC handles.
3. Round 1, one all_gather_object: each rank posts its offer (host, pid, sizes, the two 64-byte
   handles), or an error record when its own allocation/export (or its weights) failed. Every rank then checks the
   same gathered list (slot i is rank i, one host, the expected sizes, 64-byte handles), so all
   ranks reach the same verdict; no rank waits on a peer that already gave up.
4. Each rank opens the 3 peers' handles (its own slot is its local pointer: a process cannot
   open its own handle) and wraps all of them as torch tensors.
5. Round 2, one all_gather_object: each rank posts whether its opens succeeded. One failure
   anywhere and every rank unmaps and raises the same FlyDSLUnsupported: a rank must never run
   the exchange kernel while a peer serves through the portable path (it would spin forever).

The HIP calls go through a small runtime object (`HipRuntime` on ROCm, a fake in the tests), so
the protocol runs on CPU across real gloo processes. `close()` unmaps the peers' buffers, then
frees this rank's: call it only once no exchange kernel can still run (after the rank loop stops).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from ...layout import LAUNCH_REQS
from ...proto.driver_lib import hip_runtime
from .runner import FlyDSLUnsupported, PeerBuffers
from .shapes import HIDDEN, TP, row_tiles

log = logging.getLogger("dspark_sidecar.kernels")
# Sizes of exchange.py (imported from there only with flydsl; tests check they agree).
MP_MAX = 16 * row_tiles(LAUNCH_REQS)  # 64 rows: the largest launch's padded row tiles
NBLK = HIDDEN // 64  # one workgroup per 64-column block
RX_SHAPE = (2 * TP * MP_MAX, HIDDEN)  # f32 [parity x src x row, column]
FLAGS_SHAPE = (2 * TP * NBLK,)  # i32 [parity x src x block]
RX_BYTES = RX_SHAPE[0] * RX_SHAPE[1] * 4
FLAGS_BYTES = FLAGS_SHAPE[0] * 4
IPC_HANDLE_BYTES = 64  # sizeof(hipIpcMemHandle_t)
PROTOCOL = 1

HIP_DEVICE_MALLOC_UNCACHED = 0x3
HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1


class Runtime(Protocol):
    """The device calls the exchange needs; pointers are ints, handles bytes of IPC_HANDLE_BYTES."""

    def malloc_uncached(self, nbytes: int) -> int: ...

    def memset(self, ptr: int, value: int, nbytes: int) -> None: ...

    def free(self, ptr: int) -> None: ...

    def ipc_handle(self, ptr: int) -> bytes: ...

    def ipc_open(self, handle: bytes) -> int: ...

    def ipc_close(self, ptr: int) -> None: ...

    def tensor(self, ptr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor viewing (not owning) `ptr`; the caller keeps the memory alive."""
        ...


class _IpcHandle(ctypes.Structure):
    """hipIpcMemHandle_t, passed by value. Unsigned bytes: a c_char field would read as a string cut
    at the first NUL, and handles are binary."""

    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]

    @classmethod
    def of(cls, raw: bytes) -> "_IpcHandle":
        h = cls()
        ctypes.memmove(ctypes.addressof(h), raw, IPC_HANDLE_BYTES)
        return h

    def raw(self) -> bytes:
        return bytes(self.reserved)


_TYPESTR = {torch.float32: "<f4", torch.int32: "<i4"}


class _DeviceArray:
    """A __cuda_array_interface__ (v2) view of raw device memory, kept alive by the tensor wrapping it."""

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": _TYPESTR[dtype],
                                         "strides": None, "version": 2}


_HIP_FUNCTIONS = ("hipSetDevice", "hipExtMallocWithFlags", "hipMemset", "hipDeviceSynchronize", "hipFree",
                  "hipIpcGetMemHandle", "hipIpcOpenMemHandle", "hipIpcCloseMemHandle", "hipGetErrorString")


class HipRuntime:
    """Runtime over libamdhip64 through ctypes, on `device` (the rank's GPU)."""

    def __init__(self, device: torch.device, lib: ctypes.CDLL | None = None) -> None:
        if lib is None:
            lib = self._load()
        self.lib, self.device = lib, device
        missing = [f for f in _HIP_FUNCTIONS if not hasattr(lib, f)]
        if missing:
            raise FlyDSLUnsupported(f"HIP runtime lacks {', '.join(missing)}")
        lib.hipGetErrorString.restype = ctypes.c_char_p
        lib.hipIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        lib.hipExtMallocWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.hipMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        lib.hipIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_void_p]
        for fn in ("hipFree", "hipIpcCloseMemHandle"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
        self._check(lib.hipSetDevice(device.index or 0), "hipSetDevice")

    @staticmethod
    def _load() -> ctypes.CDLL:
        try:
            return hip_runtime()  # torch's own copy first (driver_lib): a second runtime has its own contexts
        except OSError as exc:
            raise FlyDSLUnsupported(f"{exc} (the TP exchange's uncached IPC buffers need ROCm)") from exc

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            msg = self.lib.hipGetErrorString(err)
            raise FlyDSLUnsupported(f"{what} failed: {msg.decode() if msg else err}")

    def malloc_uncached(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        self._check(self.lib.hipExtMallocWithFlags(ctypes.byref(p), nbytes, HIP_DEVICE_MALLOC_UNCACHED),
                    "hipExtMallocWithFlags(hipDeviceMallocUncached)")
        return int(p.value)

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        self._check(self.lib.hipMemset(ptr, value, nbytes), "hipMemset")
        self._check(self.lib.hipDeviceSynchronize(), "hipDeviceSynchronize")

    def free(self, ptr: int) -> None:
        self._check(self.lib.hipFree(ptr), "hipFree")

    def ipc_handle(self, ptr: int) -> bytes:
        h = _IpcHandle()
        self._check(self.lib.hipIpcGetMemHandle(ctypes.byref(h), ptr), "hipIpcGetMemHandle")
        return h.raw()

    def ipc_open(self, handle: bytes) -> int:
        h, p = _IpcHandle.of(handle), ctypes.c_void_p()
        self._check(self.lib.hipIpcOpenMemHandle(ctypes.byref(p), h, HIP_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
                    "hipIpcOpenMemHandle")
        return int(p.value)

    def ipc_close(self, ptr: int) -> None:
        self._check(self.lib.hipIpcCloseMemHandle(ptr), "hipIpcCloseMemHandle")

    def tensor(self, ptr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.as_tensor(_DeviceArray(ptr, shape, dtype), device="cuda")
        if t.data_ptr() != ptr:  # torch copied instead of viewing: the peer mapping would be lost
            raise FlyDSLUnsupported("torch could not view the IPC-mapped exchange buffer in place")
        return t


class _Release:
    """Undoes one rank's mapping exactly once: peers' mappings first, then its own allocations."""

    def __init__(self, runtime: Runtime, opened: list[int], owned: list[int]) -> None:
        self.runtime, self.opened, self.owned = runtime, opened, owned
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            opened, owned, self.opened, self.owned = self.opened, self.owned, [], []
        errors = []
        for ptr in opened:
            errors += _attempt(self.runtime.ipc_close, ptr)
        for ptr in owned:
            errors += _attempt(self.runtime.free, ptr)
        if errors:
            raise FlyDSLUnsupported("; ".join(errors))


def _give_up(release: _Release, why: str) -> str:
    """`why`, after releasing: a release failure is added to it, never reported instead of it (the
    reason every rank agreed on is what says why the path is off; this rank's leak is secondary)."""
    try:
        release()
    except FlyDSLUnsupported as more:
        return f"{why} (and releasing: {more})"
    return why


def _gather(group: dist.ProcessGroup | None, world: int, mine, release: _Release | None) -> list:
    """Every rank's `mine`, in rank order (all_gather_object). A collective that raises (a peer lost:
    gloo's connection closed, or the group's timeout) releases this rank's buffers first, then raises
    as it came: the caller gets no mapping to close, and its start-up reports the lost peer (app.PeerLost)."""
    out: list = [None] * world
    try:
        dist.all_gather_object(out, mine, group=group)
    except BaseException:
        if release is not None:
            try:
                release()
            except FlyDSLUnsupported as more:  # secondary: the lost peer is what stops this rank
                log.warning("rank %d: releasing the exchange buffers after a failed collective: %s",
                            dist.get_rank(group), more)
        raise
    return out


def _attempt(fn: Callable[[int], None], ptr: int) -> list[str]:
    try:
        fn(ptr)
    except FlyDSLUnsupported as exc:  # keep releasing the rest; report all at the end
        return [str(exc)]
    return []


@dataclass(frozen=True)
class MappedPeers(PeerBuffers):
    """PeerBuffers whose memory this module mapped; close() unmaps it (idempotent)."""

    release: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)

    def close(self) -> None:
        self.release()


def _offer(make_runtime: Callable[[], Runtime]) -> tuple[dict, Runtime | None, list[int]]:
    """This rank's round-1 record, its runtime and the pointers it now owns.

    Never raises: a local failure (no HIP runtime, no memory) becomes an error record, because
    the peers are about to wait for this rank in the collective."""
    runtime, owned = None, []
    try:
        runtime = make_runtime()
        rx = runtime.malloc_uncached(RX_BYTES)
        owned.append(rx)
        flags = runtime.malloc_uncached(FLAGS_BYTES)
        owned.append(flags)
        runtime.memset(flags, 0, FLAGS_BYTES)
        offer = {"protocol": PROTOCOL, "host": socket.gethostname(), "pid": os.getpid(),
                 "rx_bytes": RX_BYTES, "flags_bytes": FLAGS_BYTES,
                 "rx": runtime.ipc_handle(rx), "flags": runtime.ipc_handle(flags)}
        return offer, runtime, owned
    except Exception as exc:  # noqa: BLE001  (posted to the peers instead: they must not wait for us)
        why = str(exc) or type(exc).__name__
        if runtime is not None:
            why = _give_up(_Release(runtime, [], owned), why)
        return {"error": f"could not export its exchange buffers: {why}"}, None, []


def check_offers(offers: list) -> str | None:
    """Why the gathered offers cannot be mapped (the same answer on every rank), or None."""
    for r, o in enumerate(offers):
        if not isinstance(o, dict):
            return f"rank {r} sent no exchange offer ({type(o).__name__})"
        if "error" in o:
            return f"rank {r} {o['error']}"
        if o.get("protocol") != PROTOCOL:
            return f"rank {r} speaks exchange protocol {o.get('protocol')!r}, this build {PROTOCOL}"
        if (o.get("rx_bytes"), o.get("flags_bytes")) != (RX_BYTES, FLAGS_BYTES):
            return (f"rank {r} exchange buffers are {o.get('rx_bytes')}/{o.get('flags_bytes')} bytes, "
                    f"expected {RX_BYTES}/{FLAGS_BYTES}")
        for key in ("rx", "flags"):
            h = o.get(key)
            if h is None:
                return f"rank {r} sent no {key} IPC handle"
            if not isinstance(h, bytes) or len(h) != IPC_HANDLE_BYTES:
                got = f"{len(h)} bytes" if isinstance(h, bytes) else type(h).__name__
                return f"rank {r} sent a garbled {key} IPC handle ({got}, expected {IPC_HANDLE_BYTES} bytes)"
    hosts = {o["host"] for o in offers}
    if len(hosts) != 1:
        return f"ranks span hosts {sorted(hosts)}: HIP IPC maps memory of one node only"
    return None


def map_peers(group: dist.ProcessGroup | None, make_runtime: Callable[[], Runtime],
              epoch_device: torch.device, local_failure: str | None = None) -> MappedPeers:
    """Collective over `group` (a CPU/gloo group of the TP ranks): every rank's RX/flags mapped on every rank.

    `make_runtime` is called inside the protocol, so a rank without a HIP runtime still tells its
    peers. `local_failure` (e.g. "could not bind its weights: ...") is posted instead of an offer,
    so a rank that cannot serve the fast path for another reason turns it off on every rank.
    Raises FlyDSLUnsupported with the same reason on every rank when any rank cannot take part (a rank
    whose own release then fails adds that to it: "... (and releasing: ...)"). A collective that fails (a
    peer lost) raises its own error, once this rank released what it had allocated and mapped.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != TP:  # same on every rank: nobody allocates, nobody waits
        raise FlyDSLUnsupported(f"TP exchange needs {TP} ranks, the group has {world}")
    if local_failure is not None:
        offer, runtime, owned = {"error": local_failure}, None, []
    else:
        offer, runtime, owned = _offer(make_runtime)
    opened: list[int] = []  # appended to below: `release` undoes what is opened by then
    release = _Release(runtime, opened, owned) if runtime is not None else None
    offers = _gather(group, world, offer, release)
    why = check_offers(offers)
    if why is not None:
        if release is not None:
            why = _give_up(release, why)
        raise FlyDSLUnsupported(why)
    assert runtime is not None and release is not None  # its own offer passed the check

    rx: list[torch.Tensor] = []
    flags: list[torch.Tensor] = []
    epoch: torch.Tensor | None = None
    error, r = None, 0
    try:
        for r, o in enumerate(offers):
            if r == rank:
                rx_ptr, fl_ptr = owned
            else:
                rx_ptr = runtime.ipc_open(o["rx"])
                opened.append(rx_ptr)
                fl_ptr = runtime.ipc_open(o["flags"])
                opened.append(fl_ptr)
            rx.append(runtime.tensor(rx_ptr, RX_SHAPE, torch.float32))
            flags.append(runtime.tensor(fl_ptr, FLAGS_SHAPE, torch.int32))
    except Exception as exc:  # noqa: BLE001  (posted in round 2: every rank must learn of it)
        # r, not len(rx): rank r's RX may be wrapped already when its flags fail.
        error = f"rank {rank} could not map rank {r}'s exchange buffers: {exc}"
    if error is None:
        # Before round 2, in its verdict: allocated after it, a failure (out of device memory) raised on
        # this rank alone while its peers went on with the mapping it had just agreed to.
        try:
            epoch = torch.zeros(1, dtype=torch.int32, device=epoch_device)
        except Exception as exc:  # noqa: BLE001  (posted in round 2, as above)
            error = f"rank {rank} could not allocate its exchange epoch: {type(exc).__name__}: {exc}"
    verdicts = _gather(group, world, error, release)
    failed = next((v for v in verdicts if v is not None), None)
    if failed is not None:
        rx.clear()
        flags.clear()
        raise FlyDSLUnsupported(_give_up(release, failed))
    assert epoch is not None  # this rank's own verdict was None
    return MappedPeers(rx, flags, rx[rank], flags[rank], epoch, release=release)
