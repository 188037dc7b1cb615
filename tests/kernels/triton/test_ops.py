"""TRITON_OPS (kernels/triton/ops.py): the reference's signatures, and each linear op's two routes.

ops.py sends a linear to the vendor BLAS (blas.py) or to the Triton GEMM on every call. The vendor
route is only taken on an NVIDIA GPU, so in the interpreter (CI) nothing ran ops.py's vendor branches:
here the route checks are forced either way, and both must give the reference's result, with the
constants in the order the reference takes them (alpha, limit) and the residual written over in place.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.kernels import reference  # noqa: E402
from dspark_sidecar.kernels.ops import REFERENCE_OPS, Ops  # noqa: E402
from dspark_sidecar.kernels.triton import blas, gemm  # noqa: E402
from dspark_sidecar.kernels.triton.ops import TRITON_OPS  # noqa: E402
from dspark_sidecar.kernels.weights import NormFolded  # noqa: E402

# Not the spec's defaults (alpha 1.702, limit 7): swapped, alpha 0.5 and limit 1.0 give other values.
EPS, ALPHA, LIMIT = 1e-6, 1.0, 0.5


def test_every_triton_op_takes_the_reference_arguments():
    """The layers call each op with the reference's positional arguments (Ops: "with the signatures of
    kernels.reference"): a kernel op whose parameters came in another order, or lacked a default the
    layers rely on (cooperative, concurrent), would be handed the wrong tensors. Extra parameters
    must have defaults."""
    assert TRITON_OPS.name == "triton"
    for f in dataclasses.fields(Ops):
        if f.name == "name":
            continue
        want = list(inspect.signature(getattr(REFERENCE_OPS, f.name)).parameters.values())
        got = list(inspect.signature(getattr(TRITON_OPS, f.name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in got[: len(want)]] == [(p.name, p.kind, p.default) for p in want], f.name
        assert all(p.default is not inspect.Parameter.empty for p in got[len(want):]), f.name


def _inputs(device, dtype=torch.bfloat16, rows=7, k=256, n=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * 2.0
    w = torch.randn(n, k, generator=gen) * 2 * k ** -0.5
    nw = torch.randn(k, generator=gen) * 0.1
    res = torch.randn(rows, n, generator=gen)
    return x.to(device, dtype), w.to(device, dtype), nw.to(device, dtype), res.to(device, dtype)


@pytest.mark.parametrize("plain", [False, True], ids=["plain-triton", "plain-vendor"])
@pytest.mark.parametrize("norm", [False, True], ids=["norm-triton", "norm-vendor"])
def test_linear_ops_on_either_route(device, monkeypatch, parity, plain, norm):
    """linear (plain, with a residual, accumulated over it) through the route blas.plain_applies picks, and
    norm_linear and norm_linear_swiglu with a folded norm through the one blas.norm_applies picks: the
    reference's values, and a Triton GEMM launched exactly where the route is not the vendor's."""
    monkeypatch.setattr(blas, "plain_applies", lambda x, w: plain)
    monkeypatch.setattr(blas, "norm_applies", lambda x, w: norm)
    launches = []
    real = gemm._gemm_kernel
    monkeypatch.setattr(gemm, "_gemm_kernel", type("Spy", (), {"__getitem__": lambda s, g: launches.append(g) or real[g]})())
    x, w, nw, res = _inputs(device)
    parity(TRITON_OPS.linear(x, w), reference.linear(x, w))
    parity(TRITON_OPS.linear(x, w, res), reference.linear(x, w, res))
    acc = res.clone()
    out = TRITON_OPS.linear(x, w, acc, accumulate=True)
    assert out.data_ptr() == acc.data_ptr(), "accumulate: the sum is written over the residual (Ops.linear)"
    parity(acc, reference.linear(x, w, res))
    assert len(launches) == (0 if plain else 3), launches
    launches.clear()
    parity(TRITON_OPS.norm_linear(x, nw, EPS, NormFolded.fold(w, nw)), reference.norm_linear(x, nw, EPS, w))
    gu = torch.cat([w, w.flip(0)])
    ref = reference.norm_linear_swiglu(x, nw, EPS, gu, ALPHA, LIMIT)
    swapped = reference.norm_linear_swiglu(x, nw, EPS, gu, LIMIT, ALPHA).float()
    assert (ref.float() - swapped).abs().max() > 0.1 * ref.float().abs().max()  # the case tells them apart
    parity(TRITON_OPS.norm_linear_swiglu(x, nw, EPS, NormFolded.fold(gu, nw), ALPHA, LIMIT), ref)
    assert len(launches) == (0 if norm else 2), launches
