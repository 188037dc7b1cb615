"""--weights mxfp8: the layers' linears kept as MXFP8 compute exactly what the dense weights do (reference ops)."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import CheckpointReader
from dspark_sidecar.drafter.kv_cache import allocate_kv_cache
from dspark_sidecar.drafter.model import DSparkDrafter
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.kernels.ops import REFERENCE_OPS
from dspark_sidecar.kernels.weights import MxFp8Weight, NormFolded

PAGE = 16


def _model(cfg, ckpt, rank=0, world=1):
    return DSparkDrafter(cfg, ParallelContext(rank, world), REFERENCE_OPS, torch.float32).load(
        CheckpointReader(ckpt[0], torch.float32, cfg.quant_block))


def test_requantizing_the_loaded_checkpoint_weights_is_exact(tiny_cfg, tiny_ckpt):
    """The checkpoint is MXFP8: its dense load is exact, and quantizing it again gives the same values."""
    dense = _model(tiny_cfg, tiny_ckpt, rank=1, world=2)
    for layer in dense.layers:
        for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            w = lin.weight.detach()
            assert torch.equal(MxFp8Weight.quantize(w, tiny_cfg.quant_block).dequantize(torch.float32), w)


def test_mxfp8_layers_give_bit_identical_steps_and_commits(tiny_cfg, tiny_ckpt, tiny_embed):
    dense = _model(tiny_cfg, tiny_ckpt)
    quant = _model(tiny_cfg, tiny_ckpt).convert_layer_weights(lambda w: MxFp8Weight.quantize(w, tiny_cfg.quant_block))
    assert all(isinstance(layer.down_proj.weight, MxFp8Weight) for layer in quant.layers)
    lens = [5, 300, 4096 + 20]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens) + 1
    step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=4)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    taps = scenario.random_taps(tiny_cfg, pos.numel(), seed=5, dtype=torch.float32)
    kv_d, kv_q = (allocate_kv_cache(tiny_cfg, 1, pages, PAGE, torch.float32) for _ in range(2))
    dense.commit_context(taps, pos, slots, kv_d)
    quant.commit_context(taps, pos, slots, kv_q)
    assert all(torch.equal(a, b) for a, b in zip(kv_d, kv_q))
    out_d = dense.draft_step(step.inputs_embeds, step.positions, step.meta, kv_d)
    out_q = quant.draft_step(step.inputs_embeds, step.positions, step.meta, kv_q)
    assert torch.equal(out_d, out_q)


def test_folded_norm_layers_commit_k_v_from_the_weights_as_loaded(tiny_cfg, tiny_ckpt, tiny_embed):
    """fold_norms (the Triton backend's qkv and gate|up, kernels.weights.prepare_layer_weights) on the reference
    ops: the context commit projects k|v without the input norm (spec 3A), so it must use the rows kept as loaded
    (the folded ones hold W * (1 + w) of input_layernorm, and are no tensor to slice): the same K/V bits as the
    dense model. The step's own output and K/V differ from the dense model's by fp32 rounding only (the norm's
    (1 + w) is applied to the weight instead of the activation)."""
    dense = _model(tiny_cfg, tiny_ckpt)
    folded = _model(tiny_cfg, tiny_ckpt).fold_norms(NormFolded.fold)
    assert all(isinstance(layer.qkv_proj.weight, NormFolded) for layer in folded.layers)
    lens = [5, 40]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens)
    step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=6)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    taps = scenario.random_taps(tiny_cfg, pos.numel(), seed=7, dtype=torch.float32)
    kv_d, kv_f = (allocate_kv_cache(tiny_cfg, 1, pages, PAGE, torch.float32) for _ in range(2))
    dense.commit_context(taps, pos, slots, kv_d)
    folded.commit_context(taps, pos, slots, kv_f)
    assert all(torch.equal(a, b) for a, b in zip(kv_d, kv_f))
    out_d = dense.draft_step(step.inputs_embeds, step.positions, step.meta, kv_d)
    out_f = folded.draft_step(step.inputs_embeds, step.positions, step.meta, kv_f)
    torch.testing.assert_close(out_f, out_d, rtol=1e-5, atol=1e-5)
    for a, b in zip(kv_d, kv_f):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_weights_the_kernels_cannot_take_are_refused_naming_the_layer(tiny_cfg, tiny_ckpt):
    """A non-finite weight (it would quantize to the F8 NaN code, which the NVIDIA kernels read as a
    finite value) or one needing a block scale over 2^7 stops the conversion, and the error says
    which layer's linear: what an operator sees when --weights mxfp8 refuses a checkpoint."""

    def quantize(w):
        return MxFp8Weight.quantize(w, tiny_cfg.quant_block)

    for poison, match in ((float("nan"), "layer 1 o_proj: .* 1 non-finite"), (1e6, "layer 1 o_proj: .* above 134")):
        model = _model(tiny_cfg, tiny_ckpt)
        with torch.no_grad():
            model.layers[1].o_proj.weight[3, 5] = poison
        with pytest.raises(ValueError, match=match):
            model.convert_layer_weights(quantize)


def test_a_weight_needing_exactly_the_largest_block_scale_is_kept(tiny_cfg):
    """2^7 (exponent byte 134) is the last scale the kernels take: a block of amax 448 * 2^7 quantizes, exactly;
    one a hair larger needs 2^8 and is refused."""
    w = torch.zeros(2, tiny_cfg.quant_block)
    w[0, 0] = 448.0 * 2 ** 7
    q = MxFp8Weight.quantize(w, tiny_cfg.quant_block)
    assert q.scale.flatten().tolist() == [134, 0] and torch.equal(q.dequantize(torch.float32), w)
    w[0, 0] = 448.0 * 2 ** 7 + 1024
    with pytest.raises(ValueError, match="block exponent 135 above 134"):
        MxFp8Weight.quantize(w, tiny_cfg.quant_block)
