"""Spec draft-step.md sections 2 and 4 at the real MiniMax-M3.1 shapes, typed from the spec text.

The checkpoint tests check the written tiny checkpoint against tensor_specs, which is the code's own
list; here the real preset's list is held against the spec's section 2 written out by hand, and the
TP-4 shards against section 4 (built on the meta device: no memory).
"""

from __future__ import annotations

import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.checkpoint import EMBED_KEY, LM_HEAD_KEY, CheckpointReader, shared_specs, tensor_specs
from dspark_sidecar.drafter.config import PRESETS
from dspark_sidecar.drafter.kv_cache import allocate_kv_cache
from dspark_sidecar.drafter.model import DecoderLayer, DSparkDrafter
from dspark_sidecar.drafter.parallel import ColumnParallelLinear, ParallelContext, ReplicatedLinear, RowParallelLinear
from dspark_sidecar.kernels.ops import REFERENCE_OPS

REAL = PRESETS["minimax-m3.1"]


def spec_section_2() -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of `dspark/` with its shape and stored dtype, as section 2 lists them."""
    p = "language_model.model.dspark."
    want = {
        f"{p}fc.weight": ((6144, 30720), "bf16"),
        f"{p}hidden_norm.weight": ((6144,), "bf16"),
        f"{p}final_norm.weight": ((6144,), "bf16"),
        f"{p}markov_head.markov_w1.weight": ((200064, 256), "bf16"),
        f"{p}markov_head.markov_w2.weight": ((200064, 256), "bf16"),
        f"{p}confidence_head.proj.weight": ((1, 6400), "bf16"),
        f"{p}confidence_head.proj.bias": ((1,), "bf16"),
    }
    linears = {"self_attn.q_proj": (8192, 6144), "self_attn.k_proj": (512, 6144), "self_attn.v_proj": (512, 6144),
               "self_attn.o_proj": (6144, 8192), "mlp.gate_proj": (12288, 6144), "mlp.up_proj": (12288, 6144),
               "mlp.down_proj": (6144, 12288)}
    for i in range(5):
        lp = f"{p}layers.{i}.decoder_layer."
        want[f"{lp}input_layernorm.weight"] = ((6144,), "bf16")
        want[f"{lp}post_attention_layernorm.weight"] = ((6144,), "bf16")
        want[f"{lp}self_attn.q_norm.weight"] = ((128,), "bf16")
        want[f"{lp}self_attn.k_norm.weight"] = ((128,), "bf16")
        for name, (rows, cols) in linears.items():
            want[f"{lp}{name}.weight"] = ((rows, cols), "f8")
            want[f"{lp}{name}.weight_scale_inv"] = ((rows, cols // 32), "u8")
    return want


def test_real_checkpoint_layout_is_spec_section_2():
    want = spec_section_2()
    assert len(want) == 97
    got = {}
    for s in tensor_specs(REAL):
        got[s.key] = (s.shape, "f8" if s.mxfp8 else "bf16")
        if s.mxfp8:
            got[s.key + "_scale_inv"] = ((s.shape[0], s.shape[1] // REAL.quant_block), "u8")
    assert got == want
    assert EMBED_KEY == "language_model.model.embed_tokens.weight" and LM_HEAD_KEY == "language_model.lm_head.weight"
    assert {s.key: s.shape for s in shared_specs(REAL)} == {EMBED_KEY: (200064, 6144), LM_HEAD_KEY: (200064, 6144)}


def test_tp4_rank_shards_are_spec_section_4():
    """16 query heads and 1 KV head per rank; qkv and gate_up column-parallel (3072 FFN columns per rank),
    o_proj and down_proj row-parallel; fc replicated."""
    for rank in range(4):
        par = ParallelContext(rank, 4)
        layer = DecoderLayer(REAL, par, REFERENCE_OPS, torch.bfloat16, "meta")
        assert (layer.q_heads, layer.kv_heads) == (16, 1)
        assert isinstance(layer.qkv_proj, ColumnParallelLinear) and isinstance(layer.gate_up_proj, ColumnParallelLinear)
        assert isinstance(layer.o_proj, RowParallelLinear) and isinstance(layer.down_proj, RowParallelLinear)
        assert layer.qkv_proj.weight.shape == (16 * 128 + 128 + 128, 6144)
        assert layer.gate_up_proj.weight.shape == (2 * 3072, 6144)
        assert layer.o_proj.weight.shape == (6144, 16 * 128)
        assert layer.down_proj.weight.shape == (6144, 3072)
        assert par.shard(64) == slice(16 * rank, 16 * rank + 16) and par.shard(4) == slice(rank, rank + 1)
    model = DSparkDrafter(REAL, ParallelContext(1, 4), REFERENCE_OPS, torch.bfloat16, "meta")
    assert isinstance(model.fc, ReplicatedLinear) and model.fc.weight.shape == (6144, 30720)


class CountingExchange:
    def __init__(self) -> None:
        self.calls = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return t


def test_two_exchanges_per_layer_ten_per_step_none_in_the_context_commit(tiny_cfg, tiny_ckpt, tiny_embed):
    """Section 4: "two partial sums per layer are exchanged between ranks (10 per step)"; fc is replicated,
    so the context commit exchanges nothing. (A rank of 2 alone with a counting exchange: values unused.)"""
    ex = CountingExchange()
    model = DSparkDrafter(tiny_cfg, ParallelContext(0, 2, ex), REFERENCE_OPS, torch.float32).load(
        CheckpointReader(tiny_ckpt[0], torch.float32))
    page, lens = 16, [20]
    pages = scenario.pages_needed(lens[0] + layout.QPR, page)
    step = scenario.random_step(tiny_cfg, lens, page, pages, tiny_embed, seed=1)
    kv = allocate_kv_cache(tiny_cfg, 2, pages, page, torch.float32)
    pos, slots = scenario.context_rows(step.meta, page)
    model.commit_context(scenario.random_taps(tiny_cfg, pos.numel(), seed=2, dtype=torch.float32), pos, slots, kv)
    assert ex.calls == 0
    model.draft_step(step.inputs_embeds, step.positions, step.meta, kv)
    assert ex.calls == 2 * tiny_cfg.num_hidden_layers == 10
