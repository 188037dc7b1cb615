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


def _commit_and_step(cfg, embed, models, lens, seed, spare=0, check_commit=False):
    """Each model commits the same random context rows into its own fp32 cache, then drafts the same step on it:
    [(its cache's layers, its hidden states)]. check_commit: the caches are bit-equal after the commit (before
    the step writes its block rows)."""
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens) + spare
    step = scenario.random_step(cfg, lens, PAGE, pages, embed, seed=seed)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    taps = scenario.random_taps(cfg, pos.numel(), seed=seed + 1, dtype=torch.float32)
    kvs = [allocate_kv_cache(cfg, 1, pages, PAGE, torch.float32) for _ in models]
    for m, kv in zip(models, kvs):
        m.commit_context(taps, pos, slots, kv)
    if check_commit:
        assert all(torch.equal(a, b) for kv in kvs[1:] for a, b in zip(kvs[0], kv))
    return [(kv, m.draft_step(step.inputs_embeds, step.positions, step.meta, kv)) for m, kv in zip(models, kvs)]


def test_mxfp8_layers_give_bit_identical_steps_and_commits(tiny_cfg, tiny_ckpt, tiny_embed):
    dense = _model(tiny_cfg, tiny_ckpt)
    quant = _model(tiny_cfg, tiny_ckpt).convert_layer_weights(lambda w: MxFp8Weight.quantize(w, tiny_cfg.quant_block))
    assert all(isinstance(getattr(layer, name).weight, MxFp8Weight) for layer in quant.layers
               for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))  # each of the four linears
    (kv_d, out_d), (kv_q, out_q) = _commit_and_step(tiny_cfg, tiny_embed, [dense, quant], [5, 300, 4096 + 20],
                                                     seed=4, spare=1, check_commit=True)
    assert torch.equal(out_d, out_q) and all(torch.equal(a, b) for a, b in zip(kv_d, kv_q))


def test_folded_norm_layers_commit_k_v_from_the_weights_as_loaded(tiny_cfg, tiny_ckpt, tiny_embed):
    """fold_norms (the Triton backend's qkv and gate|up, kernels.weights.prepare_layer_weights) on the reference
    ops: the context commit projects k|v without the input norm (spec 3A), so it must use the rows kept as loaded
    (the folded ones hold W * (1 + w) of input_layernorm, and are no tensor to slice): the same K/V bits as the
    dense model. The step's own output and K/V differ from the dense model's by fp32 rounding only (the norm's
    (1 + w) is applied to the weight instead of the activation)."""
    dense = _model(tiny_cfg, tiny_ckpt)
    folded = _model(tiny_cfg, tiny_ckpt).fold_norms(NormFolded.fold)
    assert all(isinstance(layer.qkv_proj.weight, NormFolded) for layer in folded.layers)
    (kv_d, out_d), (kv_f, out_f) = _commit_and_step(tiny_cfg, tiny_embed, [dense, folded], [5, 40], seed=6,
                                                     check_commit=True)
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


@pytest.mark.parametrize("cols, block", [(40, 32), (16, 32), (64, 0), (64, -32)], ids=str)
def test_a_weight_that_is_not_whole_blocks_is_refused_as_a_value_error(cols, block):
    """An input dim that is not whole blocks (or a block below 1) reached quantize_mxfp8's reshape first:
    a RuntimeError ("shape '[2, 1, 32]' is invalid for input of size 80") or ZeroDivisionError, which
    convert_layer_weights does not name the layer of, where the container refuses such a weight as a ValueError."""
    with pytest.raises(ValueError, match=rf"MxFp8Weight.quantize: weight \[2, {cols}\] is not whole blocks of {block}"):
        MxFp8Weight.quantize(torch.randn(2, cols), block)


def test_the_container_refuses_scales_it_cannot_pair_with_the_weight():
    """A scale of another dtype than U8, or a weight whose input dim is not whole blocks, is refused when the
    MxFp8Weight is built: the kernels would read the bytes as exponents, or a short last block, silently."""
    q = torch.zeros(2, 64, dtype=torch.float8_e4m3fn)
    assert MxFp8Weight(q, torch.zeros(2, 2, dtype=torch.uint8)).shape == (2, 64)
    with pytest.raises(TypeError, match="need float8_e4m3fn \\+ uint8, got torch.float8_e4m3fn \\+ torch.int32"):
        MxFp8Weight(q, torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"scale shape \[2, 1\] does not match weight \[2, 40\] with block 32"):
        MxFp8Weight(torch.zeros(2, 40, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.uint8))


def test_a_block_other_than_32_is_kept_by_quantize_views_and_concatenation():
    """config.json's weight_block_size [1, B]: every MxFp8Weight made from one of block B (a row slice, a fused
    q|k|v) keeps B, and its bytes are 1 per weight plus 1 per block."""
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    weight = MxFp8Weight.quantize(w, 16)
    assert weight.block == 16 and weight.scale.shape == (4, 4) and weight.nbytes == 4 * 64 + 4 * 4
    dense = weight.dequantize(torch.float32)
    assert weight.dequantize().dtype == torch.bfloat16 and torch.equal(weight.dequantize(), dense.bfloat16())
    part = weight[1:3]
    assert part.block == 16 and torch.equal(part.dequantize(torch.float32), dense[1:3])
    fused = MxFp8Weight.cat([weight[:1], weight[1:]])
    assert fused.block == 16 and torch.equal(fused.dequantize(torch.float32), dense)
    with pytest.raises(ValueError, match="different blocks"):
        MxFp8Weight.cat([weight, MxFp8Weight.quantize(w, 32)])


def test_from_checkpoint_refuses_what_is_no_mxfp8_block_slice_naming_the_key(tiny_cfg, tiny_ckpt):
    """A column slice whose end cuts a block, or a key stored dense, is a CheckpointError naming the key (not the
    container's ValueError on shapes); the slice lands on the device asked for."""
    from dspark_sidecar.drafter.checkpoint import PREFIX, CheckpointError, layer_prefix

    reader = CheckpointReader(tiny_ckpt[0], torch.float32, tiny_cfg.quant_block)
    key = f"{layer_prefix(0)}mlp.down_proj.weight"
    shape = (tiny_cfg.hidden_size, tiny_cfg.ffn_hidden_size)
    with pytest.raises(CheckpointError, match=rf"{key}: column slice .* cuts MXFP8 blocks of 32"):
        MxFp8Weight.from_checkpoint(reader, key, shape, cols=slice(0, 40))
    fc = f"{PREFIX}fc.weight"
    with pytest.raises(CheckpointError, match=rf"{fc}: dtype torch.bfloat16, expected F8_E4M3"):
        MxFp8Weight.from_checkpoint(reader, fc, (tiny_cfg.hidden_size, tiny_cfg.tap_size))
    on_meta = MxFp8Weight.from_checkpoint(reader, key, shape, cols=slice(0, 64), device="meta")
    assert on_meta.device.type == "meta" and on_meta.scale.device.type == "meta" and on_meta.shape == (shape[0], 64)


def test_from_checkpoint_names_a_nan_code_in_the_rank_s_own_slice(tmp_path, tiny_cfg, tiny_ckpt):
    """The kernels' dequantization does not carry NaN through: a NaN code in the columns a rank reads is refused
    naming the key and where, while the other rank's slice (no NaN in it) loads."""
    from safetensors.torch import load_file, save_file

    from dspark_sidecar.drafter.checkpoint import CheckpointError, layer_prefix

    key = f"{layer_prefix(1)}self_attn.o_proj.weight"
    shape = (tiny_cfg.hidden_size, tiny_cfg.q_size)
    t = load_file(str(tiny_ckpt[0] / "model.safetensors"))
    t[key].view(torch.uint8)[3, shape[1] // 2 + 5] = 0xFF  # negative NaN, in rank 1 of 2's columns
    d = tmp_path / "nan"
    d.mkdir()
    save_file(t, str(d / "model.safetensors"))
    reader = CheckpointReader(d, torch.float32, tiny_cfg.quant_block)
    ranks = [ParallelContext(r, 2).shard(shape[1]) for r in range(2)]
    assert MxFp8Weight.from_checkpoint(reader, key, shape, cols=ranks[0]).shape == (shape[0], shape[1] // 2)
    with pytest.raises(CheckpointError, match=rf"^{key}: 1 NaN F8_E4M3 codes in this rank's slice \(first at \[3, 5\]\)"):
        MxFp8Weight.from_checkpoint(reader, key, shape, cols=ranks[1])


def test_mxfp8_layers_are_not_norm_folded_and_dense_ones_are_when_asked(tiny_cfg, tiny_ckpt):
    """prepare_layer_weights: --weights mxfp8 keeps the linears quantized on every backend, the Triton one
    (fold=True) included (an MXFP8 block shares one scale across columns that (1 + w) would change apart);
    dense weights are folded only when asked."""
    from dspark_sidecar.kernels.weights import NormFolded, prepare_layer_weights

    for mode, fold, kind in (("mxfp8", True, MxFp8Weight), ("bf16", True, NormFolded), ("bf16", False, torch.Tensor)):
        model = _model(tiny_cfg, tiny_ckpt)
        prepare_layer_weights(model, mode, tiny_cfg.quant_block, fold=fold)
        assert all(isinstance(layer.qkv_proj.weight, kind) for layer in model.layers), (mode, fold)


def test_a_norm_that_does_not_match_the_weight_s_columns_is_refused():
    """NormFolded.fold scales column j by (1 + w[j]): a norm of one element broadcast to every column and
    one of the row count are refused, not folded."""
    from dspark_sidecar.kernels.weights import NormFolded

    w = torch.randn(4, 3)
    assert NormFolded.fold(w, torch.zeros(3)).weight.equal(w)
    for norm in (torch.zeros(1), torch.zeros(4)):
        with pytest.raises(ValueError, match=rf"NormFolded: norm \[{norm.numel()}\] does not match weight \[4, 3\]"):
            NormFolded.fold(w, norm)
