"""The op bundle (kernels/ops.py): every field required, and REFERENCE_OPS the reference's functions by name."""

from __future__ import annotations

import dataclasses

import pytest

from dspark_sidecar.kernels import reference
from dspark_sidecar.kernels.ops import REFERENCE_OPS, Ops

OP_NAMES = [f.name for f in dataclasses.fields(Ops) if f.name != "name"]


def test_reference_ops_hold_each_reference_function_under_its_own_name():
    """The drafter reaches each op through the bundle only: a field holding another reference function
    (the static attention form, swiglu_oai in place of norm_linear_swiglu) ran it on every step, and
    the fields a step does not call (attn_prelude, norm_linear, swiglu_oai) are the twins the kernel
    tests hold the GPU ops against."""
    assert REFERENCE_OPS.name == "reference"
    wrong = {n: getattr(REFERENCE_OPS, n).__name__ for n in OP_NAMES if getattr(REFERENCE_OPS, n) is not getattr(reference, n)}
    assert wrong == {}


def test_a_bundle_missing_an_op_is_refused_not_filled_in():
    """No field has a default: a backend that leaves a kernel out fails where its bundle is built, rather
    than computing that op with another backend's function (or None) inside a step."""
    ops = {n: getattr(REFERENCE_OPS, n) for n in OP_NAMES}
    for missing in OP_NAMES:
        with pytest.raises(TypeError, match=missing):
            Ops(name="partial", **{n: f for n, f in ops.items() if n != missing})
