"""The op bundle a drafter model computes with; one instance per backend, chosen once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dspark_sidecar.kernels import reference


@dataclass(frozen=True)
class Ops:
    """Every kernel-backed op of the draft step, with the signatures of `kernels.reference`."""

    name: str
    linear: Callable
    rms_norm: Callable
    rope_cos_sin: Callable
    qk_norm_rope: Callable
    swiglu_oai: Callable
    write_kv: Callable
    paged_window_attention: Callable
    norm_linear: Callable
    norm_linear_swiglu: Callable
    attn_prelude: Callable
    norm_qkv_prelude: Callable


REFERENCE_OPS = Ops(
    name="reference",
    linear=reference.linear,
    rms_norm=reference.rms_norm,
    rope_cos_sin=reference.rope_cos_sin,
    qk_norm_rope=reference.qk_norm_rope,
    swiglu_oai=reference.swiglu_oai,
    write_kv=reference.write_kv,
    paged_window_attention=reference.paged_window_attention,
    norm_linear=reference.norm_linear,
    norm_linear_swiglu=reference.norm_linear_swiglu,
    attn_prelude=reference.attn_prelude,
    norm_qkv_prelude=reference.norm_qkv_prelude,
)
