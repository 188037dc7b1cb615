"""Triton kernel tests: on the GPU where CUDA is present, else in Triton's CPU interpreter (CI).

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module
imports triton or the kernels; on a CUDA machine it is left alone and the `gpu` variants run.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# As Triton itself reads it (runtime.INTERPRET does the same): a spelling it accepts and a list here did not
# ("y") skipped every CPU kernel test as "TRITON_INTERPRET is not 1".
try:
    import triton  # noqa: E402  (after the setdefault above)
except ModuleNotFoundError:  # no `triton` extra (README's `.[test]` install): each module here importorskips it,
    triton = None  # and an unguarded import stopped the whole suite's collection with one error
INTERPRETING = triton is not None and bool(triton.knobs.runtime.interpret)
_EARLY = "dspark_sidecar.kernels.triton.runtime" in sys.modules  # imported before this conftest ran

def _cpu_skip_reason() -> str | None:
    if HAS_CUDA:
        return "a GPU is present: the kernels are checked on it, not in the interpreter"
    if not INTERPRETING:
        return "no GPU and TRITON_INTERPRET is not 1"
    from dspark_sidecar.kernels.triton import runtime
    if _EARLY and not runtime.INTERPRET:
        return "the Triton kernels were imported before TRITON_INTERPRET was set (run this folder alone)"
    return None


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
def device(request) -> str:
    """Where the kernels run: 'cuda' (marked gpu) or 'cpu' (the interpreter, where no GPU is present)."""
    if request.param == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    if request.param == "cpu" and (reason := _cpu_skip_reason()):
        pytest.skip(reason)
    return request.param


@pytest.fixture
def cuda() -> str:
    """For the real-shape tests: the GPU only (they are too large for the interpreter)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return "cuda"


# Tolerances, relative to max|ref| (max error) and to mean|ref| (mean error).
# bf16: kernel and reference both round once to bf16 at the end (RTNE), but at different points
# in between (the normed activation is rounded before the reference's matmul and after the
# kernel's per-row scale; attention's P is rounded to bf16 for the P @ V tensor-core dot) and
# they sum in another order. One output ulp is 2^-8..2^-7 relative; SwiGLU multiplies two
# rounded halves. So the largest error may reach a few ulps of max|ref| (2^-5), while the mean
# error, where roundings cancel, must stay within one ulp (2^-7): a biased rounding or a wrong
# index or mask fails it. fp32: only the summation order differs (up to 6144 terms): 2e-5.
TOLERANCE = {torch.bfloat16: (2.0 ** -5, 2.0 ** -7), torch.float32: (2e-5, 2e-6)}


def assert_parity(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    o, r = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(o).all(), "non-finite output"
    max_tol, mean_tol = TOLERANCE[ref.dtype]
    err = (o - r).abs()
    scale, mean_scale = r.abs().max().clamp(min=1e-30), r.abs().mean().clamp(min=1e-30)
    assert err.max() <= max_tol * scale, f"max error {err.max():.3g} > {max_tol:.3g} * {scale:.3g}"
    assert err.mean() <= mean_tol * mean_scale, f"mean error {err.mean():.3g} > {mean_tol:.3g} * {mean_scale:.3g}"


@pytest.fixture
def parity():
    return assert_parity
