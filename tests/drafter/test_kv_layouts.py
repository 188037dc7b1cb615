"""The two cache layouts an engine may allocate (planes, records) behind one [2, pages, page, heads, d] view."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import CheckpointReader
from dspark_sidecar.drafter.kv_cache import (FP8_KV, allocate_kv_cache, kv_paging, kv_planes, kv_rows, kv_storage_shape,
                                             kv_view_problem, to_cache, write_kv_rows)
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.kernels.ops import REFERENCE_OPS

PAGE = 16
LENS = [3, 700, 77, 16]


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_records_view_is_the_same_memory_with_k_then_v_in_each_record(heads):
    raw = torch.arange(5 * heads * PAGE * 2 * 8, dtype=torch.float32).view(5, heads, PAGE, 16)
    v = kv_planes(raw)
    assert v.shape == (2, 5, PAGE, heads, 8) and v.data_ptr() == raw.data_ptr()
    assert v.stride() == (8, heads * PAGE * 16, 16, PAGE * 16, 1)
    assert torch.equal(v[0, 3, 7, heads - 1], raw[3, heads - 1, 7, :8])
    assert torch.equal(v[1, 3, 7, heads - 1], raw[3, heads - 1, 7, 8:])
    assert kv_view_problem(v.shape, v.stride()) is None
    planes = torch.zeros(2, 5, PAGE, heads, 8)
    assert kv_planes(planes) is planes and kv_view_problem(planes.shape, planes.stride()) is None


def test_writes_through_the_view_land_in_the_engines_records_only_at_the_slots():
    raw = torch.full((6, 2, PAGE, 2 * 4), -7.0)
    kv = kv_planes(raw)
    slots = torch.tensor([0, 17, 95])
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    write_kv_rows(kv, 0, slots, k)
    write_kv_rows(kv, 1, slots, v)
    assert torch.equal(kv_rows(kv, 0, slots), k) and torch.equal(kv_rows(kv, 1, slots), v)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(raw[s // PAGE, :, s % PAGE], torch.cat([k[i], v[i]], dim=-1))
    assert int((raw != -7.0).sum()) == 3 * 2 * 8  # nothing else moved


@pytest.mark.parametrize("shape,strides,why", [
    ((2, 4, 16, 1, 8), (8, 256, 16, 256, 2), "head_dim stride 2"),   # every other value: not one vector
    ((2, 4, 16, 1, 8), (0, 128, 8, 128, 1), "overlap"),              # K and V on the same memory
    ((2, 4, 16, 2, 8), (512, 128, 8, 8, 1), "overlap"),              # heads on top of tokens
    ((2, 4, 16, 1, 8), (512, 64, 8, 64, 1), "overlap"),              # pages of 16 tokens 8 tokens apart
    ((2, 4, 16, 1, 8), (512, 128, 8, 128), "4 strides for 5 dimensions"),
])
def test_views_whose_elements_overlap_or_scatter_a_head_are_named(shape, strides, why):
    problem = kv_view_problem(shape, strides)
    assert problem is not None and why in problem


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="planes, records"):
        kv_storage_shape(None, 1, 4, 16, "heads-first")
    with pytest.raises(ValueError, match="expected planes"):
        kv_planes(torch.zeros(4, 1, 16, 7))


def _step(model, cfg, embed, kv_layout, kv_dtype=torch.float32):
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in LENS) + 5
    step = scenario.random_step(cfg, LENS, PAGE, pages, embed, seed=3, shuffle_pages=True)
    raw = allocate_kv_cache(cfg, 1, pages, PAGE, kv_dtype, kv_layout=kv_layout)
    kv = [kv_planes(t) for t in raw]
    pos, slots = scenario.context_rows(step.meta, PAGE)
    model.commit_context(scenario.random_taps(cfg, pos.numel(), seed=4), pos, slots, kv)
    return model.draft_step(step.inputs_embeds, step.positions, step.meta, kv), raw, kv


def test_a_draft_step_over_records_equals_one_over_planes(tiny_cfg, tiny_ckpt, tiny_embed):
    model = DSparkDrafter(tiny_cfg, ParallelContext(), REFERENCE_OPS, torch.float32).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))
    out_p, raw_p, kv_p = _step(model, tiny_cfg, tiny_embed, "planes")
    out_r, raw_r, kv_r = _step(model, tiny_cfg, tiny_embed, "records")
    assert raw_r[0].dim() == 4 and raw_r[0].shape[-1] == 2 * tiny_cfg.head_dim
    assert torch.equal(out_p, out_r)
    for a, b in zip(kv_p, kv_r):
        assert torch.equal(a, b)
    assert any(bool(t.abs().sum() > 0) for t in raw_r)  # the commit and the step wrote the engine's tensors


def test_an_fp8_cache_stores_saturated_codes_rounded_to_nearest_even():
    x = torch.tensor([1000.0, -1000.0, 1.0625, 1.1875, 17.0, 0.3])
    assert to_cache(x, FP8_KV).float().tolist() == [448.0, -448.0, 1.0, 1.25, 16.0, 0.3125]
    raw = torch.zeros(2, 1, PAGE, 2 * 4, dtype=FP8_KV)
    kv = kv_planes(raw)
    write_kv_rows(kv, 1, torch.tensor([17]), torch.full((1, 1, 4), 600.0))
    assert raw[1, 0, 1, 4:].float().tolist() == [448.0] * 4 and raw[1, 0, 1, :4].float().abs().sum() == 0


def test_a_draft_step_over_an_fp8_records_cache_equals_one_over_fp8_planes(tiny_cfg, tiny_ckpt, tiny_embed):
    model = DSparkDrafter(tiny_cfg, ParallelContext(), REFERENCE_OPS, torch.float32).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))
    out_p, _, kv_p = _step(model, tiny_cfg, tiny_embed, "planes", FP8_KV)
    out_r, raw_r, kv_r = _step(model, tiny_cfg, tiny_embed, "records", FP8_KV)
    assert raw_r[0].dtype == FP8_KV and torch.equal(out_p, out_r)
    for a, b in zip(kv_p, kv_r):
        assert torch.equal(a.float(), b.float())
    # And the fp8 cache is a real rounding: the step differs from the one over an fp32 cache.
    out_f, _, _ = _step(model, tiny_cfg, tiny_embed, "planes")
    assert not torch.equal(out_f, out_p)


def test_a_padding_slot_is_refused_not_wrapped_onto_the_last_page():
    # A slot of -1 split into (page, offset) would be (-1, page_size - 1): the last page's last
    # token, silently. The ops take valid slots only, so it must fail as the flat index did.
    kv = kv_planes(torch.zeros(3, 1, PAGE, 8))
    with pytest.raises(IndexError):
        write_kv_rows(kv, 0, torch.tensor([5, -1]), torch.ones(2, 1, 4))
    with pytest.raises(IndexError):
        kv_rows(kv, 1, torch.tensor([-1]))


def test_layers_of_different_dtypes_are_each_written_and_read_in_their_own(tiny_cfg, tiny_ckpt, tiny_embed):
    """BindKV takes each layer's dtype (the compute dtype or fp8) as sent, and KVBindingState.kv_dtype
    reports layer 0's: a mixed binding must not be computed in layer 0's dtype. Layer 0 here matches
    an all-fp32 run bit for bit, and layer 1 holds that run's layer-1 rows as fp8 codes: its inputs
    were the same, and it stored them in its own dtype."""
    model = DSparkDrafter(tiny_cfg, ParallelContext(), REFERENCE_OPS, torch.float32).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))
    _, _, kv32 = _step(model, tiny_cfg, tiny_embed, "planes")
    pages = kv32[0].shape[1]
    mixed = [torch.zeros_like(kv32[0], dtype=FP8_KV) if i == 1 else torch.zeros_like(kv32[0])
             for i in range(tiny_cfg.num_hidden_layers)]
    step = scenario.random_step(tiny_cfg, LENS, PAGE, pages, tiny_embed, seed=3, shuffle_pages=True)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    model.commit_context(scenario.random_taps(tiny_cfg, pos.numel(), seed=4), pos, slots, mixed)
    out = model.draft_step(step.inputs_embeds, step.positions, step.meta, mixed)
    assert torch.equal(mixed[0], kv32[0])
    assert torch.equal(mixed[1].view(torch.uint8), to_cache(kv32[1], FP8_KV).view(torch.uint8))
    assert torch.isfinite(out).all()


# vLLM 0.34 views every layer of one int8 allocation as [blocks, kv_heads, block_size, C] bytes, C = 2 x head_dim
# elements (K then V), in a stride order resolved for the whole model (v1/kv_cache_interface.py
# compute_layout_strides / create_kv_cache_views; the orders of v1/attention/backends/utils.py). L: layer, B: block,
# H: KV head, N: token in the block, C: content; the letters in memory order, outermost first.
VLLM_LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC", "BHLNC", "LHBNC")


def _vllm_layer_views(order: str, layers: int, blocks: int, heads: int, head_dim: int, dtype: torch.dtype):
    """(the flat int8 allocation, one records view per layer) as vLLM 0.34 lays them out in `order`."""
    item = torch.empty((), dtype=dtype).element_size()
    shape = {"L": layers, "B": blocks, "H": heads, "N": PAGE, "C": 2 * head_dim * item}
    strides, step = {}, 1
    for dim in reversed(order):  # innermost first, as compute_layout_strides walks the order
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(step + 64, dtype=torch.int8)  # 64 bytes past the end: a view that overran would reach them
    five = torch.as_strided(raw, [shape[d] for d in "LBHNC"], [strides[d] for d in "LBHNC"], 0)
    return raw, [five[i].view(dtype) for i in range(layers)]


@pytest.mark.parametrize("order", VLLM_LAYOUTS)
@pytest.mark.parametrize("heads", [1, 2])
def test_every_vllm_stride_order_reads_and_writes_k_then_v_of_its_own_layer_only(order, heads):
    """FlashAttention and Triton attention read K as a record's first head_dim values and V as the rest
    (flash_attn.py: kv_cache.transpose(1, 2).split(head_size, -1) on [B, H, N, C]); the binding's planes view must
    name the same elements in every order vLLM may resolve, and a write through it touch one layer's records at the
    step's slots, nothing else."""
    d, blocks, layers = 8, 5, 3
    raw, views = _vllm_layer_views(order, layers, blocks, heads, d, torch.float32)
    target = views[1]
    for i, v in enumerate(views):  # each layer's records hold distinct values
        v.copy_(torch.arange(v.numel(), dtype=torch.float32).view(v.shape) + 1000 * i)
    kv = kv_planes(target)
    assert kv_view_problem(kv.shape, kv.stride()) is None
    k, v = target.transpose(1, 2).split(d, -1)  # [B, N, H, D] each, FlashAttention's reading
    assert torch.equal(kv[0], k) and torch.equal(kv[1], v)
    before = raw.clone()
    slots = torch.tensor([0, PAGE + 3, blocks * PAGE - 1])
    newk, newv = torch.randn(3, heads, d), torch.randn(3, heads, d)
    write_kv_rows(kv, 0, slots, newk)
    write_kv_rows(kv, 1, slots, newv)
    assert torch.equal(kv_rows(kv, 0, slots), newk) and torch.equal(kv_rows(kv, 1, slots), newv)
    k, v = target.transpose(1, 2).split(d, -1)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(k[s // PAGE, s % PAGE], newk[i]) and torch.equal(v[s // PAGE, s % PAGE], newv[i])
    changed = int((raw != before).sum())
    assert 0 < changed <= 3 * heads * 2 * d * 4  # bytes of the written records only
    for i in (0, 2):  # the other layers' records, byte for byte
        assert torch.equal(views[i], torch.arange(views[i].numel(), dtype=torch.float32).view(views[i].shape) + 1000 * i)


def test_paging_is_read_from_either_layouts_shape_and_nothing_else_is_taken_for_a_cache():
    """kv_paging: (num_pages, page_size) from the shape alone, as the shim asks each step; a page size read
    from the wrong axis (heads, or pages) addressed every slot through the wrong pages."""
    planes = torch.zeros(2, 5, 3, 2, 4)  # [2, pages, page_size, heads, d]
    records = torch.zeros(5, 2, 3, 8)  # [pages, heads, page_size, 2 d]
    assert kv_paging(planes) == (5, 3) == tuple(kv_planes(records).shape[1:3])
    assert kv_paging(records) == (5, 3)
    for odd in (torch.zeros(5, 3, 8), torch.zeros(1, 2, 5, 3, 2, 4)):
        assert kv_paging(odd) is None
