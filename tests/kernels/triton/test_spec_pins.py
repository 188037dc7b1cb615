"""Spec statements the bf16 parity tolerance cannot see, pinned on the Triton ops with hand-computed values."""

# assert_parity (conftest.py) allows a few bf16 ulps, which is right for summation order but also
# lets through a kernel that forms the norms' `1 + w` in the activation dtype instead of fp32 (spec
# section 1): one extra rounding of about half an ulp, unbiased, so every parity test passed with it.
# These inputs make that rounding change the output (tests/kernels/test_reference_spec_pins.py pins
# the reference on such numbers): w = 2^-8, so 1 + w = 1.00390625 is a bf16 tie that rounds to 1.0,
# while the row's normed values before the (1 + w) are exactly 1.5 and 0.

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.kernels import reference  # noqa: E402
from dspark_sidecar.kernels.triton.ops import TRITON_OPS  # noqa: E402

W = 2.0 ** -8
# Below half an fp32 ulp of 4, so mean(x^2) + EPS is 4 exactly; not 0, so a GEMM tile's all-zero padding
# rows get a finite row scale (rsqrt(0) there only warned, those rows are never stored).
EPS = 2.0 ** -40
# 64 threes among 144 values: mean(x^2) = 64 * 9 / 144 = 4, so the row scale is 0.5 (144: rows of 288
# bytes, as a GPU's tensor descriptors need). 1.5 * 1.00390625 = 1.505859375 rounds once to the bf16
# 1.5078125, 1.5 with 1 + w in bf16; no output is a tie, so a row scale an fp32 ulp off (a GPU's
# approximate divide or rsqrt) rounds the same. The zeros stay zeros.
ROW = ([3.0] * 4 + [0.0] * 5) * 16
WANT = ([1.5078125] * 4 + [0.0] * 5) * 16
K = len(ROW)


def test_rms_norm_forms_one_plus_w_in_fp32(device):
    x = torch.tensor([ROW, ROW[::-1]], dtype=torch.bfloat16, device=device)
    w = torch.full((K,), W, dtype=torch.bfloat16, device=device)
    ref = reference.rms_norm(x, w, EPS)
    assert ref.float().tolist() == [WANT, WANT[::-1]]  # the hand-computed values are the reference's
    assert TRITON_OPS.rms_norm(x, w, EPS).float().cpu().tolist() == [WANT, WANT[::-1]]


def test_qk_norm_rope_forms_one_plus_w_in_fp32(device):
    """Per head (2 heads of K), position 0: RoPE is the identity, so the normed heads come out as they are."""
    x = torch.tensor([[ROW, ROW[::-1]]], dtype=torch.bfloat16, device=device)  # [1, 2 heads, K]
    w = torch.full((K,), W, dtype=torch.bfloat16, device=device)
    cos, sin = reference.rope_cos_sin(torch.tensor([0], device=device), 32, 5e6)
    assert reference.qk_norm_rope(x, w, cos, sin, EPS).float().tolist() == [[WANT, WANT[::-1]]]
    assert TRITON_OPS.qk_norm_rope(x, w, cos, sin, EPS).float().cpu().tolist() == [[WANT, WANT[::-1]]]


def test_norm_linear_forms_one_plus_w_in_fp32(device):
    """Through an identity weight the GEMM's normed row comes back: the kernel scales x by (1 + w) before
    its bf16 dot (3 * 1.00390625 rounds to 3.015625, 3.0 with 1 + w in bf16) and by the row's 0.5 after it."""
    x = torch.tensor([ROW, ROW[::-1]], dtype=torch.bfloat16, device=device)
    nw = torch.full((K,), W, dtype=torch.bfloat16, device=device)
    eye = torch.eye(K, dtype=torch.bfloat16, device=device)
    assert reference.norm_linear(x, nw, EPS, eye).float().tolist() == [WANT, WANT[::-1]]
    assert TRITON_OPS.norm_linear(x, nw, EPS, eye).float().cpu().tolist() == [WANT, WANT[::-1]]
