"""The tiny drafter's context commit and draft step with TRITON_OPS match the same model with REFERENCE_OPS."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.drafter import scenario  # noqa: E402
from dspark_sidecar.drafter.checkpoint import CheckpointReader  # noqa: E402
from dspark_sidecar.drafter.kv_cache import allocate_kv_cache  # noqa: E402
from dspark_sidecar.drafter.model import DSparkDrafter  # noqa: E402
from dspark_sidecar.drafter.parallel import ParallelContext  # noqa: E402
from dspark_sidecar.kernels.ops import REFERENCE_OPS  # noqa: E402
from dspark_sidecar.kernels.triton.ops import TRITON_OPS  # noqa: E402
from helpers.side_by_side import side_by_side_against_in_order  # noqa: E402

PAGE, PAGES = 16, 16


def _run(ops, cfg, dspark_dir, embed, device, contexts=(5, 40)):
    dtype = torch.bfloat16
    model = DSparkDrafter(cfg, ParallelContext(), ops, dtype, device).load(CheckpointReader(dspark_dir, dtype, device=device))
    kv = allocate_kv_cache(cfg, 1, PAGES, PAGE, dtype, device)
    step = scenario.random_step(cfg, list(contexts), PAGE, PAGES, embed, seed=3)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    taps = scenario.random_taps(cfg, pos.numel(), seed=4)
    model.commit_context(taps.to(device), pos.to(device), slots.to(device), kv)
    out = model.draft_step(step.inputs_embeds.to(device, dtype), step.positions.to(device), step.meta.to(device), kv)
    return out, kv


def test_tiny_drafter_step(device, tiny_cfg, tiny_ckpt, tiny_embed, parity):
    """5 layers, GQA 8/4 heads of 128, two requests: every op of the step in the model's own call pattern."""
    ref, kv_ref = _run(REFERENCE_OPS, tiny_cfg, tiny_ckpt[0], tiny_embed, device)
    out, kv = _run(TRITON_OPS, tiny_cfg, tiny_ckpt[0], tiny_embed, device)
    for layer, layer_ref in zip(kv, kv_ref, strict=True):
        parity(layer, layer_ref)
    parity(out, ref)


def test_tiny_drafter_fp32_with_mxfp8_weights(device, tiny_cfg, tiny_ckpt, tiny_embed, parity):
    """--dtype fp32 --weights mxfp8 (server/app.py: prepare_layer_weights) on the Triton ops: the
    checkpoint is MXFP8, so its weights kept quantized are the dense fp32 weights exactly, and the
    step and the context commit's K/V must be the fp32 reference's within fp32's tolerance (no
    activation rounded to bf16 on the way into the dequantized weights' dots)."""
    from dspark_sidecar.kernels.weights import MxFp8Weight, prepare_layer_weights

    dtype = torch.float32
    kvs, outs = [], []
    for ops in (REFERENCE_OPS, TRITON_OPS):
        model = DSparkDrafter(tiny_cfg, ParallelContext(), ops, dtype, device).load(
            CheckpointReader(tiny_ckpt[0], dtype, tiny_cfg.quant_block, device=device))
        if ops is TRITON_OPS:
            prepare_layer_weights(model, "mxfp8", tiny_cfg.quant_block, fold=True)
            assert all(isinstance(layer.qkv_proj.weight, MxFp8Weight) for layer in model.layers)
        kv = allocate_kv_cache(tiny_cfg, 1, PAGES, PAGE, dtype, device)
        step = scenario.random_step(tiny_cfg, [5, 40], PAGE, PAGES, tiny_embed, seed=3)
        pos, slots = scenario.context_rows(step.meta, PAGE)
        taps = scenario.random_taps(tiny_cfg, pos.numel(), seed=4, dtype=dtype)
        model.commit_context(taps.to(device), pos.to(device), slots.to(device), kv)
        outs.append(model.draft_step(step.inputs_embeds.to(device, dtype), step.positions.to(device),
                                     step.meta.to(device), kv))
        kvs.append(kv)
    for layer, layer_ref in zip(kvs[1], kvs[0], strict=True):
        parity(layer, layer_ref)
    parity(outs[1], outs[0])


# Context lengths of the requests in a step: two, and eight (56 rows: the GEMMs' 64-row tiles,
# the wgmma path on an H200, where a folded-norm bug once hid from the two-request step).
CONTEXTS = {"2 requests": [5, 40], "8 requests": [5, 40, 12, 3, 30, 7, 20, 25]}


@pytest.mark.parametrize("contexts", list(CONTEXTS))
def test_tiny_drafter_with_folded_norms(device, tiny_cfg, tiny_ckpt, tiny_embed, parity, contexts):
    """The sidecar's Triton model (server/app.py): qkv and gate|up weights with their norms folded in.
    The context commit's K/V must be the same bits as unfolded (its k|v rows are kept as loaded);
    the step matches the reference within the usual tolerance."""
    if device == "cpu" and contexts == "8 requests":
        pytest.skip("64-row tiles matter on a GPU only; in the interpreter this case takes minutes "
                    "and checks nothing the two-request case does not")
    from dspark_sidecar.kernels.weights import NormFolded, prepare_layer_weights

    ref, kv_ref = _run(REFERENCE_OPS, tiny_cfg, tiny_ckpt[0], tiny_embed, device, CONTEXTS[contexts])
    unfolded = DSparkDrafter(tiny_cfg, ParallelContext(), TRITON_OPS, torch.bfloat16, device).load(
        CheckpointReader(tiny_ckpt[0], torch.bfloat16, device=device))
    model = DSparkDrafter(tiny_cfg, ParallelContext(), TRITON_OPS, torch.bfloat16, device).load(
        CheckpointReader(tiny_ckpt[0], torch.bfloat16, device=device))
    prepare_layer_weights(model, "bf16", tiny_cfg.quant_block, fold=True)
    assert all(isinstance(layer.qkv_proj.weight, NormFolded) and isinstance(layer.gate_up_proj.weight, NormFolded)
               for layer in model.layers)
    step = scenario.random_step(tiny_cfg, CONTEXTS[contexts], PAGE, PAGES, tiny_embed, seed=3)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    taps = scenario.random_taps(tiny_cfg, pos.numel(), seed=4).to(device)
    kvs = []
    for m in (unfolded, model):
        kv = allocate_kv_cache(tiny_cfg, 1, PAGES, PAGE, torch.bfloat16, device)
        m.commit_context(taps, pos.to(device), slots.to(device), kv)
        kvs.append(kv)
    for a, b in zip(*kvs, strict=True):
        assert torch.equal(a, b)
    out = model.draft_step(step.inputs_embeds.to(device, torch.bfloat16), step.positions.to(device),
                           step.meta.to(device), kvs[1])
    for layer, layer_ref in zip(kvs[1], kv_ref, strict=True):
        parity(layer, layer_ref)
    parity(out, ref)


@pytest.mark.gpu
def test_launch_groups_side_by_side_give_the_same_bits(cuda, tiny_cfg, tiny_ckpt, tiny_embed):
    """17 requests = launch groups of 8, 8 and 1 on two streams (as StepGraphs runs them with
    --launch-streams 2), eager and captured in a CUDA graph: the same hidden states and block K/V
    as in order, since each group runs the same kernels on the same inputs."""
    gen = torch.Generator().manual_seed(17)
    contexts = torch.randint(1, 40, (17,), generator=gen).tolist()
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in contexts)
    model = DSparkDrafter(tiny_cfg, ParallelContext(), TRITON_OPS, torch.bfloat16, cuda).load(
        CheckpointReader(tiny_ckpt[0], torch.bfloat16, device=cuda))
    step = scenario.random_step(tiny_cfg, contexts, PAGE, pages, tiny_embed, seed=5)
    pos, slots = scenario.context_rows(step.meta, PAGE)
    taps = scenario.random_taps(tiny_cfg, pos.numel(), seed=6).to(cuda)
    kv0 = allocate_kv_cache(tiny_cfg, 1, pages, PAGE, torch.bfloat16, cuda)
    model.commit_context(taps, pos.to(cuda), slots.to(cuda), kv0)
    embeds, positions, meta = step.inputs_embeds.to(cuda, torch.bfloat16), step.positions.to(cuda), step.meta.to(cuda)
    streams = [torch.cuda.Stream(cuda) for _ in range(2)]
    concurrent = []  # what each attention launch was told: groups at once beside it

    def attention(*args, **kw):
        concurrent.append(kw.get("concurrent", 1))
        return TRITON_OPS.paged_window_attention(*args, **kw)

    model.set_ops(dataclasses.replace(TRITON_OPS, paged_window_attention=attention))
    got = side_by_side_against_in_order(model, embeds, positions, meta, kv0, streams)
    assert got["eager"] and got["graph"] and all(got["kv"]), got
    # In order: alone (3 groups x 5 layers); then twice side by side (eager, capture warm-up and
    # capture): two streams in use, each group's attention splits for half the SMs. At the tiny
    # model's short windows that is one split either way, hence the same bits.
    layers = tiny_cfg.num_hidden_layers
    assert concurrent == [1] * 3 * layers + [2] * 3 * 3 * layers
