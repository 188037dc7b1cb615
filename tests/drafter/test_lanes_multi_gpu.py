"""Launch groups side by side at TP 2 over NCCL: one exchange lane (communicator) per stream, the same bits as in order."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
# Skip before importing triton: imported at collection, before tests/kernels/triton/conftest.py
# turns the interpreter on, it would leave every CPU kernel test without it.
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)
pytest.importorskip("triton")

from helpers.lanes_gpu import run_nccl_ranks, side_by_side_step  # noqa: E402


@pytest.mark.parametrize("streams", [2, 3])
def test_side_by_side_with_a_lane_per_stream_equals_in_order(streams, tiny_ckpt, tiny_embed):
    """17 requests on 2 or 3 streams, each stream's all-reduces on a communicator of its own: eager and
    graph-replayed hidden states and block K/V equal the in-order step on every rank, and the ranks
    agree (the exchange gives each the same sums). A shared communicator could hang here instead."""
    outs = run_nccl_ranks(2, side_by_side_step, str(tiny_ckpt[0]), tiny_embed, streams)
    for r, o in enumerate(outs):
        assert o["lanes"] == streams
        assert o["eager_same"] and o["graph_same"], f"rank {r}: side by side differs from in order"
        assert all(o["kv_same"]), f"rank {r}: block K/V differ"
    assert torch.equal(outs[0]["want"], outs[1]["want"])
