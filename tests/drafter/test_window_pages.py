"""Window-relative block tables, key by key: each key a row sees keeps its slot through the window table."""

# test_paged_layout.py compares whole draft steps over a few lengths at page size 16 and the 4096 window.
# Here the addressing alone is brute-forced over page sizes 1..16, small windows and every length from
# one block (P = 0) to several windows: the window's first page column where the window's left edge sits
# on, just before and just after a page edge, and a table width that must hold the longest reach.

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter.kv_cache import (
    StepMetadata, block_slots, window_metadata, window_metadata_into, window_width,
)

Q = layout.QPR


def _table(lens: list[int], page: int, extra: int, seed: int) -> np.ndarray:
    """Distinct shuffled pages for each request's ceil(L / page) columns, plus `extra` unused columns (0)."""
    need = [-(-L // page) for L in lens]
    cols = max(need) + extra
    ids = np.random.default_rng(seed).permutation(sum(need)).astype(np.int32)
    table, at = np.zeros((len(lens), cols), np.int32), 0
    for i, k in enumerate(need):
        table[i, :k], at = ids[at : at + k], at + k
    return table


def _window(lens: list[int], page: int, window: int, table: np.ndarray):
    R = len(lens)
    L = np.array(lens, np.int32)
    P = L[:, None].astype(np.int64) - Q + np.arange(Q)
    w = window_width(page, window)
    rel, wl, wt = np.full(Q * R, -9, np.int64), np.full(R, -9, np.int32), np.full((R, w), -9, np.int32)
    window_metadata_into(P, L, table, page, window, rel, wl, wt)
    return P, rel.reshape(R, Q), wl, wt


@pytest.mark.parametrize("page", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_every_visible_key_keeps_its_slot_through_the_window_table(page, window):
    span = window + Q - 1
    lens = list(range(Q, 3 * span + 3 * page + Q))  # P = 0 (exactly 7 tokens) up to several windows
    table = _table(lens, page, extra=2, seed=page * 100 + window)
    P, rel, wl, wt = _window(lens, page, window, table)
    w = wt.shape[1]
    reach = 0  # the most window-table columns any request needs
    for i, L in enumerate(lens):
        off = P[i, 0] - rel[i, 0]
        assert off >= 0 and off % page == 0, (L, off)
        assert (P[i] - rel[i] == off).all() and wl[i] == L - off  # shifted by the same whole pages
        first = max(0, int(P[i, 0]) - (window - 1))  # the leftmost key any of its rows sees
        assert off <= first, (L, off, first)  # no visible key is cut off on the left
        keys = np.arange(first, L)
        full = table[i, keys // page].astype(np.int64) * page + keys % page
        k_rel = keys - off
        assert int(k_rel.max()) // page < w, (L, w)  # the rightmost key's page is a column of the table
        windowed = wt[i, k_rel // page].astype(np.int64) * page + k_rel % page
        np.testing.assert_array_equal(windowed, full, err_msg=f"L={L}")
        reach = max(reach, int(k_rel.max()) // page - int(k_rel.min()) // page + 1)
    assert reach <= w <= reach + 1, (reach, w)  # wide enough for the longest reach, one spare column at most


@pytest.mark.parametrize("page", [1, 16])
def test_the_numpy_form_equals_the_torch_form_at_window_edges(page):
    window = 16
    span = window + Q - 1
    lens = [Q, Q + 1, span - 1, span, span + 1, span + page - 1, span + page, span + page + 1, 5 * span + 3]
    table = _table(lens, page, extra=1, seed=7)
    P, rel, wl, wt = _window(lens, page, window, table)
    slots = torch.zeros(Q * len(lens), dtype=torch.int64)
    meta = StepMetadata(torch.tensor(lens, dtype=torch.int32), torch.from_numpy(table), slots)
    t_rel, t_meta = window_metadata(torch.from_numpy(P.reshape(-1)), meta, page, window)
    assert np.array_equal(t_rel.numpy(), rel.reshape(-1))
    assert np.array_equal(t_meta.seq_lens.numpy(), wl) and t_meta.seq_lens.dtype == torch.int32
    assert np.array_equal(t_meta.block_tables.numpy(), wt) and t_meta.block_tables.dtype == torch.int32
    assert t_meta.slot_mapping is slots  # slots stay absolute


def test_slots_of_a_cache_past_two_to_the_31_tokens_are_exact():
    """page * page_size + offset in int64: int32 page ids times the page size pass 2^31 in a large cache."""
    page = 64
    ids = torch.tensor([(1 << 27) + 5, 3], dtype=torch.int32)
    got = block_slots(ids, torch.tensor([0, 63, 64]), page)
    assert got.dtype == torch.int64
    assert got.tolist() == [((1 << 27) + 5) * 64, ((1 << 27) + 5) * 64 + 63, 3 * 64]


def test_a_sequence_near_the_int32_length_limit_gets_a_small_window_table():
    """seq_lens are int32: a length of 2^31 - 1 shifts by a whole number of pages without overflowing, and
    its rows' window-relative positions and length fit the window table."""
    page, window = 1 << 20, 4096
    L = (1 << 31) - 1
    table = np.arange(-(-L // page), dtype=np.int32)[None, :] + 1000
    P, rel, wl, wt = _window([L], page, window, table)
    off = P[0, 0] - rel[0, 0]
    assert off == (L - (window + Q - 1)) // page * page and int(wl[0]) == L - off
    assert wt.shape == (1, 2) and wt[0, 0] == table[0, off // page]
    assert (rel[0] == np.arange(L - Q, L) - off).all() and int(rel.max()) < 2 * page
