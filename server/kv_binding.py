"""This rank's view of the engine's memory: the bound draft KV cache (with generations) and data-plane regions."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field

import grpc
import torch

from dspark_sidecar.drafter.config import DrafterConfig
from dspark_sidecar.drafter.kv_cache import FP8_KV, kv_layer_shape, kv_view_problem
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.memory import MappedMemory, QuietStream, discard_handle, gpu_uuid
from dspark_sidecar.server.errors import SidecarError, invalid, out_of_range, precondition
from dspark_sidecar.server.refusal import EngineFacts


VIEW_CACHE = 1024  # resolved region views kept (a few per request count the engine uses)
# Regions one RegisterBuffers may name (the shim registers 3). Each mapping holds one of the rank's file
# descriptors (Python's mmap keeps a dup) and one of its mappings (vm.max_map_count): a request naming tens
# of thousands, mapped before any check, ran the rank out of them while it lasted and was answered
# UNAVAILABLE MAP_EXHAUSTED, "try again", for a request that fails the same way every time.
MAX_REGIONS = 64


@dataclass
class KVBinding:
    binding_id: int
    generation: int
    layers: list[torch.Tensor]  # per layer [2, num_pages, page_size, kv_heads/tp, head_dim], any KV_LAYOUTS strides
    num_pages: int
    page_size: int
    engine: EngineFacts
    mappings: list[MappedMemory]
    spans: list[_Span] = field(default_factory=list)  # each layer's bytes (_Span.of), for the overlap rule
    lease: int = 0  # BindKVRequest.lease: released when that lease's connection ends (server/lease.py); 0: none

    def close(self) -> None:
        self.layers = []
        for m in self.mappings:
            m.close()


class MemoryBindings:
    """BindKV / UnbindKV / RegisterBuffers state of one rank; steps check their binding against it.

    The overlap rule: no byte of the bound cache is in a registered region or in the doorbell
    page's bytes, and no byte of a registered region is in the doorbell page's. The sidecar writes
    all three (K/V rows; hidden states into whichever region a step names as its output; answers
    and header words into the page), so shared bytes would be rewritten by the wrong writer with no
    error anywhere. Regions are refused whatever they are for: a region has no role when it is
    registered (any step may name any region as its output), and a region only read is read in
    place, its indices checked once and then used while the step writes K/V, which would change
    them. Whichever of BindKV, RegisterBuffers and AttachDoorbell comes second is refused
    (INVALID_ARGUMENT naming its field and both byte ranges; what is in place stands). The checks
    and the records they check against change together under the lock, so two calls racing each
    other cannot both pass. Regions may overlap each other; a doorbell page may not overlap the page
    of a doorbell still attached, the one it replaces included (claim_page)."""

    def __init__(self, cfg: DrafterConfig, tp: int, rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cfg, self.tp, self.rank, self.dtype, self.device = cfg, tp, rank, dtype, device
        self._lock = threading.Lock()
        self.kv: KVBinding | None = None
        self.generation = 0
        self.binds = 0
        self._regions: dict[int, MappedMemory] = {}
        self._retired: set[int] = set()  # released region ids: never handed out again by this process
        self._owned: dict[int, list[int]] = {}  # RegisterBuffersRequest.owner -> its live region ids
        self._released_owners: set[int] = set()  # owners released by UnregisterBuffers: register nothing more
        self._leased: dict[int, list[int]] = {}  # RegisterBuffersRequest.lease -> its live region ids
        self._pages: dict[MappedMemory, _Span] = {}  # attached doorbells' pages, until they let go (claim_page)
        self._quiet = QuietStream(device)  # where refused mappings are closed (_discard)
        # Resolved views by (region, offset, dtype, shape): an engine sends the same slices step
        # after step, and building a bounds-checked view costs ~20 us of torch calls each time.
        self._views: dict[tuple, torch.Tensor] = {}
        self.layouts: dict[tuple, tuple] = {}  # validate.py's checked step tensors per request layout
        # Bumped, under the lock, whenever released regions clear both caches: a view or layout built from a
        # region before the bump is not cached after it (keep), so no entry outlives the region it views.
        self.epoch = 0

    # KV -------------------------------------------------------------------------------------
    def bind(self, req: pb.BindKVRequest, retire=lambda close: close()) -> KVBinding:
        """Map the engine's cache and make it the current binding; the previous one is closed through
        retire(close) (RankLoop.after_device: once the device no longer reads it)."""
        e = req.engine
        try:
            if e.tp_size == 0:  # proto3's "not set": the whole EngineFacts, often
                raise invalid("engine.tp_size", "not set: send the engine's facts (EngineFacts: its rank, TP, DP and PP "
                                                "sizes, speculative config) with every BindKV")
            for name in ("dp_size", "pp_size"):  # else the fast path's refusal read 0 as "DP > 1" / "PP > 1"
                if getattr(e, name) == 0:
                    raise invalid(f"engine.{name}", "not set: send the engine's size (1 for none)")
            if e.engine_rank != self.rank:
                raise precondition(f"engine rank {e.engine_rank} bound to sidecar rank {self.rank}: engine rank r "
                                   "must talk to sidecar rank r (its own socket)", "RANK_MISMATCH", "engine.engine_rank")
            if e.tp_size != self.tp:
                raise precondition(f"engine TP {e.tp_size} != sidecar TP {self.tp}: start the sidecar with --tp "
                                   f"{e.tp_size}", "TP_MISMATCH", "engine.tp_size")
            own = gpu_uuid(self.device) if e.device_uuid else ""  # the engine names its GPU; "" on a CPU rank
            if own and e.device_uuid != own:  # worded as a layer handle's GPU mismatch (memory._open_cuda_ipc)
                raise invalid("engine.device_uuid", f"the engine rank runs on GPU {e.device_uuid}, this rank runs on "
                                                    f"GPU {own} (engine rank r must bind to sidecar rank r on the "
                                                    "same GPU)")
            if req.page_size <= 0:
                raise invalid("page_size", "must be positive")
            if len(req.layers) != self.cfg.num_hidden_layers:
                raise invalid("layers", f"{len(req.layers)} layers bound, the drafter has {self.cfg.num_hidden_layers}")
        except Exception:  # refused before any layer was opened
            self._discard([], [lb.memory for lb in req.layers])
            raise
        mappings, layers, spans, num_pages = self._map_layers(req)
        facts = EngineFacts(e.tp_size, e.dp_size, e.pp_size, e.speculative_method, e.num_speculative_tokens)
        try:
            with self._lock:
                for i, span in enumerate(spans):
                    _refuse_overlap(f"layers[{i}].memory", "the layer's cache", span, self._written_by_others())
                old, self.generation, self.binds = self.kv, self.generation + 1, self.binds + 1
                kv = self.kv = KVBinding(secrets.randbits(62) or 1, self.generation, layers, num_pages,
                                         req.page_size, facts, mappings, spans, req.lease)
        except Exception:  # over a region or the doorbell page: the binding in place stands
            layers.clear()
            self._discard(mappings, [])
            raise
        if old is not None:
            retire(old.close)
        # The one made here, not self.kv read again: an UnbindKV or BindKV on another thread may have changed
        # that since the lock (None, or a binding this call did not make).
        return kv

    def _map_layers(self, req: pb.BindKVRequest) -> tuple[list[MappedMemory], list[torch.Tensor], list[_Span], int]:
        """Each layer checked and mapped in order: (mappings, views [2, pages, page, kv_heads, head_dim],
        their spans, pages).
        On a refusal what was mapped is undone, and the handles not yet opened are given back."""
        mappings: list[MappedMemory] = []
        layers: list[torch.Tensor] = []
        spans: list[_Span] = []
        num_pages = None
        handed = 0  # layers passed to MappedMemory (which opened them, or gave back its own)
        try:
            for i, lb in enumerate(req.layers):
                f = f"layers[{i}]"
                if lb.layer != i:
                    raise invalid(f"{f}.layer", f"layers must be listed in order, got layer {lb.layer} at {i}")
                dtype = _dtype(lb.dtype, f"{f}.dtype")
                if dtype != self.dtype and dtype != FP8_KV:
                    raise invalid(f"{f}.dtype", f"cache is {dtype}, this sidecar computes in {self.dtype} (--dtype); "
                                                "a cache is served in that dtype or as float8 e4m3")
                pages = lb.shape[1] if len(lb.shape) == 5 else -1
                want = kv_layer_shape(self.cfg, self.tp, pages, req.page_size)
                if i == 0 and len(lb.shape) == 5 and lb.shape[2] != req.page_size:
                    # Refused as layers[0].shape ("expected [2, pages, 8, ...]"), the engine was told to reshape a
                    # cache that was right, page_size unnamed. A later layer unlike layer 0 is refused on its shape.
                    raise invalid("page_size", f"{req.page_size}, but layers[0] has {lb.shape[2]} tokens per "
                                               "page (shape[2]): send the cache's page size, equal to every layer's "
                                               "shape[2]")
                # Counts first: tuple() of a peer's millions of dimensions alone took seconds, on the step lock.
                if len(lb.shape) != len(want) or tuple(lb.shape) != want:
                    # Another count of dimensions has no page count to take: named, not shown as -1 pages.
                    told = ", ".join(str(n) if k != 1 or len(lb.shape) == 5 else "num_pages" for k, n in enumerate(want))
                    hint = ("; send a records cache [pages, heads, page_size, 2 * head_dim] (vLLM's) as its planes "
                            "view (client/binding.py: kv_planes)") if len(lb.shape) == 4 else ""
                    raise invalid(f"{f}.shape", f"{codec.shape_text(lb.shape)}, expected [{told}] "
                                  f"[2, num_pages, page_size, kv_heads/tp, head_dim]{hint}")
                if len(lb.strides) != len(want):
                    raise invalid(f"{f}.strides", f"{len(lb.strides)} strides, one per shape entry ({len(want)})")
                if pages < 1:
                    raise invalid(f"{f}.shape", f"{list(lb.shape)}: a cache needs at least one page")
                if num_pages is not None and pages != num_pages:
                    raise invalid(f"{f}.shape", f"{pages} pages, layer 0 has {num_pages}")
                num_pages = pages
                handed = i + 1
                m = MappedMemory(lb.memory, f"{f}.memory", self.device)
                mappings.append(m)
                t = m.view(dtype, tuple(lb.shape), tuple(lb.strides), lb.storage_offset, f)
                if t.device.type != self.device.type:
                    raise invalid(f"{f}.memory", f"cache is in {t.device.type} memory, this rank computes on "
                                                 f"{self.device}: bind the engine's device cache (CUDA/HIP IPC)")
                problem = kv_view_problem(lb.shape, lb.strides)
                if problem is not None:
                    raise invalid(f"{f}.strides", f"{problem}; send the planes view of a planes or records cache "
                                                  "(client/binding.py: kv_planes)")
                span = _Span.of(m, t)
                _refuse_overlap(f"{f}.memory", "the layer's cache", span,
                                [(f"layers[{k}]'s cache", other) for k, other in enumerate(spans)])
                spans.append(span)
                layers.append(t)
        except Exception:  # a bad layer (or handle: errors.as_sidecar_error maps it) unmaps the rest
            # The error's traceback keeps this frame: its last view would keep the refused layer mapped
            # past _discard, unmapped wherever the error is dropped (on a GPU, off the QuietStream).
            t = None
            layers.clear()
            self._discard(mappings, [lb.memory for lb in req.layers[handed:]])
            raise
        return mappings, layers, spans, int(num_pages)

    def _discard(self, opened: list[MappedMemory], unopened: list[pb.MemoryHandle]) -> None:
        """Undo a refused BindKV or RegisterBuffers: close what it mapped, and give back torch's producer
        reference of each CUDA IPC handle it never opened (memory.discard_handle: else the engine's
        block stays allocated until the engine exits). No step read any of it, so nothing is waited
        for; the closes run in a QuietStream (a handler thread's current stream is the rank's)."""
        if opened:
            with self._quiet():
                for m in opened:
                    m.close()
                opened.clear()
        for h in unopened:
            discard_handle(h)

    def unbind(self, binding_id: int, retire=lambda close: close()) -> None:
        with self._lock:
            kv = self.kv
            if kv is None or kv.binding_id != binding_id:
                raise unknown_binding(binding_id)
            self.kv = None
        retire(kv.close)

    def check(self, binding_id: int, generation: int) -> KVBinding:
        """The binding a step names, or FAILED_PRECONDITION telling the engine to re-bind."""
        kv = self.kv
        if kv is None:
            raise precondition("binding_id: no KV cache is bound on this rank: call BindKV first", "NOT_BOUND", "binding_id")
        if binding_id != kv.binding_id:
            raise precondition(f"binding_id: {binding_id} is unknown (current {kv.binding_id}): re-bind",
                               "UNKNOWN_BINDING", "binding_id")
        if generation != kv.generation:
            raise precondition(f"binding_generation: {generation} is stale (current {kv.generation}): re-bind",
                               "STALE_BINDING", "binding_generation")
        return kv

    # Data-plane regions ---------------------------------------------------------------------
    def register(self, req: pb.RegisterBuffersRequest) -> list[int]:
        """Map the request's regions, all or none, and hand out their ids (under req.owner when set)."""
        mapped: list[MappedMemory] = []
        handed = 0  # regions passed to MappedMemory (which opened them, or gave back its own)
        try:
            if len(req.regions) > MAX_REGIONS:  # counted before any is opened
                raise out_of_range("regions", f"{len(req.regions)} regions in one request, at most {MAX_REGIONS}: "
                                              "each costs the rank a file descriptor and a mapping (the shim "
                                              "registers 3 buffers)")
            for i, region in enumerate(req.regions):
                handed = i + 1
                m = MappedMemory(region.memory, f"regions[{i}].memory", self.device)
                mapped.append(m)
                if not 0 < region.size_bytes <= m.nbytes:
                    raise invalid(f"regions[{i}].size_bytes", f"{region.size_bytes}: must be positive and at most "
                                                             f"the {m.nbytes} bytes mapped")
                m.limit(region.size_bytes)  # steps may name these bytes only, not the rest of the memory
            with self._lock:
                if req.owner and req.owner in self._released_owners:
                    # The engine gave up on this registration (its call timed out) and released the
                    # token first: what is mapped here would have no one left to release it.
                    raise precondition(f"owner: {req.owner} was released by UnregisterBuffers; register under "
                                       "a new token", "OWNER_RELEASED", "owner")
                for i, m in enumerate(mapped):
                    _refuse_overlap(f"regions[{i}].memory", "the region", _Span.bytes_of(m, m.nbytes),
                                    self._kv_layers() + self._page_spans())
                ids = []
                for m in mapped:
                    # Random, like binding ids: an id an engine kept from before a sidecar restart names nothing here.
                    while (rid := secrets.randbits(62) or 1) in self._regions or rid in self._retired:
                        pass
                    self._regions[rid] = m
                    ids.append(rid)
                if req.owner:
                    self._owned.setdefault(req.owner, []).extend(ids)
                if req.lease:
                    self._leased.setdefault(req.lease, []).extend(ids)
        except Exception:  # a bad region (or handle: errors.as_sidecar_error maps it) undoes the others
            self._discard(mapped, [r.memory for r in req.regions[handed:]])
            raise
        return ids

    def check_registered(self, ids: list[int]) -> None:
        """NOT_FOUND naming the first of `ids` not registered on this rank. UnregisterBuffers asks first, outside
        the rank's section, so that a wrong id does not stop the rank's pre-launched step for nothing;
        unregister asks again under the lock (another call may release them in between)."""
        with self._lock:
            self._check_registered(ids)

    def _check_registered(self, ids: list[int]) -> None:
        """check_registered, under the lock."""
        unknown = [rid for rid in ids if rid not in self._regions]
        if unknown:
            raise SidecarError(grpc.StatusCode.NOT_FOUND, f"region_ids: {unknown[0]} is not registered on "
                               f"this rank ({len(self._regions)} registered); nothing was released",
                               "region_ids", "UNKNOWN_REGION")

    def unregister(self, ids: list[int], owner: int = 0, lease: int = 0) -> list[MappedMemory]:
        """Release the regions `ids` and those registered under `owner`, all or none: steps can no
        longer name them, and the owner registers nothing more; and those still registered under `lease`
        (its end, or the registration that saw it end while mapping), taken here, under the lock, so that an
        UnregisterBuffers of some of them just before makes this no NOT_FOUND. The cached views and checked layouts
        go here; the mappings are returned for the caller to close once the device no longer reads
        them (servicer.UnregisterBuffers)."""
        with self._lock:
            return self._unregister(ids, owner, lease)

    def _unregister(self, ids: list[int], owner: int, lease: int) -> list[MappedMemory]:
        """unregister, under the lock."""
        self._check_registered(ids)
        if owner:
            self._released_owners.add(owner)
            ids = ids + [rid for rid in self._owned.pop(owner, []) if rid in self._regions]
        if lease:
            ids = ids + [rid for rid in self._leased.pop(lease, []) if rid in self._regions]
        gone = set(ids)  # released by id too: no longer anyone's to release by owner or lease
        _forget(self._owned, gone)
        _forget(self._leased, gone)
        released = [self._regions.pop(rid) for rid in dict.fromkeys(ids)]
        self._retired.update(ids)
        if released:
            # Coarse on purpose: both caches refill in a step or two, and an entry left behind would
            # hold a view of a released region (and so its memory).
            self._views.clear()
            self.layouts.clear()
            self.epoch += 1
        return released

    # The overlap rule (class docstring) --------------------------------------------------------
    def claim_page(self, page: MappedMemory, nbytes: int) -> None:
        """AttachDoorbell: the page's first `nbytes` bytes (the header and both message areas: what the
        doorbell reads and writes, not the rest of what the handle maps) are the doorbell's until
        release_page(page); INVALID_ARGUMENT `page` where they overlap the bound cache, a region or a page
        still attached."""
        span = _Span.bytes_of(page, min(nbytes, page.nbytes))
        with self._lock:
            # A page still attached too: its doorbell marks it CLOSED as it stops, under the new one serving
            # it (the engine then takes a step still running for settled), and a ring in between is served twice.
            attached = [("the page of a doorbell still attached (until its thread has stopped)", s)
                        for s in self._pages.values()]
            _refuse_overlap("page", "the doorbell page", span, self._kv_layers() + self._regions_spans() + attached)
            self._pages[page] = span

    def release_page(self, page: MappedMemory) -> None:
        """The doorbell no longer uses the page (refused, or stopped and its page closed)."""
        with self._lock:
            self._pages.pop(page, None)

    def _kv_layers(self) -> list[tuple[str, _Span]]:
        kv = self.kv
        return [(f"layers[{i}]'s KV cache of binding {kv.binding_id}", s) for i, s in enumerate(kv.spans)] if kv else []

    def _regions_spans(self) -> list[tuple[str, _Span]]:
        return [(f"registered region {rid}", _Span.bytes_of(m, m.nbytes)) for rid, m in self._regions.items()]

    def _page_spans(self) -> list[tuple[str, _Span]]:
        return [("the doorbell page", s) for s in self._pages.values()]

    def _written_by_others(self) -> list[tuple[str, _Span]]:
        return self._regions_spans() + self._page_spans()

    @property
    def region_count(self) -> int:
        return len(self._regions)

    def retire_if_idle(self, ids: list[int], owner: int = 0, lease: int = 0) -> bool:
        """unregister's fast way out: True where `ids` is empty and neither `owner` nor `lease` holds a region (the
        owner registers nothing more, as there), decided under the lock that a registration records under, so
        that one still mapping under the owner is refused or seen here. Nothing reads anything of them, so the
        caller needs no rank section (whose quiesce would release the live engine's pre-launched step)."""
        with self._lock:
            held = self._owned.get(owner, []) + self._leased.get(lease, [])
            if ids or any(rid in self._regions for rid in held):
                return False
            self._unregister([], owner, lease)  # releases nothing; retires the owner, drops their empty lists
            return True

    def leases_regions(self, lease: int) -> bool:
        """Whether regions registered under `lease` are still registered."""
        with self._lock:
            return bool(self._leased.get(lease))

    def resolve(self, region: pb.RegionSlice, dtype: torch.dtype, shape: tuple[int, ...], field: str) -> torch.Tensor:
        """codec.RegionResolver: a contiguous view into a registered region, bounds checked (once per slice)."""
        key = (region.region_id, region.offset_bytes, dtype, shape)
        view = self._views.get(key)
        if view is None:
            epoch = self.epoch
            view = self._resolve(region, dtype, shape, field)
            self.keep(self._views, key, view, epoch, VIEW_CACHE)
        return view

    def keep(self, cache: dict, key: tuple, value: object, epoch: int, limit: int) -> None:
        """cache[key] = value (`_views`, or validate.py's `layouts`; a full cache is emptied first), unless
        regions were released since `epoch` (read before value was built from them): an unregister that
        ran in between has cleared the caches, and this entry would bring back a view of its regions."""
        with self._lock:
            if self.epoch != epoch:
                return
            if len(cache) >= limit:
                cache.clear()
            cache[key] = value

    def _resolve(self, region: pb.RegionSlice, dtype: torch.dtype, shape: tuple[int, ...], field: str) -> torch.Tensor:
        m = self._regions.get(region.region_id)
        if m is None:
            raise ValueError(f"{field}: region {region.region_id} is not registered")
        item = torch.empty((), dtype=dtype).element_size()
        if region.offset_bytes % item:
            raise ValueError(f"{field}: offset {region.offset_bytes} not aligned to {item}-byte {dtype}")
        stride, size = [], 1
        for n in reversed(shape):  # contiguous, in Python ints: any shape a request names, however large
            stride.append(size)
            size *= n
        return m.view(dtype, shape, tuple(reversed(stride)), region.offset_bytes // item, field)  # HandleError is a ValueError

    def close(self) -> None:
        """Unmap the binding and the regions (each with its last view) and forget them, under the lock (the tests'
        teardown; a rank leaves both to its exit). Kept, a later check() passed the closed binding (no layers) and a
        later slice, BindKV or RegisterBuffers met closed mappings (AttributeError, INTERNAL). Nothing is bound or
        registered after it; a second close does nothing more."""
        with self._lock:
            kv, regions = self.kv, list(self._regions.values())
            self.kv = None
            self._retired.update(self._regions)
            self._regions.clear()
            self._owned.clear()
            self._leased.clear()
            self._views.clear()
            self.layouts.clear()
            self.epoch += 1
        if kv is not None:
            kv.close()
        for m in regions:
            m.close()


@dataclass(frozen=True)
class _Span:
    """The bytes of one layer's view: which memory object, where in it, and their lattice."""

    memory: tuple  # MappedMemory.place: one shm object, or one device's address space
    start: int  # byte position of the view's first element
    dims: tuple[tuple[int, int], ...]  # (count, byte stride), ascending strides; bytes of an element included
    nbytes: int  # from the first byte to past the last

    @staticmethod
    def bytes_of(m: MappedMemory, nbytes: int) -> "_Span":
        """The first `nbytes` bytes of a mapping (a region's size_bytes, a doorbell page's used bytes)."""
        memory, start = m.place(m.storage)
        return _Span(memory, start, ((nbytes, 1),), nbytes)

    @staticmethod
    def of(m: MappedMemory, t: torch.Tensor) -> "_Span":
        memory, start = m.place(t)
        item = t.element_size()
        dims = sorted([(n, s * item) for n, s in zip(t.shape, t.stride()) if n > 1] + [(item, 1)],
                      key=lambda d: d[1])
        return _Span(memory, start, tuple(dims), 1 + sum((n - 1) * s for n, s in dims))

    def describe(self) -> str:
        return f"bytes {self.start}..{self.start + self.nbytes}"

    def overlaps(self, other: "_Span") -> bool:
        """Whether a byte is in both. Exact for views of one layout (the lattices are equal): every view
        passed kv_view_problem, so each stride steps past all the smaller ones span, and the difference
        of the starts has at most two candidate counts per dimension. Views of different layouts
        overlap where their byte ranges do (no engine lays two layers out differently in one range), and
        so do a layer and a run of bytes (bytes_of): a region in the holes of a strided layer is refused."""
        if self.memory != other.memory or not self.nbytes or not other.nbytes:
            return False
        if self.start + self.nbytes <= other.start or other.start + other.nbytes <= self.start:
            return False
        return self.dims != other.dims or _reaches(other.start - self.start, self.dims)


def _refuse_overlap(field_name: str, what: str, span: _Span, others: list[tuple[str, _Span]]) -> None:
    """INVALID_ARGUMENT `field_name` where `span` shares a byte with one of `others` ((name, span))."""
    for name, other in others:
        if span.overlaps(other):
            where = "shared-memory object" if span.memory[0] == "shm" else "GPU's address space"
            raise invalid(field_name, f"{what} ({span.describe()}) overlaps {name} ({other.describe()}) in the same "
                          f"{where}: the sidecar writes each layer's K/V rows into its own cache, hidden states into "
                          "any region a step names as its output and answers into the doorbell page, so none of "
                          "them may share a byte with another (sidecar.proto: BindKVRequest)")


def unknown_binding(binding_id: int) -> SidecarError:
    """UnbindKV's refusal of an id that is not the binding in place (released, replaced, or never this rank's)."""
    return precondition(f"binding_id: {binding_id} is not the current binding", "UNKNOWN_BINDING", "binding_id")


def _forget(by_token: dict[int, list[int]], gone: set[int]) -> None:
    """Drop released region ids from each token's list (owner or lease), and a token left with none. An owner token
    stays usable for registering all the same: only a release by owner retires it (_released_owners)."""
    for token in list(by_token):
        by_token[token] = [rid for rid in by_token[token] if rid not in gone]
        if not by_token[token]:
            del by_token[token]


def _reaches(diff: int, dims: tuple[tuple[int, int], ...]) -> bool:
    """diff = sum(d_k * stride_k) for some |d_k| < count_k (dims ascending, each stride past the span below)."""
    if not dims:
        return diff == 0
    (n, s), rest = dims[-1], dims[:-1]
    below = sum((c - 1) * t for c, t in rest)
    lo, hi = max(-(n - 1), -((below - diff) // s)), min(n - 1, (diff + below) // s)
    return any(_reaches(diff - d * s, rest) for d in range(lo, hi + 1))


def _dtype(value: int, field: str) -> torch.dtype:
    try:
        return codec.dtype_from_proto(value, field)
    except ValueError as err:
        raise invalid(field, str(err).split(": ", 1)[-1]) from None


