"""Tensors that do not describe 7 rows per request are refused by name, before anything is written."""

# Torch broadcasts and slices where a mis-shaped step should fail: positions of length 1 gave every row
# of an R = 1 step the anchor's RoPE angle and window edge; rows past 7R were dropped from the answer;
# attention metadata of fewer requests left the other rows' attention as uninitialised memory
# (torch.empty_like in the reference); the context commit rotated every row at one position.

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import CheckpointReader
from dspark_sidecar.drafter.kv_cache import StepMetadata, allocate_kv_cache, window_metadata
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.kernels.ops import REFERENCE_OPS

PAGE, PAGES = 16, 12


@pytest.fixture(scope="module")
def model(tiny_cfg, tiny_ckpt):
    return DSparkDrafter(tiny_cfg, ParallelContext(), REFERENCE_OPS, torch.float32).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))


def _step(cfg, embed, lens):
    step = scenario.random_step(cfg, lens, PAGE, PAGES, embed, seed=1)
    return step, allocate_kv_cache(cfg, 1, PAGES, PAGE, torch.float32)


def _meta(m: StepMetadata, **changes) -> StepMetadata:
    return StepMetadata(**{"seq_lens": m.seq_lens, "block_tables": m.block_tables, "slot_mapping": m.slot_mapping,
                           **changes})


CASES = {  # name -> (lens, change to (embeds, positions, meta, attn) or None, what the error names)
    "R=1, one position for 7 rows": ([40], lambda e, p, m, a: (e, p[:1], m, a), "positions"),
    "a request's rows past 7R": ([40, 20], lambda e, p, m, a: (torch.cat([e, e[:7]]), p, m, a), "inputs_embeds"),
    "7R + 7 positions": ([40, 20], lambda e, p, m, a: (e, torch.cat([p, p[:7]]), m, a), "positions"),
    "3-D embeddings": ([40, 20], lambda e, p, m, a: (e.view(2, 7, -1), p, m, a), "inputs_embeds"),
    "a slot missing": ([40, 20], lambda e, p, m, a: (e, p, _meta(m, slot_mapping=m.slot_mapping[:-1]), a),
                       "slot_mapping"),
    "a block-table row missing": ([40, 20], lambda e, p, m, a: (e, p, _meta(m, block_tables=m.block_tables[:1]), a),
                                  "block_tables"),
    "attention metadata of 1 request for 2": ([40, 20], lambda e, p, m, a: (e, p, m, (a[0], a[1].requests(0, 1))),
                                              "attention seq_lens"),
    "attention positions of another length": ([40, 20], lambda e, p, m, a: (e, p, m, (a[0][:7], a[1])),
                                              "attention positions"),
    "an attention block-table row missing": ([40, 20], lambda e, p, m, a: (
        e, p, m, (a[0], _meta(a[1], block_tables=a[1].block_tables[:1]))), "attention block_tables"),
}


@pytest.mark.parametrize("entry", ["draft_step", "forward"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_mis_shaped_step_is_refused_before_any_cache_write(case, entry, model, tiny_cfg, tiny_embed):
    lens, change, field = CASES[case]
    step, kv = _step(tiny_cfg, tiny_embed, lens)
    attn = window_metadata(step.positions, step.meta, PAGE, tiny_cfg.sliding_window)
    embeds, positions, meta, attn = change(step.inputs_embeds, step.positions, step.meta, attn)
    for t in kv:
        t.fill_(-3.0)
    with pytest.raises(ValueError, match=field):
        getattr(model, entry)(embeds, positions, meta, kv, attn=attn)
    assert all(bool((t == -3.0).all()) for t in kv), "a refused step wrote the cache"


def test_forward_refuses_rows_that_no_request_owns(model, tiny_cfg, tiny_embed):
    """Metadata of 1 request for 14 rows: rows 7..13 had no attention computed and served whatever memory held."""
    step, kv = _step(tiny_cfg, tiny_embed, [40, 20])
    meta = StepMetadata(step.meta.seq_lens[:1], step.meta.block_tables[:1], step.meta.slot_mapping)
    with pytest.raises(ValueError, match=r"inputs_embeds shape \[14, 256\], expected \[7, 256\] \(7 rows for 1 request"):
        model.forward(step.inputs_embeds, step.positions, meta, kv)


def test_well_shaped_steps_still_run(model, tiny_cfg, tiny_embed):
    step, kv = _step(tiny_cfg, tiny_embed, [40, 20])
    attn = window_metadata(step.positions, step.meta, PAGE, tiny_cfg.sliding_window)
    a = model.draft_step(step.inputs_embeds, step.positions, step.meta, [t.clone() for t in kv])
    b = model.draft_step(step.inputs_embeds, step.positions, step.meta, kv, attn=attn)
    assert a.shape == (14, tiny_cfg.hidden_size) and torch.equal(a, b)


@pytest.mark.parametrize("cut", ["positions", "slots", "taps"])
def test_context_commit_refuses_rows_of_different_counts(cut, model, tiny_cfg, tiny_embed):
    """One position for 40 rows broadcast: every row's K rotated at position 0, written without an error."""
    step, kv = _step(tiny_cfg, tiny_embed, [40])
    pos, slots = scenario.context_rows(step.meta, PAGE)
    taps = scenario.random_taps(tiny_cfg, pos.numel(), seed=2, dtype=torch.float32)
    args = {"taps": taps, "positions": pos, "slots": slots}
    args[cut] = args[cut][:1]
    with pytest.raises(ValueError, match=r"context commit: taps \[.*expected \[m, 1280\], \[m\] and \[m\]"):
        model.commit_context(args["taps"], args["positions"], args["slots"], kv)
    assert all(bool((t == 0).all()) for t in kv)


@pytest.mark.parametrize("count", [4, 6])
@pytest.mark.parametrize("entry", ["draft_step", "forward", "commit_context"])
def test_a_cache_list_of_another_layer_count_is_refused_before_any_write(entry, count, model, tiny_cfg, tiny_embed):
    """The layers zip their caches strictly, which said so only at the end: 4 caches for 5 layers had
    4 layers' K/V written first, 6 a whole step's, before a ValueError naming neither the caches nor the layers."""
    step, kv = _step(tiny_cfg, tiny_embed, [40, 20])
    kv = (kv + [t.clone() for t in kv])[:count]
    for t in kv:
        t.fill_(-3.0)
    if entry == "commit_context":
        pos, slots = scenario.context_rows(step.meta, PAGE)
        args = (scenario.random_taps(tiny_cfg, pos.numel(), seed=2, dtype=torch.float32), pos, slots, kv)
    else:
        args = (step.inputs_embeds, step.positions, step.meta, kv)
    with pytest.raises(ValueError, match=rf"{count} KV cache layers for the drafter's 5, expected one per layer"):
        getattr(model, entry)(*args)
    assert all(bool((t == -3.0).all()) for t in kv), "a refused call wrote the cache"


def test_block_k_v_go_to_the_step_s_slots_whatever_the_attention_metadata_holds(model, tiny_cfg, tiny_embed):
    """attn carries the window-relative positions and tables the attention reads; the block's K/V are written
    through the step's own slot_mapping. Through the attention metadata's slots instead, a table built for the
    attention alone (CUDA graphs' static one) would place them elsewhere, or drop them as padding (-1)."""
    step, kv = _step(tiny_cfg, tiny_embed, [40, 20])
    attn = window_metadata(step.positions, step.meta, PAGE, tiny_cfg.sliding_window)
    padded = (attn[0], _meta(attn[1], slot_mapping=torch.full_like(attn[1].slot_mapping, -1)))
    kv2 = [t.clone() for t in kv]
    a = model.draft_step(step.inputs_embeds, step.positions, step.meta, kv, attn=attn)
    b = model.draft_step(step.inputs_embeds, step.positions, step.meta, kv2, attn=padded)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(kv, kv2))
