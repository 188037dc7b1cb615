"""Turns a DraftStepRequest into checked step tensors; every malformed field gets a status naming it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import numpy as np
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.config import DrafterConfig
from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError, invalid, out_of_range
from dspark_sidecar.server.kv_binding import KVBinding, MemoryBindings


class HostMeta(NamedTuple):
    """NumPy views of a step's metadata on the host; for a shared-memory region they alias it, so a
    layout's views are built once and read each step's values (valid until the next step)."""

    positions: np.ndarray  # int64 [R, 7]
    seq_lens: np.ndarray  # int32 [R]
    tables: np.ndarray  # int32 [R, max_pages]
    slots: np.ndarray  # int64 [R, 7]


def host_meta(positions: torch.Tensor, meta: StepMetadata) -> HostMeta:
    """NumPy views of CPU tensors (copies of device ones) in HostMeta's shapes."""
    R = meta.seq_lens.shape[0]
    return HostMeta(positions.cpu().numpy().reshape(R, layout.QPR), meta.seq_lens.cpu().numpy(),
                    meta.block_tables.cpu().numpy(), meta.slot_mapping.cpu().numpy().reshape(R, layout.QPR))


@dataclass(frozen=True)
class Step:
    """A validated step: n = 7R rows, all tensors on CPU (moved to the rank's device by the runner)."""

    step_id: int
    num_reqs: int
    positions: torch.Tensor  # int64 [n]
    inputs_embeds: torch.Tensor | None  # [n, hidden]
    input_ids: torch.Tensor | None  # int64 [n]
    meta: StepMetadata
    kv: KVBinding
    output: pb.RegionSlice | None
    host: HostMeta  # the metadata again, as NumPy on the host (graphs.py builds its inputs from it)
    in_region: bool = False  # every tensor is a view of a registered region (the data plane)
    # Where the step's index tensors above are a private copy (PrivateCopy): the registered region's own
    # views of positions, seq_lens, block_tables, slot_mapping, which a pre-launched program reads on the
    # device after the engine's next write (server/prelaunch.py); None: the tensors above are those views.
    sources: tuple[torch.Tensor, ...] | None = None

    @property
    def region_meta(self) -> tuple[torch.Tensor, ...]:
        """(positions, seq_lens, block_tables, slot_mapping) where the engine writes them."""
        return self.sources if self.sources is not None else index_tensors(self.positions, self.meta)


def index_tensors(positions: torch.Tensor, meta: StepMetadata) -> tuple[torch.Tensor, ...]:
    """(positions, seq_lens, block_tables, slot_mapping): what the index checks read and PrivateCopy copies."""
    return positions, meta.seq_lens, meta.block_tables, meta.slot_mapping


def _tensor(req: pb.DraftStepRequest, field: str, mem: MemoryBindings, dtype: torch.dtype | None,
            shape: tuple[int, ...] | None, why: str = "") -> torch.Tensor:
    """The field's tensor, its dtype and shape checked; `why`: where the expected shape comes from (the message's)."""
    if not req.HasField(field):
        raise invalid(field, "missing")
    ref = getattr(req, field)
    try:
        got = codec.dtype_from_proto(ref.dtype, field)
    except ValueError as err:
        raise invalid(field, str(err).split(": ", 1)[-1]) from None
    if dtype is not None and got != dtype:
        raise invalid(field, f"dtype must be {codec.pb.DType.Name(codec.dtype_to_proto(dtype))}, "
                             f"got {codec.pb.DType.Name(ref.dtype)}")
    # The count first: tuple() of a peer's millions of dimensions alone took seconds.
    if shape is not None and (len(ref.shape) != len(shape) or tuple(ref.shape) != shape):
        because = f" ({why})" if why else ""
        raise invalid(field, f"shape {codec.shape_text(ref.shape)}, expected {list(shape)}{because}")
    try:
        return codec.from_tensor_ref(ref, field, resolver=mem.resolve)
    except ValueError as err:
        raise invalid(field, str(err).split(": ", 1)[-1]) from None


# What a DraftStepResponse carries besides its hidden states' bytes (step id, tensor header, timings):
# under 300 bytes; the rest is slack.
ANSWER_OVERHEAD = 1024


def validate_step(req: pb.DraftStepRequest, cfg: DrafterConfig, mem: MemoryBindings, max_reqs: int,
                  indices: bool = True, out_dtype: torch.dtype | None = None, answer_limit: int = 0,
                  private: bool = False) -> Step:
    """All checks of issue 3's bad-input list, cheapest first; raises SidecarError naming the field.

    indices=False leaves out the index checks (check_indices): the rank loop runs them only when a
    pre-launched copy of the step has not passed the same checks on the GPU (server/rank.py).
    out_dtype: the hidden states' dtype, to check an output region slice before the step runs
    (found after it, the step would have written its K/V for an answer that is an error).
    answer_limit: the most bytes an answer may take where it goes (gRPC's --max-message-bytes, the
    doorbell's capacity); a step asking for inline hidden states past it is refused (0: no limit).
    Two rows naming one cache slot are refused whatever `indices` (check_distinct_slots).
    private: the step's index tensors that lie in registered regions are copied out first, and the
    checks and the step read that copy only (PrivateCopy says why; every rank, server/rank.py)."""
    R = req.num_requests
    if not 1 <= R <= max_reqs:
        raise out_of_range("num_requests", f"{R} outside 1..{max_reqs} (this sidecar's --max-reqs)")
    kv = mem.check(req.binding_id, req.binding_generation)
    key = _layout_key(req)
    # Region slices only (their views depend on nothing the step carries), and host views only where
    # they alias the region (a device region's host copy is taken per step). Cached through mem.keep,
    # with the epoch read before the cache: an UnregisterBuffers on another thread meanwhile leaves no
    # entry viewing its regions.
    epoch = mem.epoch if key is not None else 0
    tensors = mem.layouts.get(key) if key is not None else None
    cache = False  # (re)store the layout's entry: new, or its PrivateCopy made
    if tensors is None:
        positions, embeds, ids, meta = _tensors(req, cfg, mem, R)
        host = host_meta(positions, meta)
        tensors = positions, embeds, ids, meta, host, None  # the last: the layout's PrivateCopy, once made
        cache = key is not None and all(t.device.type == "cpu" for t in index_tensors(positions, meta))
    positions, embeds, ids, meta, host, copy = tensors
    sources = None
    if private and (key is not None or _in_region(req)):  # before any check: what is checked is what runs
        if copy is None:
            copy = PrivateCopy(positions, ids, meta, host)
            cache = cache or (key is not None and mem.layouts.get(key) is tensors)
            tensors = (*tensors[:5], copy)
        sources = index_tensors(positions, meta)
        positions, ids, meta, host = copy.take()
    if cache:
        mem.keep(mem.layouts, key, tensors, epoch, 256)
    if ids is not None and ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < cfg.vocab_size):
        _refuse_ids(ids, cfg.vocab_size)
    output = req.output if req.HasField("output") else None
    if output is not None and out_dtype is not None:
        try:
            mem.resolve(output, out_dtype, (layout.QPR * R, cfg.hidden_size), "output")
        except ValueError as err:
            raise invalid("output", str(err).split(": ", 1)[-1]) from None
    if output is None and answer_limit and out_dtype is not None:
        _check_answer_size(R, cfg.hidden_size, out_dtype, answer_limit)
    step = Step(req.step_id, R, positions, embeds, ids, meta, kv, output, host, key is not None, sources)
    if indices:
        check_indices(step)
    # Not one of the index checks: on every path. A pre-launched step's GPU program checks it too
    # (kernels/triton/step_meta.py), on the bytes it read; this is the copy the host checked.
    check_distinct_slots(host)
    return step


class PrivateCopy:
    """A step's index tensors (positions, seq_lens, block_tables, slot_mapping, input_ids) in memory of
    the rank's own, refreshed from the registered region they lie in before the step is checked.

    A region is shared memory the engine may write at any time. Checked in place and then read again
    by the step, its metadata could be rewritten in between (an engine reusing its buffer early, a bug,
    or on purpose): the step then indexed past the cache, the vocabulary or a table inside its launch,
    and a failure there exits the rank (rank.py `_guarded`), taking its TP group down. Copied first, a
    rewrite after the copy reaches nothing the step reads; one during it leaves a mix of old and new
    values, which the checks see as the step does. The embeddings are not copied: a rewrite changes
    numbers the step computes with, never where it reads or writes, and copying them would cost
    n x hidden values a step.

    One copy per cached layout (validate.py's `mem.layouts`), reused: steps are checked and run one at a
    time under the rank loop's lock, and a step has read its copy when its launch returns (a CPU rank's
    step has run; on a GPU, graphs.py stages it into pinned memory with NumPy, and the eager and kernel
    paths' pageable host-to-device copies return once their source is read). A pre-launched step's
    program reads the region itself on the device (Step.sources) and checks what it read. Its cost per
    step, on `validate_step` with and without it (2-core dev box, ctx 4096, interleaved medians): +1.6 /
    +2.2 / +3.8 us at R = 1 / 8 / 32 when the four lie packed in one region (one span copied, _byte_span),
    +2.9 / +3.3 / +6.4 us copied one by one (the table is most of the bytes).

    Index tensors in a device region (a client registering GPU memory for them) are copied to the host:
    their layouts are not cached, so `h`, their host copy made for this step, is what is paired; input_ids
    in a device region are copied with torch at each take."""

    __slots__ = ("positions", "ids", "meta", "host", "_pairs", "_device")

    def __init__(self, positions: torch.Tensor, ids: torch.Tensor | None, meta: StepMetadata, h: HostMeta) -> None:
        fields = index_tensors(positions, meta)
        span = _byte_span(fields)
        if span is None:
            own = [torch.empty(t.shape, dtype=t.dtype) for t in fields]
        else:  # the engine's metadata region packs the four: one copy of their span, views at their offsets
            region, lo = span
            buf = torch.empty_like(region)
            own = [buf[_byte_offset(t) - lo :][: t.nbytes].view(t.dtype).view(t.shape) for t in fields]
        self.positions, self.ids = own[0], None if ids is None else torch.empty(ids.shape, dtype=ids.dtype)
        self.meta = StepMetadata(*own[1:])
        self.host = host_meta(self.positions, self.meta)  # views of the copy, as HostMeta
        pairs = list(zip(self.host, h)) if span is None else [(buf.numpy(), region.numpy())]
        self._device: tuple = ()  # (the copy, the region's device tensor): a torch copy each
        if ids is not None and ids.device.type == "cpu":
            pairs.append((self.ids.numpy(), ids.numpy()))
        elif ids is not None:
            self._device = ((self.ids, ids),)
        self._pairs = tuple(pairs)  # (the copy's view, the region's), as NumPy: a slice assignment each

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None, StepMetadata, HostMeta]:
        """Refresh the copy from the region; (positions, input_ids, metadata, host views) of the copy."""
        for dst, src in self._pairs:
            dst[...] = src
        for dst, src in self._device:
            dst.copy_(src)
        return self.positions, self.ids, self.meta, self.host


def _byte_offset(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


def _byte_span(ts: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, int] | None:
    """(uint8 view of the bytes from the 8-byte boundary at or before the first tensor's start to the last
    one's end, its offset in the storage) when every tensor is a contiguous view of one host storage packed within twice their bytes
    (an engine's metadata region: client/dataplane.py); else None. One copy of it costs ~1 us less a step
    at R = 1..8 than four NumPy assignments."""
    storage = ts[0].untyped_storage()
    if any(t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().data_ptr() != storage.data_ptr()
           for t in ts):
        return None
    # From an 8-byte boundary: each field sits at the same offset from it in the copy as in the region,
    # so an int64 field after an int32 one that starts 4 bytes past a boundary is still aligned there.
    lo = min(_byte_offset(t) for t in ts) // 8 * 8
    hi = max(_byte_offset(t) + t.nbytes for t in ts)
    if hi - lo > 2 * sum(t.nbytes for t in ts) + 64:
        return None
    return torch.empty(0, dtype=torch.uint8).set_(storage, lo, (hi - lo,)), lo


def _in_region(req: pb.DraftStepRequest) -> bool:
    """Some index tensor of the step is a region slice (inline bytes are a private copy already)."""
    return any(req.HasField(f) and getattr(req, f).WhichOneof("payload") == "region"
               for f in (*_FIELDS, "input_ids"))


# Up to this many slots a Python set finds a repeat fastest (~0.5 us at 7, ~1.7 us at 56 on the 2-core
# CI box); past it, a sort (~4 us at 56, ~6 at 224, growing slowly).
DISTINCT_BY_SET = 16 * layout.QPR


def check_distinct_slots(h: HostMeta) -> None:
    """INVALID_ARGUMENT on slot_mapping where two rows of the step name one cache slot: their K/V writes
    run in parallel, so which one the cache keeps (and the other request's attention reads) would depend
    on the order they land in. The index checks pass such a step: each slot is its position's place in
    its own request's table row, and two rows share a page (e.g. a prefix page both reference)."""
    flat = h.slots.reshape(-1)
    if flat.size <= DISTINCT_BY_SET:
        if len(set(flat.tolist())) == flat.size:
            return
    else:
        ordered = np.sort(flat)
        if not (ordered[1:] == ordered[:-1]).any():
            return
    order = np.argsort(flat, kind="stable")  # a refusal only: name the first repeated slot and its rows
    repeat = int(np.flatnonzero(flat[order][1:] == flat[order][:-1])[0])
    a, b = sorted((int(order[repeat]), int(order[repeat + 1])))
    q = layout.QPR
    raise invalid("slot_mapping", f"rows {a} and {b} (requests {a // q} and {b // q}) both write slot {int(flat[a])}: "
                                  "every row of a step needs a cache slot of its own (which row's K/V the slot "
                                  "would hold depends on the order the writes land in)")


def _refuse_ids(ids: torch.Tensor, vocab: int) -> None:
    """OUT_OF_RANGE on input_ids naming the first id outside the vocabulary, its row and request (a refusal
    only: "ids must be in [0, V)" alone left the engine to search the step's n ids itself)."""
    flat = ids.reshape(-1).cpu()
    k = int(torch.nonzero((flat < 0) | (flat >= vocab))[0])
    raise out_of_range("input_ids", f"row {k} (request {k // layout.QPR}) has id {int(flat[k])}, outside the "
                                    f"vocabulary [0, {vocab})")


def _check_answer_size(R: int, hidden: int, dtype: torch.dtype, limit: int) -> None:
    """Inline hidden states that could not be sent: refused before the step runs. Found only as the
    answer went out, the step had written its K/V, and gRPC ended a DraftSteps stream with it."""
    row = hidden * dtype.itemsize
    nbytes = layout.QPR * R * row
    if nbytes + ANSWER_OVERHEAD > limit:
        most = max(0, (limit - ANSWER_OVERHEAD) // (layout.QPR * row))
        raise SidecarError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"output: the inline hidden states of {R} requests are {nbytes} bytes, past the {limit} "
                           f"an answer may take here (--max-message-bytes, or the doorbell's capacity_bytes): "
                           f"send an output region slice, or at most {most} requests per step",
                           "output", "RESPONSE_TOO_LARGE")


def check_indices(step: Step) -> None:
    """Positions, tables and slots against each other and the bound cache; raises SidecarError naming
    the field. The pre-launched step's GPU program checks the same (kernels/triton/step_meta.py)."""
    kv = step.kv
    if not _indices_ok(step.host, kv.page_size, kv.num_pages):
        _diagnose(step.host, kv.page_size, kv.num_pages)
        # The two checks agree (tests/server/test_validate_indices.py); should they ever not, refuse.
        raise invalid("slot_mapping", "the step's positions, tables and slots failed the index check")


_FIELDS = ("positions", "seq_lens", "block_tables", "slot_mapping")


def _layout_key(req: pb.DraftStepRequest) -> tuple | None:
    """What the step's tensors are, when every one of them is a region slice (the data plane):
    an engine sends the same few layouts step after step, so their checks and views are reused."""
    which = req.WhichOneof("input")
    if which is None:
        return None
    refs = [getattr(req, f) for f in _FIELDS] + [getattr(req, which)]
    if any(r.WhichOneof("payload") != "region" for r in refs):
        return None
    return (req.num_requests, which, *(r.SerializeToString() for r in refs))


def _tensors(req: pb.DraftStepRequest, cfg: DrafterConfig, mem: MemoryBindings, R: int) -> tuple:
    """The step's tensors with dtypes and shapes checked: (positions, embeds, ids, metadata)."""
    q = layout.QPR
    n = q * R
    # Said with each shape that follows from num_requests: "positions: shape [14], expected [21]" alone left an
    # engine that miscounted its requests looking at a tensor that was right.
    rows = f"{q} rows for each of num_requests = {R}"
    # A negative count is no count of rows: the shape refusal below names it.
    if req.HasField("positions") and len(req.positions.shape) == 1 and req.positions.shape[0] > 0 \
            and req.positions.shape[0] % q:
        raise invalid("positions", f"{req.positions.shape[0]} rows is not a multiple of {q}")
    positions = _tensor(req, "positions", mem, torch.int64, (n,), rows)
    which = req.WhichOneof("input")
    if which is None:
        raise invalid("inputs_embeds", "missing: send inputs_embeds or input_ids")
    embeds = ids = None
    if which == "inputs_embeds":
        embeds = _tensor(req, "inputs_embeds", mem, None, (n, cfg.hidden_size),
                         f"{rows}, each of the drafter's hidden_size {cfg.hidden_size}")
        if not embeds.dtype.is_floating_point or embeds.dtype == torch.float8_e4m3fn:
            # The wire's name, as every other dtype refusal gives it (a torch name is not in sidecar.proto).
            raise invalid("inputs_embeds", f"dtype must be BF16, FP16 or FP32, got "
                                           f"{pb.DType.Name(codec.dtype_to_proto(embeds.dtype))}")
    else:
        ids = _tensor(req, "input_ids", mem, torch.int64, (n,), rows)
    seq_lens = _tensor(req, "seq_lens", mem, torch.int32, (R,), f"one per request, num_requests = {R}")
    # Only a table that is there: an absent one is "missing" (_tensor), not a scalar "shape []".
    if req.HasField("block_tables") and (len(req.block_tables.shape) != 2 or req.block_tables.shape[0] != R):
        raise invalid("block_tables", f"shape {codec.shape_text(req.block_tables.shape)}, expected [{R}, max_pages] "
                                      f"(a row per request, num_requests = {R})")
    tables = _tensor(req, "block_tables", mem, torch.int32, None)
    slots = _tensor(req, "slot_mapping", mem, torch.int64, (n,), rows)
    return positions, embeds, ids, StepMetadata(seq_lens, tables, slots)


_ROW_OFFS = np.arange(layout.QPR, dtype=np.int64) - layout.QPR  # request rows sit at L-7 .. L-1


# Wider tables get their grid built per step: cached, each width's arange stayed for good (a table
# padded to 2^20 columns left 8 MiB; 64 widths of a 256 MiB message's table, gigabytes).
GRID_CACHED_WIDTH = 1 << 16


def _grid_of(R: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Column numbers [width], and each row's first flat index in an [R, width] table ([R, 1])."""
    return np.arange(width), np.arange(R)[:, None] * width


_grid_cached = functools.lru_cache(maxsize=64)(_grid_of)


def _grid(R: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """_grid_of, cached for widths up to GRID_CACHED_WIDTH."""
    return (_grid_cached if width <= GRID_CACHED_WIDTH else _grid_of)(R, width)


def _indices_ok(h: HostMeta, ps: int, pages: int) -> bool:
    """Positions agree with the sequence lengths, every used page and slot lies in the bound cache,
    and each slot is its position's place in the block table.

    This runs on every step, so the valid case is one short chain of NumPy ops on the host views
    (each op costs a microsecond or two there; torch's dispatch would cost several); the slot
    range follows from the page range and the slot equality. False sends the step to `_diagnose`.
    Engines pad their tables with page ids (vLLM: zeros), so one max over the whole table usually
    settles the page range; only a table with other entries is checked row by row, over the pages
    each row uses (a 4096 window, zero-padded tables: 14-19 us instead of 20-29 at R = 1-8 in a tight
    loop on the 2-core CI box, idle; a table padded with -1: 25 us, as before).
    """
    P, L, tab, S = h
    R, width = tab.shape
    if not (L.min() >= layout.QPR and L.max() <= width * ps and (P == L[:, None] + _ROW_OFFS).all()):
        return False
    cols, base = _grid(R, width)
    ids = tab.view(np.uint32)  # a negative id is huge: one compare covers both bounds
    # ...against at most 2^31 (no int32 page id reaches it): num_pages is a uint64, and from 2^32 on
    # every uint32 was below it, a negative id among them.
    pages = min(pages, 1 << 31)
    # Pages each row uses, in int64: L + ps - 1 in L's int32 wraps negative near 2^31, and a row
    # would then check none of its pages (the slot equality below only ties slots to the table).
    used = np.add(L[:, None], ps - 1, dtype=np.int64) // ps
    if ids.max() >= pages and np.where(cols < used, ids, 0).max() >= pages:
        return False
    page, off = np.divmod(P, ps)
    return bool((np.multiply(tab.reshape(-1).take(base + page), ps, dtype=np.int64) + off == S).all())


def _diagnose(h: HostMeta, ps: int, pages: int) -> None:
    """Check by check, to name the first field and row that is wrong (run when the fast check failed)."""
    q = layout.QPR
    pos, tab, slot = h.positions, h.tables, h.slots
    lens = h.seq_lens.astype(np.int64)
    if lens.min() < q:
        i = int(np.flatnonzero(lens < q)[0])  # the first, as the messages below name theirs
        raise invalid("seq_lens", f"seq_lens[{i}] = {int(lens[i])}: every sequence length must be >= {q} (P + 7)")
    expect = lens[:, None] - q + np.arange(q)[None, :]
    if not np.array_equal(pos, expect):
        i = int(np.flatnonzero((pos != expect).any(axis=1))[0])
        raise invalid("positions", f"request {i}'s rows are at {pos[i].tolist()}, but "
                                   f"seq_lens[{i}] = {int(lens[i])} puts them at {expect[i].tolist()}")
    need = (lens + ps - 1) // ps
    if need.max() > tab.shape[1]:
        i = int(need.argmax())
        raise invalid("block_tables", f"request {i} needs {int(need[i])} pages for seq_lens {int(lens[i])}, "
                                      f"its row has {tab.shape[1]}")
    bad = (np.arange(tab.shape[1])[None, :] < need[:, None]) & ((tab < 0) | (tab >= pages))
    if bad.any():
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise out_of_range("block_tables", f"block_tables[{i}][{j}] = {int(tab[i, j])} outside the bound "
                                           f"cache's {pages} pages")
    flat = slot.reshape(-1)
    outside = (flat < 0) | (flat >= pages * ps)
    if outside.any():
        k = int(np.flatnonzero(outside)[0])
        raise out_of_range("slot_mapping", f"row {k} (request {k // q}) slot {int(flat[k])} outside the bound "
                                           f"cache's {pages * ps} slots")
    want = np.take_along_axis(tab, pos // ps, axis=1).astype(np.int64) * ps + pos % ps
    if not np.array_equal(slot, want):
        k = int(np.flatnonzero(slot.reshape(-1) != want.reshape(-1))[0])
        raise invalid("slot_mapping", f"row {k} (request {k // q}) slot {int(flat[k])} does not match block_tables "
                                      f"(position {int(pos.reshape(-1)[k])} lives at slot {int(want.reshape(-1)[k])})")
