"""A pre-launched step's metadata, built on the GPU: window-relative tables from the engine's host-mapped region, checked.

A step the sidecar queued before its doorbell rang (server/prelaunch.py) cannot have its
metadata prepared by the sidecar's host: the host sees the request only after the GPU has
started. So R programs, one per request, read the engine's metadata where the engine wrote it
(the shared metadata region, registered with the GPU: reads cross PCIe, ~1 KB per request at a
4096 window), together with the doorbell's GPU word, and writes the graph's static inputs exactly as the host path does
(graphs.py: positions, window-relative positions, slots, window lengths and tables).

It also guards what the step touches, because nothing has validated the request yet: the
word must carry the sequence and launch key the step was queued for, positions must be the 7
rows before each sequence length, each slot must be its position's place in the block table,
every page the request uses (ceil(L / page_size) columns of its table row, the window's among
them) must lie in the bound cache, and no other row of the step may name one of its slots. A
request that fails gets no-op rows (slots -1 write nothing; a 7-row window over page 0 reads
in-bounds memory) and its flag says why; the host then runs the whole step the ordinary way,
after this one. (The other requests' rows may have run: a request's rows depend on its own
inputs only, so they wrote the K/V their positions should hold, which the ordinary run, or a
refused step's fallback, writes again.)

These are exactly the host's index checks (validate.check_indices and check_distinct_slots) on
the bytes the engine wrote for the step. So a step whose every request RAN needs no host index
check, and the rank loop skips it (server/rank.py); any other step gets it in full, and its
message names the field.

The program reads device copies (`Staging`): read in place across PCIe, the sources cost the
step ~4 us per request (see Staging).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from dspark_sidecar import layout
from dspark_sidecar.drafter.kv_cache import window_metadata_into
from dspark_sidecar.proto.gpu_word import DevicePointer

FLAG_RAN, FLAG_NOT_RUNG, FLAG_INVALID = 1, 2, 3  # what the flag word holds after the program
_RAN, _NOT_RUNG, _INVALID = tl.constexpr(FLAG_RAN), tl.constexpr(FLAG_NOT_RUNG), tl.constexpr(FLAG_INVALID)


@triton.jit
def _step_meta(word_ptr, expect_ptr, pos_ptr, lens_ptr, tab_ptr, slot_ptr,
               pos_out, rel_out, slot_out, lens_out, tab_out, flag_ptr, mirror_ptr,
               page_size, span, num_pages, width, WW,
               Q: tl.constexpr, Q_PAD: tl.constexpr, WW_PAD: tl.constexpr, USED_BLOCK: tl.constexpr,
               DUP_BLOCK: tl.constexpr):
    """Program r: request r's rows and window. One program per request, so the reads across PCIe
    (up to ~260 table entries per request at a 4096 window) go out from R SMs at once."""
    r = tl.program_id(0)
    rung = tl.load(word_ptr, volatile=True) == tl.load(expect_ptr)
    j = tl.arange(0, Q_PAD)
    m = j < Q
    # Host memory the engine rewrites between steps: volatile, never from a stale cache line.
    L = tl.load(lens_ptr + r, volatile=True).to(tl.int64)
    P = tl.load(pos_ptr + r * Q + j, mask=m, other=0, volatile=True)  # int64 [Q_PAD]
    S = tl.load(slot_ptr + r * Q + j, mask=m, other=0, volatile=True)
    pcol = tl.minimum(tl.maximum(P // page_size, 0), width - 1)
    tp = tl.load(tab_ptr + r * width + pcol, mask=m, other=0, volatile=True).to(tl.int64)
    bad_row = m & ((P != L - Q + j) | (tp < 0) | (tp >= num_pages) | (tp * page_size + P % page_size != S))
    # Every page the request uses, as the host checks (the window reads the last of them).
    need = (L + page_size - 1) // page_size
    c = tl.arange(0, USED_BLOCK)
    bad_used = tl.zeros([USED_BLOCK], tl.int32)
    for c0 in range(0, width, USED_BLOCK):
        cm = (c0 + c < need) & (c0 + c < width)
        t = tl.load(tab_ptr + r * width + c0 + c, mask=cm, other=0, volatile=True)
        bad_used += (cm & ((t < 0) | (t >= num_pages))).to(tl.int32)
    first = tl.maximum(L - span, 0) // page_size  # the window's first page column
    k = tl.arange(0, WW_PAD)
    km = k < WW
    wt = tl.load(tab_ptr + r * width + tl.minimum(first + k, width - 1), mask=km, other=0, volatile=True)
    # A slot another row of the step also names (validate.check_distinct_slots): two requests whose
    # tables share a page pass every check above, and which row's K/V the slot keeps would depend on
    # the order the writes land in. Each program compares its 7 rows with the step's 7R, DUP_BLOCK at a time.
    n = tl.num_programs(0) * Q
    me = r * Q + j
    shared = tl.zeros([Q_PAD], tl.int32)
    for a0 in range(0, n, DUP_BLOCK):
        a = a0 + tl.arange(0, DUP_BLOCK)
        every = tl.load(slot_ptr + a, mask=a < n, other=-1, volatile=True)  # int64 [DUP_BLOCK]
        same = (S[:, None] == every[None, :]) & (a[None, :] < n) & (a[None, :] != me[:, None])
        shared += tl.sum(same.to(tl.int32), axis=1)
    nbad = (tl.sum(bad_row.to(tl.int32), axis=0) + tl.sum(bad_used, axis=0)
            + tl.sum(tl.where(m, shared, 0), axis=0))
    # The table holds every page the request uses: need <= width, i.e. L <= width * page_size without the
    # product, which the int32 arguments wrap past 2^31 (a table padded to 2^20 columns of 2048-token
    # pages), refusing every valid request.
    good = rung & (nbad == 0) & (L >= Q) & (need <= width)
    off = first * page_size
    j64 = j.to(tl.int64)
    tl.store(pos_out + r * Q + j, tl.where(good, P, j64), mask=m)
    tl.store(rel_out + r * Q + j, tl.where(good, P - off, j64), mask=m)
    tl.store(slot_out + r * Q + j, tl.where(good, S, -1 + 0 * S), mask=m)
    tl.store(lens_out + r, tl.where(good, L - off, Q).to(tl.int32))
    tl.store(tab_out + r * WW + k, tl.where(good, wt, 0 * wt), mask=km)
    flag = tl.where(good, _RAN, tl.where(rung, _INVALID, _NOT_RUNG))
    tl.store(flag_ptr + r, flag)
    tl.store(mirror_ptr + r, flag)  # device memory, for kernels after the step (gated_copy); may be flag_ptr


USED_BLOCK = 256  # table columns per pass of the used-pages check (a 4096 window: 257 columns)
DUP_BLOCK = 128  # the step's slots per pass of the distinct-slots check (R = 256: 14 passes of [8, 128])


def signed64(value: int) -> int:
    """A uint64 word value as the int64 the kernel compares with (Triton passes Python ints signed)."""
    return value - (1 << 64) if value >= 1 << 63 else value


# Staging: the program's sources copied to the device first -------------------------------------
# R programs reading the engine's host memory in place, each with scalar volatile loads (and each
# the same GPU word), took ~4 us per request on an H200 from the word's write to the program's
# end: 18, 46 and 132 us at R = 1, 8 and 32 (BENCHMARKS.md run 125). One launch that first copies
# the word and the span the sources lie in, 16 bytes per load, then the program on device memory,
# took 14-15 us at every R.

STAGE_WORDS = 256  # int64 per program: 2 KB, so whole blocks tile a page and reads stay inside a page-rounded registration


@triton.jit
def _stage(src, dst, word_src, word_dst, BLOCK: tl.constexpr):
    """Program p: int64 words [p*BLOCK, (p+1)*BLOCK) of the span; program 0 also the GPU word.
    Volatile: host memory the engine rewrites between steps, never from a stale cache line."""
    p = tl.program_id(0)
    o = p * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + o, tl.load(src + o, volatile=True))
    if p == 0:
        tl.store(word_dst, tl.load(word_src, volatile=True))


def _launch(kernel, grid: tuple, args: tuple, warm: bool, **consts) -> None:
    """kernel[grid](*args, **consts); with warm, only compile it for these arguments and load its code
    into the context, launching nothing.

    Why warm: CUDA loads a kernel's code at its first launch (Triton's CompiledKernel handles, per
    specialization: constexprs, and each pointer's 16-byte alignment). On an H200 that load waited
    until a queued step's wait on the GPU word passed, i.e. until the engine's next step, while the
    doorbell thread held the rank lock; an engine whose next call was a gRPC step or a BindKV
    deadlocked with it (BENCHMARKS.md run 265). Prelaunch warms a layout's launches before it queues
    the wait (server/prelaunch.py `_replay_of`)."""
    if not warm:
        kernel[grid](*args, **consts)
        return
    compiled = kernel.warmup(*args, grid=grid, **consts)
    if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
        compiled = compiled.result()
    compiled.run  # noqa: B018  (the launcher property loads the module: CompiledKernel._init_handles)


def _launch_stage(src: DevicePointer, dst: torch.Tensor, blocks: int, word_src, word_dst: torch.Tensor,
                  warm: bool = False) -> None:
    _launch(_stage, (blocks,), (src, dst, word_src, word_dst), warm, BLOCK=STAGE_WORDS, num_warps=4)


class Staging:
    """Device copies of a queued step's GPU word and host-mapped sources, for the program to read.

    `stage` queues the copies on the current stream (after the wait on the word, before the program):
    one launch per registered region the sources lie in, usually one. The buffer grows to the
    largest span seen and is reused; the stream orders each reuse after the program that read it.
    launch: how a copy runs (tests pass a CPU stand-in).
    """

    def __init__(self, device: torch.device | str, launch=_launch_stage) -> None:
        self.device = torch.device(device)
        self.word = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.buf = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._launch = launch

    def stage(self, word: DevicePointer, sources: list[tuple[DevicePointer, int, tuple[int, int]]],
              warm: bool = False) -> tuple:
        """word: the GPU word's device address. sources: per program source (its device address, bytes,
        (device address, bytes) of the page-aligned, page-rounded registration it lies in).
        Returns (word, src) for step_meta: the same values as flat tensors in device memory.
        warm: the copies compiled and loaded, not queued (_launch)."""
        plan = self.reserve(sources)
        for start, blocks, off in plan.values():
            self._launch(DevicePointer(start, torch.int64), self.buf[off // 8 :], blocks, word, self.word, warm=warm)
        raw = self.buf.view(torch.uint8)
        src = []
        for ptr, nbytes, region in sources:
            start, _, off = plan[region]
            at = off + ptr.address - start
            src.append(raw[at : at + nbytes].view(ptr.dtype))
        return self.word, tuple(src)

    def reserve(self, sources: list[tuple[DevicePointer, int, tuple[int, int]]]) -> dict:
        """Grow the buffer to what staging `sources` needs (a captured copy keeps the buffer it saw).
        Returns the plan: registration -> (start of the copy, blocks, offset in the buffer in bytes)."""
        block = STAGE_WORDS * 8
        spans: dict[tuple[int, int], tuple[int, int]] = {}  # registration -> [lo, hi) of the bytes read there
        for ptr, nbytes, region in sources:
            lo, hi = spans.get(region, (ptr.address, ptr.address + nbytes))
            spans[region] = (min(lo, ptr.address), max(hi, ptr.address + nbytes))
        plan, total = {}, 0
        for (base, size), (lo, hi) in spans.items():
            start = base + (lo - base) // block * block  # whole blocks from the registration's page-aligned base:
            blocks = -(-(hi - start) // block)  # they end at most at hi rounded up to a page, inside it
            if not (base <= lo and hi <= base + size and start + blocks * block <= base + size):
                raise ValueError(f"source bytes [{lo:#x}, {hi:#x}) are not inside their registration")
            plan[(base, size)] = (start, blocks, total)
            total += blocks * block
        if self.buf.numel() * 8 < total:
            self.buf = torch.zeros(total // 8, dtype=torch.int64, device=self.device)
        return plan


def step_meta(word, expect: torch.Tensor, src: tuple, out: tuple, flags, *, num_reqs: int, width: int, page_size: int,
              window: int, num_pages: int, mirror=None, warm: bool = False) -> None:
    """Queue the program on the current stream: R programs, one per request.

    word: int64 [1] (the doorbell's GPU word). expect: int64 [1] on the device, the word's value for
    this step (`signed64`), read when the program runs: the sidecar writes it on its stream ahead of
    each queued step, so one captured launch serves every step of a layout (server/prelaunch.py).
    src: the engine's positions int64 [n], seq_lens int32 [R], block_tables int32 [R, width],
    slots int64 [n], as tensors or proto.gpu_word.DevicePointer.
    out: the graph's positions, rel positions, slots int64 [n], lens int32 [R], tables int32 [R, ww].
    flags: int32 [>= R], flags[r] set to FLAG_* for request r.
    mirror: int32 [>= R] in device memory that gets the flags too (default: flags itself). Kernels
    queued after the step read it there: each program's read of host memory (the host's page) cost
    ~4 us, one after another (runs 125 and 186).
    warm: compiled and loaded for these arguments, not queued (_launch).
    """
    q = layout.QPR
    ww = out[4].shape[1]
    _launch(_step_meta, (num_reqs,), (word, expect, *src, *out, flags, flags if mirror is None else mirror, page_size,
                                      window + q - 1, num_pages, width, ww), warm,
            Q=q, Q_PAD=triton.next_power_of_2(q), WW_PAD=triton.next_power_of_2(ww), USED_BLOCK=USED_BLOCK,
            DUP_BLOCK=DUP_BLOCK)


def step_meta_reference(word: int, expect: int, positions: np.ndarray, seq_lens: np.ndarray, tables: np.ndarray,
                        slots: np.ndarray, page_size: int, window: int, num_pages: int, ww: int) -> tuple:
    """The program's outputs in NumPy: (positions, rel, slots, lens, tables, flags [R]); its spec.

    A request it runs gets graphs.py's host metadata (window_metadata_into) unchanged; a request it
    refuses gets the no-op rows (positions and rel 0..6, slots -1, length 7, page 0). A request one
    of whose slots another row of the step names is refused (validate.check_distinct_slots).
    """
    q = layout.QPR
    R, width = tables.shape
    P, S, L = positions.reshape(R, q), slots.reshape(R, q), seq_lens.astype(np.int64)
    rel, lens, tab = np.zeros((R, q), np.int64), np.zeros(R, np.int32), np.zeros((R, ww), np.int32)
    window_metadata_into(P, np.clip(seq_lens, 0, None), tables, page_size, window, rel, lens, tab)
    pos_out, slot_out = P.copy(), S.copy()
    flags = np.full(R, FLAG_RAN if word == expect else FLAG_NOT_RUNG, np.int32)
    values, counts = np.unique(S, return_counts=True)
    shared = np.isin(S, values[counts > 1]).any(axis=1)  # [R]
    for r in range(R):
        ok = not shared[r] and q <= L[r] <= width * page_size and (P[r] == L[r] - q + np.arange(q)).all()
        if ok:
            tp = tables[r, np.clip(P[r] // page_size, 0, width - 1)].astype(np.int64)
            ok = bool(((tp >= 0) & (tp < num_pages) & (tp * page_size + P[r] % page_size == S[r])).all())
        if ok:
            used = tables[r, : -(-L[r] // page_size)]
            ok = bool(((used >= 0) & (used < num_pages)).all())
        if word == expect and not ok:
            flags[r] = FLAG_INVALID
        if flags[r] != FLAG_RAN:
            pos_out[r] = rel[r] = np.arange(q)
            slot_out[r], lens[r], tab[r] = -1, q, 0
    return pos_out.reshape(-1), rel.reshape(-1), slot_out.reshape(-1), lens, tab, flags


# TP > 1: every rank's verdict, before any rank's K/V writes ------------------------------------
# A rank's queued step exchanges partial sums with its peers' queued steps. If one rank's
# program made its step a no-op (its word not rung, or its copy invalid) while a peer's ran, the
# peer's layers 1.. would sum real partials with the no-op's and write wrong K/V into the
# engine's cache. So the ranks all-reduce (MAX) their flags right after the program (RAN is the
# smallest flag), and this gate turns every request that some rank refused into no-op writes on
# every rank. The agreed flags go to the host's page, which then decides with the same facts on
# every rank.

@triton.jit
def _step_gate(agreed_ptr, flag_ptr, slot_out, Q: tl.constexpr, Q_PAD: tl.constexpr):
    r = tl.program_id(0)
    f = tl.load(agreed_ptr + r)
    tl.store(flag_ptr + r, f)
    j = tl.arange(0, Q_PAD)
    refused = (j * 0 + f) != _RAN  # the request's flag, per row: a vector mask
    tl.store(slot_out + r * Q + j, tl.full([Q_PAD], -1, tl.int64), mask=(j < Q) & refused)


def step_gate(agreed, flags, slots, num_reqs: int) -> None:
    """Queue the gate on the current stream: R programs.

    agreed: int32 [>= R], the ranks' flags after an all-reduce MAX; flags: int32 [>= R] (the host's
    page, as a tensor or proto.gpu_word.DevicePointer) gets them; slots: the graph's int64 [7R]
    slot input, -1 (no write) for each request whose agreed flag is not FLAG_RAN.
    """
    q = layout.QPR
    _step_gate[(num_reqs,)](agreed, flags, slots, Q=q, Q_PAD=triton.next_power_of_2(q))


def step_gate_reference(agreed: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gate in NumPy: (flags [R], slots [7R]); its spec."""
    q = layout.QPR
    out = slots.reshape(-1, q).copy()
    out[agreed != FLAG_RAN] = -1
    return agreed.copy(), out.reshape(-1)


# The queued step's output, into the engine's region -------------------------------------------
# Answering a step from its queued copy used to copy the graph's output into the engine's output
# region from the host after the ring (a torch copy_: 24-71 us of the sidecar's host path on an
# H200 host, BENCHMARKS.md runs 184-185). Queued behind the graph instead, the copy runs on the GPU
# with the step; it is gated by the program's flags, so a step the GPU refused (not rung: another
# layout, whose output may lie elsewhere) writes nothing into the engine's memory. It reads the flags
# from device memory (step_meta's mirror): reading the host's page, its 88 programs at R = 8 took the
# step from 0.42 to 0.80 ms (run 186).

COPY_BLOCK = 4096  # elements per program


@triton.jit
def _gated_copy(src, dst, flag_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    """Program (r, c): elements [c*BLOCK, (c+1)*BLOCK) of request r's ROW = 7 x hidden, if its flag is RAN."""
    r, c = tl.program_id(0), tl.program_id(1)
    if tl.load(flag_ptr + r) == _RAN:  # device memory, written by the program (and the exchange) just before
        o = c * BLOCK + tl.arange(0, BLOCK)
        m = o < ROW
        tl.store(dst + r * ROW + o, tl.load(src + r * ROW + o, mask=m), mask=m)


def gated_copy(src: torch.Tensor, dst: torch.Tensor, flags, num_reqs: int, warm: bool = False) -> None:
    """Queue on the current stream: dst[rows of r] = src[rows of r] for each request r < num_reqs whose
    flag is FLAG_RAN. src, dst: contiguous [7R, hidden] of one dtype; flags: int32 [>= R] in device memory.
    warm: compiled and loaded for these arguments, not queued (_launch)."""
    if src.shape != dst.shape or src.dtype != dst.dtype or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"gated_copy: {src.dtype} {list(src.shape)} into {dst.dtype} {list(dst.shape)}, "
                         "both contiguous and alike")
    row = src.numel() // max(1, num_reqs)
    _launch(_gated_copy, (num_reqs, triton.cdiv(row, COPY_BLOCK)), (src, dst, flags), warm, ROW=row, BLOCK=COPY_BLOCK,
            num_warps=4)


def gated_copy_reference(src: torch.Tensor, dst: torch.Tensor, flags: np.ndarray) -> torch.Tensor:
    """gated_copy in torch: dst with the rows of every FLAG_RAN request replaced by src's; its spec."""
    out = dst.clone().reshape(len(flags), -1)
    ran = torch.as_tensor(flags == FLAG_RAN)
    out[ran] = src.reshape(len(flags), -1)[ran]
    return out.reshape(dst.shape)
