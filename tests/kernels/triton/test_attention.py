"""Parity of the Triton paged sliding-window attention (non-causal 7-row block, split key range) with the reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from dspark_sidecar import layout  # noqa: E402
from dspark_sidecar.drafter.kv_cache import block_slots  # noqa: E402
from dspark_sidecar.kernels import reference  # noqa: E402
from dspark_sidecar.kernels.triton import attention  # noqa: E402
from dspark_sidecar.kernels.triton.ops import TRITON_OPS  # noqa: E402
from helpers.far_cache import far_cache  # noqa: E402

Q = layout.QPR


def _step(contexts, q_heads, kv_heads, d, page, window, dtype, device, seed):
    """Requests with P = context rows committed, block rows at P..P+6, shuffled physical pages."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor([c + Q for c in contexts], dtype=torch.int32)
    need = [-(-int(s) // page) for s in seq_lens]
    pages = sum(need) + 3
    order = torch.randperm(pages, generator=gen).to(torch.int32)
    tables = torch.zeros(len(contexts), max(need) + 1, dtype=torch.int32)
    used = 0
    for i, k in enumerate(need):
        tables[i, :k] = order[used : used + k]
        used += k
    positions = torch.cat([torch.arange(c, c + Q) for c in contexts])
    kv = torch.randn(2, pages, page, kv_heads, d, generator=gen) * 1.5
    q = torch.randn(len(contexts) * Q, q_heads, d, generator=gen) * 1.5
    return (q.to(device, dtype), kv.to(device, dtype), positions.to(device), seq_lens.to(device),
            tables.to(device), window, d ** -0.5)


# (q_heads, kv_heads, d, page, window, contexts): the window edge inside, outside and across
# requests; block_n = 16 in these cases gives several key tiles per request.
CASES = {
    "group4-slide": (4, 1, 32, 8, 40, [0, 37, 120]),
    "group2-d128": (2, 1, 128, 16, 4096, [5, 60]),
    "hk2-page5": (4, 2, 64, 5, 24, [23, 24, 90, 3]),
    # window - 1 = 64 keys left of the first block row: 4 whole tiles of 16 before the block's own
    # 7 keys, which only the last split's narrow tile holds (at s4, one tile for every split).
    "even-tiles": (4, 1, 32, 8, 65, [200, 64]),
    # R = 1 (otherwise only in the GPU-only real shapes): row 0's left edge 50 - 28 = 22 mid-page,
    # each row's edge one key further into the next page.
    "single-req": (4, 1, 32, 8, 29, [50]),
}


@pytest.mark.parametrize("splits", [None, 1, 2, 4], ids=["auto", "s1", "s2", "s4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_window_attention(device, case, dtype, splits, parity):
    *heads, page, window, contexts = CASES[case]
    args = _step(contexts, *heads, page, window, dtype, device, seed=len(case))
    q, kv, positions, seq_lens, tables, window, scale = args
    ref = reference.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale)
    out = attention.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale,
                                           splits=splits, block_n=16)
    parity(out, ref)


def test_window_edge_is_per_row(device):
    """Key 5 sits at the window's left edge: rows 0-2 (edges 3, 4, 5) see it, rows 3-6 must not."""
    q, kv, positions, seq_lens, tables, _, scale = _step([50], 1, 1, 32, 8, 0, torch.float32, device, seed=9)
    window = 48  # row 0 (P = 50) sees keys >= 3, row 6 sees keys >= 9
    base = TRITON_OPS.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale)
    slot = int(block_slots(tables[0].cpu(), torch.tensor([5]), kv.shape[2]))
    kv.view(2, -1, 1, 32)[:, slot] += 10.0
    moved = TRITON_OPS.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale)
    changed = (moved - base).abs().amax(dim=(1, 2)).cpu()
    assert changed[0] > 1e-3 and changed[1] > 1e-3 and changed[2] > 1e-3
    assert torch.all(changed[3:] == 0)


@pytest.mark.parametrize("splits", [None, 2], ids=["auto", "s2"])
def test_empty_request_gives_zeros(device, splits):
    """A padding request (seq_len 0, no keys) yields zeros, as the reference's empty softmax does: also where
    the splits are merged (every split saw no key: its max is -inf, and the merge must not take -inf - -inf)."""
    q, kv, positions, seq_lens, tables, window, scale = _step([12, 0], 2, 1, 32, 8, 64, torch.float32, device, seed=5)
    seq_lens[1] = 0
    positions[Q:] = torch.arange(Q, device=positions.device)
    ref = reference.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale)
    out = attention.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale, splits=splits)
    assert torch.all(out[Q:] == 0) and torch.all(ref[Q:] == 0)
    torch.testing.assert_close(out[:Q], ref[:Q], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("splits", [1, 4], ids=["s1", "s4"])
def test_table_past_the_used_pages_is_never_read(device, splits, parity):
    """Engines pad block-table rows past a request's pages with anything (-1, stale ids): columns past
    (seq_len - 1) // page must not be read, nor pages outside the key range (columns wholly left of
    the first row's window, here request 5's first two). Here every such column
    names a page of NaNs or a page id far past the cache, with lengths at page and window edges
    (R = 6, pages of 5, window 17) and an fp8 cache: one read of them makes the output NaN or crashes."""
    contexts, page, window = [0, 3, 8, 17, 10, 26], 5, 17
    q, kv, positions, seq_lens, tables, _, scale = _step(contexts, 4, 1, 32, page, window, torch.bfloat16, device, seed=2)
    kv = kv.cpu()
    tables = torch.cat([tables.cpu(), torch.zeros(len(contexts), 2, dtype=torch.int32)], dim=1)
    cols = [(max(0, c - (window - 1)) // page, -(-s // page)) for c, s in zip(contexts, seq_lens.tolist())]
    used = {int(p) for i, (first, end) in enumerate(cols) for p in tables[i, first:end]}
    spare = [p for p in range(kv.shape[1]) if p not in used]
    kv[:, spare] = float("nan")
    junk = torch.tensor([spare[0], 1 << 30], dtype=torch.int32)
    for i, (first, end) in enumerate(cols):
        tables[i, end:] = junk[torch.arange(tables.shape[1] - end) % 2]
        tables[i, :first] = junk[torch.arange(first) % 2]
    assert cols[5][0] == 2
    kv, tables = kv.to(device), tables.to(device)
    kv8 = kv.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    ref = reference.paged_window_attention(q, kv8, positions, seq_lens, tables, Q, window, scale)
    out = attention.paged_window_attention(q, kv8, positions, seq_lens, tables, Q, window, scale,
                                           splits=splits, block_n=16)
    parity(out, ref)


@pytest.mark.parametrize("mismatch", ["head_dim", "positions", "table_rows", "planes", "q_heads", "seq_lens"])
def test_shapes_that_do_not_match_are_refused(device, mismatch):
    """The kernels index the cache by q's head_dim, the positions by row and the block table by
    request, unchecked: a cache of narrower heads, fewer positions than rows or fewer table rows than
    requests were read past their ends (a finite, wrong output) where the reference raises."""
    q, kv, positions, seq_lens, tables, window, scale = _step([9, 30], 4, 1, 32, 8, 40, torch.float32, device, seed=4)
    if mismatch == "head_dim":
        kv = kv[..., :16].contiguous()
    elif mismatch == "positions":
        positions = positions[:Q]
    elif mismatch == "table_rows":
        tables = tables[:1]
    elif mismatch == "q_heads":  # 3 q heads over 2 KV heads: a group of 1, and q head 2 never written
        q, kv = q[:, :3], torch.cat([kv, kv], dim=3)
    elif mismatch == "seq_lens":  # [R, 2]: request r's length read at r, one of request 0's two
        seq_lens = torch.stack([seq_lens, seq_lens], dim=1)
    else:
        kv = kv[:1]
    with pytest.raises((ValueError, RuntimeError, IndexError)):
        reference.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale)
    with pytest.raises(ValueError, match="q heads over" if mismatch == "q_heads" else "do not match"):
        attention.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale, splits=1, block_n=16)


@pytest.mark.parametrize("splits", [1, 2], ids=["s1", "s2"])
def test_q_view_of_a_wider_buffer(device, splits):
    """q as a view into a wider buffer (the q heads of a [n, hq + 2 hk, d] qkv: not dense, so
    empty_like gives a contiguous output): the kernels address q and the output with q's strides,
    so the output must still be the reference's, not rows written past the output's end."""
    q, kv, positions, seq_lens, tables, window, scale = _step([39, 20], 4, 1, 32, 8, 33, torch.float32, device, seed=3)
    qkv = torch.zeros(q.shape[0], q.shape[1] + 2, q.shape[2], device=q.device)
    qkv[:, :4] = q
    view = qkv[:, :4]
    ref = reference.paged_window_attention(view, kv, positions, seq_lens, tables, Q, window, scale)
    out = attention.paged_window_attention(view, kv, positions, seq_lens, tables, Q, window, scale,
                                           splits=splits, block_n=16)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("splits", [1, 2], ids=["s1", "s2"])
def test_window_narrower_than_the_block(device, splits):
    """A window of 3 keys (below the block's 7 rows): row r sees keys P + r - 2 .. P + 6, so the block's own
    keys, which the last split's narrow tile holds, are cut per row too; a window of 7 or more hides this."""
    q, kv, positions, seq_lens, tables, _, scale = _step([20, 0], 4, 1, 32, 8, 0, torch.float32, device, seed=13)
    ref = reference.paged_window_attention(q, kv, positions, seq_lens, tables, Q, 3, scale)
    out = attention.paged_window_attention(q, kv, positions, seq_lens, tables, Q, 3, scale, splits=splits, block_n=16)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_num_splits_covers_an_h200():
    """R = 1 and 1 KV head at a full window: the tiled key range (all but the block's own Q keys, which
    the narrow tile holds) is split over many programs (a power of two)."""
    s1 = attention.num_splits(1, 1, 4096 - 1, 132)
    s8 = attention.num_splits(8, 1, 4096 - 1, 132)
    assert s1 >= 16 and s1 & (s1 - 1) == 0
    assert 8 * s8 <= 132 * attention.PROGRAMS_PER_SM and s8 >= 8
    assert attention.num_splits(64, 4, 50, 132) == 1
    # A group of 8 beside three others (R=32 on four streams) splits for a quarter of the SMs: 32
    # programs, so four groups' grids fit on the GPU at once (BENCHMARKS.md run 149).
    assert attention.num_splits(8, 1, 4096 - 1, 132 // 4) == 4


def test_a_launch_beside_others_splits_for_its_share_of_the_sms(device, monkeypatch):
    """`concurrent` launches at once: the split count is chosen for 1/concurrent of the SMs; the
    result stays the reference's."""
    q, kv, positions, seq_lens, tables, window, scale = _step([40, 200], 4, 1, 16, 16, 256, torch.float32,
                                                              device, seed=5)
    seen = []
    real = attention.num_splits

    def num_splits(r, hk, max_keys, sms, *args, **kw):
        seen.append(sms)
        return real(r, hk, max_keys, sms, *args, **kw)

    monkeypatch.setattr(attention, "num_splits", num_splits)
    ref = reference.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale)
    for concurrent in (1, 3):
        out = attention.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale,
                                               concurrent=concurrent, block_n=16)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)  # fp32 throughout: reassociation only
    full = attention.sms_of(q)
    assert seen == [full, max(1, full // 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("contexts", [[4096], [4096] * 8, [100, 4096, 5000]], ids=["R1", "R8", "mixed"])
def test_real_shapes(cuda, contexts, parity):
    """TP-4 rank: 16 q heads over 1 KV head of 128, window 4096, 16-token pages."""
    q, kv, positions, seq_lens, tables, window, scale = _step(contexts, 16, 1, 128, 16, 4096, torch.bfloat16,
                                                              cuda, seed=6)
    ref = reference.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale)
    parity(TRITON_OPS.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("contexts", [[4096], [4096] * 8, [100, 4096, 5000], [0, 3, 700]],
                         ids=["R1", "R8", "mixed", "short"])
def test_splits_merged_in_the_same_launch(cuda, contexts, monkeypatch):
    """COOP_MERGE: a request's split programs merge their partials after waiting for each other (one
    cooperative launch, no merge kernel), here at 16 splits (R = 8's). At the shard's shapes: the
    merge kernel's result within an output ulp (the sums over splits may associate differently),
    the same bits on every launch and through CUDA-graph replays (the counters must come back to
    zero each launch)."""
    q, kv, positions, seq_lens, tables, window, scale = _step(contexts, 16, 1, 128, 16, 4096, torch.bfloat16,
                                                              cuda, seed=11)
    run = lambda coop=True: attention.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window,  # noqa: E731
                                                             scale, cooperative=coop, splits=16)
    monkeypatch.setattr(attention, "COOP_MERGE", False)
    want = run()
    monkeypatch.setattr(attention, "COOP_MERGE", True)
    assert torch.equal(run(coop=False), want), "cooperative=False must take the merge kernel's path"
    assert attention._coop_lane(q, len(contexts), 1, 16) is not None
    assert attention._coop_lane(q, 1, 1, 64) is None, "64 splits (R = 1) keep the merge kernel"
    first = run()
    torch.testing.assert_close(first.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * want.float().abs().max().item())
    for _ in range(3):
        assert torch.equal(run(), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = run()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, first)
    assert int(attention._counter_page(q.device).abs().sum()) == 0, "a launch left its counters set"


def test_each_stream_gets_its_own_counter_lane(monkeypatch):
    """Cooperative launches on separate streams may run at once: each stream (by CUDA handle, per
    device) keeps one lane of counters; past LANES streams there is none (the merge kernel runs)."""
    monkeypatch.setattr(attention, "_lanes", {})
    monkeypatch.setattr(attention, "LANES", 3)
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    assert [attention._lane(a, h) for h in (111, 222, 111, 333)] == [0, 1, 0, 2]
    assert attention._lane(b, 222) == 0  # another device's page
    assert attention._lane(a, 444) is None and attention._lane(a, 222) == 1


def test_refused_cooperative_launch_falls_back(monkeypatch, caplog):
    """A device that refuses the cooperative launch on its first try (an MPS client capped below the
    grid) is marked, logged, and gets the merge kernel from then on; a later refusal is an error."""
    monkeypatch.setattr(attention, "_coop_state", {})
    q = torch.zeros(1)
    calls = []

    def refuse(coop):
        calls.append(coop)
        raise RuntimeError("too many blocks in cooperative launch")

    assert attention._launch_coop(q, refuse) is False
    assert attention._coop_state[q.device] is False and calls == [True]
    assert "cooperative launch refused" in caplog.text
    monkeypatch.setattr(attention, "_coop_state", {q.device: True})
    with pytest.raises(RuntimeError):
        attention._launch_coop(q, refuse)
    monkeypatch.setattr(attention, "_coop_state", {})
    assert attention._launch_coop(q, calls.append) is True and attention._coop_state[q.device] is True


# Caches laid out as permutations of the planes view with the page slot's or the heads' stride outermost
# (the server binds any dense permutation: kv_cache.kv_view_problem), spread out so that a far element lies
# past 2^31 without 2^31 elements of data; d 16: [2, 2 pages, page 16, 1 head] with the page slot outermost
# (slot 15 lies 15 * 143165577 > 2^31 elements in), [2, 2 pages, page 4, 3 heads] with the heads
# outermost (head 2 lies 2 * (2^30 + 16) elements in), and [2, 3 pages, page 16, 1 head] with the pages far
# apart (page 2 lies 2 * (2^30 + 512) elements in: a planes cache of over 2^31 elements, and the page the
# table's second column names holds tiled keys and the narrow tile's alike). Each with its block table.
FAR_LAYOUTS = {
    "slot-outermost": ((2, 2, 16, 1, 16), (16, 32, -(-(1 << 31) // 15), 16, 1), [1, 0]),
    "head-outermost": ((2, 2, 4, 3, 16), (16, 32, 64, (1 << 30) + 16, 1), [1, 0]),
    "page-far": ((2, 3, 16, 1, 16), (256, (1 << 30) + 512, 16, 16, 1), [0, 2]),
}


@pytest.mark.parametrize("far", list(FAR_LAYOUTS))
def test_cache_offsets_past_2_31_elements(device, far):
    """A key's offset into the cache, page * stride + slot * stride + head * stride, must be int64 in every
    term: with the page slot's or a head's stride the large one, the slot's or head's int32 product
    wrapped and the kernel read 2^32 elements before the key (here: inside the buffer, a wrong output)."""
    shape, strides, table = FAR_LAYOUTS[far]
    kv = far_cache(shape, strides, device)
    page, hk = shape[2], shape[3]
    seq = 2 * page
    positions = torch.arange(seq - Q, seq, device=device)
    seq_lens = torch.tensor([seq], dtype=torch.int32, device=device)
    tables = torch.tensor([table], dtype=torch.int32, device=device)
    q = torch.randn(Q, 2 * hk, 16, generator=torch.Generator().manual_seed(1)).to(device)
    ref = reference.paged_window_attention(q, kv, positions, seq_lens, tables, Q, 40, 0.25)
    out = attention.paged_window_attention(q, kv, positions, seq_lens, tables, Q, 40, 0.25, splits=1, block_n=16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("strided", ["positions", "seq_lens", "block_tables"])
def test_strided_index_tensors(device, strided):
    """The kernel reads positions[i], seq_lens[r] and block_tables[r, c] at i, r and r * stride(0) + c:
    a view with other strides (every other element of a wider tensor; a column-major table) was read as
    if dense, so rows took their neighbours' positions, lengths or pages, where the reference indexes it."""
    q, kv, positions, seq_lens, tables, window, scale = _step([9, 30], 4, 1, 32, 8, 12, torch.float32, device, seed=8)
    if strided == "positions":
        positions = torch.stack([positions, positions + 5], dim=1)[:, 0]
    elif strided == "seq_lens":
        seq_lens = torch.stack([seq_lens, seq_lens - 3], dim=1)[:, 0]
    else:
        tables = tables.t().contiguous().t()
    assert not (positions.is_contiguous() and seq_lens.is_contiguous() and tables.is_contiguous())
    ref = reference.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale)
    out = attention.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale, splits=2, block_n=16)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_dtype,splits", [(torch.float32, 2), (torch.float8_e4m3fn, 1)], ids=["fp32-s2", "fp8-s1"])
def test_window_edges_exact_at_4096(device, kv_dtype, splits):
    """Every row's window edge at the served window (4096, pages of 16, 64-key tiles, 16 q heads on 1 KV
    head), exactly: a parity tolerance hides one key of 4102 (1/4102 of an output). q = 0 makes each row's
    output the mean of V over the keys it sees; V's dim j < 8 marks key P - 4096 + j, dim 8 counts every key
    and dims 9.. mark the block's own keys P..P+6. Row r (at P + r) must see keys P - 4095 + r .. P + 6:
    dim j exactly when j > r (and its key exists), every block key. Anchors past the window, at 4095 (row
    0's edge at key 0, row r's at key r) and at 0 (the block alone). V's 0s and 1s are exact in fp8."""
    d, page, window, contexts = 16, 16, 4096, [4100, 4095, 0]
    seq = [c + Q for c in contexts]
    need = [-(-s // page) for s in seq]
    order = torch.randperm(sum(need), generator=torch.Generator().manual_seed(12)).to(torch.int32)
    tables = torch.zeros(len(contexts), max(need), dtype=torch.int32)
    kv = torch.zeros(2, sum(need) * page, 1, d)
    for i, (c, k) in enumerate(zip(contexts, need)):
        tables[i, :k] = order[sum(need[:i]) : sum(need[:i]) + k]
        pos = torch.arange(c + Q)
        v = torch.stack([(pos == c - window + j) for j in range(8)] + [pos >= 0]
                        + [(pos == c + j) for j in range(Q)], dim=1).float()
        slots = block_slots(tables[i], pos, page)
        kv[0, slots] = torch.randn(c + Q, 1, d, generator=torch.Generator().manual_seed(i))
        kv[1, slots] = v[:, None]
    kv = kv.view(2, -1, page, 1, d).to(device, kv_dtype)
    positions = torch.cat([torch.arange(c, c + Q) for c in contexts]).to(device)
    q = torch.zeros(len(contexts) * Q, 16, d, device=device)
    out = attention.paged_window_attention(q, kv, positions, torch.tensor(seq, dtype=torch.int32, device=device),
                                           tables.to(device), Q, window, d ** -0.5, splits=splits)
    want = torch.zeros(len(contexts), Q, d)
    for i, c in enumerate(contexts):
        for r in range(Q):
            edge = max(0, c + r - (window - 1))
            seen = c + Q - edge
            want[i, r, :8] = torch.tensor([float(c - window + j >= edge) for j in range(8)]) / seen
            want[i, r, 8], want[i, r, 9:] = 1.0, 1.0 / seen
    want = want.view(-1, 1, d).expand(-1, 16, -1)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-7)


def test_operands_on_another_device_are_refused(device):
    """The kernels take raw pointers and launch on q's device: a cache, position list, length list or block
    table on another (another rank's GPU) was read as if local. Each is refused by name (meta tensors
    stand for the other device here)."""
    q, kv, positions, seq_lens, tables, window, scale = _step([5, 60], 2, 1, 32, 8, 40, torch.float32, device, 32)
    args = {"kv_cache": kv, "positions": positions, "seq_lens": seq_lens, "block_tables": tables}
    for name in args:
        moved = {**args, name: args[name].to("meta")}
        with pytest.raises(ValueError, match=f"attention: {name} is on meta"):
            attention.paged_window_attention(q, moved["kv_cache"], moved["positions"], moved["seq_lens"],
                                             moved["block_tables"], Q, window, scale)


def test_no_requests(device):
    """A launch of no requests (R = 0): an empty output, as the reference's, and no kernel (the split
    count is planned per request: a division by R)."""
    q = torch.empty(0, 4, 32, device=device)
    args = (torch.zeros(2, 3, 8, 1, 32, device=device), torch.empty(0, dtype=torch.int64, device=device),
            torch.empty(0, dtype=torch.int32, device=device), torch.empty(0, 2, dtype=torch.int32, device=device),
            Q, 40, 0.25)
    ref = reference.paged_window_attention(q, *args)
    out = attention.paged_window_attention(q, *args)
    assert out.shape == ref.shape == (0, 4, 32) and out.dtype == ref.dtype


def test_splits_must_be_a_power_of_two(device):
    """The merge takes the splits with an arange (a power of two in Triton): 3 is refused by name."""
    q, kv, positions, seq_lens, tables, window, scale = _step([9, 30], 4, 1, 32, 8, 40, torch.float32, device, seed=4)
    with pytest.raises(ValueError, match="splits must be a power of two, got 3"):
        attention.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale, splits=3, block_n=16)


class _SpyLaunch:
    """Stands in for attention._split_kernel: records each launch's keywords, then launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append(kw)
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("q_dtype,kv_dtype,dot", [
    (torch.bfloat16, torch.bfloat16, "bf16"), (torch.bfloat16, torch.float8_e4m3fn, "bf16"),
    (torch.float32, torch.float32, "fp32"), (torch.bfloat16, torch.float32, "fp32"),
    (torch.float32, torch.bfloat16, "fp32"),
], ids=["bf16", "bf16-fp8", "fp32", "bf16-fp32", "fp32-bf16"])
def test_dot_dtype(device, monkeypatch, q_dtype, kv_dtype, dot, parity):
    """The dots run in the cache's dtype where q has it (bf16 tensor cores; P rounded to it for P @ V), in q's
    for an fp8 cache (widened exactly), and in fp32 (IEEE, not tf32) for any other mix: the parity tests
    pass with either on the interpreter, which widens every dot to fp32."""
    spy = _SpyLaunch(attention._split_kernel)
    monkeypatch.setattr(attention, "_split_kernel", spy)
    q, kv, positions, seq_lens, tables, window, scale = _step([9, 30], 4, 1, 32, 8, 40, torch.float32, device, seed=4)
    q, kv = q.to(q_dtype), kv.to(kv_dtype)
    ref = reference.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale)
    out = attention.paged_window_attention(q, kv, positions, seq_lens, tables, Q, window, scale, splits=1, block_n=16)
    parity(out, ref)
    (kw,) = spy.launches
    want = {"bf16": tl.bfloat16, "fp32": tl.float32}[dot]
    assert kw["DOT"] == want and kw["IEEE"] == (dot == "fp32")


def test_tiled_keys():
    """The keys the split count is planned for: the window's reach (window + rows - 1 keys) in the table's
    whole pages, less the narrow tile's rows; at least 1."""
    assert attention.tiled_keys(4096, Q, 258, 16) == 4095  # a window-relative table (window_width pages)
    assert attention.tiled_keys(40, Q, 2, 8) == 16 - Q  # a table narrower than the window
    assert attention.tiled_keys(40, Q, 9, 8) == 39
    assert attention.tiled_keys(3, Q, 0, 8) == 1


def test_cooperative_merge_only_where_it_can_run(monkeypatch):
    """_coop_lane on a stand-in CUDA device: a lane for 2..COOP_MAX_SPLITS splits of a grid that fits the SMs
    and the counters, on a device where the cooperative launch worked or was never tried outside a capture."""
    q = torch.zeros(1)
    monkeypatch.setattr(attention, "nvidia_of", lambda t: True)
    monkeypatch.setattr(attention, "sms_of", lambda t: 132)
    monkeypatch.setattr(attention, "_lanes", {})
    monkeypatch.setattr(attention, "_coop_state", {})
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 7})())
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert attention._coop_lane(q, 8, 1, 16) == 0 and attention._coop_lane(q, 1, 1, 2) == 0
    assert attention._coop_lane(q, 1, 1, 1) is None  # one split: nothing to merge
    assert attention._coop_lane(q, 1, 1, 2 * attention.COOP_MAX_SPLITS) is None
    assert attention._coop_lane(q, 9, 1, 16) is None  # 144 programs on 132 SMs
    monkeypatch.setattr(attention, "sms_of", lambda t: 1 << 20)
    assert attention._coop_lane(q, attention.COUNTERS // 2, 1, 2) == 0
    assert attention._coop_lane(q, attention.COUNTERS // 2 + 1, 1, 2) is None  # past the counters
    capturing[0] = True
    assert attention._coop_lane(q, 1, 1, 2) is None  # never tried: not first inside a capture
    monkeypatch.setattr(attention, "_coop_state", {q.device: True})
    assert attention._coop_lane(q, 1, 1, 2) == 0
    monkeypatch.setattr(attention, "_coop_state", {q.device: False})
    capturing[0] = False
    assert attention._coop_lane(q, 1, 1, 2) is None
    monkeypatch.setattr(attention, "COOP_MERGE", False)
    monkeypatch.setattr(attention, "_coop_state", {})
    assert attention._coop_lane(q, 1, 1, 2) is None
