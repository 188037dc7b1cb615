"""The bound KV cache never shares memory with a registered region or the doorbell page.

The sidecar writes K/V rows into the bound cache, hidden states into whatever region a step names
as its output, and answers (and header words) into the doorbell page. Nothing compared these with
each other: AttachDoorbell took the KV segment itself as its page, so every step's K/V rows
rewrote the doorbell's sequence words and every answer rewrote cache rows; a region over the
cache had steps write hidden states into it (and read their indices from bytes the step's own
K/V writes change). Whichever of BindKV, RegisterBuffers and AttachDoorbell comes second is
refused, INVALID_ARGUMENT naming its field and both byte ranges, and what was in place stands.
Layouts that share a segment but no byte (page, regions and layers side by side) still serve.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark_sidecar import layout
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.kv_cache import kv_layer_shape
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_sim import PAGE, RIG_PAGES
from helpers.waiting import wait_until

PAGES = RIG_PAGES
TIMEOUT_S = 30.0
CAP = 4096  # doorbell capacity: the page uses HEADER + 2 * CAP bytes
LENS = [5, 30]


def _kv_bytes(cfg) -> int:
    return torch.Size(kv_layer_shape(cfg, 1, PAGES, PAGE)).numel() * 4


def _segment(held, nbytes: int) -> memory.ShmTensor:
    seg = memory.shm_empty((nbytes,), torch.uint8)
    held.append(seg)
    return seg


def _handle(seg: memory.ShmTensor, offset: int = 0, size: int = 0) -> pb.MemoryHandle:
    h = memory.export_handle(seg.tensor)
    h.shm.offset_bytes, h.shm.size_bytes = offset, size
    return h


def _layer_view(seg: memory.ShmTensor, cfg, offset: int) -> torch.Tensor:
    """A planes-layout float32 layer at byte `offset` of the segment."""
    n = _kv_bytes(cfg)
    return seg.tensor[offset: offset + n].view(torch.float32).view(kv_layer_shape(cfg, 1, PAGES, PAGE))


def _refused(call, req, field: str) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(req, timeout=TIMEOUT_S)
    details = err.value.details()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), details)
    assert details.startswith(f"{field}: "), details
    assert "overlap" in details, details
    assert details.count("bytes ") >= 2, details  # both byte ranges
    return details


def _status(eng) -> pb.KVBindingState:
    return eng.stubs[0].GetStatus(pb.GetStatusRequest(), timeout=TIMEOUT_S).kv


def _serves(eng, cfg, embed, step_id: int) -> None:
    """The engine's own cache bound again, a valid step answers."""
    eng.bind()
    step = scenario.random_step(cfg, LENS, PAGE, PAGES, embed, seed=3)
    resp = eng.stubs[0].DraftStep(eng.request(0, step_id, step), timeout=TIMEOUT_S)
    assert resp.HasField("hidden_states"), resp


def test_a_doorbell_page_on_the_kv_cache_is_refused(rig):
    """The review's case: the page is layer 1's own segment."""
    eng, cfg, embed, held = rig
    eng.bind()
    layer = eng.kv[0][1].tensor
    req = pb.AttachDoorbellRequest(page=memory.export_handle(layer), capacity_bytes=CAP)
    details = _refused(eng.stubs[0].AttachDoorbell, req, "page")
    assert "layers[1]" in details, details
    # A page inside the segment, over the layer's last bytes only: refused too.
    offset = (_kv_bytes(cfg) - (bell.HEADER + 2 * CAP)) // 64 * 64
    req = pb.AttachDoorbellRequest(page=_handle(eng.kv[0][3], offset), capacity_bytes=CAP)
    assert "layers[3]" in _refused(eng.stubs[0].AttachDoorbell, req, "page")
    _serves(eng, cfg, embed, 1)


@pytest.mark.parametrize("name", ["hidden_states", "metadata"])
def test_a_region_over_the_kv_cache_is_refused(rig, name):
    """A region the sidecar may write (any region: a step names its output slice) or only reads
    (metadata): both refused, and the request's other regions are not registered either."""
    eng, cfg, embed, held = rig
    eng.bind()
    ok = _segment(held, 4096)
    kv = eng.kv[0][2]
    regions = [pb.BufferRegion(name="inputs_embeds", memory=_handle(ok), size_bytes=4096),
               pb.BufferRegion(name=name, memory=_handle(kv, 1024), size_bytes=2048)]
    details = _refused(eng.stubs[0].RegisterBuffers, pb.RegisterBuffersRequest(regions=regions), "regions[1].memory")
    assert "layers[2]" in details and "bytes 1024..3072" in details, details
    # Its last byte on the layer's first one: refused as well.
    seg = _segment(held, 4096 + _kv_bytes(cfg))
    views = eng.kv_tensors(0)[:4] + [_layer_view(seg, cfg, 4096)] + eng.kv_tensors(0)[5:]
    eng.stubs[0].BindKV(eng.bind_request(0, views), timeout=TIMEOUT_S)
    regions = [pb.BufferRegion(name=name, memory=_handle(seg), size_bytes=4097)]
    assert "layers[4]" in _refused(eng.stubs[0].RegisterBuffers, pb.RegisterBuffersRequest(regions=regions),
                                   "regions[0].memory")
    # Its first byte on the layer's last one (the high byte of its last float): refused too.
    regions = [pb.BufferRegion(name=name, memory=_handle(seg, 4096 + _kv_bytes(cfg) - 1), size_bytes=1)]
    assert "layers[4]" in _refused(eng.stubs[0].RegisterBuffers, pb.RegisterBuffersRequest(regions=regions),
                                   "regions[0].memory")
    # Side by side, it registers.
    regions = [pb.BufferRegion(name=name, memory=_handle(seg), size_bytes=4096)]
    assert len(eng.stubs[0].RegisterBuffers(pb.RegisterBuffersRequest(regions=regions), timeout=TIMEOUT_S).region_ids) == 1
    _serves(eng, cfg, embed, 2)


def test_bindkv_over_a_registered_region_is_refused_until_it_is_released(rig):
    eng, cfg, embed, held = rig
    eng.bind()
    before = _status(eng)
    seg = _segment(held, 4096 + _kv_bytes(cfg))
    rid, = eng.stubs[0].RegisterBuffers(pb.RegisterBuffersRequest(regions=[
        pb.BufferRegion(name="hidden_states", memory=_handle(seg, 4096), size_bytes=64)]), timeout=TIMEOUT_S).region_ids
    req = eng.bind_request(0, eng.kv_tensors(0)[:3] + [_layer_view(seg, cfg, 0)] + eng.kv_tensors(0)[4:])
    details = _refused(eng.stubs[0].BindKV, req, "layers[3].memory")
    assert f"region {rid}" in details and "bytes 4096..4160" in details, details
    after = _status(eng)
    assert (after.binding_id, after.generation) == (before.binding_id, before.generation)  # the binding stands
    eng.stubs[0].UnregisterBuffers(pb.UnregisterBuffersRequest(region_ids=[rid]), timeout=TIMEOUT_S)
    assert eng.stubs[0].BindKV(req, timeout=TIMEOUT_S).binding_id  # the memory is the cache's now
    _serves(eng, cfg, embed, 3)


def test_bindkv_over_the_doorbell_page_is_refused_until_it_is_replaced(rig):
    eng, cfg, embed, held = rig
    eng.bind()
    used = bell.HEADER + 2 * CAP
    seg = _segment(held, used + _kv_bytes(cfg))
    eng.stubs[0].AttachDoorbell(pb.AttachDoorbellRequest(page=_handle(seg), capacity_bytes=CAP), timeout=TIMEOUT_S)
    over = eng.bind_request(0, [_layer_view(seg, cfg, used - 64)] + eng.kv_tensors(0)[1:])
    details = _refused(eng.stubs[0].BindKV, over, "layers[0].memory")
    assert "doorbell page" in details and f"bytes 0..{used}" in details, details
    # The page's mapping reaches the whole segment (size_bytes 0), but the doorbell uses its first
    # `used` bytes only: a layer right after them binds.
    assert eng.stubs[0].BindKV(eng.bind_request(0, [_layer_view(seg, cfg, used)] + eng.kv_tensors(0)[1:]),
                               timeout=TIMEOUT_S).binding_id
    # Re-attached elsewhere, the old page is released (once its doorbell has stopped): the cache may have it.
    other = _segment(held, used)
    eng.stubs[0].AttachDoorbell(pb.AttachDoorbellRequest(page=_handle(other), capacity_bytes=CAP), timeout=TIMEOUT_S)
    refusals: list[str] = []

    def binds() -> bool:
        try:
            eng.stubs[0].BindKV(over, timeout=TIMEOUT_S)
            return True
        except grpc.RpcError as err:  # refused while the old page's doorbell still stops
            assert "doorbell page" in err.details(), err.details()
            refusals.append(err.details())
            return False

    wait_until(binds, TIMEOUT_S, lambda: f"BindKV over the released page binds: {refusals[-1:]}", interval_s=0.05)
    _serves(eng, cfg, embed, 4)


def test_a_region_over_the_doorbell_page_is_refused_both_ways(rig):
    """A step's hidden states written over the page's words would ring steps and answer them."""
    eng, cfg, embed, held = rig
    used = bell.HEADER + 2 * CAP
    seg = _segment(held, 2 * used)
    eng.stubs[0].AttachDoorbell(pb.AttachDoorbellRequest(page=_handle(seg), capacity_bytes=CAP), timeout=TIMEOUT_S)
    regions = [pb.BufferRegion(name="hidden_states", memory=_handle(seg, 64 * 64), size_bytes=64)]
    details = _refused(eng.stubs[0].RegisterBuffers, pb.RegisterBuffersRequest(regions=regions), "regions[0].memory")
    assert "doorbell page" in details, details
    rid, = eng.stubs[0].RegisterBuffers(pb.RegisterBuffersRequest(regions=[
        pb.BufferRegion(name="hidden_states", memory=_handle(seg, used), size_bytes=used)]),
        timeout=TIMEOUT_S).region_ids
    page2 = pb.AttachDoorbellRequest(page=_handle(seg, used), capacity_bytes=CAP)
    assert f"region {rid}" in _refused(eng.stubs[0].AttachDoorbell, page2, "page")
    eng.stubs[0].UnregisterBuffers(pb.UnregisterBuffersRequest(region_ids=[rid]), timeout=TIMEOUT_S)
    eng.stubs[0].AttachDoorbell(page2, timeout=TIMEOUT_S)


def test_one_segment_holding_page_regions_and_cache_side_by_side_serves(rig):
    """[doorbell page | inputs | hidden states | metadata | layer 0 | ... ]: bound, registered and
    attached in that order and the reverse, a doorbell step writes its answer where it belongs, the
    same as over gRPC, and leaves the page's and the regions' other bytes alone."""
    eng, cfg, embed, held = rig
    L, hidden = cfg.num_hidden_layers, cfg.hidden_size
    step = scenario.random_step(cfg, LENS, PAGE, PAGES, embed, seed=11)
    n = layout.QPR * len(LENS)
    used = bell.HEADER + 2 * CAP
    rows = n * hidden * 4
    offs = {"page": 0, "embeds": used, "hidden": used + rows, "meta": used + 2 * rows}
    offs["kv"] = -(-(offs["meta"] + 8192) // 64) * 64
    seg = _segment(held, offs["kv"] + L * _kv_bytes(cfg))
    views = [_layer_view(seg, cfg, offs["kv"] + i * _kv_bytes(cfg)) for i in range(L)]
    bound = eng.stubs[0].BindKV(eng.bind_request(0, views), timeout=TIMEOUT_S)
    eng.bindings = [(bound.binding_id, bound.generation)]
    sizes = {"embeds": rows, "hidden": rows, "meta": offs["kv"] - offs["meta"]}
    ids = dict(zip(sizes, eng.stubs[0].RegisterBuffers(pb.RegisterBuffersRequest(regions=[
        pb.BufferRegion(name=k, memory=_handle(seg, offs[k]), size_bytes=v) for k, v in sizes.items()]),
        timeout=TIMEOUT_S).region_ids))
    eng.stubs[0].AttachDoorbell(pb.AttachDoorbellRequest(page=_handle(seg), capacity_bytes=CAP), timeout=TIMEOUT_S)
    # The step's tensors in the regions.
    raw = seg.tensor
    raw[offs["embeds"]: offs["embeds"] + rows].view(torch.float32).view(n, hidden).copy_(step.inputs_embeds)
    req = pb.DraftStepRequest(step_id=50, binding_id=bound.binding_id, binding_generation=bound.generation,
                              num_requests=len(LENS),
                              inputs_embeds=codec.region_tensor_ref(torch.float32, (n, hidden), ids["embeds"], 0),
                              output=pb.RegionSlice(region_id=ids["hidden"], offset_bytes=0))
    off = 0
    for field, t in (("positions", step.positions), ("seq_lens", step.meta.seq_lens),
                     ("block_tables", step.meta.block_tables), ("slot_mapping", step.meta.slot_mapping)):
        nb = t.numel() * t.element_size()
        raw[offs["meta"] + off: offs["meta"] + off + nb].view(t.dtype).view(t.shape).copy_(t)
        getattr(req, field).CopyFrom(codec.region_tensor_ref(t.dtype, tuple(t.shape), ids["meta"], off))
        off = -(-(off + nb) // 8) * 8
    want = codec.from_tensor_ref(eng.stubs[0].DraftStep(eng.request(0, 49, step), timeout=TIMEOUT_S).hidden_states, "h")
    kv_before = raw[offs["kv"]:].clone()
    embeds_before = raw[offs["embeds"]: offs["hidden"]].clone()
    page = bell.Page(raw[:used].numpy(), CAP)
    seq = page.word(bell.REQ_SEQ) + 1
    page.write(page.req_area, req.SerializeToString(), bell.REQ_LEN, bell.REQ_SEQ, seq)
    wait_until(lambda: page.word(bell.RESP_SEQ) == seq, TIMEOUT_S, "an answer on the doorbell", interval_s=0.005)
    resp = pb.DraftStepResponse.FromString(page.read(page.resp_area, bell.RESP_LEN))
    assert resp.HasField("hidden_states") and resp.hidden_states.HasField("region"), resp
    got = raw[offs["hidden"]: offs["hidden"] + rows].view(torch.float32).view(n, hidden)
    assert torch.equal(got, want)
    assert torch.equal(raw[offs["embeds"]: offs["hidden"]], embeds_before)
    assert torch.equal(raw[offs["kv"]:], kv_before)  # the same step again: the same K/V rows, nothing else
    # The reverse order: a new binding of the same layers after the regions and the page.
    assert eng.stubs[0].BindKV(eng.bind_request(0, views), timeout=TIMEOUT_S).binding_id
    _serves(eng, cfg, embed, 51)


def test_a_page_over_a_page_still_attached_is_refused_until_it_lets_go():
    """claim_page: a replaced doorbell's page is its own until its thread stops (release_page); a new page
    over it meanwhile is refused, one beside it is not."""
    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.server.errors import SidecarError
    from dspark_sidecar.server.kv_binding import MemoryBindings

    cpu = torch.device("cpu")
    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, cpu)
    used = bell.HEADER + 2 * CAP
    seg = memory.shm_empty((2 * used,), torch.uint8)
    pages = [memory.MappedMemory(_handle(seg, off), "page", cpu) for off in (0, 64, used)]
    try:
        mem.claim_page(pages[0], used)
        with pytest.raises(SidecarError) as err:
            mem.claim_page(pages[1], used)
        assert (err.value.code, err.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, "page"), err.value
        assert "still attached" in err.value.message and f"bytes 0..{used}" in err.value.message, err.value.message
        mem.claim_page(pages[2], used)  # beside it
        mem.release_page(pages[0])
        mem.claim_page(pages[1], used - 64)  # its bytes are free now (and end where the third page starts)
    finally:
        for p in pages:
            p.close()
        seg.close()
