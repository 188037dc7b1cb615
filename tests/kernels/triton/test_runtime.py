"""runtime: where the Triton kernels run, and programmatic dependent launch (PDL) between them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.kernels.triton import microbench, runtime  # noqa: E402
from dspark_sidecar.kernels.triton.ops import TRITON_OPS  # noqa: E402


def test_pdl_only_on_an_nvidia_gpu_of_sm90(monkeypatch):
    """PDL is a launch attribute of sm_90 and later: never for the interpreter's CPU tensors (whose
    launcher takes no such keyword), and never while the tunable is off."""
    monkeypatch.setattr(runtime, "PDL", True)
    assert not runtime.pdl_of(torch.zeros(1))
    assert runtime.pdl_kwargs(torch.zeros(1)) == {"PDL": False}
    if torch.cuda.is_available():
        on_gpu = torch.zeros(1, device="cuda")
        assert runtime.pdl_of(on_gpu) == runtime.sm90_of(on_gpu)
        assert runtime.pdl_kwargs(on_gpu) == ({"PDL": True, "launch_pdl": True} if runtime.sm90_of(on_gpu) else {"PDL": False})
        monkeypatch.setattr(runtime, "PDL", False)
        assert not runtime.pdl_of(on_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [56, 7])
def test_pdl_gives_the_same_bits(cuda, rows, monkeypatch):
    """The 5-layer step at the TP-4 shard's shapes and a 4096 context (microbench.make_step: the
    qkv GEMM's partials, the prelude writing q and the block K/V, the attention reading them; 56 rows
    merge the splits in the cooperative launch, 7 in the merge kernel), eager and CUDA-graphed with
    PDL on and off: the same bits. A kernel that read its predecessor's output before the wait
    would read stale q or K/V on some launches."""
    if not runtime.sm90_of(torch.zeros(1, device=cuda)):
        pytest.skip("PDL needs compute capability 9.0")
    torch.manual_seed(0)
    step = microbench.make_step(rows, 4096, torch.device(cuda), False, TRITON_OPS)
    got = {}
    for pdl in (False, True):
        monkeypatch.setattr(runtime, "PDL", pdl)
        eager = step().clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        replays = []
        for _ in range(3):
            graph.replay()
            replays.append(out.clone())
        torch.cuda.synchronize()
        got[pdl] = [eager, *replays]
    for a, b in zip(got[False], got[True], strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(got[True][0], r) for r in got[True][1:])
