"""The engine harness and its shim on GPUs: a TP-2 sidecar on the Triton backend, over the data plane, against the stock layers."""

from __future__ import annotations

import pytest
import torch

from dspark_sidecar.client.demo import DemoConfig, run_demo
from dspark_sidecar.client.reasons import REQS
from helpers.engine_fakes import short_socket_dir

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]
if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)


def test_shim_forwards_over_the_data_plane_at_tp2_and_matches_the_stock_layers(tmp_path):
    """Each engine rank on its own GPU (KV cache, stock layers over NCCL), its shim on the doorbell
    with CUDA IPC; the sidecar graphs and pre-launches its steps. Every forwarded round also runs
    the stock layers: bf16 through 5 layers, with the Triton kernels' roundings, stays within 3e-2
    relative (as in test_dataplane_gpu); both engine ranks draft the same tokens."""
    cfg = DemoConfig(rounds=40, tp=2, required_tp=2, dtype="bf16", device="cuda", transport="doorbell",
                     socket_dir=str(short_socket_dir()), work_dir=str(tmp_path), progress_every=0)
    r = run_demo(cfg, out=lambda _line: None)
    too_big = r.fallbacks.get(REQS, 0)
    assert r.forwarded + too_big == r.rounds, r.fallbacks  # only steps above --max-reqs stay local
    assert r.forwarded >= r.rounds // 2 and r.compared == r.forwarded
    assert r.backend == "triton" and r.ranks_agree
    assert r.max_hidden_rel < 3e-2 and r.max_kv_rel < 3e-2, (r.max_hidden_rel, r.max_kv_rel)
