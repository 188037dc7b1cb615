"""MemoryBindings (server/kv_binding.py) on its own: what bind answers, and what is left after close."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.drafter.kv_cache import kv_layer_shape
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.kv_binding import MemoryBindings

_FP = grpc.StatusCode.FAILED_PRECONDITION


def _maps_of(name: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(name in line for line in maps)


def _layer(i: int, t: torch.Tensor) -> pb.KVLayerBinding:
    return pb.KVLayerBinding(layer=i, memory=memory.export_handle(t), dtype=codec.dtype_to_proto(t.dtype),
                             shape=list(t.shape), strides=list(t.stride()), storage_offset=t.storage_offset())


def _bind_request(segs: list[memory.ShmTensor]) -> pb.BindKVRequest:
    return pb.BindKVRequest(engine=pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1), page_size=16,
                            layers=[_layer(i, s.tensor) for i, s in enumerate(segs)])


@pytest.fixture
def cache():
    """A fresh MemoryBindings of the tiny drafter on CPU, the shared-memory segments of one cache, and one of 4 KiB."""
    cfg = load_config("tiny")
    segs = [memory.shm_empty(kv_layer_shape(cfg, 1, 4, 16), torch.float32) for _ in range(cfg.num_hidden_layers)]
    other = memory.shm_empty((4096,), torch.uint8)
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    yield mem, segs, other
    mem.close()
    for s in (*segs, other):
        s.close()


def test_bind_answers_the_binding_it_made_though_another_call_changed_it_before_it_returned(cache):
    """bind() recorded its binding under the lock, then retired the old one and returned self.kv, read again after
    the lock: an UnbindKV (a lease's end) or another BindKV on another thread in between, which the lock alone
    orders, had it answer None (BindKV's answer then failed INTERNAL on None.binding_id) or a binding it never
    made. It answers the one it made (released since: a step naming it is refused, and the engine binds again)."""
    mem, segs, _ = cache
    first = mem.bind(_bind_request(segs))

    def retire(close) -> None:
        close()
        racer = threading.Thread(target=lambda: mem.unbind(mem.kv.binding_id))  # between the lock and the return
        racer.start()
        racer.join()

    kv = mem.bind(_bind_request(segs), retire)
    assert kv is not None and kv is not first and kv.generation == first.generation + 1, kv
    assert mem.kv is None and kv.layers == []  # released by the racer's UnbindKV, and closed
    with pytest.raises(SidecarError) as err:
        mem.check(kv.binding_id, kv.generation)
    assert (err.value.code, err.value.reason) == (_FP, "NOT_BOUND"), err.value


def test_after_close_nothing_is_bound_or_registered_and_a_view_still_held_reads_its_memory(cache):
    """close() unmapped the binding and the regions but kept both recorded: check() still passed the closed binding
    (no layers: a step would run against nothing), a slice of a closed region and any BindKV or RegisterBuffers
    after it failed with AttributeError ('NoneType' object has no attribute 'numel': INTERNAL, not a refusal).
    Closed, nothing is bound or registered; closing again is harmless; a view taken before still reads its bytes."""
    mem, segs, other = cache
    idle = [_maps_of(s.segment.name) for s in (*segs, other)]  # the engine's own mappings
    kv = mem.bind(_bind_request(segs))
    rid, = mem.register(pb.RegisterBuffersRequest(regions=[pb.BufferRegion(
        name="metadata", memory=memory.export_handle(other.tensor), size_bytes=4096)], owner=5, lease=6))
    view = mem.resolve(pb.RegionSlice(region_id=rid, offset_bytes=0), torch.int32, (4,), "positions")
    other.tensor[:16].view(torch.int32).copy_(torch.arange(4, dtype=torch.int32))
    mem.close()
    mem.close()
    assert torch.equal(view, torch.arange(4, dtype=torch.int32))  # the mapping goes with its last view
    assert kv.layers == [] and mem.kv is None and mem.region_count == 0 and not mem.leases_regions(6)
    with pytest.raises(SidecarError) as err:
        mem.check(kv.binding_id, kv.generation)
    assert (err.value.code, err.value.reason) == (_FP, "NOT_BOUND"), err.value
    with pytest.raises(ValueError, match=f"positions: region {rid} is not registered"):
        mem.resolve(pb.RegionSlice(region_id=rid, offset_bytes=0), torch.int32, (4,), "positions")
    del view
    assert [_maps_of(s.segment.name) for s in (*segs, other)] == idle
    with pytest.raises(SidecarError) as err:  # an id from before the close names nothing
        mem.unregister([rid])
    assert err.value.code == grpc.StatusCode.NOT_FOUND, err.value


def _region(mem: MemoryBindings, seg: memory.ShmTensor, **tokens) -> int:
    rid, = mem.register(pb.RegisterBuffersRequest(regions=[pb.BufferRegion(
        name="metadata", memory=memory.export_handle(seg.tensor), size_bytes=seg.tensor.numel())], **tokens))
    return rid


def test_a_slice_named_again_in_another_dtype_is_viewed_in_that_dtype(cache):
    """The view cache's key holds the dtype: the same bytes named as int32 and then as float32 (or int64 over the
    same offset and shape) are two views, never the first one handed back for the second."""
    mem, _, other = cache
    rid = _region(mem, other)
    at = pb.RegionSlice(region_id=rid, offset_bytes=64)
    other.tensor[64:72].view(torch.int32).copy_(torch.tensor([1, 2], dtype=torch.int32))
    assert mem.resolve(at, torch.int32, (2,), "positions").tolist() == [1, 2]
    as_float = mem.resolve(at, torch.float32, (2,), "inputs_embeds")
    assert as_float.dtype == torch.float32 and torch.equal(as_float.view(torch.int32), torch.tensor([1, 2],
                                                                                                    dtype=torch.int32))
    assert mem.resolve(at, torch.int32, (2,), "positions").dtype == torch.int32


def test_the_view_cache_is_bounded(cache, monkeypatch):
    """A full view cache is emptied before the next entry: an engine naming a new slice every step (another offset,
    another request count) would otherwise grow it, and what its views keep alive, for the rank's life."""
    from dspark_sidecar.server import kv_binding

    monkeypatch.setattr(kv_binding, "VIEW_CACHE", 4)
    mem, _, other = cache
    rid = _region(mem, other)
    sizes = []
    for k in range(10):
        mem.resolve(pb.RegionSlice(region_id=rid, offset_bytes=4 * k), torch.int32, (1,), "positions")
        sizes.append(len(mem._views))
    assert max(sizes) == 4 and sizes[-1] >= 1, sizes


def test_a_lease_whose_registration_named_no_region_holds_none(cache):
    """leases_regions says whether regions under the lease are still registered, not whether the lease was ever
    named: an empty RegisterBuffers under it registers nothing, and its end must not take the rank's exclusive
    section for nothing (whose quiesce releases the live engine's pre-launched step, at TP > 1 on this rank alone)."""
    mem, _, other = cache
    assert mem.register(pb.RegisterBuffersRequest(regions=[], owner=5, lease=6)) == []
    assert not mem.leases_regions(6)
    rid = _region(mem, other, lease=6)
    assert mem.leases_regions(6)
    mem.unregister([rid])
    assert not mem.leases_regions(6)


def test_a_page_size_other_than_the_caches_names_page_size(cache):
    """page_size must equal shape[2] of every layer (sidecar.proto). An engine sending another one was refused
    naming layers[0].shape, "expected [2, 4, 8, ...]": told to reshape a cache that was right, the field it had
    wrong never named. Refused naming page_size and both numbers, before any layer is mapped."""
    mem, segs, _ = cache
    before = [_maps_of(s.segment.name) for s in segs]
    req = _bind_request(segs)
    req.page_size = 8
    with pytest.raises(SidecarError) as err:
        mem.bind(req)
    e = err.value
    assert (e.code, e.field) == (grpc.StatusCode.INVALID_ARGUMENT, "page_size"), e
    assert e.message.startswith("page_size: 8, but layers[0] has 16 tokens per page (shape[2])"), e.message
    assert mem.kv is None and [_maps_of(s.segment.name) for s in segs] == before
    # A later layer that disagrees with layer 0 (and page_size) is that layer's shape, as before.
    req = _bind_request(segs)
    req.layers[2].shape[2] = 8
    with pytest.raises(SidecarError) as err:
        mem.bind(req)
    assert err.value.field == "layers[2].shape", err.value


def test_a_cache_sent_in_its_records_layout_is_told_to_send_the_planes_view(cache):
    """A layer of 4 dimensions (vLLM's records layout [pages, heads, page_size, 2 * head_dim], sent as allocated)
    was refused "expected [2, -1, 16, 4, 128]": a page count of -1 no cache has, and no word of the planes view
    the sidecar takes. The expected shape names num_pages, and the message says how to send it."""
    mem, segs, _ = cache
    req = _bind_request(segs)
    records = [4, 4, 16, 256]  # the tiny drafter's 4 KV heads at TP 1, 4 pages
    req.layers[0].shape[:] = records
    del req.layers[0].strides[-1]
    with pytest.raises(SidecarError) as err:
        mem.bind(req)
    e = err.value
    assert (e.code, e.field) == (grpc.StatusCode.INVALID_ARGUMENT, "layers[0].shape"), e
    assert "-1" not in e.message and "[2, num_pages, 16, 4, 128]" in e.message, e.message
    assert "kv_planes" in e.message and mem.kv is None, e.message


def test_a_region_id_from_before_close_is_never_handed_out_after_it(cache, monkeypatch):
    """close() forgets the regions but retires their ids, as UnregisterBuffers does: an id drawn again after it
    is drawn anew, so a late step or release naming a region from before never reaches one registered since."""
    from dspark_sidecar.server import kv_binding

    mem, _, other = cache
    draws = iter([11, 11, 12])
    monkeypatch.setattr(kv_binding.secrets, "randbits", lambda bits: next(draws))
    assert _region(mem, other) == 11
    mem.close()
    assert _region(mem, other) == 12


def test_a_registration_of_max_regions_is_taken_and_one_more_refused_mapping_nothing(cache):
    """MAX_REGIONS is the most one RegisterBuffers may name: that many are mapped, one more is OUT_OF_RANGE naming
    the count before any region is opened."""
    from dspark_sidecar.server.kv_binding import MAX_REGIONS

    mem, _, other = cache
    region = pb.BufferRegion(name="metadata", memory=memory.export_handle(other.tensor), size_bytes=4096)
    before = _maps_of(other.segment.name)
    with pytest.raises(SidecarError) as err:
        mem.register(pb.RegisterBuffersRequest(regions=[region] * (MAX_REGIONS + 1)))
    e = err.value
    assert (e.code, e.field) == (grpc.StatusCode.OUT_OF_RANGE, "regions"), e
    assert f"{MAX_REGIONS + 1} regions in one request, at most {MAX_REGIONS}" in e.message, e.message
    assert mem.region_count == 0 and _maps_of(other.segment.name) == before
    ids = mem.register(pb.RegisterBuffersRequest(regions=[region] * MAX_REGIONS))
    assert len(set(ids)) == MAX_REGIONS == mem.region_count
    for m in mem.unregister(ids):
        m.close()


def test_a_view_built_while_its_region_is_released_is_not_cached_past_the_release(cache, monkeypatch):
    """resolve builds a slice's view outside the lock and caches it after: an UnregisterBuffers in between clears
    the cache and bumps the epoch, and keep() drops the view it would have stored. Cached, it would outlive its
    region: a later step naming the released id handed that view (and its released memory) instead of the refusal.
    (Mutation pass, review 390: no test raced the cache with a release.)"""
    mem, _, other = cache
    rid = _region(mem, other)
    at = pb.RegionSlice(region_id=rid, offset_bytes=0)
    real = mem._resolve
    released = []

    def racing(*args):
        view = real(*args)
        released.extend(mem.unregister([rid]))  # between the view's build and its caching
        return view

    monkeypatch.setattr(mem, "_resolve", racing)
    assert mem.resolve(at, torch.int32, (4,), "positions").shape == (4,)  # the step that raced gets its view
    monkeypatch.undo()
    assert len(released) == 1 and mem._views == {}
    with pytest.raises(ValueError, match=f"positions: region {rid} is not registered"):
        mem.resolve(at, torch.int32, (4,), "positions")
    for m in released:
        m.close()


def test_retire_if_idle_is_false_while_the_owner_or_lease_holds_a_region_and_then_releases_nothing(cache):
    """UnregisterBuffers and a lease's end skip the rank's section only where retire_if_idle says nothing of theirs
    is registered. Were it True for a lease (or owner) still holding a region, that region would be released inside
    it and its mapping dropped: never closed after the device, the doorbell's pre-launched step and the step graphs
    that read it in place never taken out of use. False, it leaves everything registered and the owner usable; once
    idle, True retires the owner as an UnregisterBuffers by owner does. (Mutation pass, review 390.)"""
    mem, _, other = cache
    rid = _region(mem, other, owner=5, lease=6)
    assert not mem.retire_if_idle([], owner=5)
    assert not mem.retire_if_idle([], lease=6)
    assert not mem.retire_if_idle([rid])
    assert mem.region_count == 1 and mem.leases_regions(6)
    again = _region(mem, other, owner=5)  # not retired by a False
    released = mem.unregister([rid, again])
    assert len(released) == 2
    for m in released:
        m.close()
    assert mem.retire_if_idle([], owner=5, lease=6)
    with pytest.raises(SidecarError) as err:
        _region(mem, other, owner=5)
    assert (err.value.code, err.value.reason) == (_FP, "OWNER_RELEASED"), err.value
