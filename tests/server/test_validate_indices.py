"""The step's index checks: the one-pass NumPy check and the field-by-field diagnosis must agree.

validate_step runs the fast check on every step and only calls the diagnosis when it fails; a
case the fast check refuses but the diagnosis lets through would run a bad step, and one it
passes but should refuse would write K/V outside the request's pages. Each case below is one
way an engine can get the metadata wrong (plus garbage where the kernels never look).

A pre-launched step is checked on the GPU instead (kernels/triton/step_meta.py) and, if every
request passed there, not again on the host (server/rank.py): the program's spec must refuse
exactly what the fast check refuses, on every case here.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

# step_meta.py (the GPU program's NumPy spec, which every case here checks against) imports triton, the
# optional `triton` extra: without it this file failed at collection, and stopped the README's whole run.
pytest.importorskip("triton")

from dspark_sidecar.drafter.kv_cache import StepMetadata, window_width  # noqa: E402
from dspark_sidecar.kernels.triton.step_meta import FLAG_INVALID, FLAG_RAN, step_meta_reference  # noqa: E402
from dspark_sidecar.server.errors import SidecarError  # noqa: E402
from dspark_sidecar.server.validate import _diagnose, _indices_ok, host_meta  # noqa: E402

PS, PAGES = 16, 64
LENS = [7, 40, 100]  # a request with no context, one mid-page, one over several pages
WINDOW = 32  # the GPU program's window: the last request uses pages before it (columns 0-2)


def _valid(pad: int = -123456):
    """Requests with distinct shuffled pages, rows at L-7 .. L-1, slots through the tables; the
    tables are one page wider than the longest request, the spare entries `pad`: garbage, or a page
    id as vLLM pads (the fast check's shortcut: every entry a page of the cache)."""
    gen = torch.Generator().manual_seed(0)
    width = -(-max(LENS) // PS) + 1
    perm = torch.randperm(PAGES, generator=gen)
    tables = torch.full((len(LENS), width), pad, dtype=torch.int32)  # unused entries: never read
    pos, slots, used = [], [], 0
    for i, L in enumerate(LENS):
        need = -(-L // PS)
        tables[i, :need] = perm[used : used + need].to(torch.int32)
        used += need
        p = torch.arange(L - 7, L)
        pos.append(p)
        slots.append(tables[i, p // PS].to(torch.int64) * PS + p % PS)
    return torch.cat(pos), StepMetadata(torch.tensor(LENS, dtype=torch.int32), tables, torch.cat(slots))


def _check(positions, meta):
    """(fast check's verdict, the field the diagnosis names or None); the GPU program's spec must agree with
    it and the distinct-slots check (it runs both)."""
    h = host_meta(positions, meta)
    ok = _indices_ok(h, PS, PAGES)
    distinct = np.unique(h.slots).size == h.slots.size
    flags = _gpu_flags(positions, meta)
    assert bool((flags == FLAG_RAN).all()) is (ok and distinct), f"GPU flags {flags.tolist()}, host check {ok}"
    try:
        _diagnose(h, PS, PAGES)
    except SidecarError as err:
        return ok, err.field
    return ok, None


def _gpu_flags(positions, meta) -> np.ndarray:
    """The pre-launched step's program's flags [R] for this metadata (its NumPy spec), rung."""
    word = 5 << 32 | 3  # rung: only the checks decide the flags
    return step_meta_reference(word, word, positions.numpy(), meta.seq_lens.numpy(), meta.block_tables.numpy(),
                               meta.slot_mapping.numpy(), PS, WINDOW, PAGES, window_width(PS, WINDOW))[5]


@pytest.mark.parametrize("pad", [-123456, 0], ids=["garbage-padded", "zero-padded"])
def test_valid_metadata_passes_both(pad):
    assert _check(*_valid(pad)) == (True, None)


def _shifted_positions(pos, meta):
    pos[9] += 1


def _short_seq_len(pos, meta):  # below the 7 rows of the block
    meta.seq_lens[0] = 6


def _short_seq_len_rows_consistent(pos, meta):  # 6: the rows at -1 .. 5, where positions and slots agree
    # Only the seq_lens bound refuses this one: the rows are where seq_lens puts them, and the slot of
    # position -1 is the one a wrapped table lookup (the last entry of the flattened table) gives.
    meta.seq_lens[0] = 6
    pos[:7] = torch.arange(-1, 6)
    p = pos[1:7]
    meta.slot_mapping[1:7] = meta.block_tables[0, p // PS].to(torch.int64) * PS + p % PS
    meta.slot_mapping[0] = int(meta.block_tables.reshape(-1)[-1]) * PS + (-1) % PS


def _seq_len_past_table(pos, meta):  # needs more pages than the row has
    meta.seq_lens[2] = meta.block_tables.shape[1] * PS + 1
    pos[14:] = torch.arange(int(meta.seq_lens[2]) - 7, int(meta.seq_lens[2]))


def _page_past_cache(pos, meta):
    meta.block_tables[1, 0] = PAGES


def _negative_page(pos, meta):
    meta.block_tables[2, 3] = -1


def _page_before_window(pos, meta):  # used by the request, never read by its window
    meta.block_tables[2, 0] = PAGES


def _slot_elsewhere(pos, meta):  # inside the cache, but not where the table puts the row
    meta.slot_mapping[4] = (int(meta.slot_mapping[4]) + PS) % (PAGES * PS)


def _slot_past_cache(pos, meta):
    meta.slot_mapping[20] = PAGES * PS


def _slot_off_its_offset(pos, meta):  # the right page, another offset in it (no other row's slot)
    # Request 0 (L = 7) fills offsets 0..6 of its page: a check of the page alone let its K/V land at
    # offset 10, where its attention (reading by position) never looks.
    meta.slot_mapping[4] = int(meta.block_tables[0, 0]) * PS + 10


@pytest.mark.parametrize("corrupt,field", [
    (_shifted_positions, "positions"), (_short_seq_len, "seq_lens"), (_short_seq_len_rows_consistent, "seq_lens"),
    (_seq_len_past_table, "block_tables"),
    (_page_past_cache, "block_tables"), (_negative_page, "block_tables"), (_page_before_window, "block_tables"),
    (_slot_elsewhere, "slot_mapping"), (_slot_off_its_offset, "slot_mapping"),
    (_slot_past_cache, "slot_mapping"),
], ids=lambda x: getattr(x, "__name__", x))
@pytest.mark.parametrize("pad", [-123456, 0], ids=["garbage-padded", "zero-padded"])
def test_each_corruption_fails_the_fast_check_and_is_named(corrupt, field, pad):
    pos, meta = _valid(pad)
    corrupt(pos, meta)
    assert _check(pos, meta) == (False, field)


# sidecar.proto (StepError.code): a page or slot outside the bound cache is OUT_OF_RANGE; any other fault of the
# metadata (rows, lengths and slots that disagree) is INVALID_ARGUMENT.
_OUTSIDE_THE_CACHE = (_page_past_cache, _negative_page, _page_before_window, _slot_past_cache)


@pytest.mark.parametrize("corrupt", [
    _shifted_positions, _short_seq_len, _seq_len_past_table, _page_past_cache, _negative_page, _page_before_window,
    _slot_elsewhere, _slot_off_its_offset, _slot_past_cache], ids=lambda x: x.__name__)
def test_an_index_outside_the_cache_is_out_of_range_and_any_other_fault_invalid(corrupt):
    pos, meta = _valid()
    corrupt(pos, meta)
    with pytest.raises(SidecarError) as err:
        _diagnose(host_meta(pos, meta), PS, PAGES)
    want = grpc.StatusCode.OUT_OF_RANGE if corrupt in _OUTSIDE_THE_CACHE else grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.code == want, err.value.message


def test_a_sequence_that_fills_its_table_row_to_the_last_slot_passes():
    """seq_len = width x page_size: its last row sits in the row's last page, at its last offset; a table
    exactly as wide as the pages a request uses is what an engine sizing it per step sends."""
    L = 2 * PS
    tables = torch.tensor([[5, 9]], dtype=torch.int32)
    pos = torch.arange(L - 7, L)
    slots = tables[0, pos // PS].to(torch.int64) * PS + pos % PS
    assert _check(pos, StepMetadata(torch.tensor([L], dtype=torch.int32), tables, slots)) == (True, None)


def test_host_views_alias_the_tensors():
    """A layout's views are built once (validate.py caches them) and must see each step's values."""
    pos, meta = _valid()
    h = host_meta(pos, meta)
    pos[0] = 999
    meta.block_tables[0, 0] = 5
    assert h.positions[0, 0] == 999 and h.tables[0, 0] == 5


def test_a_sequence_length_near_2_31_still_checks_every_page_it_uses():
    """L + page_size - 1 in int32 wrapped negative, so a row checked none of its pages: a table entry
    far past the cache, with the slot that matches it, passed the host check (on a GPU the K/V write
    would have landed outside the cache)."""
    import numpy as np

    ps, pages, width = 1 << 20, 2, 2048
    L = np.array([2**31 - 1], dtype=np.int32)
    tab = np.zeros((1, width), dtype=np.int32)
    tab[0, -1] = 1000  # the page of the block's rows, far past the 2-page cache
    P = L.astype(np.int64)[:, None] + np.arange(7) - 7
    S = tab[0, P // ps].astype(np.int64) * ps + P % ps
    h = host_meta(torch.from_numpy(P.reshape(-1)), StepMetadata(torch.from_numpy(L), torch.from_numpy(tab),
                                                                 torch.from_numpy(S.reshape(-1))))
    assert not _indices_ok(h, ps, pages)
    with pytest.raises(SidecarError, match="block_tables\\[0\\]\\[2047\\] = 1000 outside"):
        _diagnose(h, ps, pages)


@pytest.mark.parametrize("pages", [2**32, 2**32 + 5, 2**40])
def test_a_negative_page_id_is_refused_however_many_pages_the_cache_has(pages):
    """The fast check reads the table as uint32 (a negative id is huge); num_pages is a uint64, and from
    2^32 pages on every uint32 was below it: -1 with its matching (negative) slots passed the host check,
    which the diagnosis and the GPU program refuse, and the step's K/V write landed before the cache."""
    pos = torch.arange(7, dtype=torch.int64)
    tab = torch.full((1, 1), -1, dtype=torch.int32)
    h = host_meta(pos, StepMetadata(torch.tensor([7], dtype=torch.int32), tab, -PS + pos % PS))
    assert not _indices_ok(h, PS, pages)
    with pytest.raises(SidecarError, match="block_tables\\[0\\]\\[0\\] = -1 outside"):
        _diagnose(h, PS, pages)


def test_wide_padded_tables_leave_no_table_sized_memory_behind():
    """The fast check's column grid was cached per (R, width), up to 64 widths: a step whose table is
    padded to a million columns (4 MiB inline, valid) left an 8 MiB int64 arange behind for good, so
    steps of 64 different wide tables (up to the 256 MiB message limit each) held gigabytes."""
    import gc
    import tracemalloc

    L = 40
    p = torch.arange(L - 7, L)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(16):
            tab = torch.zeros((1, (1 << 20) + i), dtype=torch.int32)  # pages 0..2, then zero padding
            slots = tab[0, p // PS].to(torch.int64) * PS + p % PS
            assert _indices_ok(host_meta(p, StepMetadata(torch.tensor([L], dtype=torch.int32), tab, slots)), PS, PAGES)
            del tab, slots
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert retained < 4 << 20, f"{retained / 2**20:.0f} MiB retained after 16 steps"


def _shared_page_request():
    """_valid()'s step with request 1's block rows (positions 33..39, offsets 1..7) moved into request
    0's page (its rows at offsets 0..6): tables, positions and slots agree, and six slots are each
    named by two rows, one of each request."""
    from dspark_sidecar.proto import codec
    from dspark_sidecar.proto import sidecar_pb2 as pb

    pos, meta = _valid()
    meta.block_tables[1, 2] = meta.block_tables[0, 0]
    p = pos[7:14]
    meta.slot_mapping[7:14] = meta.block_tables[1, p // PS].to(torch.int64) * PS + p % PS
    req = pb.DraftStepRequest(
        step_id=1, num_requests=len(LENS), binding_id=3, binding_generation=1,
        positions=codec.to_tensor_ref(pos), input_ids=codec.to_tensor_ref(torch.zeros(7 * len(LENS), dtype=torch.int64)),
        seq_lens=codec.to_tensor_ref(meta.seq_lens), block_tables=codec.to_tensor_ref(meta.block_tables),
        slot_mapping=codec.to_tensor_ref(meta.slot_mapping))
    return pos, meta, req


@pytest.mark.parametrize("indices", [True, False], ids=["host index checks", "pre-launched (GPU index checks)"])
def test_two_rows_naming_one_slot_are_refused_naming_both_and_the_slot(indices):
    """Two rows of a step writing one cache slot: which row's K/V the cache then holds depends on the
    order the writes land in (they run in parallel), and the other request's attention reads it. The
    index checks pass such a step (each slot is its position's place in its own table row); it was
    served. Now INVALID_ARGUMENT on slot_mapping naming both rows and the slot, on every path; a
    pre-launched step's GPU program makes both requests no-ops (kernels/triton/step_meta.py)."""
    from types import SimpleNamespace

    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.proto import codec
    from dspark_sidecar.server.validate import validate_step

    pos, meta, req = _shared_page_request()
    assert _check(pos, meta) == (True, None)  # the index checks pass it
    assert _gpu_flags(pos, meta).tolist() == [FLAG_INVALID, FLAG_INVALID, FLAG_RAN]
    kv = SimpleNamespace(page_size=PS, num_pages=PAGES)
    mem = SimpleNamespace(check=lambda binding_id, generation: kv, layouts={}, resolve=None)
    slot = int(meta.block_tables[0, 0]) * PS + 1
    with pytest.raises(SidecarError) as err:
        validate_step(req, load_config("tiny"), mem, 8, indices=indices)
    assert err.value.code.name == "INVALID_ARGUMENT" and err.value.field == "slot_mapping"
    assert err.value.message.startswith(f"slot_mapping: rows 1 and 7 (requests 0 and 1) both write slot {slot}")
    # Distinct slots again (request 1 back in its own page): served.
    pos, meta = _valid()
    req.slot_mapping.CopyFrom(codec.to_tensor_ref(meta.slot_mapping))
    req.block_tables.CopyFrom(codec.to_tensor_ref(meta.block_tables))
    assert validate_step(req, load_config("tiny"), mem, 8, indices=indices).num_reqs == len(LENS)


@pytest.mark.parametrize("R", [1, 16, 17, 256], ids=lambda r: f"R={r}")
def test_distinct_slots_check_finds_a_repeat_at_every_step_size(R):
    """Both ways of finding a repeat (a set up to 16 requests, a sort past them) refuse the same steps:
    each request's rows in a page of their own are served; one slot written twice, anywhere, is not."""
    import numpy as np

    from dspark_sidecar.server.validate import HostMeta, check_distinct_slots

    slots = (np.arange(R, dtype=np.int64)[:, None] * PS + np.arange(7)).copy()
    h = HostMeta(np.zeros((R, 7), np.int64), np.zeros(R, np.int32), np.zeros((R, 1), np.int32), slots)
    check_distinct_slots(h)
    slots[R - 1, 6] = slots[R // 2, 3]  # the last row writes a slot a row before it writes too
    a = R // 2 * 7 + 3
    with pytest.raises(SidecarError, match=rf"^slot_mapping: rows {a} and {7 * R - 1} \(requests {R // 2} and "
                                           rf"{R - 1}\) both write slot {int(slots[R // 2, 3])}: "):
        check_distinct_slots(h)


@pytest.mark.parametrize("pad", [-1, PAGES], ids=["padded with -1", "padded past the cache"])
def test_a_sequence_ending_on_a_page_boundary_is_not_held_to_the_padding_after_its_pages(pad):
    """seq_len = 2 x page_size uses exactly 2 pages: the column after them is padding the request never reads
    (an engine pads with -1 or any garbage). Counting one page too many there checked that padding as a page,
    and the fast check refused a valid step that the diagnosis then could not name."""
    L = 2 * PS
    tables = torch.tensor([[5, 9, pad, pad]], dtype=torch.int32)
    pos = torch.arange(L - 7, L)
    slots = tables[0, pos // PS].to(torch.int64) * PS + pos % PS
    assert _check(pos, StepMetadata(torch.tensor([L], dtype=torch.int32), tables, slots)) == (True, None)


def _host_passes(P, L, tables, S, ps, pages) -> bool:
    """validate.check_indices and check_distinct_slots both let the step through."""
    from types import SimpleNamespace

    from dspark_sidecar.server.validate import HostMeta, check_distinct_slots, check_indices

    h = HostMeta(P.reshape(-1, 7), L, tables, S.reshape(-1, 7))
    try:
        check_indices(SimpleNamespace(host=h, kv=SimpleNamespace(page_size=ps, num_pages=pages)))
        check_distinct_slots(h)
    except SidecarError:
        return False
    return True


@pytest.mark.parametrize("seed", range(4))
def test_the_gpu_programs_spec_runs_exactly_the_requests_the_host_checks_pass(seed):
    """Random steps, valid and faulty: the program's spec (step_meta_reference) marks request r RAN exactly when r
    alone passes the host's index checks and no other row of the step names one of its slots; so every request
    RAN exactly when the whole step passes check_indices and check_distinct_slots, which the rank loop then skips
    (server/rank.py). A RAN request gets graphs.py's metadata (window_metadata_into), a refused one the no-op rows."""
    from dspark_sidecar.drafter.kv_cache import window_metadata_into
    from helpers.step_cases import random_step

    rng = np.random.default_rng(seed)
    word = 9 << 32 | 2
    for _ in range(250):
        P, L, tables, S, ps, window, pages = random_step(rng)
        R, ww = L.shape[0], window_width(ps, window)
        pos, rel, slots, lens, tab, flags = step_meta_reference(word, word, P, L, tables, S, ps, window, pages, ww)
        case = f"L={L.tolist()} ps={ps} pages={pages} tables={tables.tolist()} P={P.tolist()} S={S.tolist()}"
        assert bool((flags == FLAG_RAN).all()) is _host_passes(P, L, tables, S, ps, pages), case
        rows = S.reshape(R, 7)
        want_rel, want_lens, want_tab = np.zeros((R, 7), np.int64), np.zeros(R, np.int32), np.zeros((R, ww), np.int32)
        window_metadata_into(P, np.clip(L, 0, None), tables, ps, window, want_rel, want_lens, want_tab)
        for r in range(R):
            alone = _host_passes(P.reshape(R, 7)[r], L[r : r + 1], tables[r : r + 1], rows[r], ps, pages)
            shared = bool(np.isin(rows[r], np.delete(rows, r, axis=0)).any())
            assert bool(flags[r] == FLAG_RAN) is (alone and not shared), f"request {r}: {case}"
            got = (pos.reshape(R, 7)[r], rel.reshape(R, 7)[r], slots.reshape(R, 7)[r], lens[r], tab[r])
            if flags[r] == FLAG_RAN:
                want = (P.reshape(R, 7)[r], want_rel[r], rows[r], want_lens[r], want_tab[r])
            else:
                assert flags[r] == FLAG_INVALID
                want = (np.arange(7), np.arange(7), np.full(7, -1), 7, np.zeros(ww))
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w, err_msg=f"request {r}: {case}")
