"""The engine end of the same-GPU data plane: registered step buffers, the shm doorbell, interprocess events.

Registered once: a GPU (or, on CPU, shm) region for inputs_embeds and one for the hidden
states, and a shm region for the step metadata, which the engine builds on the host anyway
(reading it there keeps validation off the GPU). Each step then copies its tensors into the
regions on the engine's stream, records the "inputs written" event, and rings the doorbell with
a DraftStepRequest whose tensors are RegionSlices (a few hundred bytes). The answer's hidden
states are a view of the output region, ordered after the sidecar's work by making the
engine's stream wait on the sidecar's "outputs written" event: no host sync on either side.
The view is valid until the next step is sent.

`DoorbellTransport` (client/doorbell_transport.py) puts a `DoorbellChannel` and its `StepBuffers`
behind the send / wait / settled interface of the gRPC `StepStream` (a page the sidecar closed, or
an answer that does not decode, reads there as a broken stream), so the shim can use either transport.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import secrets
import time
from typing import NamedTuple

import grpc
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.proto.gpu_word import GpuWordError, GpuWordOps, RegisteredPage


log = logging.getLogger("dspark_sidecar.client")


CLOSE_WAIT_S = 5.0  # how long closing a doorbell waits for the engine's stream to pass its last step
SENT_STREAMS = 4  # how many of the streams steps were sent from close() waits for (an engine uses one or two)
# Pages whose GPU registration outlived their channel's close() (a stream that never passed, a refused unregister):
# mapped until the process exits. Not on the channel, which the shim drops right after close(): collected with it,
# the page was unmapped under the live registration, whose range a later page mapped at that address then meets.
_KEPT: list = []

# RegisterBuffers errors after which the regions may be registered on the sidecar all the same.
_OUTCOME_UNKNOWN = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                              grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN})


class DataPlaneError(RuntimeError):
    """The data plane cannot be set up or used; the shim falls back to the gRPC stream."""


class DoorbellClosed(DataPlaneError):
    """The sidecar stopped serving this doorbell (another AttachDoorbell replaced it, or the rank is
    shutting down) without answering the step rung last. Nothing of that step runs on the sidecar any more
    (sidecar.proto: a pre-launched copy may have run it, and has finished), so it is settled."""


def ipc_group(endpoint: str) -> int | None:
    """The group to share this engine's shared-memory segments with: the group of the sidecar rank's
    unix socket (who may connect may map them), if this process may give its files that group. None
    for a TCP endpoint, or a group this process is not in: the segments stay owner-only (0600), which
    serves a sidecar running as this same user.

    Why: under systemd on AMD the sidecar runs as its own user (deploy/systemd), and Python's 0600
    segments (the doorbell page, the metadata region) could not be opened by it: the doorbell was
    refused and every step went over the gRPC stream."""
    if not endpoint.startswith("unix:"):
        return None
    try:
        gid = os.stat(endpoint[len("unix:"):]).st_gid
    except OSError:
        return None
    return gid if os.geteuid() == 0 or gid == os.getegid() or gid in os.getgroups() else None


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, keep: list,
           group: int | None = None) -> torch.Tensor:
    held = memory.exportable_zeros(shape, dtype, device, group)
    keep.append(held)
    return held.tensor


class Staged(NamedTuple):
    """A step copied into the regions: what its request must carry, and where its answer will be."""

    fields: bytes  # a serialized DraftStepRequest with the layout's region slices and launch key only.
    # Appended to a serialized request with the step's own scalars it makes the whole request (protobuf
    # merges concatenated messages): no merge, and the slices are not serialized again (DoorbellTransport).
    launch_key: int
    hidden: torch.Tensor  # [n, hidden] view of the output region


_LAUNCH_KEYS = itertools.count()  # one sequence per process: see _next_launch_key


def _next_launch_key() -> int:
    """A launch key (sidecar.proto DraftStepRequest.launch_key) no layout of this process has had: 1 ..
    SKIP_KEY - 1, wrapping after 2^32 - 2 layouts. One sequence for every StepBuffers, not one each:
    two of them on one doorbell both starting at 1 would name the same key for different slices, and
    a step queued for one's layout would run, on the GPU, the other's stale step (next() on a count is
    atomic under the GIL)."""
    return next(_LAUNCH_KEYS) % (bell.SKIP_KEY - 1) + 1


class StepBuffers:
    """The registered regions of one engine rank, sized for `max_reqs` requests."""

    def __init__(self, stub: pb_grpc.DrafterSidecarStub, hidden: int, max_reqs: int, max_pages: int,
                 dtype: torch.dtype, device: torch.device, timeout_s: float = 10.0, group: int | None = None,
                 lease: int = 0) -> None:
        """lease: the engine's lease token (client/lease.py), under which the sidecar releases the regions
        should this process end without close(); 0: none."""
        n = layout.QPR * max_reqs
        self._stub, self._timeout_s = stub, timeout_s
        self._ids: list[int] = []  # registered with the sidecar: released there by close()
        # Names the registration before it is sent: a call that times out may still complete on the
        # sidecar, and the engine, which never saw the ids, releases the regions by this token.
        self.owner = secrets.randbits(63) or 1
        self._shm: list = []
        self._layouts: dict[tuple, tuple] = {}
        self.max_reqs, self.max_pages, self.dtype, self.device = max_reqs, max_pages, dtype, device
        try:
            self.embeds = _alloc((n, hidden), dtype, device, self._shm, group)
            self.hidden = _alloc((n, hidden), dtype, device, self._shm, group)
            # Metadata lives in host shared memory on every device kind (see module docstring).
            meta_len = 2 * n * 8 + max_reqs * 4 + max_reqs * max_pages * 4 + 4 * 8  # + alignment
            meta = memory.shm_empty((meta_len,), torch.uint8, group)
            self._shm.append(meta)
            self.meta_bytes = meta.tensor
            regions = [pb.BufferRegion(name=name, memory=memory.export_handle(t), size_bytes=t.numel() * t.element_size())
                       for name, t in (("inputs_embeds", self.embeds), ("hidden_states", self.hidden),
                                       ("metadata", self.meta_bytes))]
            ids = list(stub.RegisterBuffers(pb.RegisterBuffersRequest(regions=regions, owner=self.owner, lease=lease),
                                            timeout=timeout_s).region_ids)
            if len(ids) != 3 or len(set(ids)) != 3 or 0 in ids:
                self._release_owner()  # whatever it did register, it did under our token
                raise DataPlaneError(f"RegisterBuffers answered region ids {ids}, not three distinct ones")
        except grpc.RpcError as e:
            if e.code() in _OUTCOME_UNKNOWN:  # the sidecar may have registered them all the same
                self._release_owner()
            self.close()
            raise
        except BaseException:  # refused (an older sidecar, a handle it cannot map), or out of memory: keep nothing
            self.close()
            raise
        self._ids = ids
        self.embeds_id, self.hidden_id, self.meta_id = ids

    def input_view(self, n: int) -> torch.Tensor:
        """The registered input rows [n, hidden]: an engine that writes its embeddings here (e.g. as
        the out= of its embedding lookup) passes this view to `fill`, which then copies nothing."""
        rows = self.embeds.shape[0]
        if n > rows:  # sliced, the view is cut short: an out= then resizes it, which on a GPU moves the whole
            # input region's storage away from the memory the sidecar mapped
            raise DataPlaneError(f"a step of {n} input rows exceeds the registered buffers ({rows} rows)")
        return self.embeds[:n]

    def fill(self, req: pb.DraftStepRequest, embeds: torch.Tensor, positions: torch.Tensor,
             meta: StepMetadata) -> torch.Tensor:
        """Copy one step's tensors into the regions and point `req` at them; returns the hidden view."""
        staged = self.stage(embeds, positions, meta)
        req.MergeFromString(staged.fields)  # the layout's fields, kept serialized: ~0.7 us less than MergeFrom
        return staged.hidden

    def stage(self, embeds: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> Staged:
        """Copy one step's tensors into the regions; what the request must say about them (`Staged`)."""
        srcs = (positions, meta.seq_lens, meta.block_tables, meta.slot_mapping)
        key = (positions.shape, meta.seq_lens.shape, meta.block_tables.shape, meta.slot_mapping.shape,
               positions.dtype, meta.seq_lens.dtype, meta.block_tables.dtype, meta.slot_mapping.dtype, embeds.shape[1])
        got = self._layouts.get(key)
        if got is None:
            got = self._layout(key, srcs, embeds.shape[1])
        staged, dsts, inputs = got
        if embeds.shape != inputs.shape:  # the request names [n, hidden] rows: copy_ would broadcast one row into all
            raise DataPlaneError(f"inputs_embeds {list(embeds.shape)} for a step of {list(inputs.shape)} input rows")
        if embeds.data_ptr() != inputs.data_ptr() or embeds.stride() != inputs.stride():  # not written in place
            inputs.copy_(embeds, non_blocking=True)
        for (dst, addr, nbytes), t in zip(dsts, srcs):  # same dtypes and shapes (the layout's key): a plain copy
            if t.is_cpu and t.is_contiguous():  # bytes into shm: torch's dispatch costs several us at a step's start
                ctypes.memmove(addr, t.data_ptr(), nbytes)
            else:
                dst.copy_(t)
        return staged

    def _layout(self, key: tuple, srcs: tuple, hidden: int) -> tuple:
        """Per (shapes, dtypes): the request's region slices, views (tensor, NumPy) of the metadata
        region, and the input and hidden rows [n, hidden]; checked against the regions once.

        An engine repeats a handful of shapes; building all this once per shape keeps the per-step
        cost at four copies and one message merge. Contiguous host tensors are copied by memmove:
        at the start of a synchronized step torch's copy_ cost several microseconds each (fill took
        45-89 us on an H200 host; BENCHMARKS.md run 12), and NumPy's copy with its torch -> NumPy
        view about 2.5 us each (run 115).
        """
        R, n, pages = srcs[1].shape[0], srcs[0].numel(), srcs[2].shape[1]
        # The rows too (n from the positions): past the region's, the input and hidden views below were cut short,
        # and the request named [n, hidden] rows the regions do not have.
        rows = self.embeds.shape[0]
        if R > self.max_reqs or pages > self.max_pages or n > rows:
            raise DataPlaneError(f"step of {R} requests x {pages} pages, {n} input rows exceeds the registered buffers "
                                 f"({rows} rows, {self.max_reqs} requests x {self.max_pages} pages)")
        template = pb.DraftStepRequest(inputs_embeds=codec.region_tensor_ref(self.dtype, (n, hidden), self.embeds_id, 0),
                                       output=pb.RegionSlice(region_id=self.hidden_id, offset_bytes=0),
                                       launch_key=_next_launch_key())
        raw, dsts, off = self.meta_bytes, [], 0
        for field, t in zip(("positions", "seq_lens", "block_tables", "slot_mapping"), srcs):
            off = -(-off // 8) * 8  # keep every tensor 8-byte aligned
            nbytes = t.numel() * t.dtype.itemsize
            if off + nbytes > raw.numel():
                raise DataPlaneError(f"{field} {list(t.shape)} does not fit the registered metadata region")
            view = raw[off : off + nbytes].view(t.dtype).reshape(t.shape)
            dsts.append((view, view.data_ptr(), nbytes))
            getattr(template, field).CopyFrom(codec.region_tensor_ref(t.dtype, tuple(t.shape), self.meta_id, off))
            off += nbytes
        if len(self._layouts) >= 64:
            self._layouts.clear()
        staged = Staged(template.SerializeToString(), template.launch_key, self.hidden[:n])
        got = self._layouts[key] = (staged, dsts, self.embeds[:n])
        return got

    def close(self) -> None:
        """Release the regions on the sidecar (UnregisterBuffers, within the registration's deadline),
        then here. Without it the sidecar would keep them mapped until it exits, and under CUDA IPC
        keep these buffers allocated. A sidecar that is gone or restarted has nothing to release:
        the failed call is logged and closing goes on."""
        ids, self._ids = self._ids, []
        if ids:  # by id as well as by owner: a sidecar older than the owner field releases by id
            self._unregister(pb.UnregisterBuffersRequest(region_ids=ids, owner=self.owner))
        self._layouts.clear()  # their raw addresses point into the regions unmapped below
        self.embeds = self.hidden = self.meta_bytes = None  # type: ignore[assignment]
        for t in self._shm:
            t.close()
        self._shm.clear()

    def _release_owner(self) -> None:
        """After a RegisterBuffers whose outcome is unknown: release whatever the sidecar registered
        under this owner, and retire the token there so a registration still under way is refused."""
        self._unregister(pb.UnregisterBuffersRequest(owner=self.owner))

    def _unregister(self, req: pb.UnregisterBuffersRequest) -> None:
        try:
            self._stub.UnregisterBuffers(req, timeout=self._timeout_s)
        except grpc.RpcError as e:
            log.info("UnregisterBuffers: %s (a sidecar that is gone holds nothing; a live one keeps the "
                     "regions until it exits)", e.code().name)
        except ValueError as e:  # the channel was closed under us: the local memory still goes
            log.info("UnregisterBuffers not sent (%s); a live sidecar keeps the regions until it exits", e)


def _raw_stream(device: torch.device) -> int:
    """The current stream's handle on `device`, without building a torch Stream object."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return raw(index) if raw is not None else torch.cuda.current_stream(device).cuda_stream


def _stream(raw: int, device: torch.device) -> torch.cuda.Stream:
    """The torch stream of a raw handle on `device` (0: the default stream)."""
    return torch.cuda.default_stream(device) if raw == 0 else torch.cuda.ExternalStream(raw, device=device)


class DoorbellChannel:
    """One engine rank's doorbell to its sidecar rank (one step in flight)."""

    def __init__(self, stub: pb_grpc.DrafterSidecarStub, device: torch.device, capacity: int = 1 << 16,
                 timeout_s: float = 10.0, gpu_word: bool = True, group: int | None = None, lease: int = 0) -> None:
        """lease: the engine's lease token (client/lease.py), whose end stops the sidecar's doorbell (0: none)."""
        self.capacity, self.device = capacity, device
        self._header: RegisteredPage | None = None
        self.ringer: bell.Ringer | None = None
        self.page: bell.Page | None = None
        # The raw streams steps were last sent from, newest last (0 is the default stream): close() waits
        # for each, where a GPU word's write may still be queued. Set before the try: close() reads it when
        # AttachDoorbell is refused after the GPU word was registered (helper 80: an AttributeError hid the
        # refusal, the shim never fell back to its gRPC stream, and each retry leaked a page).
        self._sent_on: list[int] = []
        self._sent_at = 0.0
        # The raw stream last ordered after the sidecar's "outputs written" event (None: no answer yet).
        self._ordered_on: int | None = None
        self.alive = False
        self._page = memory.shm_empty((bell.HEADER + 2 * capacity,), torch.uint8, group)
        # Everything after the page is made inside the try: the page's views, the CUDA event and the GPU
        # word's probe raised past it before, and the page's segment stayed in /dev/shm until exit.
        try:
            self.page = bell.Page(self._page.tensor.numpy(), capacity)
            # On this channel's GPU whatever the calling thread's current one is (connect() may run on another
            # thread than the engine's, which set its device on its own): the page's registration is made in the
            # current context (GpuWordOps._bind refuses another GPU's: the GPU word was dropped), and torch makes
            # the input event, at ipc_handle(), on the current GPU, where every send's record of it then raised.
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                self.input_event = torch.cuda.Event(interprocess=True) if device.type == "cuda" else None
                # Recorded on the stream that waited for the last answer when the next step comes from another
                # (order_inputs): the engine's reads of that answer's rows queued there come before the next step.
                self._waited_event = torch.cuda.Event() if device.type == "cuda" else None
                if self._waited_event is not None:  # made on this GPU now: the driver's calls need its handle
                    self._waited_event.record(torch.cuda.current_stream(device))
                # The GPU word (server/prelaunch.py): offered when this process can write it from its stream.
                self._ops = GpuWordOps.load(device) if gpu_word else None
                if self._ops is not None:
                    try:
                        self._header = RegisteredPage(self._ops, self._page.tensor.data_ptr())
                    except GpuWordError as err:  # said: the steps are then not pre-launched
                        log.warning("GPU word unavailable on %s (%s): steps are not pre-launched", device, err)
                        self._ops = None
                resp = stub.AttachDoorbell(pb.AttachDoorbellRequest(
                    page=memory.export_handle(self._page.tensor), capacity_bytes=capacity,
                    input_event=self.input_event.ipc_handle() if self.input_event is not None else b"",
                    gpu_word=self._header is not None, lease=lease), timeout=timeout_s)
                self.output_event = (torch.cuda.Event.from_ipc_handle(device, resp.output_event)
                                     if device.type == "cuda" else None)
        except BaseException:  # refused: the page and its GPU registration go now, not at exit
            self.close()
            raise
        # Where this end writes the word; 0: the sidecar does not pre-launch, nothing is written.
        self.word_address = self._header.device_ptr + bell.GPU_WORD_OFFSET if resp.gpu_word and self._header else 0
        if resp.wake_fifo:
            try:
                self.ringer = bell.Ringer(resp.wake_fifo)
            # Not reachable from here (a NUL byte in the path is a ValueError: it escaped after the attach and
            # left the page and its registration to the process's exit): the idle doorbell still looks every 2 ms.
            except (OSError, ValueError):
                self.ringer = None
        self._seq = self.page.word(bell.REQ_SEQ)
        self.rung_mono_ns = self.answer_seen_mono_ns = 0  # the last ring, and when its answer was seen (monotonic)
        self.alive = True

    def send(self, req: pb.DraftStepRequest) -> None:
        self.send_bytes(req.SerializeToString(), req.launch_key)

    def send_bytes(self, data: bytes, launch_key: int) -> None:
        """Ring with a serialized DraftStepRequest whose launch key is `launch_key`."""
        if len(data) > self.capacity:
            raise DataPlaneError(f"request of {len(data)} bytes exceeds the doorbell ({self.capacity})")
        # Numbered before the driver's calls, and not given back when one raises: the GPU word (this number and
        # launch_key) may be queued already, and the sidecar's pre-launched copy run on it; the next step rung under
        # the same number and layout would be answered from that copy (server/prelaunch.py offer). A number skipped
        # costs nothing: the sidecar serves any new number it finds rung, and no queued copy matches it.
        self._seq += 1
        if self._ops is not None:  # raw handles: building torch's Stream object costs ~15-25 us at a step's start
            raw = _raw_stream(self.device)
            if not self._sent_on or self._sent_on[-1] != raw:  # a stream not sent from just before: close() waits for it too
                self._note_stream(raw)
            if self.word_address:  # after the inputs on this stream: the pre-launched step starts here,
                # so first (the event is for a step that runs the ordinary way)
                self._ops.write(raw, self.word_address, bell.gpu_word(self._seq, launch_key))
            self._ops.record(self.input_event, raw)
        elif self.input_event is not None:
            self.input_event.record(torch.cuda.current_stream(self.device))
        self.page.write(self.page.req_area, data, bell.REQ_LEN, bell.REQ_SEQ, self._seq)  # ring: sequence last
        self.rung_mono_ns = time.monotonic_ns()  # with StepTimings' seen/published_mono_ns: where a step's time went
        if self.ringer is not None:  # after the sequence store (see proto/doorbell.py Waker.sleep)
            try:
                self.ringer.wake_if_asleep(self.page)
            except OSError as err:  # rung all the same: the step is in flight, and its wait must run
                log.warning("doorbell: could not wake the sidecar's doorbell thread (%s); it finds the ring "
                            "within %.0f ms all the same", err, bell.MISSED_WAKE_S * 1e3)
        self._sent_at = time.perf_counter()

    def wait(self, step_id: int, timeout_s: float) -> pb.DraftStepResponse | None:
        """The answer, None on timeout, DoorbellClosed once the sidecar has closed the page without
        answering. On GPU the engine's stream is ordered after the sidecar's writes."""
        if not bell.wait_until(lambda: self.page.word(bell.RESP_SEQ) == self._seq or self.page.word(bell.CLOSED),
                               time.perf_counter() + timeout_s, self._sent_at, bell.nap_for(self.device.type)):
            return None
        if self.page.word(bell.RESP_SEQ) != self._seq:  # read after CLOSED, which the sidecar stores after any answer
            self.alive = False
            raise DoorbellClosed(f"the sidecar closed this doorbell without answering step {step_id} (another "
                                 "AttachDoorbell replaced it, or the rank is shutting down); nothing of the step runs there any more")
        self.answer_seen_mono_ns = time.monotonic_ns()
        # First: an answer means the step was launched, whatever its bytes turn out to say; its
        # kernels may still read the input rows and write the K/V cache.
        self._after_outputs()
        return pb.DraftStepResponse.FromString(self.page.read(self.page.resp_area, bell.RESP_LEN))

    def settled(self, step_id: int) -> bool:
        """Whether the last step sent was answered. A late answer (one `wait` gave up on) orders this
        stream after that step's writes, as `wait` would have: the sidecar answers once the step is
        launched, and until it has run, the next step's input copy could overwrite what it reads."""
        closed = self.page.word(bell.CLOSED)  # first: the sidecar stores it after its last answer
        if self.page.word(bell.RESP_SEQ) != self._seq:
            if closed:  # never answered, and nothing of it runs on the sidecar any more (sidecar.proto)
                self.alive = False
                return True
            return False
        self._after_outputs()
        return True

    @property
    def closed_by_sidecar(self) -> bool:
        """The sidecar has stopped serving this page for good: the engine should attach again."""
        return self.page is not None and self.page.words is not None and bool(self.page.word(bell.CLOSED))

    def order_inputs(self) -> None:
        """Before the next step's inputs are copied into the regions: if the current stream is not the one
        `wait` ordered after the last answer, it waits for that answer's "outputs written" event and for the
        work queued so far on the stream that waited.

        `wait` orders only the stream current there. An engine that stages the next step from another
        stream (torch's streams do not order with each other) would otherwise copy its inputs over rows
        the previous step's kernels may still read (helper 80's hazard 2), and the next step could write
        the output region before the engine's read of the last answer there, queued on the stream that
        waited (the shim's hidden() copy), had run: the engine got the next step's hidden states. One
        raw-handle read per step (no Stream object) when the stream is the same, as it is for an engine
        drafting on one stream."""
        if self._ordered_on is not None and _raw_stream(self.device) != self._ordered_on:
            waited = self._ordered_on
            self._after_outputs()
            self._after_stream(waited)

    @property
    def copies_raw(self) -> bool:
        """Whether copy_rows goes through the driver (the GPU word's ops loaded), not torch."""
        return self._ops is not None

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src) on the engine's current stream, for two contiguous tensors of one shape and dtype on
        this GPU (an answer's rows out of the output region): through the driver where the ops are loaded
        (no dispatch: runs 296-297 measured 4-8 us less host time after the answer than torch's clone), else
        torch's copy_."""
        if self._ops is None:
            dst.copy_(src)
            return
        if dst.shape != src.shape or dst.dtype != src.dtype or not (dst.is_contiguous() and src.is_contiguous()):
            raise ValueError(f"copy_rows: {list(src.shape)} {src.dtype} into {list(dst.shape)} {dst.dtype}, both "
                             "contiguous, expected")
        self._ops.copy(_raw_stream(self.device), dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size())

    def _after_stream(self, raw: int) -> None:
        """Make the engine's current stream wait for the work queued so far on stream `raw`."""
        if self._waited_event is None:  # CPU: every read of a region is done when it returns
            return
        try:
            if self._ops is not None:  # raw handles, as in send
                self._ops.record(self._waited_event, raw)
                self._ops.wait_event(_raw_stream(self.device), self._waited_event)
            else:
                self._waited_event.record(_stream(raw, self.device))
                torch.cuda.current_stream(self.device).wait_event(self._waited_event)
        except RuntimeError as err:  # a stream the engine has destroyed since: its queued work may still run
            log.info("doorbell: cannot order after stream %#x the last answer was waited on (%s); waiting for "
                     "the device", raw, err)
            torch.cuda.synchronize(self.device)

    def _after_outputs(self) -> None:
        """Make the engine's current stream wait for the sidecar's "outputs written" event."""
        if self.output_event is not None:
            raw = _raw_stream(self.device)
            if self._ops is not None:  # raw handles, as in send (torch's current_stream() builds a Stream object)
                self._ops.wait_event(raw, self.output_event)
            else:
                torch.cuda.current_stream(self.device).wait_event(self.output_event)
            self._ordered_on = raw

    def close(self) -> None:
        self.alive = False
        if self.ringer is not None:
            self.ringer.close()
        if self._header is not None:
            # From any thread (an engine may close from another than the one that opened): the
            # unregister needs this GPU's context current (GpuWordOps._bind refuses another's).
            with torch.cuda.device(self.device):
                if not self._stream_passed(CLOSE_WAIT_S):
                    # The stream may wait on a wedged sidecar's event: no bounded wait can make the
                    # unmap safe, so the page and its registration stay (a few KB) rather than hang.
                    log.warning("doorbell: the engine's stream has not passed its last step after %.0f s (a "
                                "wedged sidecar?); its doorbell page stays mapped until the process exits",
                                CLOSE_WAIT_S)
                    _KEPT.append((self._header, self.page, self._page))
                    return
                try:
                    self._header.close()  # no queued write can land after the unmap
                except BaseException:  # still registered (RegisteredPage.close): the page must stay mapped
                    _KEPT.append((self._header, self.page, self._page))
                    raise
        if self.page is not None:  # None: __init__ failed before it was made
            self.page.close()
        self._page.close()

    def _note_stream(self, raw: int) -> None:
        if raw in self._sent_on:
            self._sent_on.remove(raw)
        self._sent_on.append(raw)
        del self._sent_on[:-SENT_STREAMS]

    def _stream_passed(self, timeout_s: float) -> bool:
        """Whether the streams steps were sent from (their GPU words' writes) and the closing thread's
        current stream get past all their queued work within timeout_s. The senders', not only the
        closing thread's: an engine may close from another thread, whose current stream (torch's streams
        do not order with each other) says nothing of a write still queued on the sender's."""
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        events = [done]
        for raw in self._sent_on:
            try:
                done = torch.cuda.Event()
                done.record(_stream(raw, self.device))
            except RuntimeError as err:  # a stream the engine has destroyed since: it queues nothing any more
                log.info("doorbell: not waiting on stream %#x steps were sent from (%s)", raw, err)
                continue
            events.append(done)
        deadline = time.monotonic() + timeout_s
        while not all(e.query() for e in events):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True
