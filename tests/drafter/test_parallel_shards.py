"""Each rank's shard of the parallel linears, in one process: the ranks' outputs together equal the full layer."""

# test_tensor_parallel.py runs whole drafters over gloo in several processes. Here each rank r of N is
# built alone, with an exchange that records what it was given and sums nothing, so that the test
# itself adds the ranks' partial outputs: a shard cut from the wrong rows or columns, a residual joined
# on every rank, or an exchange missing or doubled shows up as a wrong sum or a wrong count, in ms.

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.drafter.parallel import (
    ColumnParallelLinear, ParallelContext, ReplicatedLinear, RowParallelLinear,
)
from dspark_sidecar.kernels.ops import REFERENCE_OPS

F32 = torch.float32


class Source:
    """A WeightSource over full matrices: the slice a rank asks for, checked against the full shape."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights, self.reads = weights, []

    def read(self, key, shape, rows=None, cols=None):
        w = self.weights[key]
        assert tuple(w.shape) == tuple(shape), (key, w.shape, shape)
        self.reads.append((key, rows, cols))
        return w[rows if rows is not None else slice(None), cols if cols is not None else slice(None)].clone()


class Recording:
    """An exchange that keeps a copy of each tensor it is asked to sum and returns it unchanged (one rank alone)."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.seen.append(t.clone())
        return t


def _weights(gen: torch.Generator, **shapes) -> dict[str, torch.Tensor]:
    return {k: torch.randn(*s, generator=gen, dtype=F32) for k, s in shapes.items()}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_column_parallel_shards_of_fused_matrices_put_together_equal_the_full_outputs(world):
    """q|k|v fused: rank r holds rows r/N of each matrix on its own (not r/N of the concatenation), so its
    output is [q_r | k_r | v_r]; the ranks' pieces, regrouped per matrix, are the full q, k and v."""
    gen = torch.Generator().manual_seed(0)
    outs = {"q": 16, "k": 8, "v": 8}
    src = Source(_weights(gen, **{k: (o, 12) for k, o in outs.items()}))
    x = torch.randn(5, 12, generator=gen, dtype=F32)
    pieces = {k: [] for k in outs}
    for r in range(world):
        ex = Recording()
        lin = ColumnParallelLinear(12, list(outs.values()), ParallelContext(r, world, ex), REFERENCE_OPS, F32, "cpu")
        lin.load(src, list(outs))
        y = lin(x)
        assert y.shape == (5, sum(outs.values()) // world) and ex.seen == []  # nothing exchanged
        for k, part in zip(outs, y.split([o // world for o in outs.values()], dim=1), strict=True):
            pieces[k].append(part)
    for k in outs:
        torch.testing.assert_close(torch.cat(pieces[k], dim=1), x @ src.weights[k].T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_row_parallel_partials_summed_over_ranks_equal_the_full_output_with_the_residual_once(world, accumulate):
    """Rank r of N: its partial x[:, cols_r] @ W[:, cols_r]^T goes through its exchange exactly once, and only
    rank 0's carries the residual; the test's sum of what the ranks exchanged is residual + x @ W^T."""
    gen = torch.Generator().manual_seed(1)
    src = Source(_weights(gen, o=(6, 16)))
    x = torch.randn(3, 16, generator=gen, dtype=F32)
    residual = torch.randn(3, 6, generator=gen, dtype=F32)
    total = torch.zeros(3, 6, dtype=F32)
    for r in range(world):
        ex = Recording()
        par = ParallelContext(r, world, ex)
        lin = RowParallelLinear(16, 6, par, REFERENCE_OPS, F32, "cpu")
        lin.load(src, "o")
        res = residual.clone()
        y = lin(x[:, par.shard(16)], residual=res, accumulate=accumulate)
        assert len(ex.seen) == 1, f"rank {r} of {world}: {len(ex.seen)} exchanges, expected 1"
        assert torch.equal(ex.seen[0], y)  # what it returns is what it exchanged (the sum, on a real group)
        if r and accumulate:
            assert torch.equal(res, residual)  # only rank 0 may write over the residual
        total += ex.seen[0]
    torch.testing.assert_close(total, residual + x @ src.weights["o"].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [1, 2])
def test_rank_0_with_accumulate_sums_into_the_residual_it_was_given(world):
    """accumulate is handed on to Ops.linear: rank 0's partial is written over its (dead) residual and that
    tensor is what the exchange sums and the layer returns, no new one (DecoderLayer's residual stream
    relies on it: a GPU backend then copies nothing). Without accumulate the residual is left alone."""
    gen = torch.Generator().manual_seed(5)
    src = Source(_weights(gen, o=(6, 16)))
    x = torch.randn(3, 16, generator=gen, dtype=F32)
    residual = torch.randn(3, 6, generator=gen, dtype=F32)
    ex = Recording()
    par = ParallelContext(0, world, ex)
    lin = RowParallelLinear(16, 6, par, REFERENCE_OPS, F32, "cpu")
    lin.load(src, "o")
    part = x[:, par.shard(16)]
    kept = residual.clone()
    y = lin(part, residual=kept)
    assert y is not kept and torch.equal(kept, residual)
    acc = residual.clone()
    y_acc = lin(part, residual=acc, accumulate=True)
    assert y_acc is acc and torch.equal(acc, y)


def test_rank_2_of_4_reads_its_own_quarter_and_a_replicated_weight_whole():
    src = Source(_weights(torch.Generator().manual_seed(2), q=(16, 8), k=(8, 8), o=(8, 16), fc=(4, 8)))
    par = ParallelContext(2, 4, Recording())
    ColumnParallelLinear(8, [16, 8], par, REFERENCE_OPS, F32, "cpu").load(src, ["q", "k"])
    RowParallelLinear(16, 8, par, REFERENCE_OPS, F32, "cpu").load(src, "o")
    fc = ReplicatedLinear(8, 4, REFERENCE_OPS, F32, "cpu")
    fc.load(src, "fc")
    assert src.reads == [("q", slice(8, 12), None), ("k", slice(4, 6), None), ("o", None, slice(8, 12)),
                         ("fc", None, None)]
    assert torch.equal(fc.weight, src.weights["fc"])


@pytest.mark.parametrize("which", ["column", "row"])
def test_a_dimension_that_does_not_split_over_the_ranks_is_refused_at_load_not_cut_short(which):
    """A q|k|v with 6 KV rows at TP 4 (or an FFN of 10 inputs): per = 1 would give ranks 0..3 rows 0..3 and
    leave 4..5 on no rank. The load says which dimension, before anything is copied."""
    gen = torch.Generator().manual_seed(3)
    par = ParallelContext(3, 4, Recording())
    if which == "column":
        src = Source(_weights(gen, q=(8, 8), k=(6, 8)))
        lin = ColumnParallelLinear(8, [8, 6], par, REFERENCE_OPS, F32, "cpu")
        before = lin.weight.clone()
        with pytest.raises(ValueError, match="dimension 6 not divisible by TP size 4"):
            lin.load(src, ["q", "k"])
    else:
        src = Source(_weights(gen, down=(8, 10)))
        lin = RowParallelLinear(10, 8, par, REFERENCE_OPS, F32, "cpu")
        before = lin.weight.clone()
        with pytest.raises(ValueError, match="dimension 10 not divisible by TP size 4"):
            lin.load(src, "down")
    torch.testing.assert_close(lin.weight, before, rtol=0, atol=0, equal_nan=True)  # nothing copied


def test_a_row_parallel_output_is_summed_by_the_exchange_of_the_lane_it_is_given():
    """Lane j's launch groups run on stream j: their partials must go through lane j's communicator only (one
    communicator's collectives from two streams could pair differently on different ranks)."""
    gen = torch.Generator().manual_seed(4)
    src = Source(_weights(gen, o=(6, 16)))
    lanes = [Recording(), Recording(), Recording()]
    par = ParallelContext(1, 2, lanes[0], tuple(lanes[1:]))
    lin = RowParallelLinear(16, 6, par, REFERENCE_OPS, F32, "cpu")
    lin.load(src, "o")
    x = torch.randn(2, 8, generator=gen, dtype=F32)
    for lane in (2, 0, 1):
        lin(x, lane=lane)
    assert [len(ex.seen) for ex in lanes] == [1, 1, 1]
    with pytest.raises(ValueError, match="exchange lane 3 outside the 3"):
        lin(x, lane=3)
