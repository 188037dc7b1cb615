"""The paged cache: physical page order is irrelevant, and block K/V land exactly at the given slots."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import CheckpointReader
from dspark_sidecar.drafter.kv_cache import StepMetadata, allocate_kv_cache
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.kernels.ops import REFERENCE_OPS

PAGE = 16
LENS = [3, 4200, 77, 16]


def run(model, cfg, embed, shuffle: bool, poison: float | None = None):
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in LENS) + 5
    step = scenario.random_step(cfg, LENS, PAGE, pages, embed, seed=3, shuffle_pages=shuffle)
    kv = allocate_kv_cache(cfg, 1, pages, PAGE, torch.float32)
    if poison is not None:
        for t in kv:
            t.fill_(poison)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    model.commit_context(scenario.random_taps(cfg, pos.numel(), seed=4), pos, slots, kv)
    before = [t.clone() for t in kv]
    out = model.draft_step(step.inputs_embeds, step.positions, step.meta, kv)
    return out, step, before, kv


def test_shuffled_pages_give_identical_output(tiny_cfg, tiny_ckpt, tiny_embed):
    model = DSparkDrafter(tiny_cfg, ParallelContext(), REFERENCE_OPS, torch.float32).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))
    a, sa, _, _ = run(model, tiny_cfg, tiny_embed, shuffle=False)
    b, sb, _, _ = run(model, tiny_cfg, tiny_embed, shuffle=True)
    assert not torch.equal(sa.meta.block_tables, sb.meta.block_tables)
    assert torch.equal(a, b)


def test_block_kv_written_exactly_at_slots(tiny_cfg, tiny_ckpt, tiny_embed):
    model = DSparkDrafter(tiny_cfg, ParallelContext(), REFERENCE_OPS, torch.float32).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))
    poison = 1234.5
    _, step, before, after = run(model, tiny_cfg, tiny_embed, shuffle=True, poison=poison)
    slots = step.meta.slot_mapping
    assert slots.numel() == layout.QPR * len(LENS)
    for layer, (b, a) in enumerate(zip(before, after)):
        flat_b, flat_a = b.view(2, -1, *b.shape[-2:]), a.view(2, -1, *a.shape[-2:])
        changed = (flat_a != flat_b).any(dim=-1).any(dim=-1).any(dim=0)  # [num_slots]
        assert set(changed.nonzero().flatten().tolist()) == set(slots.tolist()), f"layer {layer}"
        mask = torch.ones(changed.numel(), dtype=torch.bool)
        mask[slots] = False
        assert torch.equal(flat_a[:, mask], flat_b[:, mask])  # every other slot untouched
        assert not (flat_a[:, slots] == poison).any()  # block rows fully written


def test_padding_slots_are_skipped(tiny_cfg, tiny_ckpt):
    model = DSparkDrafter(tiny_cfg, ParallelContext(), REFERENCE_OPS, torch.float32).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))
    kv = allocate_kv_cache(tiny_cfg, 1, 4, PAGE, torch.float32)
    for t in kv:
        t.fill_(-7.0)
    slots = torch.tensor([5, -1, 17, -1])
    model.commit_context(scenario.random_taps(tiny_cfg, 4, seed=1), torch.tensor([0, 1, 2, 3]), slots, kv)
    flat = kv[0].view(2, -1, *kv[0].shape[-2:])
    written = (flat != -7.0).any(-1).any(-1).any(0).nonzero().flatten().tolist()
    assert written == [5, 17]


def test_launch_grouping_r17_three_launches_equal_unsplit(tiny_cfg, tiny_ckpt, tiny_embed, monkeypatch):
    cfg = tiny_cfg
    model = DSparkDrafter(cfg, ParallelContext(), REFERENCE_OPS, torch.float32).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))
    lens = [int(x) for x in torch.randint(1, 200, (17,), generator=torch.Generator().manual_seed(0))]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens)
    step = scenario.random_step(cfg, lens, PAGE, pages, tiny_embed, seed=5)
    kv = allocate_kv_cache(cfg, 1, pages, PAGE, torch.float32)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    model.commit_context(scenario.random_taps(cfg, pos.numel(), seed=6), pos, slots, kv)

    launches: list[int] = []
    forward = model.forward

    def counting(embeds, positions, meta: StepMetadata, caches, attn=None, lane=0, concurrent=1):
        launches.append(meta.num_reqs)
        # In order: every group sums through the step's own exchange, and runs alone on the GPU.
        assert lane == 0 and concurrent == 1
        return forward(embeds, positions, meta, caches, attn, lane=lane, concurrent=concurrent)

    monkeypatch.setattr(model, "forward", counting)
    grouped = model.draft_step(step.inputs_embeds, step.positions, step.meta, kv)
    assert launches == [8, 8, 1]
    launches.clear()
    unsplit = model.draft_step(step.inputs_embeds, step.positions, step.meta, kv, launch_reqs=17)
    assert launches == [17]
    # Row-wise ops and per-request attention: only the matmul's row blocking differs between
    # the two batch sizes, so the results agree to fp32 rounding.
    torch.testing.assert_close(grouped, unsplit, rtol=1e-5, atol=1e-5)


def test_window_relative_metadata_gives_identical_output(tiny_cfg, tiny_ckpt, tiny_embed):
    from dspark_sidecar.drafter.kv_cache import window_metadata

    model = DSparkDrafter(tiny_cfg, ParallelContext(), REFERENCE_OPS, torch.float32).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))
    lens = [3, 4096 + 300, 4095, 600, 4096 + 17]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens) + 2
    step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=9)
    kv = allocate_kv_cache(tiny_cfg, 1, pages, PAGE, torch.float32)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    model.commit_context(scenario.random_taps(tiny_cfg, pos.numel(), seed=10), pos, slots, kv)
    rel, wmeta = window_metadata(step.positions, step.meta, PAGE, tiny_cfg.sliding_window)
    assert wmeta.block_tables.shape == (len(lens), -(-(4096 + 6) // PAGE) + 1)
    assert int(rel.min()) >= 0
    full = model.draft_step(step.inputs_embeds, step.positions, step.meta, [t.clone() for t in kv])
    windowed = model.draft_step(step.inputs_embeds, step.positions, step.meta, kv, attn=(rel, wmeta))
    assert torch.equal(full, windowed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_numpy_window_metadata_matches_torch(tiny_cfg, tiny_embed, seed):
    """The sidecar's per-step NumPy form (written into staging arrays) equals the torch reference."""
    import numpy as np

    from dspark_sidecar.drafter.kv_cache import window_metadata, window_metadata_into, window_width

    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 3 * tiny_cfg.sliding_window, (9,), generator=gen).tolist()
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens) + 1
    step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=seed)
    rel, wmeta = window_metadata(step.positions, step.meta, PAGE, tiny_cfg.sliding_window)
    w = window_width(PAGE, tiny_cfg.sliding_window)
    rel_np, lens_np = np.full(rel.shape, -1, np.int64), np.full(9, -1, np.int32)
    table_np = np.full((9, w), -1, np.int32)
    window_metadata_into(step.positions.numpy(), step.meta.seq_lens.numpy(), step.meta.block_tables.numpy(), PAGE,
                         tiny_cfg.sliding_window, rel_np, lens_np, table_np)
    assert np.array_equal(rel_np, rel.numpy())
    assert np.array_equal(lens_np, wmeta.seq_lens.numpy())
    assert np.array_equal(table_np, wmeta.block_tables.numpy())


def test_block_slots_hand_computed():
    """The scenario's slot_mapping (where K/V is written) and the reference attention's reads both come from
    block_slots, so a wrong offset moved both together and every test above still passed: pin it by hand."""
    from dspark_sidecar.drafter.kv_cache import block_slots

    table = torch.tensor([7, 3], dtype=torch.int32)
    assert block_slots(table, torch.tensor([0, 15, 16, 17]), PAGE).tolist() == [7 * 16, 7 * 16 + 15, 3 * 16, 3 * 16 + 1]
