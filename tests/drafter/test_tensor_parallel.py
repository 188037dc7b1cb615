"""TP 2 and TP 4 (real processes, gloo) equal TP 1 on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from helpers.ranks import run_ranks
from helpers.tp_draft import draft

# fp32: the ranks' partial sums are added in a different order than TP 1's single dot
# products, so results differ by rounding only (~1e-6 relative); 1e-5 leaves margin.
# bf16: partial sums are rounded to bf16 before the all-reduce (as in vLLM), a few bf16 ulps.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def tp1(tiny_ckpt, tiny_embed):
    return {dt: draft(0, 1, str(tiny_ckpt[0]), tiny_embed, dt) for dt in TOL}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", list(TOL), ids=["fp32", "bf16"])
def test_tp_equals_tp1(world, dtype, tp1, tiny_ckpt, tiny_embed):
    outs = run_ranks(world, draft, str(tiny_ckpt[0]), tiny_embed, dtype)
    for r in range(1, world):  # every rank ends with the same all-reduced hidden states
        assert torch.equal(outs[r], outs[0]), f"rank {r} differs from rank 0"
    ref = tp1[dtype]
    err = (outs[0].double() - ref.double()).norm() / ref.double().norm()
    assert err < TOL[dtype], f"TP {world} vs TP 1: relative error {err:.2e}"


def test_launch_groups_side_by_side_are_refused_with_an_exchange(tiny_cfg):
    """At TP > 1 every launch group's all-reduces share one communicator: side by side on several
    streams they could be issued out of order across ranks, so draft_step refuses before launching."""
    from dspark_sidecar.drafter import scenario
    from dspark_sidecar.drafter.kv_cache import allocate_kv_cache
    from dspark_sidecar.drafter.model import DSparkDrafter
    from dspark_sidecar.drafter.parallel import ParallelContext
    from dspark_sidecar.kernels.ops import REFERENCE_OPS

    class Summing:
        def all_reduce(self, t):
            return t

    model = DSparkDrafter(tiny_cfg, ParallelContext(0, 2, Summing()), REFERENCE_OPS, torch.float32)
    step = scenario.random_step(tiny_cfg, [3] * 9, 16, 9, torch.randn(tiny_cfg.vocab_size, tiny_cfg.hidden_size), seed=1)
    kv = allocate_kv_cache(tiny_cfg, 2, 9, 16, torch.float32)
    with pytest.raises(ValueError, match="need TP 1"):
        model.draft_step(step.inputs_embeds, step.positions, step.meta, kv, streams=[object(), object()])
