"""The shim's per-step check of the bound KV cache, without a sidecar."""

from __future__ import annotations

import gc

import torch

from dspark_sidecar.client.binding import Binding, KVBinder, cache_identity
from dspark_sidecar.proto import sidecar_pb2 as pb


def _bound(layers: list[torch.Tensor]) -> KVBinder:
    from dspark_sidecar.client import binding

    b = KVBinder(pb.EngineFacts())
    b.current = Binding(1, 1, cache_identity(layers), binding._watch(layers))  # as bind() leaves it
    return b


def _layers(n: int = 5) -> list[torch.Tensor]:
    # each the front half of a larger allocation, so that a layer can move inside it in place
    return [torch.zeros(2 * 1024, dtype=torch.bfloat16)[:1024].view(2, 4, 16, 1, 8) for _ in range(n)]


def test_the_same_tensors_need_no_bind_and_new_views_of_them_neither():
    layers = _layers()
    b = _bound(layers)
    assert not b.needs_bind(layers)
    views = [t.view(t.shape) for t in layers]  # other tensor objects, the same memory and layout
    assert not b.needs_bind(views)
    assert all(ref() is t for (ref, *_), t in zip(b.current.seen, views))  # now watched in place


def test_a_layer_changed_in_place_or_replaced_needs_a_bind():
    for change in (
        lambda ls: ls[2].as_strided_((2, 4, 16, 1, 4), ls[2].stride()),  # shape, same object and pointer
        lambda ls: ls[3].as_strided_(ls[3].shape, ls[3].stride(), 8),  # storage offset only
        lambda ls: ls[0].as_strided_(ls[0].shape, (1024, 256, 16, 8, 1)),  # strides only
        lambda ls: setattr(ls[1], "data", ls[1].data.view(torch.float16)),  # dtype, same bytes and shape
        lambda ls: ls[2].set_(torch.zeros_like(ls[2]).untyped_storage(), 0, ls[2].shape, ls[2].stride()),  # moved only
        lambda ls: ls.__setitem__(4, torch.zeros_like(ls[4])),  # re-allocated
        lambda ls: ls.pop(),  # one layer fewer
        lambda ls: ls.append(torch.zeros_like(ls[0])),  # one layer more (the bound ones unchanged)
    ):
        layers = _layers()
        b = _bound(layers)
        change(layers)
        assert b.needs_bind(layers), change


def test_the_binding_does_not_keep_a_freed_cache_alive():
    layers = _layers(2)
    b = _bound(layers)
    del layers
    gc.collect()
    assert all(ref() is None for ref, *_ in b.current.seen)
    # Dead references: the full identity decides. (Not a same-shaped allocation here: the allocator may
    # hand back the freed addresses, and a cache at the same place with the same layout is the same.)
    assert b.needs_bind([torch.zeros(2, 4, 16, 1, 4, dtype=torch.bfloat16) for _ in range(2)])


def test_caches_the_sidecar_cannot_address_are_refused_for_good_saying_why():
    # Raw fp8 bytes (vLLM stores fp8 codes as uint8; its plug-in passes e4m3 at scale 1 as
    # float8_e4m3fn), e5m2, and a shape neither layout has: the bind is refused permanently, by
    # name (not a passing failure the shim would retry).
    import pytest

    from dspark_sidecar.client.binding import BindError, bind_request

    fp8 = "serves an fp8 cache as float8_e4m3fn codes at k/v scale 1 only"
    for layers, why in (([torch.zeros(4, 1, 16, 256, dtype=torch.uint8)] * 5, fp8),
                        ([torch.zeros(4, 1, 16, 256, dtype=torch.float8_e5m2)] * 5, fp8),
                        ([torch.zeros(4, 1, 16, 255)] * 5, r"shape \[4, 1, 16, 255\]: expected planes"),
                        ([torch.zeros(4, 16, 256)] * 5, "expected planes")):
        with pytest.raises(BindError, match=why) as err:
            bind_request(layers, pb.EngineFacts())
        assert err.value.permanent and "KV layer 0" in str(err.value)


def test_bindkv_names_the_gpu_the_cache_lives_on(monkeypatch):
    """The shim's facts name its config's device, resolved when it was built ("cuda": the device current
    then). The sidecar compares the named GPU with its own at BindKV, and the cache's GPU is the one that
    must match: bind_request names the cache's. (No GPU here: the layer is a stand-in with a CUDA device,
    and the uuid lookup is faked.)"""
    from types import SimpleNamespace

    from dspark_sidecar.client import binding
    from dspark_sidecar.proto import memory

    monkeypatch.setattr(memory, "gpu_uuid", lambda d: f"GPU-{d.index}" if d.type == "cuda" else "")
    facts = pb.EngineFacts(engine_rank=1, device="cuda", device_uuid="GPU-0")  # resolved to cuda:0 at start-up
    named = binding.on_cache_gpu(facts, SimpleNamespace(device=torch.device("cuda", 1)))
    assert named.device_uuid == "GPU-1" and named.engine_rank == 1 and facts.device_uuid == "GPU-0"
    same = binding.on_cache_gpu(facts, SimpleNamespace(device=torch.device("cuda", 0)))
    assert same is facts
    assert binding.on_cache_gpu(facts, torch.zeros(1)) is facts  # a CPU cache: the facts as they are


def test_another_segment_at_a_freed_ones_address_needs_a_bind(monkeypatch):
    """On CPU the segment is part of the identity: a segment mapped where a freed one was (the same address,
    shape and strides) is another cache, which the sidecar, still mapping the old one, does not see."""
    from dspark_sidecar.proto import memory
    from helpers.engine_fakes import shm_kv_cache

    kv = shm_kv_cache()
    try:
        layers = [s.tensor for s in kv]
        b = _bound(layers)
        assert not b.needs_bind([t.view(t.shape) for t in layers])  # new tensor objects, the same segments
        ptr = layers[2].untyped_storage().data_ptr()
        _, size = memory._EXPORTED[ptr]
        monkeypatch.setitem(memory._EXPORTED, ptr, ("psm_another", size))  # as a new segment mapped at that address
        assert b.needs_bind([t.view(t.shape) for t in layers])
    finally:
        for s in kv:
            s.close()
