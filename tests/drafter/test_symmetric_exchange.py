"""SymmetricExchange (torch symmetric memory's one-shot all-reduce) against NCCL, on real GPUs."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.server.config import ServeConfig, ServeConfigError


def test_symmetric_exchange_is_refused_where_it_cannot_run():
    with pytest.raises(ServeConfigError, match="--exchange symmetric: needs CUDA GPUs"):
        ServeConfig(exchange="symmetric", device="cpu")
    with pytest.raises(ServeConfigError, match="--exchange symmetric: needs CUDA GPUs"):
        ServeConfig(exchange="symmetric", dist_backend="gloo")
    with pytest.raises(ServeConfigError, match="--exchange: must be nccl or symmetric"):
        ServeConfig(exchange="mpi")


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_symmetric_exchange_sums_like_nccl_and_every_rank_gets_the_same_bits():
    from helpers.exchange_ranks import COUNT, ROWS, symmetric_vs_nccl
    from helpers.ranks import run_ranks

    res = run_ranks(2, symmetric_vs_nccl)
    for rows in ROWS:
        for i in range(COUNT):  # ten in a row, each its own data: a reused buffer overwritten too early would show
            got, want = res[0][rows]["graph"][i], res[0][rows]["nccl"][i]
            # bf16 inputs summed in another order than NCCL's, rounded once to bf16: ~1 ulp.
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
            assert torch.equal(got, res[0][rows]["eager"][i])  # graphed == eager
            assert torch.equal(got, res[1][rows]["graph"][i])  # rank 1 holds the same bits
    assert torch.equal(res[0]["fallback"], torch.full((3, 512), 2.0, dtype=torch.bfloat16))
