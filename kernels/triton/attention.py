"""Paged sliding-window attention of the 7-row blocks, non-causal in the block, split over the key range.

Per request and KV head, the 7 rows x GQA group (7 x 16 = 112 at TP 4) query vectors share
every K/V tile, so one program computes a [112 -> 128, d] x [d, BLOCK_N] score tile on the
tensor cores. The key range max(0, min_pos - (window - 1)) .. seq_len - 1 (4102 keys at a full
window) is cut flash-decoding style: program `s` of SPLITS takes key tiles s, s + SPLITS, ...
(strided, so any range is covered with a grid fixed by shapes alone: graph-capturable, no
host sync) of all but its last ROWS keys, keeps an online softmax (running max m, sum l,
unnormalised acc) and writes it. Those last ROWS keys (the block's own, at a full window) are
one narrow tile that the last split folds in after its key tiles: tiled with the rest they
would make 4102 keys 65 tiles of 64, so one split of 16 would run 5 tiles while 15 run 4, and
every split waits for it; 4095 keys make 64 tiles, 4 for every split, and the narrow tile goes
to a split that has no more tiles than any other;
`_reduce_kernel` merges the splits per (request, head row): out = sum_s e^(m_s - M) acc_s /
sum_s e^(m_s - M) l_s. On NVIDIA GPUs, with 2..COOP_MAX_SPLITS splits, the split programs merge
them themselves instead, in the same cooperative launch (one launch less per layer). With
SPLITS = 1 the split kernel normalises and stores directly.
Scores and softmax are fp32; P is rounded to the dot's operand dtype for the P @ V dot (flash-attention's
usual choice; 2^-9 relative per weight in bf16): the K/V dtype, or q's for an fp8 cache (widened exactly). Softmax runs in base 2 with log2(e) folded in the scale.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from dspark_sidecar.kernels.triton.runtime import (
    INTERPRET, cast, check_device, dep_release, dep_wait, mma, nvidia_of, pdl_kwargs, same_device, sms_of, tl_dtype,
)

log = logging.getLogger("dspark_sidecar.kernels")
LOG2E = 1.4426950408889634
# Tunables: key tile, fewest key tiles per split, programs to aim for per SM.
BLOCK_N = 64
MIN_TILES_PER_SPLIT = 1
PROGRAMS_PER_SM = 1
# Two key tiles in flight while one is computed: since the narrow tile, each split at R = 8 runs exactly
# 4 tiles, and 3 stages took the step at 56 rows from 397.7-402.9 to 395.5-396.0 us, at 7 rows
# unchanged (334.5-334.9 against 332.1-336.2; run 177). Before it, 3 stages were no better (run 45).
NUM_STAGES = 3
NUM_WARPS = 8  # for a [128-row, 128] accumulator (the shard's 112 rows); smaller Q blocks take 4
# Merge the splits inside the split kernel's own launch on NVIDIA GPUs: a cooperative launch
# keeps every program resident, so a request's SPLITS programs can wait for each other and each
# merge a share of the Q block's rows, instead of a `_reduce_kernel` launch (see _split_kernel).
# Measured on an H200 (runs 52-53): at 16 splits (R = 5..8) the step 1.5-2% faster; at 64 (R = 1),
# where each program merges 2 rows after waiting for 63 others, 2% slower: hence COOP_MAX_SPLITS.
COOP_MERGE = True
COOP_MAX_SPLITS = 16
# The cooperative merge's counters: 2 int32 per (request, KV head) of a launch, which holds at most
# one program per SM, so 1024 cover any grid. One lane of them per stream: launches on one stream
# run one after another and may share them, but launch groups on separate streams (the model's
# draft_step side by side) may run at once, and two grids on the same counters wait on each other's
# counts for ever (a tiny model's 64-program grids hung a sidecar that way, run 108). Up to LANES
# streams per device get a lane; launches on any further stream keep the merge kernel.
COUNTERS = 1 << 10
LANES = 64


@triton.jit
def _split_kernel(
    q_ptr, kv_ptr, pos_ptr, seq_ptr, bt_ptr, out_ptr, po_ptr, pml_ptr, cnt_ptr,
    stride_qn, stride_qh, stride_qd,
    stride_c0, stride_cp, stride_cs, stride_ch, stride_cd, stride_bt,
    window, qk_scale, hk, PAGE: tl.constexpr,
    ROWS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr, SPLITS: tl.constexpr, OUT: tl.constexpr,
    DOT: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr, COOP: tl.constexpr, RB: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (request, kv head, split). Row m of the Q block is (block row m // GROUP, head m % GROUP).

    Key positions are int32 (a context is far below 2^31 tokens) and PAGE is compile-time, so
    the per-key page lookup (kpos // PAGE, kpos % PAGE) is a shift and a mask: with a run-time
    page size these were 64-bit divisions, a long software sequence per key and per tile.
    Cache offsets are int64 in every term: the bound cache may be any dense permutation of the
    planes view (kv_cache.kv_view_problem), so a page slot's or a head's stride may be the large one,
    and its int32 product wrapped past 2^31 elements (a read ~2^32 elements before the cache).

    PDL (runtime.PDL): the positions, sequence lengths and block table, written before the step's
    first layer, are read before the wait for the prelude; q and the block rows' K/V after it.
    """
    req, h, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < ROWS * GROUP
    d_mask = offs_d < D
    row = req * ROWS + offs_m // GROUP
    head = h * GROUP + offs_m % GROUP
    qpos = tl.load(pos_ptr + row, mask=m_valid, other=0).to(tl.int32)
    seq_len = tl.load(seq_ptr + req).to(tl.int32)
    min_pos = tl.min(tl.where(m_valid, qpos, seq_len), axis=0)
    start = tl.maximum(min_pos - (window - 1), 0)
    left = qpos - (window - 1)  # each row's own window edge
    # Keys start .. tiled_end - 1 in BN-key tiles; tiled_end .. seq_len - 1 (at most ROWS) in the
    # narrow tile of the last split, which has the fewest key tiles (split s has tiles s, s + SPLITS, ...).
    tiled_end = tl.maximum(seq_len - ROWS, start)
    n_tiles = tl.cdiv(tiled_end - start, BN).to(tl.int32)
    # The block-table entries of a tile are fetched one tile ahead, so that the K/V gathers of
    # a tile wait on one memory latency, not on two in a row.
    kpos = start + sp * BN + tl.arange(0, BN)
    page = tl.load(bt_ptr + req * stride_bt + kpos // PAGE, mask=kpos < tiled_end, other=0)
    last = sp == SPLITS - 1
    bpos = tiled_end + tl.arange(0, BB)
    kv_h = kv_ptr + h.to(tl.int64) * stride_ch  # this program's KV head
    b_valid = bpos < tl.where(last, seq_len, tiled_end)  # empty on the other splits
    bpage = tl.load(bt_ptr + req * stride_bt + bpos // PAGE, mask=b_valid, other=0)
    dep_wait(PDL)
    q = tl.load(q_ptr + row[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_valid[:, None] & d_mask[None, :], other=0.0).to(DOT)
    # The narrow tile's K/V (the prelude has just written the block's own) are gathered before the
    # key tiles, so that their latency hides under them; the other splits' masks load nothing.
    b_off = (bpage.to(tl.int64) * stride_cp + (bpos % PAGE).to(tl.int64) * stride_cs)[:, None] \
        + offs_d[None, :] * stride_cd
    b_mask = b_valid[:, None] & d_mask[None, :]
    kb = tl.load(kv_h + b_off, mask=b_mask, other=0.0)
    vb = tl.load(kv_h + stride_c0 + b_off, mask=b_mask, other=0.0)

    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BLOCK_D), tl.float32)
    for t in range(sp, n_tiles, SPLITS):
        kpos = start + t * BN + tl.arange(0, BN)
        k_valid = kpos < tiled_end
        base = page.to(tl.int64) * stride_cp + (kpos % PAGE).to(tl.int64) * stride_cs
        kv_off = base[:, None] + offs_d[None, :] * stride_cd
        kv_mask = k_valid[:, None] & d_mask[None, :]
        k = tl.load(kv_h + kv_off, mask=kv_mask, other=0.0).to(DOT)
        v = tl.load(kv_h + stride_c0 + kv_off, mask=kv_mask, other=0.0).to(DOT)
        nxt = kpos + SPLITS * BN
        page = tl.load(bt_ptr + req * stride_bt + nxt // PAGE, mask=nxt < tiled_end, other=0)
        m_i, l_i, acc = _online_tile(q, k, v, k_valid[None, :] & (kpos[None, :] >= left[:, None]), m_i, l_i, acc,
                                     qk_scale, BM, DOT, INTERPRET, IEEE)
    if last:
        visible = b_valid[None, :] & (bpos[None, :] >= left[:, None])
        m_i, l_i, acc = _online_tile(q, kb.to(DOT), vb.to(DOT), visible, m_i, l_i, acc, qk_scale, BM, DOT,
                                     INTERPRET, IEEE)

    dep_release(PDL)
    if SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no key at all (a padding request): 0
        tl.store(out_ptr + row[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                 cast(o, OUT, INTERPRET), mask=m_valid[:, None] & d_mask[None, :])
    else:
        part = (req * hk + h) * SPLITS + sp  # workspace [R, hk, SPLITS, BM, (BLOCK_D | 2)]
        # Only the Q block's real rows (112 of 128 at TP 4): the merge reads no other.
        tl.store(po_ptr + part * BM * BLOCK_D + offs_m[:, None] * BLOCK_D + offs_d[None, :], acc,
                 mask=m_valid[:, None])
        tl.store(pml_ptr + part * BM * 2 + offs_m * 2, m_i, mask=m_valid)
        tl.store(pml_ptr + part * BM * 2 + offs_m * 2 + 1, l_i, mask=m_valid)
        if COOP:
            # The request's SPLITS programs, all resident (a cooperative launch), meet here: each
            # releases its partials, waits until all SPLITS have, merges RB of the Q block's rows
            # (the merge kernel's operations; its sums over splits may associate differently, an
            # output ulp at most), then counts itself done; the last one done zeroes both
            # counters for the next launch (all are past the wait).
            cnt = cnt_ptr + 2 * (req * hk + h)
            tl.debug_barrier()
            tl.atomic_add(cnt, 1, sem="release", scope="gpu")
            arrived = tl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
            while arrived < SPLITS:
                arrived = tl.atomic_add(cnt, 0, sem="acquire", scope="gpu")
            _merge_rows(po_ptr, pml_ptr, out_ptr, req, h, sp * RB, stride_qn, stride_qh, stride_qd, hk,
                        ROWS, GROUP, D, BLOCK_D, BM, SPLITS, OUT, INTERPRET, RB)
            tl.debug_barrier()
            if tl.atomic_add(cnt + 1, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(cnt + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _online_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, BM: tl.constexpr, DOT: tl.constexpr,
                 INTERPRET: tl.constexpr, IEEE: tl.constexpr):
    """One key tile into the online softmax: q [BM, d], k and v [n, d], visible [BM, n] ->
    the running max m_i [BM], sum l_i [BM] and unnormalised acc [BM, d], updated."""
    s = mma(q, tl.trans(k), tl.zeros((BM, k.shape[0]), tl.float32), INTERPRET, IEEE) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = mma(cast(p, DOT, INTERPRET), v, acc * alpha[:, None], INTERPRET, IEEE)
    return m_new, l_i, acc


@triton.jit
def _merge_rows(po_ptr, pml_ptr, out_ptr, req, h, m0, stride_qn, stride_qh, stride_qd, hk,
                ROWS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                BM: tl.constexpr, SPLITS: tl.constexpr, OUT: tl.constexpr, INTERPRET: tl.constexpr,
                RB: tl.constexpr):
    """Merge the SPLITS partial softmaxes of Q-block rows m0 .. m0 + RB - 1 at once ([RB, SPLITS,
    BLOCK_D]: every load in flight together) and store the rows; the partials are read from L2 (.cg:
    in the cooperative merge other SMs wrote them during this very launch, and L1 is not coherent)."""
    RBP: tl.constexpr = triton.next_power_of_2(RB)
    rows = m0 + tl.arange(0, RBP)
    valid = (tl.arange(0, RBP) < RB) & (rows < ROWS * GROUP)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    rh = req * hk + h
    ml = pml_ptr + ((rh * SPLITS + offs_s[None, :]) * BM + rows[:, None]) * 2  # [RBP, SPLITS]
    m_s = tl.load(ml, mask=valid[:, None], other=float("-inf"), cache_modifier=".cg")
    l_s = tl.load(ml + 1, mask=valid[:, None], other=0.0, cache_modifier=".cg")
    acc = tl.load(po_ptr + (((rh * SPLITS + offs_s[None, :, None]) * BM + rows[:, None, None]) * BLOCK_D
                            + offs_d[None, None, :]), mask=valid[:, None, None], other=0.0, cache_modifier=".cg")
    m_max = tl.max(m_s, axis=1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m_s - m_max[:, None])  # 0 for splits that saw no key
    num = tl.sum(acc * w[:, :, None], axis=1)
    den = tl.sum(l_s * w, axis=1)
    o = num / tl.where(den > 0, den, 1.0)[:, None]
    row = req * ROWS + rows // GROUP
    head = h * GROUP + rows % GROUP
    tl.store(out_ptr + row[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
             cast(o, OUT, INTERPRET), mask=valid[:, None] & (offs_d < D)[None, :])


@triton.jit
def _reduce_kernel(
    po_ptr, pml_ptr, out_ptr, stride_qn, stride_qh, stride_qd, hk,
    ROWS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BM: tl.constexpr, SPLITS: tl.constexpr, OUT: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (request * hk + kv head, Q-block row m): merge the SPLITS partial softmaxes in order."""
    dep_wait(PDL)
    dep_release(PDL)
    rh = tl.program_id(0)
    _merge_rows(po_ptr, pml_ptr, out_ptr, rh // hk, rh % hk, tl.program_id(1), stride_qn, stride_qh, stride_qd, hk,
                ROWS, GROUP, D, BLOCK_D, BM, SPLITS, OUT, INTERPRET, 1)


def _coop_lane(q: torch.Tensor, r: int, hk: int, sp: int) -> int | None:
    """The counter lane of a cooperative launch that merges the splits in the split kernel's launch, or
    None for the merge kernel: COOP_MERGE, 2..COOP_MAX_SPLITS splits, a CUDA (not HIP) GPU, not the
    interpreter (its programs run one after another: a wait would never end), a grid of at most one
    program per SM (what the kernel's registers allow) that fits a counter lane, a lane for the
    current stream, and a device where a cooperative launch of it has worked (see _launch_coop)."""
    if not COOP_MERGE or not 1 < sp <= COOP_MAX_SPLITS or not nvidia_of(q):
        return None
    if r * hk * sp > sms_of(q) or 2 * r * hk > COUNTERS:
        return None
    lane = _lane(q.device, torch.cuda.current_stream(q.device).cuda_stream)
    state = _coop_state.get(q.device)
    if state is None:  # never tried here: not inside a capture, where a failed launch would void the graph
        state = not torch.cuda.is_current_stream_capturing()
    return lane if state else None


# device -> whether a cooperative launch worked there. A GPU shared under MPS with a cap on this
# client's SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) refuses a grid it cannot hold all at once.
_coop_state: dict[torch.device, bool] = {}


def _launch_coop(q: torch.Tensor, launch) -> bool:
    """launch(coop=True); on the device's first try, a refusal turns the cooperative merge off there
    (logged) and returns False, so that the caller runs the merge kernel instead."""
    try:
        launch(True)
    except RuntimeError as err:
        if _coop_state.get(q.device) is not None:
            raise
        _coop_state[q.device] = False
        log.warning("attention: cooperative launch refused on %s (%s); the splits merge in a separate kernel",
                    q.device, err)
        return False
    _coop_state.setdefault(q.device, True)
    return True


@functools.lru_cache(maxsize=None)
def _counter_page(device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters [LANES, COUNTERS] that cooperative attention launches on `device` use and
    leave zeroed. First made by an eager launch (_coop_lane: a device's first try is never captured),
    so no graph capture ever allocates or zeroes it."""
    return torch.zeros(LANES, COUNTERS, dtype=torch.int32, device=device)


# (device, stream handle) -> lane of the counter page, handed out in order of first use.
_lanes: dict[tuple[torch.device, int], int] = {}


def _lane(device: torch.device, stream: int) -> int | None:
    """The counter lane of launches on `stream` (its CUDA handle) on `device`; None past LANES streams."""
    key = (device, stream)
    lane = _lanes.get(key)
    if lane is None:
        taken = sum(1 for d, _ in _lanes if d == device)
        if taken >= LANES:
            return None
        lane = _lanes[key] = taken
    return lane


def tiled_keys(window: int, rows_per_req: int, table_pages: int, page_size: int) -> int:
    """Keys the split kernel tiles for a block table of `table_pages` columns: what the window reaches in
    those whole pages, less the last rows_per_req keys (the narrow tile's)."""
    return max(1, min(window + rows_per_req - 1, table_pages * page_size) - rows_per_req)


def num_splits(num_reqs: int, kv_heads: int, max_keys: int, sms: int, block_n: int = BLOCK_N,
               min_tiles: int | None = None, programs_per_sm: int | None = None) -> int:
    """Splits of the key range (a power of two, for the reduce's arange), from shapes alone."""
    tiles = triton.cdiv(max_keys, block_n)
    want = triton.cdiv((programs_per_sm or PROGRAMS_PER_SM) * sms, num_reqs * kv_heads)
    cap = max(1, tiles // (min_tiles or MIN_TILES_PER_SPLIT))
    s = max(1, min(want, cap))
    return 1 << (s.bit_length() - 1)  # round down to a power of two


def paged_window_attention(q: torch.Tensor, kv_layer: torch.Tensor, positions: torch.Tensor,
                           seq_lens: torch.Tensor, block_tables: torch.Tensor, rows_per_req: int,
                           window: int, scale: float, cooperative: bool = True, concurrent: int = 1,
                           splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """q [n, hq, d], kv_layer [2, pages, page_size, hk, d] (any KV_LAYOUTS view: read through its
    strides), positions int64 [n], seq_lens int32 [R],
    block_tables int32 [R, max_pages] -> [n, hq, d] in q.dtype (the reference's contract).

    cooperative=False: the splits always merge in the merge kernel, never in a cooperative launch,
    whose grid must be resident all at once (DecoderLayer: not beside collectives that spin on peers).

    `splits` defaults from the largest tiled key range the shapes allow: window + rows - 1 keys
    (rows at P..P+6, seq_len P + 7), capped by the block table's pages, less the narrow tile's
    rows keys, and from this launch's
    share of the SMs: `concurrent` launches at once (a step's launch groups side by side) each
    split for 1/concurrent of them. Split for every SM, each group's grid fills the GPU (128
    programs at R = 8), so cooperative grids on other streams cannot be resident beside it and the
    groups' attentions run one after another: at R = 32 on four streams, splitting for a quarter
    of the SMs took the step from 1.23 to 1.07 ms at a 4096 context (BENCHMARKS.md run 149).
    """
    check_device(q, kv_layer)
    same_device("attention", q=q, kv_cache=kv_layer, positions=positions, seq_lens=seq_lens,
                block_tables=block_tables)
    n, hq, d = q.shape
    page_size, hk = kv_layer.shape[2], kv_layer.shape[3]
    r = seq_lens.shape[0]
    group = hq // hk
    if n != r * rows_per_req or hq % hk:
        raise ValueError(f"attention: {n} rows for {r} requests of {rows_per_req}; {hq} q heads over {hk}")
    # The kernels index the cache, positions and block table by these counts unchecked: a cache of
    # another head_dim (or without its K|V planes), fewer positions than rows or fewer table rows than
    # requests read past those tensors (or into a neighbour's) where the reference raises.
    if (kv_layer.dim() != 5 or kv_layer.shape[0] != 2 or kv_layer.shape[4] != d or tuple(positions.shape) != (n,)
            or seq_lens.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != r):
        raise ValueError(f"attention: q {list(q.shape)}, cache {list(kv_layer.shape)}, positions "
                         f"{list(positions.shape)}, seq_lens {list(seq_lens.shape)} and block tables "
                         f"{list(block_tables.shape)} do not match ([2, pages, page_size, kv_heads, {d}], [{n}], "
                         f"[{r}], [{r}, max_pages])")
    # The kernels load q and store the output through one set of strides (q's). empty_like keeps a
    # dense q's strides but makes a non-dense view (q heads sliced out of a wider qkv) contiguous,
    # so such a q is copied first: with its own strides the stores would land past the output.
    if not q.is_contiguous():
        q = q.contiguous()
    # The positions, sequence lengths and a table row are read as dense (element i at i): a strided view
    # of them (every other element of a wider tensor) read its neighbours'. Dense ones are not copied.
    positions, seq_lens, block_tables = positions.contiguous(), seq_lens.contiguous(), block_tables.contiguous()
    out = torch.empty_like(q)
    if r == 0:
        return out
    bn = block_n or BLOCK_N
    keys = tiled_keys(window, rows_per_req, block_tables.shape[1], page_size)
    sp = splits or num_splits(r, hk, keys, max(1, sms_of(q) // max(1, concurrent)), bn)
    bm = max(16, triton.next_power_of_2(rows_per_req * group))
    bd = max(16, triton.next_power_of_2(d))
    if sp > 1:
        po = torch.empty((r, hk, sp, bm, bd), dtype=torch.float32, device=q.device)
        pml = torch.empty((r, hk, sp, bm, 2), dtype=torch.float32, device=q.device)
    else:
        po = pml = out
    if sp & (sp - 1):
        raise ValueError(f"attention: splits must be a power of two, got {sp}")
    s = kv_layer.stride()
    # Same dtypes: dot in that dtype (bf16 tensor cores); an fp8 e4m3 cache widens exactly to q's
    # dtype (3 mantissa bits, exponents inside bf16's), so also q's; other mixes: both to fp32 (exact).
    dot = tl_dtype(q.dtype) if q.dtype == kv_layer.dtype or kv_layer.dtype == torch.float8_e4m3fn else tl.float32

    lane = _coop_lane(q, r, hk, sp) if cooperative else None

    def launch(coop: bool) -> None:
        _split_kernel[(r, hk, sp)](
            q, kv_layer, positions, seq_lens, block_tables, out, po, pml,
            _counter_page(q.device)[lane] if coop else pml,
            q.stride(0), q.stride(1), q.stride(2), s[0], s[1], s[2], s[3], s[4], block_tables.stride(0),
            window, scale * LOG2E, hk, PAGE=page_size,
            ROWS=rows_per_req, GROUP=group, D=d, BLOCK_D=bd, BM=bm, BN=bn,
            BB=max(16, triton.next_power_of_2(rows_per_req)), SPLITS=sp, OUT=tl_dtype(q.dtype),
            DOT=dot, IEEE=dot == tl.float32, INTERPRET=INTERPRET, COOP=coop,
            RB=triton.cdiv(rows_per_req * group, sp), num_warps=NUM_WARPS if bm * bd >= 128 * 64 else 4,
            num_stages=NUM_STAGES, **({"launch_cooperative_grid": True} if coop else {}), **pdl_kwargs(q, "attention"),
        )

    coop = lane is not None and _launch_coop(q, launch)
    if not coop:
        launch(False)
    if sp > 1 and not coop:
        _reduce_kernel[(r * hk, rows_per_req * group)](
            po, pml, out, q.stride(0), q.stride(1), q.stride(2), hk,
            ROWS=rows_per_req, GROUP=group, D=d, BLOCK_D=bd, BM=bm, SPLITS=sp, OUT=tl_dtype(q.dtype),
            INTERPRET=INTERPRET, num_warps=4, **pdl_kwargs(q, "merge"),
        )
    return out
