"""The pre-launched step's metadata program against its NumPy spec and the host path it must equal."""

from __future__ import annotations

import contextlib
import mmap

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.drafter import scenario  # noqa: E402
from dspark_sidecar.drafter.kv_cache import window_metadata_into, window_width  # noqa: E402
from dspark_sidecar.kernels.triton import step_meta as sm  # noqa: E402
from dspark_sidecar.proto.doorbell import SKIP_KEY, gpu_word  # noqa: E402
from dspark_sidecar.proto.gpu_word import DevicePointer  # noqa: E402

PAGE, WINDOW, Q = 16, 64, 7


def _case(lens: list[int], seed: int, spare_cols: int = 3):
    """A valid step's host metadata (positions, seq_lens, tables, slots) over shuffled pages."""
    need = [scenario.pages_needed(c + Q, PAGE) for c in lens]
    pages = sum(need) + 5
    width = max(need) + spare_cols
    perm = np.random.default_rng(seed).permutation(pages).astype(np.int32)
    tables = np.full((len(lens), width), -1, np.int32)  # unused columns: -1, as engines pad
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used : used + n]
        used += n
    L = np.array([c + Q for c in lens], np.int32)
    P = L[:, None].astype(np.int64) - Q + np.arange(Q)
    S = tables[np.arange(len(lens))[:, None], P // PAGE].astype(np.int64) * PAGE + P % PAGE
    return P.reshape(-1), L, tables, S.reshape(-1), pages


def _run(device, word: int, expect: int, P, L, T, S, pages):
    R, ww = L.shape[0], window_width(PAGE, WINDOW)
    dev = torch.device(device)
    src = [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (P, L, T, S)]
    n = R * Q
    out = (torch.full((n,), 99, dtype=torch.int64, device=dev), torch.full((n,), 99, dtype=torch.int64, device=dev),
           torch.full((n,), 99, dtype=torch.int64, device=dev), torch.full((R,), 99, dtype=torch.int32, device=dev),
           torch.full((R, ww), 99, dtype=torch.int32, device=dev))
    flag = torch.zeros(R, dtype=torch.int32, device=dev)
    mirror = torch.full((R + 1,), 99, dtype=torch.int32, device=dev)  # the device copy the gated copy reads
    w = torch.tensor([sm.signed64(word)], dtype=torch.int64, device=dev)
    sm.step_meta(w, torch.tensor([sm.signed64(expect)], device=dev), src, out, flag, num_reqs=R, width=T.shape[1],
                 page_size=PAGE, window=WINDOW, num_pages=pages, mirror=mirror)
    assert torch.equal(mirror[:R], flag) and mirror[R] == 99  # the same flags, nothing past R
    return tuple(t.cpu().numpy() for t in out) + (flag.cpu().numpy(),)


def _check(got, want) -> None:
    for g, w, name in zip(got, want, ("positions", "rel", "slots", "lens", "tables", "flag")):
        np.testing.assert_array_equal(g, w, err_msg=name)


# window-page-edge: L - (WINDOW + Q - 1) a whole number of pages (86 - 70 = 16, 118 - 70 = 48), where a window
# span one key longer or shorter moves the window's first page column.
@pytest.mark.parametrize("lens", [[0], [40, 5, 300], [3, 17, 100, 1000, 2, 64, 65, 9], [79, 111]],
                         ids=["R1", "R3", "R8", "window-page-edge"])
@pytest.mark.parametrize("seed", [0, 1])
def test_valid_step_equals_host_path(device, lens, seed):
    """A rung, valid step: exactly graphs.py's host metadata (window_metadata_into) and flag RAN."""
    P, L, T, S, pages = _case(lens, seed)
    word = gpu_word(41, 3)
    want = sm.step_meta_reference(word, word, P, L, T, S, PAGE, WINDOW, pages, window_width(PAGE, WINDOW))
    R, ww = len(lens), window_width(PAGE, WINDOW)
    rel, wl, wt = np.zeros(R * Q, np.int64), np.zeros(R, np.int32), np.zeros((R, ww), np.int32)
    window_metadata_into(P, L, T, PAGE, WINDOW, rel, wl, wt)
    assert (want[5] == sm.FLAG_RAN).all()
    np.testing.assert_array_equal(want[1], rel)
    np.testing.assert_array_equal(want[3], wl)
    np.testing.assert_array_equal(want[4], wt)
    _check(_run(device, word, word, P, L, T, S, pages), want)


def _kernel_slots(P, T, r):
    """Request r's slots as the program computes each row's place (C-style // and %, the column clamped to
    the table), so that only the check a case aims at can refuse it."""
    col = np.clip(np.trunc(P / PAGE).astype(np.int64), 0, T.shape[1] - 1)
    return T[r, col].astype(np.int64) * PAGE + np.fmod(P, PAGE)


def _corrupt(kind: str, P, L, T, S, pages):
    P, L, T, S = P.copy(), L.copy(), T.copy(), S.copy()
    if kind == "position":
        P[4] += 1
    elif kind == "rows-shifted":  # rows one key early, each slot its position's place: only the position check
        P[:Q] -= 1
        S[:Q] = _kernel_slots(P[:Q], T, 0)
    elif kind == "short-len":  # rows -1..5 before a length of 6, slots as the program places them
        L[0] = Q - 1
        P[:Q] = np.arange(-1, Q - 1)
        S[:Q] = _kernel_slots(P[:Q], T, 0)
    elif kind == "past-table":  # rows at the table's last slot and one past it (a full table, slots where the
        L[1] = T.shape[1] * PAGE + 1  # program's clamped column puts them): the table lacks a page the rows use
        P[Q : 2 * Q] = L[1] - Q + np.arange(Q)
        spare = [p for p in range(pages) if p not in set(T[T >= 0].tolist())]
        free = np.flatnonzero(T[1] < 0)
        T[1, free] = spare[: free.size]
        S[Q : 2 * Q] = _kernel_slots(P[Q : 2 * Q], T, 1)
    elif kind == "wild-position":  # positions far outside the table: the column read stays in it (no fault)
        P[4], P[5] = -(1 << 40), 1 << 40
    elif kind == "slot":
        S[-1] += 1
    elif kind == "page-out-of-cache":  # the page holding the last row's slot
        last = (int(L[-1]) - 1) // PAGE
        T[-1, last] = pages
    elif kind == "negative-window-page":  # a page the window reads, not one the slots use
        rows = P[Q : 2 * Q] // PAGE  # request 1's rows lie in columns 18 and 19 (300..306)
        col = int(rows.min()) - 1
        assert col >= max(int(L[1]) - (WINDOW + Q - 1), 0) // PAGE and col not in rows
        T[1, col] = -3
    elif kind == "page-before-window":  # a page the request uses that its window does not read (as validate.py)
        T[1, 0] = pages
    return P, L, T, S


@pytest.mark.parametrize("kind,bad", [("position", 0), ("rows-shifted", 0), ("short-len", 0), ("past-table", 1),
                                      ("wild-position", 0), ("slot", 2), ("page-out-of-cache", 2),
                                      ("negative-window-page", 1), ("page-before-window", 1)])
def test_invalid_request_is_a_noop(device, kind, bad):
    """Whatever the GPU would touch wrongly turns that request into no-op rows: no slot written (-1),
    a 7-row window over page 0 (in-bounds), its flag INVALID; the other requests run as the host path."""
    P, L, T, S, pages = _case([40, 300, 100], seed=3)
    P, L, T, S = _corrupt(kind, P, L, T, S, pages)
    word = gpu_word(7, 2)
    ww = window_width(PAGE, WINDOW)
    want = sm.step_meta_reference(word, word, P, L, T, S, PAGE, WINDOW, pages, ww)
    assert want[5].tolist() == [sm.FLAG_INVALID if r == bad else sm.FLAG_RAN for r in range(3)], kind
    rows = slice(Q * bad, Q * bad + Q)
    assert (want[2][rows] == -1).all() and want[3][bad] == Q and (want[4][bad] == 0).all()
    rel, wl, wt = np.zeros(3 * Q, np.int64), np.zeros(3, np.int32), np.zeros((3, ww), np.int32)
    window_metadata_into(P, L, T, PAGE, WINDOW, rel, wl, wt)
    ok = [r for r in range(3) if r != bad]
    okrows = np.concatenate([np.arange(Q * r, Q * r + Q) for r in ok])
    np.testing.assert_array_equal(want[1][okrows], rel[okrows])
    np.testing.assert_array_equal(want[2][okrows], S[okrows])
    np.testing.assert_array_equal(want[4][ok], wt[ok])
    _check(_run(device, word, word, P, L, T, S, pages), want)


# The first and last requests' lengths agree modulo PAGE: their last rows sit at one offset of their last page.
# R20: the last request's rows lie past the program's first DUP_BLOCK of slots.
@pytest.mark.parametrize("lens", [[40, 300, 104], [5, 17, 100, 1000, 2, 64, 65, 21],
                                  [40] + [3 * i for i in range(18)] + [104]], ids=["R3", "R8", "R20"])
def test_requests_sharing_a_slot_are_no_ops(device, lens):
    """Two requests whose tables share a page (each row still its position's place in its own table: the
    index checks pass) write one slot from two rows: which K/V it keeps would depend on the order the
    writes land in. validate.check_distinct_slots refuses such a step on the host; the program makes both
    requests no-ops, INVALID, so a queued copy never writes the slot; the others run as the host path."""
    P, L, T, S, pages = _case(lens, seed=5)
    a, b = 0, len(lens) - 1
    T[b, (int(L[b]) - 1) // PAGE] = T[a, (int(L[a]) - 1) // PAGE]  # b's last page is a's
    rows = P.reshape(-1, Q)[b]
    S = S.copy()
    S[Q * b : Q * b + Q] = T[b, rows // PAGE].astype(np.int64) * PAGE + rows % PAGE  # b's slots, from its table
    assert S[Q * b + Q - 1] == S[Q * a + Q - 1] and np.unique(S).size < S.size
    word = gpu_word(9, 4)
    want = sm.step_meta_reference(word, word, P, L, T, S, PAGE, WINDOW, pages, window_width(PAGE, WINDOW))
    assert want[5].tolist() == [sm.FLAG_INVALID if r in (a, b) else sm.FLAG_RAN for r in range(len(lens))]
    for r in (a, b):
        assert (want[2][Q * r : Q * r + Q] == -1).all()
    _check(_run(device, word, word, P, L, T, S, pages), want)


@pytest.mark.parametrize("word", [gpu_word(8, 2), gpu_word(7, 5), gpu_word(7, SKIP_KEY)],
                         ids=["next-seq", "other-layout", "released-by-sidecar"])
def test_word_not_for_this_step_is_a_noop(device, word):
    """A word with another sequence or key (another layout, or the sidecar's own release) runs nothing."""
    P, L, T, S, pages = _case([40, 300], seed=4)
    want = sm.step_meta_reference(word, gpu_word(7, 2), P, L, T, S, PAGE, WINDOW, pages, window_width(PAGE, WINDOW))
    assert (want[5] == sm.FLAG_NOT_RUNG).all() and (want[2] == -1).all()
    _check(_run(device, word, gpu_word(7, 2), P, L, T, S, pages), want)


def test_a_wait_passed_early_at_the_sequence_wrap_finds_the_last_word_and_runs_nothing(device):
    """The word keeps 32 bits of the sequence. CUDA's wait compares (int64)(word - value) >= 0 and copes with
    the wrap, but ROCm documents hipStreamWaitValueGte as a plain `word >= value`: waiting for step 2^32
    (sequence bits 0), the previous step's word (bits 0xFFFFFFFF) passes at once, before the engine writes
    the inputs (helper 79). The program still compares the whole word with the expected one, so the step
    it reads then is not rung: every request a no-op, and the step is run the ordinary way."""
    seq, key = 1 << 32, 2
    last = gpu_word(seq - 1, key)  # still there when the queued wait is reached
    assert last >= gpu_word(seq, 0)  # ROCm's unsigned compare: passed
    assert (last - gpu_word(seq, 0)) % (1 << 64) >= 1 << 63  # CUDA's (and _word_reached's): not reached
    P, L, T, S, pages = _case([40, 300], seed=6)
    want = sm.step_meta_reference(last, gpu_word(seq, key), P, L, T, S, PAGE, WINDOW, pages,
                                  window_width(PAGE, WINDOW))
    assert (want[5] == sm.FLAG_NOT_RUNG).all() and (want[2] == -1).all()
    _check(_run(device, last, gpu_word(seq, key), P, L, T, S, pages), want)


def test_signed64_round_trips_the_word():
    """Words with the top bit set (sequence >= 2^31) reach the kernel as the same 64 bits."""
    for w in (0, gpu_word(1, 1), gpu_word(0x8000_0000, 7), gpu_word(0xFFFF_FFFF, SKIP_KEY)):
        assert np.int64(sm.signed64(w)).view(np.uint64) == np.uint64(w)


@pytest.mark.parametrize("agreed", [[sm.FLAG_RAN] * 3, [sm.FLAG_RAN, sm.FLAG_INVALID, sm.FLAG_RAN],
                                    [sm.FLAG_NOT_RUNG] * 3], ids=["all-ran", "one-refused", "not-rung"])
def test_gate_noops_every_request_some_rank_refused(device, agreed):
    """TP > 1: after the flags' all-reduce, a request any rank refused writes no K/V on any rank."""
    P, L, T, S, pages = _case([40, 5, 300], 0)
    want_flags, want_slots = sm.step_gate_reference(np.array(agreed, np.int32), S)
    dev = torch.device(device)
    slots = torch.from_numpy(S.copy()).to(dev)
    flags = torch.zeros(3, dtype=torch.int32, device=dev)
    sm.step_gate(torch.tensor(agreed, dtype=torch.int32, device=dev), flags, slots, 3)
    np.testing.assert_array_equal(flags.cpu().numpy(), want_flags)
    np.testing.assert_array_equal(slots.cpu().numpy(), want_slots)
    refused = np.repeat(np.array(agreed) != sm.FLAG_RAN, Q)
    assert (want_slots[refused] == -1).all() and (want_slots[~refused] == S[~refused]).all()


@pytest.mark.parametrize("flags", [[sm.FLAG_RAN] * 3, [sm.FLAG_RAN, sm.FLAG_INVALID, sm.FLAG_RAN],
                                   [sm.FLAG_NOT_RUNG] * 3], ids=["all-ran", "one-refused", "not-rung"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_copy_writes_only_the_requests_the_gpu_ran(device, flags, dtype):
    """The queued step's output into the engine's region: a refused request's rows keep what was there
    (hidden 5000: rows of 35000 elements, so the last program of each request is partial)."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randn(3 * Q, 5000, generator=gen).to(dtype)
    dst = torch.randn(3 * Q, 5000, generator=gen).to(dtype)
    want = sm.gated_copy_reference(src, dst, np.array(flags, np.int32))  # reference first
    dev = torch.device(device)
    got = dst.to(dev)
    if device == "cuda":  # warm: compiled and loaded, nothing copied
        sm.gated_copy(src.to(dev), got, torch.tensor(flags, dtype=torch.int32, device=dev), 3, warm=True)
        assert torch.equal(got.cpu(), dst)
    with _loads() as loaded:
        sm.gated_copy(src.to(dev), got, torch.tensor(flags, dtype=torch.int32, device=dev), 3)
    assert device != "cuda" or loaded == [], f"loaded at launch, after the warm call: {loaded}"
    assert torch.equal(got.cpu(), want)  # a copy: exact
    for r, f in enumerate(flags):
        rows = slice(r * Q, (r + 1) * Q)
        assert torch.equal(want[rows], (src if f == sm.FLAG_RAN else dst)[rows])
    with pytest.raises(ValueError, match="alike"):
        sm.gated_copy(src.to(dev), got[:, :10], torch.tensor(flags, dtype=torch.int32, device=dev), 3)
    # Contiguous and of one dtype, but another shape: the rows' length comes from src, so a slice of fewer
    # rows would be written past its end (here one of more rows, which the copy would not overrun).
    with pytest.raises(ValueError, match="alike"):
        sm.gated_copy(src.to(dev), torch.zeros(4 * Q, 5000, dtype=dtype, device=dev),
                      torch.tensor(flags, dtype=torch.int32, device=dev), 3)


@contextlib.contextmanager
def _loads():
    """The names of the kernels whose code Triton loads into the context inside the block (its load hook).
    After a warm=True call the real launch must load nothing: behind a queued wait on the GPU word a load
    waited for the engine's next ring (server/prelaunch.py `_replay_of`)."""
    import triton

    names: list[str] = []

    def hook(module, function, name, *rest):
        names.append(name)

    triton.knobs.runtime.kernel_load_start_hook.add(hook)
    try:
        yield names
    finally:
        triton.knobs.runtime.kernel_load_start_hook.remove(hook)


def _host_region(arrays) -> tuple[mmap.mmap, list[tuple[int, int]]]:
    """The arrays laid out as the engine's fill() does (8-aligned, one after another) in a page-aligned
    mapping of two pages; returns it and each array's (offset, bytes)."""
    buf = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    raw = np.frombuffer(buf, np.uint8)
    spans, off = [], 24  # not at the region's start: the copy must begin in a block below it
    for a in arrays:
        off = -(-off // 8) * 8
        raw[off : off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        spans.append((off, a.nbytes))
        off += a.nbytes
    return buf, spans


@pytest.mark.parametrize("lens", [[40, 5, 300], [3, 17, 100, 1000, 2, 64, 65, 9]], ids=["R3", "R8"])
def test_staged_sources_give_what_the_program_reads_in_place(device, lens):
    """Staging copies the word and the host-mapped sources in whole 2 KB blocks; the program on the
    copies gives the reference's outputs exactly (on a GPU the sources really are host memory,
    registered and read across PCIe)."""
    P, L, T, S, pages = _case(lens, seed=5)
    word_value = gpu_word(41, 3)
    want = sm.step_meta_reference(word_value, word_value, P, L, T, S, PAGE, WINDOW, pages, window_width(PAGE, WINDOW))
    buf, spans = _host_region((P, L, T, S))
    word_buf = mmap.mmap(-1, mmap.PAGESIZE)
    np.frombuffer(word_buf, np.int64)[0] = sm.signed64(word_value)
    host = np.frombuffer(buf, np.uint8).ctypes.data
    host_word = np.frombuffer(word_buf, np.uint8).ctypes.data
    regs = []
    if device == "cuda":
        from dspark_sidecar.proto.gpu_word import GpuWordOps, RegisteredPage

        ops = GpuWordOps.load(torch.device("cuda"))
        if ops is None:
            pytest.skip("no stream memory operations on this driver")
        regs = [RegisteredPage(ops, host, len(buf)), RegisteredPage(ops, host_word)]
        base, word_addr = regs[0].device_ptr, regs[1].device_ptr
    else:  # the interpreter reads host addresses directly
        base, word_addr = host, host_word
    try:
        dtypes = (torch.int64, torch.int32, torch.int32, torch.int64)
        sources = [(DevicePointer(base + off, dt), n, (base, len(buf))) for (off, n), dt in zip(spans, dtypes)]
        def as_views(src, dst, blocks, word_src, word_dst, warm=False):  # the interpreter takes tensors, not addresses
            view = torch.frombuffer(buf, dtype=torch.int64)[(src.address - host) // 8 :]
            sm._launch_stage(view, dst, blocks, torch.frombuffer(word_buf, dtype=torch.int64)[:1], word_dst, warm=warm)

        staging = sm.Staging(device, launch=as_views if device == "cpu" else sm._launch_stage)
        R, ww, dev = len(lens), window_width(PAGE, WINDOW), torch.device(device)
        n = R * Q
        out = tuple(torch.full((n,), 99, dtype=torch.int64, device=dev) for _ in range(3)) + (
            torch.full((R,), 99, dtype=torch.int32, device=dev), torch.full((R, ww), 99, dtype=torch.int32, device=dev))
        flag = torch.zeros(R, dtype=torch.int32, device=dev)
        expect = torch.tensor([sm.signed64(word_value)], device=dev)
        kw = dict(num_reqs=R, width=T.shape[1], page_size=PAGE, window=WINDOW, num_pages=pages)
        if device == "cuda":  # Prelaunch's first sight of a layout: compiled and loaded, nothing queued
            word, src = staging.stage(DevicePointer(word_addr, torch.int64), sources, warm=True)
            sm.step_meta(word, expect, src, out, flag, warm=True, **kw)
            torch.cuda.synchronize()
            assert int(staging.word[0]) == 0 and all(bool((t == 99).all()) for t in out) and not flag.any()
        with _loads() as loaded:
            word, src = staging.stage(DevicePointer(word_addr, torch.int64), sources)
            assert word is staging.word and all(t.device.type == device for t in src)
            sm.step_meta(word, expect, src, out, flag, **kw)
        assert loaded == [], f"loaded at launch, after the warm call: {loaded}"
        _check(tuple(t.cpu().numpy() for t in out) + (flag.cpu().numpy(),), want)
    finally:
        for r in regs:
            r.close()


def test_staging_copies_whole_blocks_inside_each_registration():
    """One launch per registration the sources lie in, from a block boundary of that registration,
    never past its (page-rounded) end; the views returned sit where each source's bytes land; a
    source outside its registration is refused before anything is queued."""
    launches = []

    def launch(src, dst, blocks, word_src, word_dst, warm=False):
        assert not warm
        launches.append((src.address, blocks, dst.data_ptr()))

    block, page = sm.STAGE_WORDS * 8, mmap.PAGESIZE
    a, b = (0x7F00_0000_0000, 2 * page), (0x7F00_1000_0000, page)  # two registrations (device address, bytes)
    sources = [(DevicePointer(a[0] + 24, torch.int64), 56, a), (DevicePointer(a[0] + 80, torch.int32), 4, a),
               (DevicePointer(a[0] + 2100, torch.int32), 4000, a), (DevicePointer(b[0] + 3000, torch.int64), 56, b)]
    staging = sm.Staging("cpu", launch=launch)
    word, src = staging.stage(DevicePointer(0x1000, torch.int64), sources)
    assert [(s, n) for s, n, _ in launches] == [(a[0], 3), (b[0] + 2048, 1)]
    assert all(s % block == 0 and s + n * block <= r[0] + r[1] for (s, n, _), r in zip(launches, (a, b)))
    base = staging.buf.data_ptr()
    assert [t.data_ptr() - base for t in src] == [24, 80, 2100, 3 * block + 3000 - 2048]
    assert [t.numel() * t.element_size() for t in src] == [56, 4, 4000, 56]
    with pytest.raises(ValueError, match="not inside their registration"):
        staging.stage(word, [(DevicePointer(b[0] + page - 8, torch.int64), 16, b)])
    # Bytes inside a registration that is not a whole number of blocks, whose last block would pass its end.
    odd = (0x7F00_2000_0000, block + 100)
    with pytest.raises(ValueError, match="not inside their registration"):
        staging.stage(word, [(DevicePointer(odd[0] + block + 8, torch.int64), 16, odd)])
    assert len(launches) == 2


def test_staging_reserve_grows_the_buffer_before_a_capture_bakes_it_in():
    """`reserve` grows the buffer to what the sources need and returns stage's plan; a stage of the
    same sources after it copies into that very buffer (a captured copy keeps the address it saw),
    and a smaller layout later reuses it; only a larger one makes a new buffer."""
    launches = []

    def launch(src, dst, blocks, word_src, word_dst, warm=False):
        assert not warm
        launches.append((src.address, blocks, dst.data_ptr()))

    block, page = sm.STAGE_WORDS * 8, mmap.PAGESIZE
    reg = (0x7F00_0000_0000, 4 * page)
    small = [(DevicePointer(reg[0] + 8, torch.int64), 56, reg)]
    large = [(DevicePointer(reg[0] + 8, torch.int64), 56, reg),
             (DevicePointer(reg[0] + 3 * block, torch.int32), 900, reg)]
    staging = sm.Staging("cpu", launch=launch)
    plan = staging.reserve(large)
    assert plan == {reg: (reg[0], 4, 0)} and staging.buf.numel() * 8 == 4 * block
    before = staging.buf.data_ptr()
    staging.stage(DevicePointer(0x1000, torch.int64), large)
    staging.stage(DevicePointer(0x1000, torch.int64), small)
    assert staging.buf.data_ptr() == before and [d for _, _, d in launches] == [before, before]
    staging.reserve(large + [(DevicePointer(reg[0] + 3 * page, torch.int64), 8, reg)])
    assert staging.buf.data_ptr() != before and staging.buf.numel() * 8 == -(-(3 * page + 8) // block) * block


def test_a_table_of_more_than_2_31_slots_is_not_refused(device):
    """width * page_size past 2^31 (a table padded to 2^20 columns of 2048-token pages; here 2^15 + 1 of
    65536, for the interpreter's sake): the host's check and the reference take the valid request, and
    so must the program. Computed in the kernel's int32 arguments, the product wrapped negative and every
    request came back INVALID."""
    page, R = 1 << 16, 1
    width = (1 << 31) // page + 1
    L = np.array([40], np.int32)
    T = np.zeros((R, width), np.int32)
    T[0, 0] = 3
    P = (L[:, None].astype(np.int64) - Q + np.arange(Q)).reshape(-1)
    S = T[0, P // page].astype(np.int64) * page + P % page
    ww, word, pages = window_width(page, WINDOW), gpu_word(3, 1), 8
    want = sm.step_meta_reference(word, word, P, L, T, S, page, WINDOW, pages, ww)
    assert (want[5] == sm.FLAG_RAN).all()
    dev = torch.device(device)
    src = [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (P, L, T, S)]
    out = tuple(torch.full((R * Q,), 99, dtype=torch.int64, device=dev) for _ in range(3)) + (
        torch.full((R,), 99, dtype=torch.int32, device=dev), torch.full((R, ww), 99, dtype=torch.int32, device=dev))
    flag = torch.zeros(R, dtype=torch.int32, device=dev)
    expect = torch.tensor([sm.signed64(word)], device=dev)
    sm.step_meta(expect.clone(), expect, src, out, flag, num_reqs=R, width=width, page_size=page, window=WINDOW,
                 num_pages=pages)
    _check(tuple(t.cpu().numpy() for t in out) + (flag.cpu().numpy(),), want)


def _program(device, P, L, T, S, page, window, pages, word=gpu_word(5, 1)):
    """The program's outputs (positions, rel, slots, lens, tables, flags) for this step, rung."""
    R, ww, dev = L.shape[0], window_width(page, window), torch.device(device)
    src = [torch.from_numpy(np.ascontiguousarray(a)).to(dev) for a in (P, L, T, S)]
    out = tuple(torch.full((R * Q,), 99, dtype=torch.int64, device=dev) for _ in range(3)) + (
        torch.full((R,), 99, dtype=torch.int32, device=dev), torch.full((R, ww), 99, dtype=torch.int32, device=dev))
    flag = torch.zeros(R, dtype=torch.int32, device=dev)
    expect = torch.tensor([sm.signed64(word)], device=dev)
    sm.step_meta(expect.clone(), expect, src, out, flag, num_reqs=R, width=T.shape[1], page_size=page, window=window,
                 num_pages=pages)
    return tuple(t.cpu().numpy() for t in out) + (flag.cpu().numpy(),)


@pytest.mark.parametrize("seed", range(3))
def test_random_steps_give_the_references_outputs(device, seed):
    """Random steps, valid and faulty (page sizes 1-16, requests sharing slots, lengths filling or passing the
    table, pages outside the cache, slots -1): the program's every output equals its spec's, which runs exactly
    what the host's checks pass (tests/server/test_validate_indices.py)."""
    from helpers.step_cases import random_step

    rng = np.random.default_rng(100 + seed)
    for _ in range(12):
        P, L, T, S, page, window, pages = random_step(rng)
        want = sm.step_meta_reference(gpu_word(5, 1), gpu_word(5, 1), P, L, T, S, page, window, pages,
                                      window_width(page, window))
        case = f"L={L.tolist()} page={page} pages={pages} T={T.tolist()} P={P.tolist()} S={S.tolist()}"
        for g, w, name in zip(_program(device, P, L, T, S, page, window, pages), want,
                              ("positions", "rel", "slots", "lens", "tables", "flag")):
            np.testing.assert_array_equal(g, w, err_msg=f"{name}: {case}")


def _one_request(L: int, T: np.ndarray, page: int):
    P = np.arange(L - Q, L, dtype=np.int64)
    return P, np.array([L], np.int32), T, T[0, P // page].astype(np.int64) * page + P % page


@pytest.mark.parametrize("table,pages,ran", [
    ([[2**31 - 1, 5]], 2**31, True),  # the largest int32 page id, one below the cache's end
    ([[2**31 - 1, 5]], 2**31 - 1, False),  # ... at it
    ([[2**31 - 1, 5]], 2**40, True),  # a cache of more pages than an int32 counts (a 64-bit argument)
    ([[-1, 5]], 2**40, False),  # a negative page id, whatever the cache's size
    ([[-(2**31), 5]], 2**40, False),
    ([[1, 2]], 1, False),  # one page: the argument Triton specializes as the constant 1
], ids=["last-page-id", "page-id-at-the-end", "pages-past-2^31", "negative-page", "int32-min-page", "one-page"])
def test_page_ids_at_the_int32_edges_are_checked_as_the_host_checks(device, table, pages, ran):
    P, L, T, S = _one_request(10, np.array(table, np.int32), PAGE)
    want = sm.step_meta_reference(gpu_word(5, 1), gpu_word(5, 1), P, L, T, S, PAGE, WINDOW, pages,
                                  window_width(PAGE, WINDOW))
    assert want[5].tolist() == [sm.FLAG_RAN if ran else sm.FLAG_INVALID]
    _check(_program(device, P, L, T, S, PAGE, WINDOW, pages), want)


@pytest.mark.parametrize("row,value", [(0, -(2**63)), (6, 2**63 - 1)], ids=["int64-min", "int64-max"])
@pytest.mark.parametrize("field", ["positions", "slots"])
def test_positions_and_slots_at_the_int64_edges_are_refused(device, field, row, value):
    """A row at an extreme int64 (its column clamped into the table, // and % as C's): INVALID, no-op rows."""
    P, L, T, S = _one_request(10, np.array([[1, 2]], np.int32), PAGE)
    (P if field == "positions" else S)[row] = value
    want = sm.step_meta_reference(gpu_word(5, 1), gpu_word(5, 1), P, L, T, S, PAGE, WINDOW, 4,
                                  window_width(PAGE, WINDOW))
    assert want[5].tolist() == [sm.FLAG_INVALID] and (want[2] == -1).all()
    _check(_program(device, P, L, T, S, PAGE, WINDOW, 4), want)


def test_page_size_one_checks_every_position_s_own_page(device):
    """page_size 1 (the argument Triton specializes as the constant 1): each row its own page; two rows of one
    request on one page (a table naming it twice) share a slot and are refused."""
    T = np.arange(12, dtype=np.int32)[None].copy()
    P, L, T, S = _one_request(12, T, 1)
    word = gpu_word(5, 1)
    assert sm.step_meta_reference(word, word, P, L, T, S, 1, 1, 12, window_width(1, 1))[5].tolist() == [sm.FLAG_RAN]
    _check(_program(device, P, L, T, S, 1, 1, 12), sm.step_meta_reference(word, word, P, L, T, S, 1, 1, 12,
                                                                        window_width(1, 1)))
    T[0, 11] = T[0, 10]
    P, L, T, S = _one_request(12, T, 1)
    want = sm.step_meta_reference(word, word, P, L, T, S, 1, 1, 12, window_width(1, 1))
    assert want[5].tolist() == [sm.FLAG_INVALID]
    _check(_program(device, P, L, T, S, 1, 1, 12), want)


def test_signed64_keeps_every_word_s_64_bits():
    """Every uint64 word, the edges and random ones: an int64 with the same bits (what Triton passes)."""
    rng = np.random.default_rng(0)
    words = [0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1]
    words += [int(w) for w in rng.integers(0, 2**64 - 1, 200, dtype=np.uint64, endpoint=True)]
    for w in words:
        s = sm.signed64(w)
        assert -(2**63) <= s < 2**63 and s % 2**64 == w, hex(w)


@pytest.mark.parametrize("seed", range(3))
def test_staging_views_hold_each_source_s_bytes(seed):
    """Random sources in up to three page-aligned registrations of fake device memory, copied as the launches
    ask (whole blocks, from each launch's start): every view stage returns holds exactly its source's bytes,
    every launch reads whole blocks inside its registration, and nothing is copied twice."""
    rng = np.random.default_rng(seed)
    page, block = mmap.PAGESIZE, sm.STAGE_WORDS * 8
    regs = [(0x7F00_0000_0000 + i * (1 << 24), int(rng.integers(1, 4)) * page) for i in range(int(rng.integers(1, 4)))]
    memory = {base: rng.integers(0, 256, size, dtype=np.uint8) for base, size in regs}
    copied = []

    def launch(src, dst, blocks, word_src, word_dst, warm=False):
        base, size = next(r for r in regs if r[0] <= src.address < r[0] + r[1])
        lo = src.address - base
        assert lo % block == 0 and lo + blocks * block <= size and not warm
        dst.view(torch.uint8)[: blocks * block] = torch.from_numpy(memory[base][lo : lo + blocks * block].copy())
        copied.append((base, lo, blocks))

    sources = []
    for _ in range(int(rng.integers(1, 8))):
        base, size = regs[int(rng.integers(0, len(regs)))]
        dt = [torch.int32, torch.int64][int(rng.integers(0, 2))]
        nbytes = int(rng.integers(1, 64)) * dt.itemsize
        off = int(rng.integers(0, (size - nbytes) // dt.itemsize + 1)) * dt.itemsize
        sources.append((DevicePointer(base + off, dt), nbytes, (base, size)))
    staging = sm.Staging("cpu", launch=launch)
    word, src = staging.stage(DevicePointer(0x1000, torch.int64), sources)
    assert len(copied) == len({region for _, _, region in sources})
    for (ptr, nbytes, (base, _)), view in zip(sources, src):
        lo = ptr.address - base
        assert view.dtype == ptr.dtype and view.numel() * view.element_size() == nbytes
        np.testing.assert_array_equal(view.view(torch.uint8).numpy(), memory[base][lo : lo + nbytes])
    assert staging.buf.numel() * 8 == sum(blocks for _, _, blocks in copied) * block
