"""The synthetic steps (drafter/scenario.py) the bench, `step`, the warm-up and the tests build: their pages, rows
and slots pinned by hand. The model tests compare one scenario with itself (shuffled pages, split launches), so a
step laid out wrong on both sides (an anchor in the wrong row, P one off) passed them all."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter import scenario

Q = layout.QPR


def test_pages_needed_at_zero_exact_multiples_and_one_past():
    assert [scenario.pages_needed(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert scenario.pages_needed(7, 1) == 7 and scenario.pages_needed(7, 7) == 1


def test_block_tables_give_each_request_its_own_pages_and_refuse_a_cache_too_small():
    """An exact fit is used to the last page; one page short is named (not a shape error in the table's copy)."""
    lens = [16, 17, 1]  # 1 + 2 + 1 pages
    for gen in (None, torch.Generator().manual_seed(5)):
        t = scenario.allocate_block_tables(lens, 16, 4, gen)
        assert t.dtype == torch.int32 and t.shape == (3, 2)
        owned = [t[0, :1], t[1, :2], t[2, :1]]
        assert sorted(torch.cat(owned).tolist()) == [0, 1, 2, 3]  # no page shared between two requests
        assert t[0, 1] == 0 and t[2, 1] == 0  # unused entries 0, as vLLM pads
    with pytest.raises(ValueError, match="^4 pages needed, cache has 3$"):
        scenario.allocate_block_tables(lens, 16, 3)


@pytest.mark.parametrize("contexts", [[0], [10], [16, 0, 25]], ids=["context 0", "across a page", "three"])
def test_a_step_s_rows_are_anchor_then_noise_at_p_to_p_plus_6_in_the_request_s_pages(tiny_cfg, contexts):
    """P = the context length: seq_len P + 7, positions P..P+6, ids [anchor, N x 6], embeddings of those ids,
    slots through the request's own block-table row (context 10: rows 10..15 on the first page, 16 on the second)."""
    embed = torch.randn(tiny_cfg.vocab_size, 4, generator=torch.Generator().manual_seed(0))
    step = scenario.random_step(tiny_cfg, contexts, 16, 12, embed, seed=2)
    meta = step.meta
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == [c + Q for c in contexts]
    ids = step.input_ids.view(-1, Q)
    assert (ids[:, 1:] == tiny_cfg.noise_token_id).all() and not (ids[:, 0] == tiny_cfg.noise_token_id).any()
    assert torch.equal(step.inputs_embeds, embed[step.input_ids])
    for i, c in enumerate(contexts):
        rows = step.positions[i * Q : (i + 1) * Q].tolist()
        assert rows == list(range(c, c + Q))
        table = meta.block_tables[i].tolist()
        want = [table[p // 16] * 16 + p % 16 for p in rows]
        assert meta.slot_mapping[i * Q : (i + 1) * Q].tolist() == want
    if contexts == [10]:
        page0, page1 = meta.block_tables[0].tolist()
        assert meta.slot_mapping.tolist() == [page0 * 16 + o for o in range(10, 16)] + [page1 * 16]
    pos, slots = scenario.context_rows(meta, 16)  # the committed rows 0..P-1 of each request, in order
    assert pos.tolist() == [p for c in contexts for p in range(c)]
    assert slots.tolist() == [int(meta.block_tables[i, p // 16]) * 16 + p % 16
                              for i, c in enumerate(contexts) for p in range(c)]
    assert not set(slots.tolist()) & set(meta.slot_mapping.tolist())  # block rows never over the context


def test_the_same_seed_gives_the_same_step_and_another_seed_other_anchors_and_pages(tiny_cfg):
    embed = torch.zeros(tiny_cfg.vocab_size, 2)
    a, b = (scenario.random_step(tiny_cfg, [40, 3, 70], 16, 64, embed, seed=7) for _ in range(2))
    c = scenario.random_step(tiny_cfg, [40, 3, 70], 16, 64, embed, seed=8)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.meta.block_tables, b.meta.block_tables)
    assert not torch.equal(a.input_ids, c.input_ids) and not torch.equal(a.meta.block_tables, c.meta.block_tables)


def test_random_taps_are_seeded_and_of_order_one(tiny_cfg):
    """Stand-ins for real activations: zeros (or a constant) would commit a context that every attention reads
    alike, and a wrong row would hide in it."""
    t = scenario.random_taps(tiny_cfg, 64, seed=1, dtype=torch.float32)
    assert t.shape == (64, tiny_cfg.tap_size) and 0.9 < float(t.std()) < 1.1 and abs(float(t.mean())) < 0.05
    assert torch.equal(t, scenario.random_taps(tiny_cfg, 64, seed=1, dtype=torch.float32))
    assert not torch.equal(t, scenario.random_taps(tiny_cfg, 64, seed=2, dtype=torch.float32))


def test_rel_l2_by_hand():
    """||got - want|| / ||want||, also for a reference of small norm (K/V rows, hidden states after a norm)."""
    want = torch.tensor([0.03, 0.04])  # norm 0.05
    assert scenario.rel_l2(want + torch.tensor([0.0, 0.005]), want) == pytest.approx(0.1)
    assert scenario.rel_l2(want.to(torch.bfloat16), want.to(torch.bfloat16)) == 0.0
    assert scenario.rel_l2(torch.zeros(3), torch.zeros(3)) == 0.0  # both zero: equal, not 0/0
    assert math.isnan(scenario.rel_l2(torch.tensor([float("nan"), 0.0]), want))  # judged as a failure, not dropped
