"""Why vLLM's deployment keeps the sidecar shim off for good, read from vLLM 0.34's config and the draft it built.

Each function answers a reason string (said once, and the draft's CUDA graphs kept: vllm_plugin.shim_off_reason and
the speculator hook) or None. They read vLLM's objects by attribute only, so none imports vLLM, and an object that
does not say (another vLLM, a fake) is not refused for it.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from dspark_sidecar.client.metadata import fields_missing


def _draft_hf_config(vllm_config: Any) -> Any:
    """The draft checkpoint's config.json as vLLM loaded it (speculative_config.draft_model_config.hf_config),
    or None."""
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(getattr(spec, "draft_model_config", None), "hf_config", None)


def _draft_text_config(vllm_config: Any) -> Any:
    """The part of the draft's config.json that holds its layers' fields, where the sidecar reads them (draft-step.md
    section 2: text_config), as vLLM holds it (draft_model_config.hf_text_config: text_config where there is one, the
    whole config where not); the whole config for a vLLM without that field. Read from hf_config alone, a nested
    sliding_window and rotary_dim read as unsaid, and the window and rotary checks below were skipped."""
    model_config = getattr(getattr(vllm_config, "speculative_config", None), "draft_model_config", None)
    return getattr(model_config, "hf_text_config", None) or _draft_hf_config(vllm_config)


def draft_layout_refusal(vllm_config: Any) -> str | None:
    """Why vLLM's draft steps will never have the layout the sidecar serves, from its speculative config, or None.
    vLLM 0.34's DSpark speculator drafts 1 + num_speculative_tokens rows per request for a checkpoint with
    sample_from_anchor false (dspark/speculator.py), and splits the draft's KV cache over the ranks with a draft
    decode-context-parallel size above 1 (speculator_config.py resolves it into the field read here). The shim
    would refuse or fall back on every such step, the draft's graphs given away for nothing: off, said once."""
    # Read as vLLM reads it: any false value (0, null) too.
    if not getattr(_draft_hf_config(vllm_config), "sample_from_anchor", True):
        return ("the DSpark checkpoint has sample_from_anchor false: vLLM drafts 1 + 7 rows per request, and the "
                "sidecar serves the spec's 7")
    spec = getattr(vllm_config, "speculative_config", None)
    dcp = int(getattr(spec, "draft_decode_context_parallel_size", None) or 1)
    if dcp > 1:
        return (f"draft decode context parallel size {dcp}: each rank holds part of the draft KV cache, and the "
                "sidecar binds whole caches (set draft_decode_context_parallel_size 1)")
    return None


def draft_attention_refusal(model: Any, vllm_config: Any) -> str | None:
    """Why the attention vLLM built for the draft's layers is not the one the sidecar serves, or None (None too
    for a model whose layers do not say; a layer is judged on each part it says, none refused for one it leaves
    out). The stock forward attends as vLLM resolved the checkpoint's config
    (vLLM 0.34 models/qwen3_dflash.py _resolve_layer_attention: a window only on "sliding_attention" layers, and
    transformers fills "full_attention" where config.json has no layer_types; causal where dflash_config says so;
    dflash_config.swa_window_size over sliding_window; rotary dims from partial_rotary_factor, rotary_dim unread).
    The sidecar serves the spec's non-causal block over its config's sliding_window with its rotary_dim, read from
    the same config.json: where they differ, a forwarded step returned other hidden states and wrote other block
    K/V than the stock layers it replaced, without a word."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return None
    text = _draft_text_config(vllm_config)
    window, rotary = getattr(text, "sliding_window", None), getattr(text, "rotary_dim", None)
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:  # says nothing of its attention: not refused for it, and the layers after it still judged
            continue
        # Each part judged where the layer says it, alone: a vLLM that keeps no `causal` on the module (one where it
        # is still unused) still has its backend, window and rotary dims read. Both were required before, and such
        # a draft was forwarded unchecked: on ROCM_ATTN (its cache misread) or with full attention.
        backend = _backend_name(attn)
        if backend in _KV_HEAD_GROUP_BACKENDS:
            return (f"vLLM's {backend} attention backend holds draft layer {i}'s KV cache as K and V head groups with "
                    "an x-packed key interior (ROCm's default), which the sidecar cannot read: it binds the "
                    "[pages, kv_heads, page_size, 2 x head_dim] cache; choose the draft's attention backend with the "
                    "speculative config's attention_backend (which ROCm backend keeps that layout is unverified)")
        missing = fields_missing(fields) if (fields := _metadata_fields(attn)) is not None else []
        if missing:
            return (f"vLLM's {backend} attention backend keeps no {', '.join(missing)} in its step metadata, which "
                    "the shim reads each step: every step would fall back; choose the draft's attention backend "
                    "with the speculative config's attention_backend (FLASH_ATTN or TRITON_ATTN)")
        if getattr(attn, "causal", False):
            return (f"vLLM serves draft layer {i} causally (the checkpoint's dflash_config.causal or is_causal), "
                    "and the sidecar serves the spec's non-causal block")
        served = getattr(attn, "sliding_window", _UNSAID)
        if served is None:
            return (f"vLLM serves draft layer {i} with full attention (its config.json's layer_types do not name it "
                    f"sliding_attention), and the sidecar a {window}-token window")
        if served is not _UNSAID and window is not None and served != window:
            return (f"vLLM serves draft layer {i} with a {served}-token window "
                    f"(dflash_config.swa_window_size), and the sidecar the config's sliding_window {window}")
        dims = getattr(getattr(attn, "rotary_emb", None), "rotary_dim", None)
        if rotary is not None and dims is not None and dims != rotary:
            return (f"vLLM rotates {dims} dims of each head in draft layer {i} (head_dim x partial_rotary_factor), "
                    f"and the sidecar the config's rotary_dim {rotary}")
    return None


_UNSAID = object()  # a layer's attention that has no sliding_window (None there is full attention)


# Backends whose per-layer cache is not the records layout [pages, kv_heads, page_size, 2 * head_dim] the binding
# reads (kv_cache.kv_planes): vLLM 0.34's ROCM_ATTN (customize_spec: num_head_slots=2, K then V each
# [page_size, kv_heads * head_dim] in shape, the key x-packed inside, paged_attn.py split_kv_cache). Its view is
# 4-D too, so kv_planes took it for records: a BindKV refused for its shape, or, at 2 KV heads a rank, one
# accepted that reads K and V of head 0 as K of heads 0 and 1.
_KV_HEAD_GROUP_BACKENDS = frozenset({"ROCM_ATTN"})


def _attn_backend(self_attn: Any) -> Any:
    """The attention backend class vLLM's selector picked for a draft layer (self_attn.attn.attn_backend), or None."""
    return getattr(getattr(self_attn, "attn", None), "attn_backend", None)


def _backend_name(self_attn: Any) -> str | None:
    """The name of the attention backend vLLM picked for a draft layer (self_attn.attn.attn_backend), or None."""
    get_name = getattr(_attn_backend(self_attn), "get_name", None)
    return str(get_name()) if callable(get_name) else None


def _metadata_fields(self_attn: Any) -> set[str] | None:
    """The field names of the metadata class the draft layer's attention backend builds, or None where it does not
    say. vLLM 0.34 names it as the type argument of the backend's builder (AttentionMetadataBuilder[M], perhaps on
    a base class: RocmAiterUnifiedAttentionMetadataBuilder(RocmAttentionMetadataBuilder)); M is a dataclass."""
    get_builder = getattr(_attn_backend(self_attn), "get_builder_cls", None)
    if not callable(get_builder):
        return None
    for klass in getattr(get_builder(), "__mro__", ()):
        for base in getattr(klass, "__orig_bases__", ()):
            for arg in typing.get_args(base):
                if dataclasses.is_dataclass(arg):
                    return {f.name for f in dataclasses.fields(arg)}
    return None


def kv_memory_refusal(vllm_config: Any) -> str | None:
    """Why the engine's KV cache cannot be shared with the sidecar, from vLLM's config, or None. vLLM 0.34
    turns its extensible KV cache on by default on CUDA and ROCm (config/vllm.py _resolve_extensible_kv_cache):
    the cache is driver-mapped virtual memory, which legacy CUDA/HIP IPC handles (torch's tensor sharing, BindKV)
    cannot export, as vLLM itself says of connectors that share that way. So is a cache allocated in vLLM's
    CuMemAllocator pool (cuMemCreate / cuMemMap), as it is with model_config.enable_cumem_allocator
    (v1/worker/gpu_worker.py _maybe_get_memory_pool_context(tag="kv_cache")). Every BindKV would fail, every
    step fall back, and the draft's graphs be given away for nothing. None while vLLM has not resolved the
    setting. Sleep mode, which turns the cumem allocator on, is sleep_mode_refusal's to name."""
    if getattr(getattr(vllm_config, "cache_config", None), "enable_extensible_kv_cache", None):
        return ("vLLM's extensible KV cache is on (driver-mapped memory, which CUDA/HIP IPC cannot share with the "
                "sidecar): start vLLM with --disable-extensible-kv-cache to use it")
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "enable_cumem_allocator", False) and not getattr(model, "enable_sleep_mode", False):
        return ("vLLM's cumem allocator is on (--enable-cumem-allocator: the KV cache is driver-mapped memory, which "
                "CUDA/HIP IPC cannot share with the sidecar): start vLLM without it to use it")
    return None


def kv_groups_refusal(speculator: Any) -> str | None:
    """Why every draft step will fall back for the draft's KV cache layout, from vLLM's speculator once its
    attention is set (vLLM 0.34 calls init_cudagraph_manager after set_attn, which lists the KV cache groups the
    draft's layers lie in: dflash/speculator.py draft_kv_cache_group_ids), or None. A step carries one block
    table and one slot mapping for all layers, so the shim falls back on every step of a draft spanning several
    (metadata.spans_kv_groups); its draft graphs would be given away for nothing."""
    ids = getattr(speculator, "draft_kv_cache_group_ids", None)
    if ids is None or len(ids) < 2:
        return None
    return (f"the draft's attention layers span {len(ids)} KV cache groups, each with its own block table, and a "
            "sidecar step carries one")


def sleep_mode_refusal(vllm_config: Any) -> str | None:
    """Why the shim must stay off under vLLM's sleep mode, or None when it is not enabled. A wake-up maps new
    physical memory under the same KV tensors at the same addresses: the shim's identity check cannot see
    that and vLLM gives the draft model no hook for it, so the sidecar would go on using the memory it
    mapped before the sleep (client/FAILURE_MODES.md). Every rank reads the same config: all stay off."""
    if not getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
        return None
    return ("vLLM sleep mode is enabled (model_config.enable_sleep_mode): a wake-up remaps the KV cache "
            "unseen by the sidecar's binding; run without sleep mode to use the sidecar")
