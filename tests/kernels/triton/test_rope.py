"""The Triton RoPE table against reference.rope_cos_sin: same fp64 maths, so the same fp32 bits on a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.kernels import reference  # noqa: E402
from dspark_sidecar.kernels.triton.rope import rope_cos_sin  # noqa: E402

# fp32 spacing just below 1: both sides round the same double to fp32, so on the GPU (the same
# libdevice pow/cos/sin) the bits are equal; the interpreter's numpy cos/sin may differ from
# torch's CPU ones by an fp64 ulp, which can flip one fp32 rounding: one fp32 ulp at most.
ULP = 2.0 ** -23


@pytest.mark.parametrize("n", [1, 7, 56, 130], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("rot,theta", [(64, 5_000_000.0), (16, 10_000.0), (6, 1234.567)],
                         ids=["r64-5e6", "r16-1e4", "r6-odd-theta"])
def test_rope_cos_sin_matches_reference(device, n, rot, theta):
    """Positions in the millions (the fp64 angles matter there) and a theta fp32 cannot hold."""
    gen = torch.Generator().manual_seed(n * 1000 + rot)
    positions = torch.randint(0, 3_000_000, (n,), generator=gen).to(device)
    cos_ref, sin_ref = reference.rope_cos_sin(positions, rot, theta)
    cos, sin = rope_cos_sin(positions, rot, theta)
    assert cos.shape == sin.shape == (n, rot // 2) and cos.dtype == sin.dtype == torch.float32
    if device == "cuda":
        assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
    else:
        assert (cos - cos_ref).abs().max() <= ULP and (sin - sin_ref).abs().max() <= ULP


@pytest.mark.parametrize("rot,theta", [(64, 5_000_000.0), (16, 10_000.0)], ids=["r64-5e6", "r16-1e4"])
def test_rope_cos_sin_positions_past_2_24(device, rot, theta):
    """Positions fp32 cannot hold (past 2^24, odd): each goes to fp64 exactly, as the reference's does; one
    rounded through fp32 (2^24 + 1 -> 2^24) moves the angle by a whole inv_freq (1 radian at i = 0)."""
    positions = torch.tensor([(1 << 24) + 1, (1 << 24) + 3, (1 << 25) + 7, 50_000_001, 7], device=device)
    assert not torch.equal(positions.float().double(), positions.double())  # the case can tell the two apart
    cos_ref, sin_ref = reference.rope_cos_sin(positions, rot, theta)
    cos, sin = rope_cos_sin(positions, rot, theta)
    if device == "cuda":
        assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
    else:
        assert (cos - cos_ref).abs().max() <= ULP and (sin - sin_ref).abs().max() <= ULP


def test_rope_cos_sin_theta_keeps_fp64_bits(device):
    """A theta that is not an fp32 value moves the table: passed as fp32 it would not."""
    positions = torch.tensor([2_999_999], device=device)
    theta = 10_000.000_1
    cos_ref, _ = reference.rope_cos_sin(positions, 64, theta)
    cos_f32, _ = reference.rope_cos_sin(positions, 64, float(torch.tensor(theta, dtype=torch.float32)))
    assert not torch.equal(cos_ref, cos_f32)  # the case can tell the two apart
    cos, _ = rope_cos_sin(positions, 64, theta)
    assert (cos - cos_ref).abs().max() <= ULP


def test_rope_cos_sin_empty(device):
    cos, sin = rope_cos_sin(torch.empty(0, dtype=torch.int64, device=device), 64, 5e6)
    assert cos.shape == sin.shape == (0, 32)


def test_rope_cos_sin_strided_positions(device):
    """The kernel reads positions[i] at i: a strided view (every other element of a wider tensor, as the
    reference takes) must give the table of those positions, not of its neighbours'."""
    wide = torch.randint(0, 3_000_000, (9, 2), generator=torch.Generator().manual_seed(3)).to(device)
    positions = wide[:, 0]
    assert not positions.is_contiguous()
    cos_ref, sin_ref = reference.rope_cos_sin(positions, 16, 10_000.0)
    cos, sin = rope_cos_sin(positions, 16, 10_000.0)
    assert (cos - cos_ref).abs().max() <= ULP and (sin - sin_ref).abs().max() <= ULP
