"""MemoryHandle <-> memory: the engine exports tensors (POSIX shm on CPU, CUDA/HIP IPC on GPU), the sidecar maps them."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.gpu_alloc import AllocationQueryError, bytes_left

log = logging.getLogger("dspark_sidecar.memory")


class HandleError(ValueError):
    """A memory handle cannot be exported or mapped; the message says why."""


class HandleUncheckable(HandleError):
    """A handle refused because this process could not check it (the driver's query failed), not
    because of anything in it: the same handle may pass a moment later (server/errors.py: UNAVAILABLE)."""


class HandleExhausted(HandleError):
    """A handle this process could not map for want of a resource of its own or of the host (file
    descriptors, memory or address space: EMFILE, ENFILE, ENOMEM; a driver out of memory opening a CUDA
    IPC handle), not because of anything in it: the same handle maps once the resource is back
    (server/errors.py: UNAVAILABLE, which the engine retries; INVALID_ARGUMENT turned its fast path off
    for good over a passing condition)."""


# errno values of a failed open or mmap that say nothing about the handle: the process or host ran short (or, EAGAIN
# of the open, another process's file lease on the segment, which the kernel is breaking: AttachedSegment).
_EXHAUSTED_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN})
# How torch words the same shortages in the RuntimeError of a CUDA/HIP IPC open: the driver's out of
# memory (cudaErrorMemoryAllocation, hipErrorOutOfMemory), or the strerror of a failed open or mmap of the
# handle's reference counter file ("unable to open shared memory object ...: Too many open files (24)").
_EXHAUSTED_WORDS = ("out of memory", *(os.strerror(e).lower() for e in _EXHAUSTED_ERRNOS))


def _exhausted(err: BaseException) -> bool:
    """Whether a failed map or open is a passing shortage of this process or host (HandleExhausted)."""
    if isinstance(err, OSError):
        return err.errno in _EXHAUSTED_ERRNOS
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and any(w in str(err).lower() for w in _EXHAUSTED_WORDS)


# Engine side: tensors allocated in named shared memory -----------------------------------------

@dataclass
class ShmTensor:
    """A tensor whose storage is a whole POSIX shared-memory segment the engine created.

    `segment` names the segment (and unlinks it); its own mapping is closed at once. The tensor views
    a mapping of its own (shm_empty), which goes with the last view of it: a view still held at close()
    (StepBuffers.input_view, a step's hidden view) stays valid memory, as on the sidecar (MappedMemory)."""

    tensor: torch.Tensor
    segment: shared_memory.SharedMemory
    unlinked: bool = dataclasses.field(default=False, repr=False)

    def close(self, unlink: bool = True) -> None:
        """Idempotent: the name is removed (and dropped from the resource tracker) once, whoever removed it."""
        if self.tensor is not None:
            with _EXPORTED_LOCK:
                _EXPORTED.pop(self.tensor.untyped_storage().data_ptr(), None)
        self.tensor = None  # type: ignore[assignment]  # unmapped now unless a view of it is still alive
        self.segment.close()
        if unlink and not self.unlinked:
            self.unlinked = True
            unlink_segment(self.segment, "shared-memory segment")


def unlink_segment(seg: shared_memory.SharedMemory, what: str) -> None:
    """Remove a segment's name this process made, also when someone else removed it first (an operator cleaning
    /dev/shm, systemd's RemoveIPC): a warning naming `what`, not FileNotFoundError."""
    try:
        seg.unlink()
    except FileNotFoundError:
        log.warning("%s %s was removed by another process", what, seg.name)
        # SharedMemory.unlink unregisters only after a successful unlink: without this the resource
        # tracker warns of a "leaked" segment at exit and tries to unlink it again.
        resource_tracker.unregister(seg._name, "shared_memory")


_EXPORTED: dict[int, tuple[str, int]] = {}  # data_ptr of a segment's first byte -> (name, size)
_EXPORTED_LOCK = threading.Lock()


def segment_problem(st_uid: int, st_mode: int, euid: int) -> str | None:
    """Why a segment with this owner and mode may not be mapped by a process running as `euid` (one
    clause, with what was found and what to do), or None.

    - writable by every user (o+w): any local user could shrink it under the mapping, and the next
      access kills this process with SIGBUS (a sidecar rank, and with it the group), or rewrite it.
    - another user's, not shared read/write with its group: only root's privilege opens it, so a caller
      who names it (whoever reaches the socket; with --tcp-base-port any local user) would have a root
      sidecar map, and for a KV binding write into, a segment its owner shares with nobody. The engine's
      own segments are 0600 under the sidecar's user, or 0660 for its group (shm_empty)."""
    found = f"(owner uid {st_uid}, mode {stat.S_IMODE(st_mode):04o})"
    if st_mode & stat.S_IWOTH:
        return (f"is writable by every user {found}: any of them could shrink it under the mapping (SIGBUS) or "
                "rewrite it; create it 0600, or 0660 for a group the sidecar is in")
    if st_uid != euid and st_mode & 0o060 != 0o060:
        return (f"is private to another user {found}: this process (uid {euid}) opens it only by privilege; "
                "register segments of the sidecar's user, or ones their owner shares read/write with a group "
                "(0660)")
    return None


class AttachedSegment:
    """A POSIX shared-memory segment another process created, mapped by name without Python's resource
    tracker (the creator owns it: it unlinks it, and its tracker cleans up after a crash).

    Why not SharedMemory(create=False): before Python 3.13 it registers the segment with this process's
    tracker, which would unlink it when this process exits, while the creator still uses it. Undoing
    that with resource_tracker.unregister also drops the *creator's* registration when both processes
    share one tracker (ranks spawned by one parent), and the creator's own unlink then fails in the
    tracker ("KeyError: '/psm_...'", printed by the demo's engine ranks). Linux keeps these segments
    in /dev/shm, where they are opened and mapped as SharedMemory itself does.
    """

    def __init__(self, name: str) -> None:
        name = name.lstrip("/")
        # A POSIX shared-memory name is one entry of /dev/shm: a name with a path in it could reach
        # any file this process may write, which it would map and, for a KV cache, write into.
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"{name!r} is not a shared-memory name (one entry of /dev/shm, no '/')")
        path = os.path.join("/dev/shm", name)
        try:
            # O_NONBLOCK: an open for writing of a file another process holds a lease on (fcntl F_SETLEASE, which
            # its owner may take) otherwise waits until it lets go, up to /proc/sys/fs/lease-break-time (45 s),
            # inside BindKV's rank section. No effect on a regular file's mapping; the descriptor is closed below.
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as err:
            if err.errno == errno.EWOULDBLOCK:  # EAGAIN: passing (the kernel is breaking the lease), HandleExhausted
                raise OSError(errno.EWOULDBLOCK, f"{path} is under another process's file lease (fcntl F_SETLEASE), "
                                                 "which the kernel is breaking") from None
            if err.errno != errno.ELOOP:
                raise
            # O_NOFOLLOW's refusal reads "Too many levels of symbolic links": say what it is and what to send.
            raise OSError(errno.ELOOP, f"{path} is a symbolic link, refused (its target could change under the "
                                       "mapping); send the segment's own name") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO (any user may make one here): mmap's bare EINVAL said nothing
                kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else f"of file type {stat.S_IFMT(st.st_mode):o}"
                raise ValueError(f"{path} is not a shared-memory segment (a regular file), it is {kind}; send the "
                                 "name of a segment the engine created")
            why = segment_problem(st.st_uid, st.st_mode, os.geteuid())
            if why:
                raise ValueError(f"{path} {why}")
            self.size, self.file = st.st_size, (st.st_dev, st.st_ino)  # file: which object, whatever its name
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name, self.buf = name, memoryview(self._mmap)

    def close(self) -> None:
        """Unmap (BufferError while a view of `buf` is alive, as SharedMemory.close)."""
        if self.buf is not None:
            self.buf.release()
            self.buf = None  # type: ignore[assignment]
            self._mmap.close()

    def release(self) -> None:
        """Let the mapping go with its last holder: a tensor made from `buf` (torch.frombuffer) holds
        `buf`, which holds the mapping; it is unmapped when the last of them is freed. Not close():
        frombuffer keeps no buffer export, so close() would unmap under such a tensor."""
        self.buf = self._mmap = None  # type: ignore[assignment]


def new_segment(size: int, name: str | None = None) -> shared_memory.SharedMemory:
    """A new shared-memory segment of `size` bytes (named `name`, else a random name; created exclusively:
    FileExistsError for a name taken) whose pages are reserved now. ftruncate reserves none: on a full
    /dev/shm (a container's 64 MiB default, shared with NCCL and the engine) the segment was still made, and the
    first store into it was a SIGBUS that killed the process. Reserved here, it is OSError ENOSPC, a refusal."""
    # Larger than /dev/shm itself: refused before the name is made. SharedMemory cleans up after an OSError only,
    # and past 2^63 - 1 (ftruncate's off_t) its OverflowError left the name in /dev/shm for good.
    try:
        fs = os.statvfs("/dev/shm")
        room = fs.f_blocks * fs.f_frsize or _INT64_MAX  # 0 blocks: a tmpfs mounted without a size limit
    except OSError:
        room = _INT64_MAX
    if size > room:
        raise OSError(errno.ENOSPC, f"a shared-memory segment of {size} bytes cannot fit /dev/shm ({room} bytes)")
    seg = shared_memory.SharedMemory(name=name, create=True, size=size)
    try:
        os.posix_fallocate(seg._fd, 0, size)  # the segment's own descriptor (POSIX SharedMemory keeps it open)
    except BaseException:
        seg.close()
        unlink_segment(seg, "refused shared-memory segment")  # one removed by someone else: the refusal is raised
        raise
    return seg


def shm_empty(shape: tuple[int, ...], dtype: torch.dtype, group: int | None = None) -> ShmTensor:
    """A zero-filled tensor in a fresh shared-memory segment, exportable with `export_handle`.

    Python makes the segment 0600: only this user opens it. With `group`, it is made 0660 and that
    group's: a sidecar running as another user of the group (its socket's) can map it too."""
    nbytes = max(1, int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
    seg = new_segment(nbytes)
    try:
        if group is not None:
            _share_with_group(seg.name, group)
        # Viewed through a mapping of its own, not seg.buf: SharedMemory.close() (ShmTensor.close, or its
        # __del__) unmaps under any tensor made from seg.buf (frombuffer keeps no buffer export), and a view
        # the engine still held crashed it at its next access. This one goes with its last view.
        mapping = AttachedSegment(seg.name)
        seg.close()  # nothing views it
        # Raises for a shape the bytes cannot be viewed as (a zero-element shape of a dtype wider than
        # the 1-byte minimum segment: a StatusReport's hidden_size 0 sized the doorbell's regions so).
        t = torch.frombuffer(mapping.buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
        mapping.release()
        t.zero_()
    except BaseException:
        t = mapping = None  # type: ignore[assignment]  # unmapped now, not with the error's traceback
        seg.close()
        # Else it stayed in /dev/shm until the process exited; one removed by someone else: the refusal is raised.
        unlink_segment(seg, "refused shared-memory segment")
        raise
    with _EXPORTED_LOCK:
        _EXPORTED[t.untyped_storage().data_ptr()] = (seg.name, nbytes)
    return ShmTensor(t, seg)


def _share_with_group(name: str, gid: int) -> None:
    """Group read/write on /dev/shm/`name` for `gid` (set through the descriptor: the name is ours, just
    created exclusively, but a path call would follow whatever the entry had become)."""
    fd = os.open(os.path.join("/dev/shm", name.lstrip("/")), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o660)
    finally:
        os.close(fd)


@dataclass
class DeviceTensor:
    """A GPU tensor the engine exports through CUDA/HIP IPC (no segment to close), shaped like ShmTensor."""

    tensor: torch.Tensor

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]


def exportable_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                     group: int | None = None) -> ShmTensor | DeviceTensor:
    """Zeros the sidecar can map with `export_handle`: a shared-memory segment on CPU (shared with
    `group`, see shm_empty), device memory on a GPU. The caller keeps the holder and closes it when done."""
    if device.type == "cpu":
        return shm_empty(shape, dtype, group)
    return DeviceTensor(torch.zeros(shape, dtype=dtype, device=device))


def export_handle(t: torch.Tensor) -> pb.MemoryHandle:
    """A handle to the storage under `t` (the sidecar applies t's own shape/strides/offset)."""
    storage = t.untyped_storage()
    if t.device.type == "cpu":
        with _EXPORTED_LOCK:
            entry = _EXPORTED.get(storage.data_ptr())
        if entry is None:
            raise HandleError("CPU tensor is not in exported shared memory: allocate it with shm_empty()")
        name, size = entry
        return pb.MemoryHandle(shm=pb.SharedMemoryHandle(name=name, size_bytes=size, offset_bytes=0))
    if t.device.type == "cuda":
        (device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync) = storage._share_cuda_()
        props = torch.cuda.get_device_properties(device)
        return pb.MemoryHandle(cuda_ipc=pb.CudaIpcHandle(
            device_index=device, device_uuid=str(getattr(props, "uuid", "")), ipc_handle=handle,
            storage_size_bytes=size, storage_offset_bytes=offset, ref_counter_handle=rc_handle,
            ref_counter_offset=rc_offset, event_handle=ev_handle or b"", event_sync_required=bool(ev_sync)))
    raise HandleError(f"cannot export memory of device type {t.device.type}")


# Sidecar side: map a handle and view it as a tensor -----------------------------------------------

class MappedMemory:
    """One mapped handle: a byte storage the sidecar can view with any dtype/shape/stride."""

    def __init__(self, handle: pb.MemoryHandle, field: str, device: torch.device) -> None:
        kind = handle.WhichOneof("kind")
        self._segment: AttachedSegment | None = None
        if kind == "shm":
            try:
                seg = AttachedSegment(handle.shm.name)  # the engine's: it owns and unlinks it
            except (FileNotFoundError, OSError, ValueError) as e:
                error = HandleExhausted if _exhausted(e) else HandleError
                raise error(f"{field}: cannot open shared memory {handle.shm.name!r}: {e}") from None
            lo, size = handle.shm.offset_bytes, handle.shm.size_bytes
            problem = None
            if lo > seg.size:
                problem = f"offset {lo} beyond segment size {seg.size}"
            elif size and not lo <= size <= seg.size:
                problem = f"size_bytes {size} outside the segment's {seg.size} bytes (or below offset_bytes {lo})"
            if problem is not None:
                # Unmapped now (nothing views it yet): the error's traceback keeps this frame and `seg`, which
                # stayed mapped past the refusal until whoever held the error dropped it (MemoryBindings._discard).
                seg.close()
                raise HandleError(f"{field}: {problem}")
            self._segment = seg
            self.storage = torch.frombuffer(seg.buf, dtype=torch.uint8)[lo : size or seg.size]
            self._memory = ("shm", *seg.file)
        elif kind == "cuda_ipc":
            self.storage = _open_cuda_ipc(handle.cuda_ipc, field, device)
            self._memory = ("device", self.storage.device.index)
        else:
            raise HandleError(f"{field}: memory handle has no kind (shm or cuda_ipc)")

    @property
    def nbytes(self) -> int:
        return self.storage.numel()

    def place(self, t: torch.Tensor) -> tuple[tuple, int]:
        """Where a view of this mapping starts: (the memory object, byte position in it). Two views are in
        the same memory exactly when their objects are equal: one shared-memory object (by inode, whatever
        name or mapping reached it), or one device's address space (torch maps an IPC allocation once per
        process, so every handle to it gives the same addresses)."""
        if self._memory[0] == "shm":  # the storage begins at the segment's first byte (see __init__)
            return self._memory, t.data_ptr() - t.untyped_storage().data_ptr()
        return self._memory, t.data_ptr()

    def limit(self, nbytes: int) -> None:
        """Views may reach the first `nbytes` bytes only (a registered region's size_bytes)."""
        self.storage = self.storage[:nbytes]

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...],
             offset: int, field: str) -> torch.Tensor:
        """The tensor at element `offset` with the given shape/stride; bounds checked against the mapping."""
        item = torch.empty((), dtype=dtype).element_size()
        if len(stride) != len(shape):
            raise HandleError(f"{field}: {len(stride)} strides for {len(shape)} dimensions")
        if any(s < 0 for s in shape) or any(s < 0 for s in stride) or offset < 0:
            raise HandleError(f"{field}: negative shape, stride or offset")
        extent = offset + (1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0)
        if extent * item > self.nbytes:
            raise HandleError(f"{field}: view needs {extent * item} bytes, mapping has {self.nbytes}")
        # The address, not storage_offset(): a CUDA IPC handle's offset is inside its storage's pointer
        # (torch's rebuild adds it), storage_offset() 0, and a misaligned K/V or int64 view accepted there
        # faulted at the first step ("misaligned address", a CUDA error that ends the rank; helper 81).
        # Segments are page-aligned, so for shared memory this is the handle's offset as before.
        misaligned = self.storage.data_ptr() % item
        if misaligned:
            raise HandleError(f"{field}: the region starts {misaligned} bytes past a multiple of {item} (its "
                              f"handle's offset), not aligned for {item}-byte {dtype}")
        if self.nbytes % item:
            base = self.storage[: self.nbytes - self.nbytes % item]
        else:
            base = self.storage
        try:
            typed = base.view(dtype)
            return typed.as_strided(shape, stride, typed.storage_offset() + offset)
        # Whatever torch still refuses: the request's fault, not the rank's. TypeError too: its argument parser's
        # "Overflow when unpacking long" for a stride past int64 (a zero-element shape passes the bounds check).
        except (RuntimeError, TypeError) as err:
            why = str(err).split("\n", 1)[0]  # the parser's error goes on with a C++ trace: its first line
            raise HandleError(f"{field}: {why}") from None

    def close(self) -> None:
        """Drop this mapping: unmapped at once, or (a view of it still alive, e.g. a step's tensor
        the caller still holds) when the last such view is freed, never under it."""
        self.storage = None  # type: ignore[assignment]
        if self._segment is not None:
            self._segment.release()
            self._segment = None


class QuietStream:
    """Where CUDA IPC mappings are closed: the device current (page unregistrations need its context)
    and an idle stream of its own. torch synchronizes the current stream before it unmaps, and a
    sidecar rank's stream may hold a queued copy waiting on its engine or, at TP > 1, on its peers,
    which the closing thread (holding the GIL, perhaps the rank's lock) would wait for. Off CUDA a
    no-op."""

    def __init__(self, device: torch.device) -> None:
        self.device, self._stream = device, None

    def __call__(self) -> contextlib.AbstractContextManager:
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:  # made on first use
            self._stream = torch.cuda.Stream(self.device)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(self._stream))
        return stack


def discard_handle(handle: pb.MemoryHandle) -> None:
    """Give back torch's producer reference of a CUDA IPC handle this process will never open.

    Each export (torch's `_share_cuda_`) counts one consumer in a shared ref-counter file, and the
    engine's allocator frees the block only once that consumer has let go (torch's IPC "limbo",
    emptied by `ipc_collect`). A handle refused before it is opened would otherwise keep the
    engine's block allocated until the engine exits. Shared memory needs nothing: the engine owns
    and unlinks its segments."""
    if handle.WhichOneof("kind") == "cuda_ipc":
        _discard_cuda_ipc(handle.cuda_ipc)


# Counters in one of torch's ref-counter files (CUDA_IPC_REF_COUNTER_FILE_SIZE, CudaIPCTypes.h): an
# export's ref_counter_offset indexes int64s in that file's mapping, and torch decrements the one it
# names, unchecked, when it gives the reference back (_release_ipc_counter, or an opened storage's unmap).
_REF_COUNTERS = 10000
# The largest value torch takes for a size or offset: it unpacks them as int64 (ValueError past that).
_INT64_MAX = (1 << 63) - 1
# Bytes of a cudaIpcEventHandle_t / hipIpcEventHandle_t (CUDA_IPC_HANDLE_SIZE): torch reads that many from
# an event handle it must wait on, whatever the length of the bytes it was given.
_IPC_EVENT_HANDLE_BYTES = 64
# Bytes of torch's ref-counter file: its counters after the 64-byte header of its mapping (RefcountedMapAllocator).
_REF_COUNTER_FILE_BYTES = 8 * _REF_COUNTERS + 64


def counter_file_problem(name: bytes) -> str | None:
    """Why torch must not be handed `name` as a CUDA IPC handle's ref-counter file, or None.

    torch opens the name in /dev/shm read/write on the caller's word, unchecked (a give-back, an opened
    storage's unmap): a file shorter than its counter file it grows to that size and zeroes the first byte
    of, it bumps and drops the int at its start and unlinks the file if that reaches 0, and it decrements
    an int64 inside it. Named so, any segment this process may open (another engine's page or KV cache,
    the ranks' rendezvous board, as root any user's) was rewritten or removed. torch names its counter
    files torch_* (NewProcessWideShmHandle) and makes them that size; a name that is not there is no
    harm (torch's open fails, quietly)."""
    text = name.decode("utf-8", "replace").lstrip("/")
    if not text.startswith("torch_") or "/" in text or "\0" in text:
        return f"{text!r} is not the name of one of torch's ref-counter files (torch_*, one entry of /dev/shm)"
    try:
        # The name's own bytes, as torch opens them: `text` has U+FFFD for each byte that is not UTF-8, a name
        # that is not there, which passed a 1-byte torch_...\xff file on to torch.
        st = os.lstat(b"/dev/shm/" + name.lstrip(b"/"))
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size < _REF_COUNTER_FILE_BYTES:
        return (f"/dev/shm/{text} is not one of torch's ref-counter files (a regular file of at least "
                f"{_REF_COUNTER_FILE_BYTES} bytes; found mode {st.st_mode:o}, {st.st_size} bytes)")
    return None


def _discard_cuda_ipc(h: pb.CudaIpcHandle) -> None:
    if not h.ref_counter_handle:
        return
    if h.ref_counter_offset >= _REF_COUNTERS:  # no counter of torch's: the decrement would land past its file
        log.warning("a refused CUDA IPC handle names ref counter %d, outside torch's %d: nothing given back",
                    h.ref_counter_offset, _REF_COUNTERS)
        return
    why = counter_file_problem(h.ref_counter_handle)
    if why:  # torch would write into (or remove) whatever file it names
        log.warning("a refused CUDA IPC handle's ref_counter_handle %s: nothing given back", why)
        return
    try:
        torch.UntypedStorage._release_ipc_counter(h.ref_counter_handle, h.ref_counter_offset)
    except Exception as e:  # noqa: BLE001  (a counter file that is gone: its engine exited, nothing is held)
        log.warning("could not give back the engine's reference of a refused CUDA IPC handle (%s); the engine "
                    "keeps that block until it exits", e)


# Opens are check-then-map over torch's process-wide cache of opened handles (see _rebuild): one at a time.
_OPEN_LOCK = threading.Lock()


def _rebuild(h: pb.CudaIpcHandle, field: str, device: torch.device) -> torch.Tensor:
    """torch's open of a CUDA/HIP IPC handle, as a byte tensor of storage_size_bytes; HandleError if it
    cannot be opened, with the engine's producer reference given back exactly once either way.

    torch maps a handle once per process and serves later opens of it from a cache, giving back their
    producer reference itself before it builds the tensor. An open that claims more bytes than the
    cached storage has then fails inside torch, after that give-back, with a RuntimeError ("Trying to
    resize storage that is not resizable"): it is refused here before torch is called instead. The
    cached storage is held until torch has looked it up, so it cannot expire in between."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, storage_from_cache

    key = (h.ipc_handle, h.storage_offset_bytes)
    held = storage_from_cache(torch.UntypedStorage, key)
    if held is not None and h.storage_size_bytes > held.nbytes():
        have = held.nbytes()
        del held
        _discard_cuda_ipc(h)
        raise HandleError(f"{field}: storage_size_bytes {h.storage_size_bytes} exceeds the {have} bytes of the "
                          "storage this handle opened when this sidecar first mapped it; send the exported "
                          "storage's own size")
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, (h.storage_size_bytes,), (1,), 0, torch.UntypedStorage, torch.uint8,
            device.index if device.index is not None else torch.cuda.current_device(), h.ipc_handle,
            h.storage_size_bytes, h.storage_offset_bytes, False, h.ref_counter_handle, h.ref_counter_offset,
            h.event_handle, h.event_sync_required)  # bytes even when empty: torch's open takes no None (TypeError)
    except RuntimeError as err:  # e.g. bytes that are no IPC handle: the driver refuses to open them
        if held is None and storage_from_cache(torch.UntypedStorage, key) is None:
            _discard_cuda_ipc(h)  # torch mapped nothing, so it gave nothing back
        error = HandleExhausted if _exhausted(err) else HandleError
        raise error(f"{field}: the CUDA/HIP IPC handle cannot be opened on {device}: {err}") from None


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU's UUID as handles and EngineFacts name it (str of torch's device property), or
    "" for a CPU device or a torch that does not report one. Handles and BindKV compare against it."""
    if device.type != "cuda":
        return ""
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))


def _open_cuda_ipc(h: pb.CudaIpcHandle, field: str, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        _discard_cuda_ipc(h)
        raise HandleError(f"{field}: a CUDA/HIP IPC handle needs a GPU sidecar, this rank runs on {device}")
    uuid = gpu_uuid(device)
    if uuid and h.device_uuid != uuid:  # an empty one too: the exporter (export_handle) always names its GPU
        _discard_cuda_ipc(h)
        raise HandleError(f"{field}: handle is from GPU {h.device_uuid or '(not named)'}, this rank runs on GPU "
                          f"{uuid} (engine rank r must bind to sidecar rank r on the same GPU)")
    if not h.storage_size_bytes:  # torch would open nothing and keep the counter; the query then fails (uncheckable)
        _discard_cuda_ipc(h)
        raise HandleError(f"{field}: storage_size_bytes 0: a CUDA/HIP IPC handle must name a storage of at least "
                          "one byte")
    # torch's open answers an empty handle, or a sync with no event, with no storage and no exception (Python's
    # SystemError: INTERNAL, the counter kept); an event handle of another length it reads past its bytes.
    if not h.ipc_handle:
        _discard_cuda_ipc(h)
        raise HandleError(f"{field}: ipc_handle is empty: send the exported storage's handle")
    if h.event_sync_required and len(h.event_handle) != _IPC_EVENT_HANDLE_BYTES:
        _discard_cuda_ipc(h)
        raise HandleError(f"{field}: event_sync_required with an event_handle of {len(h.event_handle)} bytes, not "
                          f"{_IPC_EVENT_HANDLE_BYTES}: send the exported event's handle")
    if h.ref_counter_offset >= _REF_COUNTERS:  # torch would decrement it, past its counter file, on unmap
        raise HandleError(f"{field}: ref_counter_offset {h.ref_counter_offset} is outside torch's ref-counter "
                          f"file of {_REF_COUNTERS} counters; send the exported storage's own counter")
    why = counter_file_problem(h.ref_counter_handle) if h.ref_counter_handle else None
    if why:  # torch would write into (or remove) that file on unmap: refused, and nothing given back to it
        raise HandleError(f"{field}: ref_counter_handle {why}; send the exported storage's own counter")
    if max(h.storage_size_bytes, h.storage_offset_bytes) > _INT64_MAX:  # torch's ValueError, not a HandleError
        _discard_cuda_ipc(h)
        raise HandleError(f"{field}: storage_size_bytes {h.storage_size_bytes} or storage_offset_bytes "
                          f"{h.storage_offset_bytes} past 2^63 - 1: no GPU allocation is that large")
    with _OPEN_LOCK:
        t = _rebuild(h, field, device)
    # The handle opened the exporter's whole allocation; the storage the message claims must lie in it
    # (gpu_alloc). Refused here, `t` is dropped, and with it the mapping and the engine's reference.
    # Asked at the mapping's start (a storage_offset_bytes past the end points at nothing the driver
    # knows), with the rank's GPU current: the driver answers for the calling thread's context, and a
    # gRPC handler thread's current device need not be the rank's.
    try:
        with torch.cuda.device(t.device):
            room = bytes_left(t.data_ptr() - h.storage_offset_bytes, t.device.index) - h.storage_offset_bytes
    except (OSError, AttributeError, AllocationQueryError) as err:  # no driver library, no such symbol, a failed query
        refusal = (f"cannot check the handle's storage against the GPU allocation it opens ({err}); refused "
                   "rather than mapped unchecked")
        # A failed query may pass next time (run 266's 201); a missing library or symbol never will.
        error = HandleUncheckable if isinstance(err, AllocationQueryError) else HandleError
    else:
        error = HandleError
        total = room + h.storage_offset_bytes
        # An offset past the allocation's end itself: "-4096 bytes from storage_offset_bytes" named no field to fix.
        refusal = None if h.storage_size_bytes <= room else (
            f"storage_size_bytes {h.storage_size_bytes} runs past the end of the GPU allocation the handle opens "
            f"({room} bytes from storage_offset_bytes {h.storage_offset_bytes}, {total} in all); send the exported "
            "storage's own size and offset") if room >= 0 else (
            f"storage_offset_bytes {h.storage_offset_bytes} is past the end of the GPU allocation the handle opens "
            f"({total} bytes in all); send the exported storage's own offset")
    if refusal is None:
        return t
    # Unmapped now, on a quiet stream (torch synchronizes the current stream as it unmaps, and this
    # thread's is the rank's), not whenever the exception's traceback, which would hold `t`, is freed.
    with QuietStream(device)():
        del t
    raise error(f"{field}: {refusal}")
