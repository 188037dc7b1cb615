"""The GEMMs routed to the vendor BLAS (kernels/triton/blas.py): their results, and when ops.py routes them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.kernels import reference  # noqa: E402
from dspark_sidecar.kernels.triton import blas, gemm  # noqa: E402
from dspark_sidecar.kernels.triton.ops import TRITON_OPS  # noqa: E402
from dspark_sidecar.kernels.weights import MxFp8Weight, NormFolded  # noqa: E402

EPS, ALPHA, LIMIT = 1e-6, 1.702, 7.0


def _inputs(rows, k, n, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen) * 2.0
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    nw = torch.randn(k, generator=gen) * 0.1
    res = torch.randn(rows, n, generator=gen)
    return x.to(device, dtype), w.to(device, dtype), nw.to(device, dtype), res.to(device, dtype)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("swiglu", [False, True], ids=["norm_linear", "norm_linear_swiglu"])
@pytest.mark.parametrize("shape", [(7, 256, 96), (21, 320, 200), (56, 384, 192)], ids=lambda s: "x".join(map(str, s)))
def test_vendor_norm_linear(device, shape, swiglu, seed, parity):
    """The vendor's fp32 product, then the finalize summing each row's squares from x itself (K not a
    power of two at 320 and 384: the row load is masked): the reference's results within the bf16
    bound (parity: the folded weight and the row scale after the product round differently)."""
    rows, k, n = shape
    x, w, nw, _ = _inputs(rows, k, n, torch.bfloat16, device, seed)
    ref = (reference.norm_linear_swiglu(x, nw, EPS, w, ALPHA, LIMIT) if swiglu
           else reference.norm_linear(x, nw, EPS, w))
    out = blas.norm_linear(x, NormFolded.fold(w, nw), nw, EPS, (ALPHA, LIMIT) if swiglu else None)
    parity(out, ref)
    # x as a view of a wider tensor (row stride past k): the finalize reads each row of x at k apart.
    wide = torch.cat([x, x.flip(0)], dim=1)[:, :k]
    assert torch.equal(blas.norm_linear(wide, NormFolded.fold(w, nw), nw, EPS, (ALPHA, LIMIT) if swiglu else None), out)


def test_vendor_norm_linear_refuses_another_norm(device):
    x, w, nw, _ = _inputs(7, 256, 96, torch.bfloat16, device, 0)
    with pytest.raises(ValueError, match="another norm weight"):
        blas.norm_linear(x, NormFolded.fold(w, nw), nw.clone(), EPS)


def test_vendor_norm_linear_refuses_an_odd_gate_up(device):
    """An odd gate|up weight has no halves: the vendor route paired gate column j with column f + j of a
    floored f and dropped the last row unseen, where the Triton GEMM (gemm._check) and the reference refuse."""
    x, w, nw, _ = _inputs(7, 256, 97, torch.bfloat16, device, 0)
    with pytest.raises(RuntimeError):
        reference.norm_linear_swiglu(x, nw, EPS, w, ALPHA, LIMIT)
    with pytest.raises(ValueError, match="odd number of rows"):
        gemm.gemm(x, NormFolded.fold(w, nw), nw, EPS, swiglu=(ALPHA, LIMIT))
    with pytest.raises(ValueError, match="odd number of rows"):
        blas.norm_linear(x, NormFolded.fold(w, nw), nw, EPS, (ALPHA, LIMIT))


@pytest.mark.gpu
def test_ops_route_dense_gpu_linears_to_the_vendor(cuda, monkeypatch, parity):
    """On a GPU, with the tunables on: a plain linear is the reference's bits (the same torch ops);
    a folded-norm GEMM runs the vendor route, no Triton GEMM launch; MXFP8 weights and tunables
    off keep the Triton GEMM."""
    x, w, nw, res = _inputs(56, 384, 192, torch.bfloat16, cuda, 3)
    launches = []
    real = gemm._gemm_kernel
    monkeypatch.setattr(gemm, "_gemm_kernel", type("Spy", (), {"__getitem__": lambda s, g: launches.append(g) or real[g]})())
    monkeypatch.setattr(blas, "PLAIN_MIN_ROWS", 1)
    monkeypatch.setattr(blas, "NORM_MIN_ROWS", 1)
    monkeypatch.setattr(blas, "ADDMM", False)
    assert torch.equal(TRITON_OPS.linear(x, w, res), reference.linear(x, w, res))
    monkeypatch.setattr(blas, "ADDMM", True)
    fused, ref = TRITON_OPS.linear(x, w, res), reference.linear(x, w, res)
    parity(fused, ref)
    # One rounding of the exact sum against the reference's two: apart by at most the product's
    # first rounding (half an ulp of y) plus one ulp of the output (eps = 2^-7 bounds an ulp relative
    # to a bf16 value); a residual lost or added twice is |res|, far outside.
    y = reference.linear(x, w).float()
    bound = torch.finfo(torch.bfloat16).eps * (ref.float().abs() + y.abs())
    assert ((fused.float() - ref.float()).abs() <= bound).all()
    acc = res.clone()  # written over the residual in place (no copy of it first): the same bits
    assert TRITON_OPS.linear(x, w, acc, accumulate=True).data_ptr() == acc.data_ptr() and torch.equal(acc, fused)
    folded = NormFolded.fold(torch.cat([w, w.flip(0)]), nw)
    parity(TRITON_OPS.norm_linear_swiglu(x, nw, EPS, folded, ALPHA, LIMIT),
           reference.norm_linear_swiglu(x, nw, EPS, torch.cat([w, w.flip(0)]), ALPHA, LIMIT))
    assert launches == []
    TRITON_OPS.linear(x, MxFp8Weight.quantize(w))
    assert len(launches) == 1
    monkeypatch.setattr(blas, "PLAIN_MIN_ROWS", 0)
    monkeypatch.setattr(blas, "NORM_MIN_ROWS", 57)
    parity(TRITON_OPS.linear(x, w, res), reference.linear(x, w, res))
    parity(TRITON_OPS.norm_linear(x, nw, EPS, NormFolded.fold(w, nw)), reference.norm_linear(x, nw, EPS, w))
    assert len(launches) == 3


def test_what_the_vendor_route_takes(monkeypatch):
    """Dense bf16/fp16 weights of the activation's dtype on a GPU only: never CPU tensors (the
    interpreter runs the Triton kernels), MXFP8 weights, fp32, or a norm that is not folded; and
    the folded-norm route only where torch.mm has out_dtype."""
    monkeypatch.setattr(blas, "PLAIN_MIN_ROWS", 1)
    monkeypatch.setattr(blas, "NORM_MIN_ROWS", 1)
    x, w, nw, _ = _inputs(7, 256, 96, torch.bfloat16, "cpu", 0)
    assert not blas.plain_applies(x, w) and not blas.norm_applies(x, NormFolded.fold(w, nw))
    meta = torch.empty(8, 256, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(blas, "nvidia_of", lambda t: t.device.type == "meta")  # meta tensors stand for a GPU's
    wm = torch.empty(96, 256, dtype=torch.bfloat16, device="meta")
    assert blas.plain_applies(meta, wm)
    assert blas.norm_applies(meta, NormFolded(wm, torch.empty(256, dtype=torch.bfloat16, device="meta")))
    assert not blas.norm_applies(meta, wm)  # a norm that is not folded: the Triton GEMM scales x
    assert not blas.plain_applies(meta, wm.float()) and not blas.plain_applies(meta.float(), wm.float())
    assert not blas.plain_applies(meta, MxFp8Weight.quantize(w))
    monkeypatch.setattr(blas, "MM_OUT_DTYPE", False)  # an older torch: mm without out_dtype
    assert not blas.norm_applies(meta, NormFolded(wm, torch.empty(256, dtype=torch.bfloat16, device="meta")))
    assert blas.plain_applies(meta, wm)
    monkeypatch.setattr(blas, "MM_OUT_DTYPE", True)
    monkeypatch.setattr(blas, "NORM_MIN_ROWS", 9)
    monkeypatch.setattr(blas, "PLAIN_MIN_ROWS", 9)
    assert not blas.norm_applies(meta, NormFolded(wm, torch.empty(256, dtype=torch.bfloat16, device="meta")))
    assert not blas.plain_applies(meta, wm)  # 8 rows, below the threshold
    monkeypatch.setattr(blas, "NORM_MIN_ROWS", 0)  # 0: never, whatever the rows
    monkeypatch.setattr(blas, "PLAIN_MIN_ROWS", 0)
    assert not blas.norm_applies(meta, NormFolded(wm, torch.empty(256, dtype=torch.bfloat16, device="meta")))
    assert not blas.plain_applies(meta, wm)


@pytest.mark.parametrize("addmm", [False, True])
def test_vendor_linear_accumulates_over_the_residual(monkeypatch, addmm):
    """accumulate=True: the sum written over the residual itself (Ops.linear's contract, no copy of it
    first), on either route (addmm's epilogue or the reference's maths); the plain torch ops, on the CPU."""
    monkeypatch.setattr(blas, "ADDMM", addmm)
    x, w, _, res = _inputs(7, 64, 32, torch.bfloat16, "cpu", 5)
    fresh = blas.linear(x, w, res)
    acc = res.clone()
    assert blas.linear(x, w, acc, accumulate=True).data_ptr() == acc.data_ptr()
    assert torch.equal(acc, fresh) and not torch.equal(acc, res)


def test_the_out_dtype_probe(monkeypatch):
    """An mm without out_dtype (torch before it had one) makes the probe say no, rather than the
    folded-norm route failing inside a step."""
    assert isinstance(blas.MM_OUT_DTYPE, bool)

    def old_mm(a, b, *, out=None):
        return a @ b

    monkeypatch.setattr(torch, "mm", old_mm)
    assert blas._mm_has_out_dtype() is False
