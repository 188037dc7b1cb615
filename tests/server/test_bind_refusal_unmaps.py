"""A refused BindKV unmaps every layer it mapped at once (MemoryBindings._discard), the refused one included;
a replaced or released binding is unmapped through retire, and its generation is refused."""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.drafter.kv_cache import kv_layer_shape
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError, as_sidecar_error
from dspark_sidecar.server.kv_binding import MemoryBindings


def _maps_of(name: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(name in line for line in maps)


def _layer(i: int, t: torch.Tensor, strides=None) -> pb.KVLayerBinding:
    return pb.KVLayerBinding(layer=i, memory=memory.export_handle(t), dtype=codec.dtype_to_proto(t.dtype),
                             shape=list(t.shape), strides=list(strides or t.stride()),
                             storage_offset=t.storage_offset())


@pytest.mark.parametrize("refusal", ["strides", "overlap", "offset", "size"])
def test_the_refused_layer_s_mapping_does_not_outlive_the_refusal(refusal):
    """The refused layer's view stayed in _map_layers' frame, which the error's traceback keeps: its
    mapping went only when the error was dropped, on whatever thread and (on a GPU) stream that was,
    not in _discard's QuietStream with the others. Stood in for on CPU: while the error is held, the
    refused layer's segment was still mapped. So was a segment MappedMemory itself refused (offset_bytes or
    size_bytes past its end) after mapping it: its own frame held the mapping."""
    cfg = load_config("tiny")
    segs = [memory.shm_empty(kv_layer_shape(cfg, 1, 4, 16), torch.float32) for _ in range(cfg.num_hidden_layers)]
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    try:
        layers = [_layer(i, s.tensor) for i, s in enumerate(segs)]
        if refusal == "strides":  # layer 2's own elements overlap (kv_view_problem)
            layers[2] = _layer(2, segs[2].tensor, [s // 2 for s in segs[2].tensor.stride()[:-1]] + [1])
        elif refusal == "overlap":  # layer 3 on layer 2's memory
            layers[3] = _layer(3, segs[2].tensor)
        elif refusal == "offset":  # refused by MappedMemory itself, after it mapped the segment
            layers[2].memory.shm.offset_bytes = 1 << 40
        else:
            layers[2].memory.shm.size_bytes = 1 << 40
        before = [_maps_of(s.segment.name) for s in segs]
        with pytest.raises((SidecarError, memory.HandleError)) as err:
            mem.bind(pb.BindKVRequest(engine=pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1),
                                      page_size=16, layers=layers))
        want = {"strides": "layers[2].strides", "overlap": "layers[3].memory"}.get(refusal, "layers[2].memory")
        assert as_sidecar_error(err.value).field == want, err.value  # a HandleError is mapped so (errors.py)
        assert err.value.__traceback__ is not None  # held, as a handler thread holds it until its call ends
        assert [_maps_of(s.segment.name) for s in segs] == before and mem.kv is None
    finally:
        for s in segs:
            s.close()


def _bind_request(layers) -> pb.BindKVRequest:
    return pb.BindKVRequest(engine=pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1),
                            page_size=16, layers=layers)


def _shorten(layer: pb.KVLayerBinding) -> None:
    del layer.strides[-1]


def _place(layer: pb.KVLayerBinding, offset_bytes: int, size_bytes: int, storage_offset: int = 0) -> None:
    layer.memory.shm.offset_bytes, layer.memory.shm.size_bytes = offset_bytes, size_bytes
    layer.storage_offset = storage_offset


# Each refusal of a layer's facts: (edit of a valid request, code, field, reason). A check dropped here
# bound a cache the steps then index past (pages, shape, count) or read in the wrong dtype or order.
_IPA, _FP = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
_REFUSALS = {
    "engine_rank": (lambda r, kv: setattr(r.engine, "engine_rank", 1), _FP, "engine.engine_rank", "RANK_MISMATCH"),
    "tp_size": (lambda r, kv: setattr(r.engine, "tp_size", 2), _FP, "engine.tp_size", "TP_MISMATCH"),
    "page_size": (lambda r, kv: setattr(r, "page_size", 0), _IPA, "page_size", "INVALID_FIELD"),
    "count": (lambda r, kv: r.layers.pop(), _IPA, "layers", "INVALID_FIELD"),
    "order": (lambda r, kv: setattr(r.layers[1], "layer", 2), _IPA, "layers[1].layer", "INVALID_FIELD"),
    "dtype": (lambda r, kv: setattr(r.layers[2], "dtype", pb.DTYPE_BF16), _IPA, "layers[2].dtype", "INVALID_FIELD"),
    "unknown dtype": (lambda r, kv: setattr(r.layers[2], "dtype", 999), _IPA, "layers[2].dtype", "INVALID_FIELD"),
    "heads": (lambda r, kv: r.layers[2].shape.__setitem__(3, 2), _IPA, "layers[2].shape", "INVALID_FIELD"),
    "strides count": (lambda r, kv: _shorten(r.layers[2]), _IPA, "layers[2].strides", "INVALID_FIELD"),
    "no pages": (lambda r, kv: r.layers[0].shape.__setitem__(1, 0), _IPA, "layers[0].shape", "INVALID_FIELD"),
    "fewer pages": (lambda r, kv: r.layers[2].shape.__setitem__(1, 2), _IPA, "layers[2].shape", "INVALID_FIELD"),
    # The handle maps fewer bytes than the view needs (the segment has them: torch alone would allow it).
    "short": (lambda r, kv: _place(r.layers[2], 0, kv - 4), _IPA, "layers[2]", "INVALID_FIELD"),
    # A negative offset reached the bytes before the handle's offset_bytes.
    "negative offset": (lambda r, kv: _place(r.layers[2], 4096, kv, -1024), _IPA, "layers[2]", "INVALID_FIELD"),
    "offset past the end": (lambda r, kv: _place(r.layers[2], kv + 1, 0), _IPA, "layers[2].memory", "INVALID_FIELD"),
    "size below offset": (lambda r, kv: _place(r.layers[2], 4096, 64), _IPA, "layers[2].memory", "INVALID_FIELD"),
}


@pytest.mark.parametrize("case", [*_REFUSALS, "over a region"])
def test_a_refused_bind_names_its_field_maps_nothing_and_the_binding_in_place_stands(case):
    cfg = load_config("tiny")
    shape = kv_layer_shape(cfg, 1, 4, 16)
    segs = [memory.shm_empty(shape, torch.float32) for _ in range(2 * cfg.num_hidden_layers)]
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    try:
        L = cfg.num_hidden_layers
        kv = mem.bind(_bind_request([_layer(i, s.tensor) for i, s in enumerate(segs[:L])]))
        req = _bind_request([_layer(i, s.tensor) for i, s in enumerate(segs[L:])])
        if case == "over a region":  # the cache over a registered region: mapped, then refused under the lock
            mem.register(pb.RegisterBuffersRequest(regions=[pb.BufferRegion(
                name="hidden_states", memory=memory.export_handle(segs[L + 3].tensor), size_bytes=64)]))
            code, field, reason = _IPA, "layers[3].memory", "INVALID_FIELD"
        else:
            edit, code, field, reason = _REFUSALS[case]
            edit(req, segs[0].tensor.numel() * 4)
        before = [_maps_of(s.segment.name) for s in segs]
        with pytest.raises((SidecarError, memory.HandleError)) as err:
            mem.bind(req)
        e = as_sidecar_error(err.value)
        assert (e.code, e.field, e.reason) == (code, field, reason), e
        assert [_maps_of(s.segment.name) for s in segs] == before
        assert mem.kv is kv and mem.check(kv.binding_id, kv.generation) is kv and len(kv.layers) == L
    finally:
        mem.close()
        for s in segs:
            s.close()


@pytest.mark.parametrize("where", ["before mapping", "by MappedMemory"])
def test_each_handle_a_refused_bind_never_opened_is_given_back_once(monkeypatch, where):
    """Layer 2 refused, before MappedMemory saw its handle (a dtype) or by MappedMemory itself (a CUDA IPC
    handle on a CPU rank: it gives that one back): layers 2.. go back to the engine, each exactly once (a
    second give-back of torch's producer reference frees a block another consumer still maps)."""
    released = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter",
                        lambda handle, offset, **kw: released.append(handle), raising=False)
    cfg = load_config("tiny")
    segs = [memory.shm_empty(kv_layer_shape(cfg, 1, 4, 16), torch.float32) for _ in range(2)]
    try:
        layers = [_layer(i, s.tensor) for i, s in enumerate(segs)]
        for i in range(2, cfg.num_hidden_layers):
            layer = _layer(i, segs[0].tensor)
            layer.memory.CopyFrom(pb.MemoryHandle(cuda_ipc=pb.CudaIpcHandle(
                ipc_handle=b"h", storage_size_bytes=64, ref_counter_handle=b"/torch_c%d" % i, ref_counter_offset=8)))
            layers.append(layer)
        if where == "before mapping":
            layers[2].dtype = pb.DTYPE_BF16
        mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
        with pytest.raises((SidecarError, memory.HandleError)) as err:
            mem.bind(_bind_request(layers))
        assert as_sidecar_error(err.value).field.startswith("layers[2]"), err.value
        assert released == [b"/torch_c%d" % i for i in range(2, cfg.num_hidden_layers)] and mem.kv is None
    finally:
        for s in segs:
            s.close()


def test_a_replaced_or_released_binding_is_unmapped_and_its_generation_refused():
    """BindKV again: the old cache is closed (through retire), the new generation is greater and the old
    one is STALE; UnbindKV of another id changes nothing, of the current one unmaps it."""
    cfg = load_config("tiny")
    L = cfg.num_hidden_layers
    segs = [memory.shm_empty(kv_layer_shape(cfg, 1, 4, 16), torch.float32) for _ in range(2 * L)]
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    try:
        idle = [_maps_of(s.segment.name) for s in segs]
        first = mem.bind(_bind_request([_layer(i, s.tensor) for i, s in enumerate(segs[:L])]))
        gen1, id1 = first.generation, first.binding_id
        del first
        retired = []  # RankLoop.after_device: the old cache is closed once the device no longer reads it
        second = mem.bind(_bind_request([_layer(i, s.tensor) for i, s in enumerate(segs[L:])]), retired.append)
        assert len(retired) == 1 and [_maps_of(s.segment.name) for s in segs] == [n + 1 for n in idle]
        retired.pop()()
        assert [_maps_of(s.segment.name) for s in segs] == idle[:L] + [n + 1 for n in idle[L:]]
        assert second.generation > gen1 and mem.check(second.binding_id, second.generation) is second
        for bid, gen, reason, field in ((second.binding_id, gen1, "STALE_BINDING", "binding_generation"),
                                        (id1, second.generation, "UNKNOWN_BINDING", "binding_id")):
            with pytest.raises(SidecarError) as err:
                mem.check(bid, gen)
            assert (err.value.code, err.value.reason, err.value.field) == (_FP, reason, field), err.value
        with pytest.raises(SidecarError) as err:
            mem.unbind(id1)
        assert (err.value.code, err.value.reason) == (_FP, "UNKNOWN_BINDING") and mem.kv is second
        mem.unbind(second.binding_id, retired.append)
        del second
        assert len(retired) == 1 and mem.kv is None
        retired.pop()()
        assert [_maps_of(s.segment.name) for s in segs] == idle and mem.kv is None
        with pytest.raises(SidecarError) as err:
            mem.check(id1, gen1)
        assert err.value.reason == "NOT_BOUND"
    finally:
        mem.close()
        for s in segs:
            s.close()


def test_a_generation_other_than_the_binding_s_is_refused_whether_older_or_newer():
    """A step names its binding by id and generation together: the rank posts the step's generation to the
    rendezvous (rank.py), so one naming the current id with any other generation, a newer one included (an
    engine rank that took a peer rank's generation, or its own counter gone wrong), is STALE_BINDING, never run
    against a binding it does not name."""
    cfg = load_config("tiny")
    L = cfg.num_hidden_layers
    segs = [memory.shm_empty(kv_layer_shape(cfg, 1, 4, 16), torch.float32) for _ in range(L)]
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    try:
        mem.bind(_bind_request([_layer(i, s.tensor) for i, s in enumerate(segs)]))
        kv = mem.bind(_bind_request([_layer(i, s.tensor) for i, s in enumerate(segs)]))  # generation 2
        assert mem.check(kv.binding_id, kv.generation) is kv
        for gen in (kv.generation - 1, kv.generation + 1, 0):
            with pytest.raises(SidecarError) as err:
                mem.check(kv.binding_id, gen)
            e = err.value
            assert (e.code, e.reason, e.field) == (_FP, "STALE_BINDING", "binding_generation"), (gen, e)
    finally:
        mem.close()
        for s in segs:
            s.close()


def test_a_region_registered_while_bindkv_records_its_cache_is_refused_where_it_overlaps(monkeypatch):
    """The overlap rule's check and the binding it checks are one step under the bindings' lock: a RegisterBuffers
    of a region over the new cache, arriving after BindKV's check but before the binding is recorded, waits and is
    then refused (the second of the two). Checked and recorded apart, it passed against the binding in place (none),
    was registered, and steps wrote hidden states into cache rows that K/V writes rewrote, with no error anywhere."""
    import threading

    from dspark_sidecar.server import kv_binding

    cfg = load_config("tiny")
    L = cfg.num_hidden_layers
    segs = [memory.shm_empty(kv_layer_shape(cfg, 1, 4, 16), torch.float32) for _ in range(L)]
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    region = pb.RegisterBuffersRequest(regions=[pb.BufferRegion(
        name="hidden_states", memory=memory.export_handle(segs[3].tensor), size_bytes=64)])  # layer 3's first bytes
    outcome: list = []

    def register() -> None:
        try:
            outcome.append(mem.register(region))
        except SidecarError as err:
            outcome.append(err)

    real = kv_binding.KVBinding
    racer = threading.Thread(target=register)

    def recorded_after_a_register(*args, **kwargs):
        # BindKV's layers checked, its binding about to be recorded: a RegisterBuffers comes in. Waited for a
        # while, not forever: under the lock it cannot finish until bind() lets go.
        racer.start()
        racer.join(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_binding, "KVBinding", recorded_after_a_register)
    try:
        before = _maps_of(segs[3].segment.name)
        kv = mem.bind(_bind_request([_layer(i, s.tensor) for i, s in enumerate(segs)]))
        racer.join(10)
        assert not racer.is_alive() and len(outcome) == 1
        e = outcome[0]
        assert isinstance(e, SidecarError), f"registered over the bound cache: region ids {e}"
        assert (e.code, e.field) == (_IPA, "regions[0].memory") and "KV cache of binding" in e.message, e
        assert mem.region_count == 0 and mem.kv is kv and _maps_of(segs[3].segment.name) == before + 1  # the cache's
    finally:
        mem.close()
        for s in segs:
            s.close()


def test_a_binding_mixing_the_compute_dtype_and_fp8_codes_is_bound_each_layer_in_its_own():
    """sidecar.proto: each layer's dtype stands alone, the compute dtype or DTYPE_FP8_E4M3 (vLLM's kv_cache_dtype
    fp8). Refused, an fp8 deployment's every BindKV was INVALID_ARGUMENT and its engine drafted without the
    sidecar; taken in layer 0's dtype, the fp8 layers' codes were read as floats. Another dtype is refused."""
    cfg = load_config("tiny")
    L = cfg.num_hidden_layers
    segs = [memory.shm_empty(kv_layer_shape(cfg, 1, 4, 16), torch.float8_e4m3fn if i % 2 else torch.float32)
            for i in range(L)]
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    try:
        gen = torch.Generator().manual_seed(0)
        for s in segs:  # each layer's own bytes, to tell its view from another layer's or another dtype's
            raw = s.tensor.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        kv = mem.bind(_bind_request([_layer(i, s.tensor) for i, s in enumerate(segs)]))
        assert [t.dtype for t in kv.layers] == [s.tensor.dtype for s in segs]
        assert all(torch.equal(t.view(torch.uint8), s.tensor.view(torch.uint8)) for t, s in zip(kv.layers, segs))
        req = _bind_request([_layer(i, s.tensor) for i, s in enumerate(segs)])
        req.layers[1].dtype = pb.DTYPE_UINT8  # the same bytes, as vLLM holds fp8 codes: not a served dtype
        with pytest.raises(SidecarError) as err:
            mem.bind(req)
        assert (err.value.code, err.value.field) == (_IPA, "layers[1].dtype") and mem.kv is kv, err.value
    finally:
        mem.close()
        for s in segs:
            s.close()


def test_a_host_memory_cache_bound_on_a_gpu_rank_is_refused_and_unmapped():
    """A GPU rank's steps write K/V with device kernels: a cache in host shared memory (an engine on the CPU, or
    one that sent shm handles for its GPU cache) is INVALID_ARGUMENT naming the layer's memory, and what the call
    mapped goes at once. Bound, the first step's kernels were handed host pointers (an illegal address that ends
    the rank). Stood in for on this CPU host: a rank whose device is cuda:0, its refusals closed in place."""
    import contextlib

    cfg = load_config("tiny")
    L = cfg.num_hidden_layers
    segs = [memory.shm_empty(kv_layer_shape(cfg, 1, 4, 16), torch.float32) for _ in range(L)]
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cuda", 0))
    mem._quiet = contextlib.nullcontext  # no CUDA here: the QuietStream a GPU rank closes refused mappings in
    try:
        before = [_maps_of(s.segment.name) for s in segs]
        with pytest.raises(SidecarError) as err:
            mem.bind(_bind_request([_layer(i, s.tensor) for i, s in enumerate(segs)]))
        e = err.value
        assert (e.code, e.field, e.reason) == (_IPA, "layers[0].memory", "INVALID_FIELD"), e
        assert "cpu memory" in e.message and "CUDA/HIP IPC" in e.message, e.message
        assert [_maps_of(s.segment.name) for s in segs] == before and mem.kv is None
    finally:
        for s in segs:
            s.close()
