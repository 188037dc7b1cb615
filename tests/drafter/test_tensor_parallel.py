"""TP 2 and TP 4 (real processes, gloo) equal TP 1 on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from helpers.ranks import run_ranks
from helpers.tp_draft import draft, draft_through_lanes

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


def test_launch_groups_side_by_side_need_an_exchange_lane_per_stream(tiny_cfg):
    """At TP > 1 each stream's launch groups must sum through a communicator of their own (one
    communicator's collectives issued from several streams could run in different orders on
    different ranks): with fewer lanes than streams, draft_step refuses before launching."""
    from dspark_sidecar.drafter import scenario
    from dspark_sidecar.drafter.kv_cache import allocate_kv_cache
    from dspark_sidecar.drafter.model import DSparkDrafter
    from dspark_sidecar.drafter.parallel import ParallelContext
    from dspark_sidecar.kernels.ops import REFERENCE_OPS

    class Summing:
        def all_reduce(self, t):
            return t

    model = DSparkDrafter(tiny_cfg, ParallelContext(0, 2, Summing(), (Summing(),)), REFERENCE_OPS, torch.float32)
    step = scenario.random_step(tiny_cfg, [3] * 9, 16, 9, torch.randn(tiny_cfg.vocab_size, tiny_cfg.hidden_size), seed=1)
    kv = allocate_kv_cache(tiny_cfg, 2, 9, 16, torch.float32)
    with pytest.raises(ValueError, match="exchange lane per stream; this rank .* has 2"):
        model.draft_step(step.inputs_embeds, step.positions, step.meta, kv, streams=[object()] * 3)
    # A rank given no lanes at all (an exchange only) has one: two streams are already one too many.
    model = DSparkDrafter(tiny_cfg, ParallelContext(0, 2, Summing()), REFERENCE_OPS, torch.float32)
    with pytest.raises(ValueError, match="exchange lane per stream; this rank .* has 1"):
        model.draft_step(step.inputs_embeds, step.positions, step.meta, kv, streams=[object()] * 2)
    # As many streams as lanes is what the server makes: accepted (one launch group here, so it runs in order
    # on the CPU; the side-by-side path itself is tests/drafter/test_lanes_multi_gpu.py's).
    model = DSparkDrafter(tiny_cfg, ParallelContext(0, 2, Summing(), (Summing(),)), REFERENCE_OPS, torch.float32)
    one = scenario.random_step(tiny_cfg, [3] * 2, 16, 2, torch.randn(tiny_cfg.vocab_size, tiny_cfg.hidden_size), seed=1)
    out = model.draft_step(one.inputs_embeds, one.positions, one.meta, kv, streams=[object()] * 2)
    assert out.shape == (14, tiny_cfg.hidden_size)


@pytest.mark.parametrize("world", [1, 2])
def test_a_rank_that_exchanges_nothing_takes_launch_streams_without_lanes(world, tiny_cfg):
    """TP 1, or one shard computed alone (--shard-of: a LocalExchange at TP 2), sums nothing: its launch groups
    may share the one exchange on any number of streams, so --launch-streams needs no lanes there."""
    from dspark_sidecar.drafter import scenario
    from dspark_sidecar.drafter.kv_cache import allocate_kv_cache
    from dspark_sidecar.drafter.model import DSparkDrafter
    from dspark_sidecar.drafter.parallel import LocalExchange, ParallelContext
    from dspark_sidecar.kernels.ops import REFERENCE_OPS

    model = DSparkDrafter(tiny_cfg, ParallelContext(0, world, LocalExchange()), REFERENCE_OPS, torch.float32)
    step = scenario.random_step(tiny_cfg, [3] * 2, 16, 2, torch.randn(tiny_cfg.vocab_size, tiny_cfg.hidden_size), seed=1)
    kv = allocate_kv_cache(tiny_cfg, world, 2, 16, torch.float32)
    # One launch group: it runs in order on the CPU; what is checked is that the streams are not refused.
    out = model.draft_step(step.inputs_embeds, step.positions, step.meta, kv, streams=[object()] * 3)
    assert out.shape == (14, tiny_cfg.hidden_size)


def test_exchange_lanes_are_addressed_by_stream_index():
    from dspark_sidecar.drafter.parallel import LocalExchange, ParallelContext

    a, b, c = object(), object(), object()
    par = ParallelContext(1, 4, a, (b, c))
    assert par.num_lanes == 3 and not par.local
    assert ParallelContext(1, 4, a).num_lanes == 1  # no lanes: the exchange alone
    assert [par.exchange_of(i) for i in range(3)] == [a, b, c]
    for bad in (-1, 3):
        with pytest.raises(ValueError, match=f"exchange lane {bad} outside the 3"):
            par.exchange_of(bad)
    local = ParallelContext(0, 4, LocalExchange())  # --shard-of: nothing is exchanged, any stream may share it
    assert local.local and all(local.exchange_of(i) is local.exchange for i in range(8))


def test_a_rank_outside_its_group_or_a_dimension_that_does_not_split_is_refused():
    """A rank numbered past its group would shard past the weights' ends, and a dimension that does not
    split evenly would leave its last rows on no rank: both refused where the slice is made."""
    from dspark_sidecar.drafter.parallel import ParallelContext

    for rank, world in ((4, 4), (-1, 4), (0, 0)):
        with pytest.raises(ValueError, match=f"rank {rank} outside world size {world}"):
            ParallelContext(rank, world)
    assert ParallelContext(3, 4).shard(12) == slice(9, 12)
    with pytest.raises(ValueError, match="dimension 10 not divisible by TP size 4"):
        ParallelContext(3, 4).shard(10)


@pytest.mark.parametrize("world", [2, 4])
def test_a_launch_group_summed_through_its_own_lane_gives_the_same_bits(world, tiny_ckpt, tiny_embed):
    """Real processes over gloo: a lane made as the server makes them (app.exchange_lanes: a new group,
    probed once) sums a launch group's partials to the same bits as the world group, and every
    all-reduce of the group went through the lane it was given (2 per layer), none through the other."""
    outs = run_ranks(world, draft_through_lanes, str(tiny_ckpt[0]), tiny_embed, torch.float32)
    layers = 2 * 5
    for r, (out0, out1, calls0, calls1, kv_same) in enumerate(outs):
        assert torch.equal(out0, out1), f"rank {r}: lane 1 gave other sums than lane 0"
        assert torch.equal(out0, outs[0][0]), f"rank {r} differs from rank 0"
        assert calls0 == (layers, 0) and calls1 == (0, layers), (r, calls0, calls1)
        assert all(kv_same), f"rank {r}: the block K/V differ between the lanes"


def test_ranks_with_exchange_lanes_keep_the_attention_out_of_cooperative_launches(tiny_cfg):
    """Beside all-reduce kernels that hold SMs while waiting on peers, a grid that must be resident
    all at once could wait for ever: a rank with lanes asks its attention for no cooperative launch;
    one without lanes (in order, or TP 1) lets the backend choose."""
    import dataclasses

    from dspark_sidecar.drafter import scenario
    from dspark_sidecar.drafter.kv_cache import allocate_kv_cache
    from dspark_sidecar.drafter.model import DSparkDrafter
    from dspark_sidecar.drafter.parallel import ParallelContext
    from dspark_sidecar.kernels import reference
    from dspark_sidecar.kernels.ops import REFERENCE_OPS

    class Summing:
        def all_reduce(self, t):
            return t

    asked = []

    def attention(*args, cooperative=True, **kw):
        asked.append(cooperative)
        return reference.paged_window_attention(*args, **kw)

    ops = dataclasses.replace(REFERENCE_OPS, paged_window_attention=attention)
    step = scenario.random_step(tiny_cfg, [3] * 2, 16, 2, torch.randn(tiny_cfg.vocab_size, tiny_cfg.hidden_size), seed=1)
    for lanes, want in (((Summing(),), False), ((), True)):
        asked.clear()
        model = DSparkDrafter(tiny_cfg, ParallelContext(0, 2, Summing(), lanes), ops, torch.float32)
        kv = allocate_kv_cache(tiny_cfg, 2, 2, 16, torch.float32)
        model.draft_step(step.inputs_embeds, step.positions, step.meta, kv)
        assert asked == [want] * tiny_cfg.num_hidden_layers, (lanes, asked)


def test_the_exchange_sums_over_its_own_group_not_the_world():
    """Real processes over gloo: a DistExchange given a group of 2 of the 4 ranks sums those 2 only.
    The lane test above counts calls in wrappers and compares bits with the world group, which is
    the same set of ranks: an exchange that summed over the world group would pass it."""
    from helpers.tp_draft import sum_in_halves

    outs = run_ranks(4, sum_in_halves, timeout_s=60)
    assert [float(o[0]) for o in outs] == [3.0, 3.0, 7.0, 7.0], outs
