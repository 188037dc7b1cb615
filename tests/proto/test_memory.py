"""Mapping the engine's memory on the sidecar: views a request names are bounds- and alignment-checked."""

from __future__ import annotations

import errno
import os

import grpc
import pytest
import torch

from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.proto import memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import as_sidecar_error
from dspark_sidecar.server.kv_binding import MemoryBindings
from helpers.engine_fakes import recording_shm


@pytest.fixture
def segment():
    held = memory.shm_empty((4096,), torch.uint8)
    yield held
    held.close()


def test_a_region_that_starts_misaligned_for_the_dtype_is_refused_not_fatal(segment):
    """torch's view(dtype) raised RuntimeError for a storage offset the dtype does not divide, which the
    rank loop takes for a failed launch (the whole group exits). It is a bad request: HandleError."""
    handle = memory.export_handle(segment.tensor)
    handle.shm.offset_bytes = 4
    m = memory.MappedMemory(handle, "regions[0].memory", torch.device("cpu"))
    try:
        assert m.view(torch.int32, (4,), (1,), 0, "positions").numel() == 4  # 4-byte aligned: fine
        with pytest.raises(memory.HandleError, match="positions: the region starts 4 bytes past a multiple of 8"):
            m.view(torch.int64, (2,), (1,), 0, "positions")
    finally:
        m.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64])
def test_a_storage_whose_address_is_misaligned_is_refused_whatever_its_storage_offset(dtype):
    """A CUDA IPC handle's storage_offset_bytes goes into its storage's pointer (torch's rebuild_cuda_tensor),
    storage_offset() stays 0: the check read only the latter, so a K/V or int64 view one byte off was
    accepted, and its first step's write faulted on the GPU (misaligned address), ending the rank
    (helper 81). Stood in for on CPU: a byte storage at an odd address with storage_offset() 0."""
    buf = bytearray(4096)
    m = memory.MappedMemory.__new__(memory.MappedMemory)
    m._segment, m._memory = None, ("device", 0)
    m.storage = torch.frombuffer(buf, dtype=torch.uint8, offset=1)
    assert m.storage.storage_offset() == 0 and m.storage.data_ptr() % 2 == 1
    with pytest.raises(memory.HandleError, match="layers\\[0\\]: the region starts 1 bytes past"):
        m.view(dtype, (2, 8), (8, 1), 0, "layers[0]")
    assert m.view(torch.uint8, (16,), (1,), 0, "layers[0]").numel() == 16  # bytes need no alignment


def test_a_region_slice_of_any_size_is_checked_against_the_mapping(segment):
    """A block_tables slice's second dimension is the one size no expected shape bounds: [1, 2^62]
    made torch's stride computation overflow (RuntimeError) before the bounds check could refuse it."""
    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    try:
        (rid,) = mem.register(pb.RegisterBuffersRequest(regions=[pb.BufferRegion(
            name="metadata", memory=memory.export_handle(segment.tensor), size_bytes=4096)]))
        ok = mem.resolve(pb.RegionSlice(region_id=rid, offset_bytes=0), torch.int32, (2, 8), "block_tables")
        assert ok.shape == (2, 8) and ok.stride() == (8, 1)
        with pytest.raises(ValueError, match="block_tables: view needs"):
            mem.resolve(pb.RegionSlice(region_id=rid, offset_bytes=0), torch.int32, (1, 1 << 62), "block_tables")
    finally:
        mem.close()


def test_a_zero_element_region_slice_whose_strides_pass_int64_is_refused_naming_its_field(segment):
    """A shape with a 0 needs no bytes, so the bounds check passes it, but its contiguous strides are still the
    product of the dimensions after each: [0, 2^62, 4] asks as_strided for a stride of 2^64, which torch's
    argument parser refuses with TypeError, not RuntimeError. It escaped resolve() (a codec.RegionResolver, which
    raises ValueError naming the field), as no refusal at all. validate_step does not reach it today (its one
    shape a request sizes, block_tables', is 2-D, so its strides fit); a 3-D slice there would have been an
    exception its callers catch as no bad request: the rank loop's "failed inside its launch" exit."""
    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    try:
        (rid,) = mem.register(pb.RegisterBuffersRequest(regions=[pb.BufferRegion(
            name="metadata", memory=memory.export_handle(segment.tensor), size_bytes=4096)]))
        with pytest.raises(memory.HandleError, match="^block_tables: ") as err:
            mem.resolve(pb.RegionSlice(region_id=rid, offset_bytes=0), torch.int64, (0, 1 << 62, 4), "block_tables")
        refusal = as_sidecar_error(err.value)
        assert (refusal.code, refusal.field) == (grpc.StatusCode.INVALID_ARGUMENT, "block_tables"), refusal
        # A zero-element slice whose strides fit is still a view, as before.
        assert mem.resolve(pb.RegionSlice(region_id=rid, offset_bytes=0), torch.int64, (0, 4), "f").shape == (0, 4)
    finally:
        mem.close()


def test_strides_that_do_not_match_the_shape_are_named(segment):
    """BindKV's layer strides: one per dimension, else INVALID_ARGUMENT naming the layer (it came back
    as INTERNAL from torch's as_strided)."""
    m = memory.MappedMemory(memory.export_handle(segment.tensor), "layers[0].memory", torch.device("cpu"))
    try:
        with pytest.raises(memory.HandleError, match="layers\\[0\\]: 1 strides for 2 dimensions"):
            m.view(torch.float32, (2, 4), (1,), 0, "layers[0]")
    finally:
        m.close()


def test_attaching_claims_nothing_in_the_resource_tracker(segment, monkeypatch):
    """The creator owns its segment. An attach that registered it (SharedMemory(create=False) before
    Python 3.13) and then unregistered it also dropped the creator's registration in a shared
    tracker; the creator's unlink then printed "KeyError: '/psm_...'" from the tracker."""
    from multiprocessing import resource_tracker

    calls = []
    monkeypatch.setattr(resource_tracker, "register", lambda *a: calls.append(("register", a)))
    monkeypatch.setattr(resource_tracker, "unregister", lambda *a: calls.append(("unregister", a)))
    handle = memory.export_handle(segment.tensor)
    m = memory.MappedMemory(handle, "page", torch.device("cpu"))
    segment.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert m.view(torch.uint8, (4,), (1,), 0, "page").tolist() == [1, 2, 3, 4]  # the same bytes
    m.close()
    seg = memory.AttachedSegment(handle.shm.name)
    assert seg.size >= 4096 and bytes(seg.buf[:4]) == b"\x01\x02\x03\x04"
    seg.close()
    assert calls == []


def _maps_of(name: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(name in line for line in maps)


def test_closing_a_mapping_never_unmaps_under_a_live_view(segment):
    """torch.frombuffer keeps no buffer export, so unmapping at close() (as it did) left any view still
    held (a step's tensor, a cached layout) pointing at unmapped memory: reading it crashed the process.
    The mapping now goes with its last view."""
    segment.tensor[:4] = torch.tensor([9, 8, 7, 6], dtype=torch.uint8)
    name = segment.segment.name
    before = _maps_of(name)
    m = memory.MappedMemory(memory.export_handle(segment.tensor), "regions[0].memory", torch.device("cpu"))
    view = m.view(torch.uint8, (4,), (1,), 0, "positions")
    assert _maps_of(name) == before + 1
    m.close()
    assert view.tolist() == [9, 8, 7, 6] and _maps_of(name) == before + 1
    del view
    assert _maps_of(name) == before
    unviewed = memory.MappedMemory(memory.export_handle(segment.tensor), "page", torch.device("cpu"))
    unviewed.close()
    assert _maps_of(name) == before  # nothing viewed it: unmapped at close


def test_closing_an_exported_tensor_never_unmaps_under_a_live_view():
    """The engine's side of the same hazard: ShmTensor.close() unmapped the segment under any view still
    held (StepBuffers.input_view, which an engine writes its embeddings into, or a step's hidden view,
    across a dropped link), and the next access crashed the process (SIGSEGV) or wrote into whatever was
    mapped there since. The segment is unlinked at close; its mapping goes with its last view."""
    held = memory.shm_empty((4096,), torch.uint8)
    name = held.segment.name
    held.tensor[:4] = torch.tensor([9, 8, 7, 6], dtype=torch.uint8)
    view = held.tensor[:4]
    assert _maps_of(name) == 1
    held.close()
    assert not os.path.exists(f"/dev/shm/{name.lstrip('/')}")  # unlinked at once
    assert _maps_of(name) == 1 and view.tolist() == [9, 8, 7, 6]
    with pytest.raises(memory.HandleError, match="not in exported shared memory"):
        memory.export_handle(view)  # no longer names a segment: it was unlinked
    del view
    assert _maps_of(name) == 0
    unviewed = memory.shm_empty((4096,), torch.uint8)
    name = unviewed.segment.name
    unviewed.close()
    assert _maps_of(name) == 0  # nothing viewed it: unmapped at close


def test_region_ids_are_random_never_reused_and_released_all_or_none(segment):
    from dspark_sidecar.server.errors import SidecarError

    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    region = pb.BufferRegion(name="metadata", memory=memory.export_handle(segment.tensor), size_bytes=4096)
    try:
        a, b = mem.register(pb.RegisterBuffersRequest(regions=[region, region]))
        assert a != b and a > 3 and b > 3  # not 1, 2, 3: an id kept from a restarted sidecar names nothing
        mem.resolve(pb.RegionSlice(region_id=a, offset_bytes=0), torch.int32, (4,), "positions")
        with pytest.raises(SidecarError, match="region_ids: 7 is not registered") as err:
            mem.unregister([a, 7])
        assert err.value.reason == "UNKNOWN_REGION" and mem.region_count == 2
        for m in mem.unregister([a]):
            m.close()
        assert mem.region_count == 1
        with pytest.raises(ValueError, match=f"region {a} is not registered"):  # not from the view cache
            mem.resolve(pb.RegionSlice(region_id=a, offset_bytes=0), torch.int32, (4,), "positions")
        mem.resolve(pb.RegionSlice(region_id=b, offset_bytes=0), torch.int32, (4,), "positions")
    finally:
        mem.close()


def test_an_id_drawn_again_is_never_handed_out_while_registered_or_once_released(segment, monkeypatch):
    """Random ids collide only by chance; when one does, the draw is made again. A released id is never handed
    out again by this process: an engine's late step or UnregisterBuffers naming a region it released would
    otherwise reach (write into, or release) another engine's region registered since."""
    from dspark_sidecar.server import kv_binding

    draws = iter([11, 11, 12, 11, 12, 13])  # 11 live, then 11 released and 12 live: each drawn again
    monkeypatch.setattr(kv_binding.secrets, "randbits", lambda bits: next(draws))
    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    region = pb.BufferRegion(name="metadata", memory=memory.export_handle(segment.tensor), size_bytes=4096)
    try:
        assert mem.register(pb.RegisterBuffersRequest(regions=[region, region])) == [11, 12]
        for m in mem.unregister([11]):
            m.close()
        assert mem.register(pb.RegisterBuffersRequest(regions=[region])) == [13]
        assert sorted(mem._regions) == [12, 13]
    finally:
        mem.close()


def test_regions_are_released_by_their_owner_token_and_a_released_token_registers_nothing(segment):
    """An engine whose RegisterBuffers timed out never saw the ids; it releases by the token it chose
    (client/dataplane.StepBuffers). The token is then retired, so a registration still under way on
    the sidecar when the release arrives is refused and maps nothing, rather than leaking."""
    from dspark_sidecar.server.errors import SidecarError

    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    region = pb.BufferRegion(name="metadata", memory=memory.export_handle(segment.tensor), size_bytes=4096)
    name, before = segment.segment.name, _maps_of(segment.segment.name)
    try:
        a, b = mem.register(pb.RegisterBuffersRequest(regions=[region, region], owner=41))
        (c,) = mem.register(pb.RegisterBuffersRequest(regions=[region], owner=42))
        for m in mem.unregister([b]):  # released by id: no longer the owner's to release
            m.close()
        released = mem.unregister([], owner=41)
        assert len(released) == 1 and mem.region_count == 1
        for m in mem.unregister([c]):  # by id: owner 42 has nothing left, and is not kept
            m.close()
        assert 42 not in mem._owned and mem.region_count == 0
        (c,) = mem.register(pb.RegisterBuffersRequest(regions=[region], owner=42))  # not retired: registers again
        for m in released:
            m.close()
        assert _maps_of(name) == before + 1  # c's mapping only
        with pytest.raises(ValueError, match=f"region {a} is not registered"):
            mem.resolve(pb.RegionSlice(region_id=a, offset_bytes=0), torch.int32, (4,), "positions")
        with pytest.raises(SidecarError, match="owner: 41 was released") as err:
            mem.register(pb.RegisterBuffersRequest(regions=[region], owner=41))
        assert err.value.reason == "OWNER_RELEASED" and mem.region_count == 1 and _maps_of(name) == before + 1
        assert mem.unregister([], owner=43) == []  # a token whose registration never arrived: not an error
        with pytest.raises(SidecarError, match="owner: 43 was released"):  # ... and it arrives after its release
            mem.register(pb.RegisterBuffersRequest(regions=[region], owner=43))
        assert mem.region_count == 1 and _maps_of(name) == before + 1
        mem.resolve(pb.RegionSlice(region_id=c, offset_bytes=0), torch.int32, (4,), "positions")
    finally:
        mem.close()


def test_a_registration_with_one_bad_region_registers_and_maps_none_of_them(segment):
    """All or none: the ids of the regions mapped before the bad one would never reach the engine."""
    from dspark_sidecar.server.errors import SidecarError

    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    handle = memory.export_handle(segment.tensor)
    good = pb.BufferRegion(name="metadata", memory=handle, size_bytes=4096)
    too_big = pb.BufferRegion(name="inputs", memory=handle, size_bytes=4097)
    name, before = segment.segment.name, _maps_of(segment.segment.name)
    try:
        with pytest.raises(SidecarError, match=r"regions\[1\].size_bytes: 4097: must be positive and at most the 4096"):
            mem.register(pb.RegisterBuffersRequest(regions=[good, too_big], owner=5))
        assert mem.region_count == 0 and _maps_of(name) == before
        assert mem.unregister([], owner=5) == []
    finally:
        mem.close()


def _ipc(offset: int) -> pb.MemoryHandle:
    """A CUDA IPC handle as an engine exports it; only its ref counter matters here."""
    return pb.MemoryHandle(cuda_ipc=pb.CudaIpcHandle(ipc_handle=b"h", storage_size_bytes=4096,
                                                     ref_counter_handle=b"/torch_counter", ref_counter_offset=offset))


@pytest.fixture
def given_back(monkeypatch):
    """The ref counters a refusal gives back to their engine (torch's producer reference per export)."""
    calls = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter",
                        classmethod(lambda cls, handle, offset, device=None: calls.append((handle, offset))))
    return calls


def test_a_refused_registration_gives_back_each_unopened_cuda_handle_once(segment, given_back):
    """Each CUDA IPC export counts one consumer; a handle refused unopened would keep the engine's block
    allocated until the engine exits. Here region 1 is refused (this rank has no GPU) and region 2
    is never reached: both counters go back once; region 0, opened, is closed (its own release)."""
    from dspark_sidecar.server.errors import as_sidecar_error

    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    name, before = segment.segment.name, _maps_of(segment.segment.name)
    good = pb.BufferRegion(name="metadata", memory=memory.export_handle(segment.tensor), size_bytes=4096)
    req = pb.RegisterBuffersRequest(regions=[good, pb.BufferRegion(name="inputs", memory=_ipc(8), size_bytes=4096),
                                             pb.BufferRegion(name="hidden", memory=_ipc(16), size_bytes=4096)])
    with pytest.raises(Exception) as err:
        mem.register(req)
    assert "needs a GPU sidecar" in as_sidecar_error(err.value).message
    assert sorted(given_back) == [(b"/torch_counter", 8), (b"/torch_counter", 16)]
    assert mem.region_count == 0 and _maps_of(name) == before


def test_a_refused_bind_gives_back_every_cuda_handle_it_did_not_open(given_back):
    from dspark_sidecar.server.errors import SidecarError

    cfg = load_config("tiny")
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    layers = [pb.KVLayerBinding(layer=i, memory=_ipc(8 * i)) for i in range(cfg.num_hidden_layers)]
    wrong_tp = pb.BindKVRequest(engine=pb.EngineFacts(engine_rank=0, tp_size=4, dp_size=1, pp_size=1), page_size=16,
                               layers=layers)
    with pytest.raises(SidecarError, match="TP_MISMATCH|engine TP 4"):
        mem.bind(wrong_tp)
    assert sorted(o for _, o in given_back) == [8 * i for i in range(cfg.num_hidden_layers)]
    given_back.clear()
    from dspark_sidecar.drafter.kv_cache import kv_layer_shape
    from dspark_sidecar.proto import codec

    for lb in layers:  # well formed: layer 0 reaches MappedMemory, which refuses it (no GPU here)
        lb.dtype = codec.dtype_to_proto(torch.float32)
        lb.shape[:] = kv_layer_shape(cfg, 1, 4, 16)
        lb.strides[:] = torch.empty(tuple(lb.shape)).stride()  # BindKV checks the strides' count before any map
    with pytest.raises(ValueError, match=r"layers\[0\].memory: a CUDA/HIP IPC handle needs a GPU sidecar"):
        mem.bind(pb.BindKVRequest(engine=pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1), page_size=16, layers=layers))
    # Layer 0's counter given back where it was refused, the rest by the undo: each exactly once.
    assert sorted(o for _, o in given_back) == [8 * i for i in range(cfg.num_hidden_layers)]
    assert mem.kv is None


@pytest.mark.parametrize("name", ["../../tmp/outside", "a/b", "..", ".", ""])
def test_a_shared_memory_name_must_be_one_entry_of_dev_shm(name):
    """A name with a path in it could reach any file the sidecar may write (found by the RPC fuzzing)."""
    handle = pb.MemoryHandle(shm=pb.SharedMemoryHandle(name=name))
    with pytest.raises(memory.HandleError, match="is not a shared-memory name"):
        memory.MappedMemory(handle, "regions[0].memory", torch.device("cpu"))


def test_a_symbolic_link_in_dev_shm_is_not_followed(segment, tmp_path):
    import os

    link = f"dspark-test-link-{os.getpid()}"
    os.symlink(tmp_path / "target", f"/dev/shm/{link}")
    (tmp_path / "target").write_bytes(b"\0" * 4096)
    try:
        with pytest.raises(memory.HandleError, match="cannot open shared memory"):
            memory.MappedMemory(pb.MemoryHandle(shm=pb.SharedMemoryHandle(name=link)), "page", torch.device("cpu"))
    finally:
        os.unlink(f"/dev/shm/{link}")


def test_a_region_s_slices_stay_inside_its_registered_bytes(segment):
    """size_bytes bounds what steps may name, not the whole mapping (an output slice past it wrote
    engine memory that was never registered: found by the RPC fuzzing)."""
    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    handle = memory.export_handle(segment.tensor)
    try:
        (rid,) = mem.register(pb.RegisterBuffersRequest(regions=[pb.BufferRegion(name="m", memory=handle,
                                                                                  size_bytes=1024)]))
        mem.resolve(pb.RegionSlice(region_id=rid, offset_bytes=768), torch.int32, (64,), "positions")
        with pytest.raises(ValueError, match="positions: view needs 1028 bytes, mapping has 1024"):
            mem.resolve(pb.RegionSlice(region_id=rid, offset_bytes=772), torch.int32, (64,), "positions")
        with pytest.raises(Exception, match="must be positive"):
            mem.register(pb.RegisterBuffersRequest(regions=[pb.BufferRegion(name="m", memory=handle)]))
    finally:
        mem.close()


@pytest.mark.parametrize("named", ["GPU-other", ""])
def test_a_cuda_handle_from_another_gpu_or_naming_none_is_refused_and_given_back(named, given_back, monkeypatch):
    """The same-GPU check used to be skipped for a handle whose device_uuid was empty."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-this"))
    h = _ipc(24).cuda_ipc
    h.device_uuid = named
    shown = named or r"\(not named\)"
    with pytest.raises(memory.HandleError, match=rf"handle is from GPU {shown}, this rank runs on GPU GPU-this"):
        memory._open_cuda_ipc(h, "regions[0].memory", torch.device("cuda", 0))
    assert given_back == [(b"/torch_counter", 24)]


def test_a_cuda_handle_of_no_bytes_is_refused_as_invalid_and_given_back(given_back, monkeypatch):
    """torch's rebuild_cuda_tensor answers storage_size_bytes 0 with an empty storage: nothing opened, and
    the producer reference never given back (the engine's block stayed allocated). The allocation query
    on its null pointer then failed, refusing the handle as uncheckable (UNAVAILABLE): the engine would
    retry a handle that can never map. Refused before torch is asked, as the engine's fault."""
    from types import SimpleNamespace

    import torch.multiprocessing.reductions as reductions

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-this"))
    asked = []

    def rebuild(*args):  # torch's branch for a storage of no bytes: an empty storage, no counter given back
        asked.append(args)
        return torch.empty(0, dtype=torch.uint8)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    h = _ipc(32).cuda_ipc
    h.device_uuid, h.storage_size_bytes = "GPU-this", 0
    with pytest.raises(memory.HandleError, match="regions\\[0\\].memory: storage_size_bytes 0") as err:
        memory._open_cuda_ipc(h, "regions[0].memory", torch.device("cuda", 0))
    assert not isinstance(err.value, memory.HandleUncheckable)
    assert given_back == [(b"/torch_counter", 32)] and asked == []


def _torch_like_rebuild(monkeypatch, asked: list) -> None:
    """rebuild_cuda_tensor as torch's unpacks its numbers: int64, a ValueError past it (no RuntimeError)."""
    import torch.multiprocessing.reductions as reductions

    def rebuild(*args):
        asked.append(args)
        if any(isinstance(a, int) and a >= 1 << 63 for a in args):
            raise ValueError("Overflow when unpacking long long")
        return torch.empty(args[8], dtype=torch.uint8)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)


@pytest.mark.parametrize("offset", [10000, (1 << 63) - 1, (1 << 64) - 1])
def test_a_cuda_handle_naming_a_counter_outside_torch_s_file_is_refused_and_nothing_decremented(
        offset, given_back, monkeypatch):
    """torch decrements the int64 at ref_counter_offset in its 10000-counter file's mapping, unchecked, when
    it gives a reference back (a refused handle's _release_ipc_counter, an opened storage's unmap): a
    handle naming counter 10000 or more had the sidecar write past that mapping into its own memory
    (SIGSEGV, or silent corruption). Refused before torch is asked, and nothing is given back."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-this"))
    asked = []
    _torch_like_rebuild(monkeypatch, asked)
    h = _ipc(offset).cuda_ipc
    h.device_uuid = "GPU-this"
    with pytest.raises(memory.HandleError, match=rf"layers\[0\].memory: ref_counter_offset {offset} is outside"):
        memory._open_cuda_ipc(h, "layers[0].memory", torch.device("cuda", 0))
    h.device_uuid = "GPU-other"  # refused for another reason: its counter is not given back either
    with pytest.raises(memory.HandleError, match="handle is from GPU GPU-other"):
        memory._open_cuda_ipc(h, "layers[0].memory", torch.device("cuda", 0))
    memory.discard_handle(pb.MemoryHandle(cuda_ipc=h))
    assert asked == [] and given_back == []


@pytest.mark.parametrize("size, offset", [(1 << 63, 0), (4096, (1 << 64) - 1)])
def test_a_cuda_handle_whose_size_or_offset_is_past_int64_is_refused_as_invalid_and_given_back(
        size, offset, given_back, monkeypatch):
    """The proto's sizes are uint64, torch unpacks them as int64: past 2^63 - 1 its ValueError escaped
    _rebuild (which turns RuntimeError only into a HandleError) as INTERNAL, and the engine's producer
    reference was never given back."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-this"))
    asked = []
    _torch_like_rebuild(monkeypatch, asked)
    h = _ipc(24).cuda_ipc
    h.device_uuid, h.storage_size_bytes, h.storage_offset_bytes = "GPU-this", size, offset
    with pytest.raises(memory.HandleError, match=r"layers\[0\].memory: storage_size_bytes .* past 2\^63 - 1") as err:
        memory._open_cuda_ipc(h, "layers[0].memory", torch.device("cuda", 0))
    assert not isinstance(err.value, (memory.HandleUncheckable, memory.HandleExhausted))
    assert asked == [] and given_back == [(b"/torch_counter", 24)]


@pytest.fixture
def counter_file():
    """A file in /dev/shm named as torch names its ref-counter files, of the size given (0: none made)."""
    made = []

    def make(nbytes: int) -> bytes:
        name = f"torch_{os.getpid()}_{len(made)}_dspark_test"
        made.append(f"/dev/shm/{name}")
        if nbytes:
            with open(made[-1], "wb") as f:
                f.truncate(nbytes)
        return f"/{name}".encode()

    yield make
    for path in made:
        if os.path.exists(path):
            os.unlink(path)


def test_a_refused_handle_s_counter_is_given_back_only_into_a_torch_counter_file(segment, counter_file, given_back):
    """torch's give-back opens the ref_counter_handle it is handed in /dev/shm, read/write, unchecked: a file
    shorter than its counter file it grows and zeroes the first byte of, it drops the int64 the offset names,
    and it unlinks the file if the int at its start counts 0. Any caller could name any segment this rank may
    open (an engine's KV cache or doorbell page, the ranks' rendezvous board, as root anyone's) in a handle
    refused on purpose (here: a CUDA handle on a CPU rank), and have it rewritten or removed."""
    victim = f"/{segment.segment.name.lstrip('/')}".encode()  # an engine's zero-filled segment (psm_*)
    short, torch_s, absent = counter_file(4096), counter_file(memory._REF_COUNTER_FILE_BYTES), counter_file(0)
    for name in (victim, short, torch_s, absent):
        h = _ipc(7)
        h.cuda_ipc.ref_counter_handle = name
        with pytest.raises(memory.HandleError, match="needs a GPU sidecar"):
            memory.MappedMemory(h, "regions[0].memory", torch.device("cpu"))
    # torch's own counter file, and a name that is not there (torch's open fails, quietly): given back.
    assert given_back == [(torch_s, 7), (absent, 7)]


def test_a_cuda_handle_naming_a_file_that_is_no_torch_counter_is_refused_before_torch(segment, counter_file,
                                                                                      given_back, monkeypatch):
    """Opened, the storage's unmap decrements the same counter through the same unchecked open."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-this"))
    asked = []
    _torch_like_rebuild(monkeypatch, asked)
    for name in (f"/{segment.segment.name.lstrip('/')}".encode(), counter_file(4096), b"/rendezvous-board"):
        h = _ipc(24).cuda_ipc
        h.device_uuid, h.ref_counter_handle = "GPU-this", name
        with pytest.raises(memory.HandleError, match=r"layers\[0\].memory: ref_counter_handle .* is not"):
            memory._open_cuda_ipc(h, "layers[0].memory", torch.device("cuda", 0))
    assert asked == [] and given_back == []


@pytest.fixture
def torch_open(monkeypatch):
    """torch's own rebuild_cuda_tensor, with only its C++ open (UntypedStorage._new_shared_cuda) stood in by
    the checks it makes before the driver is asked (torch/csrc/StorageSharing.cpp): arguments of another
    type are a TypeError; an empty handle, or a sync with an empty event handle, returns NULL with no
    exception set, which Python raises as SystemError. Otherwise a CPU storage of the size asked. Returns
    the opens torch got that far with."""
    import torch.multiprocessing.reductions as reductions

    opened = []

    def new_shared_cuda(device, handle, size, offset, counter, counter_offset, event, sync):
        if not (all(isinstance(v, int) for v in (device, size, offset, counter_offset))
                and all(isinstance(v, bytes) for v in (handle, counter, event)) and isinstance(sync, bool)):
            raise TypeError("_new_shared in CUDA mode received an invalid combination of arguments")
        if (sync and not event) or not handle:
            raise SystemError("<built-in method _new_shared_cuda> returned NULL without setting an exception")
        opened.append((handle, event, sync))
        return torch.UntypedStorage(size)

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(new_shared_cuda), raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    before = set(reductions.shared_cache)
    yield opened
    for key in set(reductions.shared_cache) - before:
        reductions.shared_cache.pop(key, None)


def test_a_cuda_handle_with_no_event_opens_as_the_proto_allows(torch_open, given_back):
    """sidecar.proto: event_handle is "empty when none". _rebuild passed an empty one on as None, which
    torch's open refuses (TypeError: it takes bytes only): a handle with no event was answered INTERNAL
    instead of mapped, and the engine's producer reference was never given back."""
    h = _ipc(40).cuda_ipc
    h.event_handle, h.event_sync_required = b"", False
    t = memory._rebuild(h, "layers[0].memory", torch.device("cuda", 0))
    assert t.numel() == 4096 and torch_open == [(b"h", b"", False)] and given_back == []


@pytest.mark.parametrize("ipc, event, why", [
    (b"", b"", "ipc_handle is empty"),
    (b"h", b"", "event_sync_required with an event_handle of 0 bytes, not 64"),
    (b"h", b"e" * 8, "event_sync_required with an event_handle of 8 bytes, not 64"),
])
def test_a_cuda_handle_torch_would_open_as_nothing_is_refused_as_invalid_and_given_back(
        ipc, event, why, torch_open, given_back, monkeypatch):
    """An empty ipc_handle (the proto's default), or a sync asked with an empty event handle: torch's open
    returned NULL with no exception, a SystemError that escaped as INTERNAL with the engine's producer
    reference kept. An event handle shorter than a cudaIpcEventHandle_t torch reads past its bytes.
    Refused before torch is asked, as the engine's fault, and given back once."""
    from types import SimpleNamespace

    from dspark_sidecar.server.errors import as_sidecar_error

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-this"))
    h = _ipc(48).cuda_ipc
    h.device_uuid, h.ipc_handle, h.event_handle, h.event_sync_required = "GPU-this", ipc, event, True
    with pytest.raises(memory.HandleError, match=rf"layers\[0\].memory: {why}") as err:
        memory._open_cuda_ipc(h, "layers[0].memory", torch.device("cuda", 0))
    assert as_sidecar_error(err.value).code.name == "INVALID_ARGUMENT"
    assert torch_open == [] and given_back == [(b"/torch_counter", 48)]


def test_a_segment_shared_with_a_group_is_0660_and_that_group_s():
    """Python makes segments 0600: a sidecar of another user (systemd on AMD) could not map the engine's
    doorbell page or metadata region, and every step went over the gRPC stream."""
    import stat as st

    plain = memory.shm_empty((64,), torch.uint8)
    shared = memory.shm_empty((64,), torch.uint8, group=os.getegid())
    try:
        info = [os.stat(f"/dev/shm/{m.segment.name}") for m in (plain, shared)]
        assert st.S_IMODE(info[0].st_mode) == 0o600
        assert st.S_IMODE(info[1].st_mode) == 0o660 and info[1].st_gid == os.getegid()
    finally:
        plain.close()
        shared.close()


@pytest.mark.parametrize("group", [None, os.getegid()], ids=["private", "group"])
def test_a_segment_that_cannot_hold_the_tensor_is_unlinked_not_left_in_dev_shm(group):
    """A zero-element shape of a 4-byte dtype gets the 1-byte minimum segment, which torch cannot view as
    that dtype (RuntimeError: a StatusReport's hidden_size 0 sized the doorbell's regions so). The
    segment stayed in /dev/shm, one per connect, until the process exited."""
    with recording_shm() as shm:
        with pytest.raises(RuntimeError):
            memory.shm_empty((28, 0), torch.float32, group)
    assert len(shm.created) == 1
    assert shm.left() == set(), f"{shm.left()} left in /dev/shm"


OTHER_UID = 12345


@pytest.mark.parametrize("owner, mode, refusal", [
    ("mine", 0o600, None),  # the engine as the sidecar's own user (shm_empty)
    ("other", 0o660, None),  # the engine as another user, shared with the socket's group (shm_empty(group=))
    ("mine", 0o666, "is writable by every user"),
    ("mine", 0o662, "is writable by every user"),
    ("mine", 0o606, "is writable by every user"),  # o+w alone, without g+w
    ("other", 0o600, "is private to another user"),
    ("other", 0o640, "is private to another user"),
], ids=lambda v: f"{v:04o}" if isinstance(v, int) else v)
def test_a_segment_any_user_may_truncate_or_only_privilege_opens_is_refused(segment, owner, mode, refusal):
    """Mapped, a segment another process shrinks kills the rank with SIGBUS at its next access: one that
    every user may write (o+w) let any local user do that (or rewrite a step's metadata). And a root sidecar
    opened any user's private (0600) segment, so whoever reached its socket (with --tcp-base-port, any local
    user) could have it map, and for a KV binding write into, a segment they could not open themselves."""
    if owner == "other" and os.geteuid() != 0:
        pytest.skip("another user's segment needs chown (root)")
    path = f"/dev/shm/{segment.segment.name.lstrip('/')}"
    os.chmod(path, mode)
    if owner == "other":
        os.chown(path, OTHER_UID, -1)
    handle = memory.export_handle(segment.tensor)
    if refusal is None:
        memory.MappedMemory(handle, "regions[0].memory", torch.device("cpu")).close()
        return
    with pytest.raises(memory.HandleError) as refused:
        memory.MappedMemory(handle, "regions[0].memory", torch.device("cpu"))
    uid = OTHER_UID if owner == "other" else os.geteuid()
    assert f"{path} {refusal} (owner uid {uid}, mode {mode:04o})" in str(refused.value), refused.value
    assert str(refused.value).startswith("regions[0].memory: cannot open shared memory"), refused.value


@pytest.mark.parametrize("code", ["EMFILE", "ENFILE", "ENOMEM"])
def test_a_segment_that_cannot_be_opened_for_want_of_descriptors_or_memory_is_passing_not_invalid(segment, code,
                                                                                                  monkeypatch):
    """Opening or mapping an engine's segment failed with EMFILE/ENFILE (the rank or the host out of file
    descriptors) or ENOMEM (out of memory or address space): nothing in the handle is wrong, but it was
    answered INVALID_ARGUMENT, which client/binding.py reads as permanent: the engine's fast path went off
    for its life over a passing shortage. Now HandleExhausted (UNAVAILABLE: retried). A segment that is not
    there stays the engine's fault (INVALID_ARGUMENT)."""

    import grpc

    from dspark_sidecar.client.binding import _PERMANENT_CODES
    from dspark_sidecar.server.errors import as_sidecar_error

    handle = memory.export_handle(segment.tensor)
    real_open = os.open

    def short_open(path, flags, *args, **kwargs):
        if path.startswith("/dev/shm/"):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(memory.os, "open", short_open)
    with pytest.raises(memory.HandleExhausted) as info:
        memory.MappedMemory(handle, "layers[0].memory", torch.device("cpu"))
    err = as_sidecar_error(info.value)
    assert (err.code, err.field, err.reason) == (grpc.StatusCode.UNAVAILABLE, "layers[0].memory", "MAP_EXHAUSTED")
    assert err.code not in _PERMANENT_CODES
    # Through BindKV's mapping too: the whole bind is refused as passing.
    cfg = load_config("tiny")
    from dspark_sidecar.drafter.kv_cache import kv_layer_shape
    from dspark_sidecar.proto import codec

    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    layers = [pb.KVLayerBinding(layer=i, memory=handle, dtype=codec.dtype_to_proto(torch.float32),
                                shape=kv_layer_shape(cfg, 1, 1, 16),
                                strides=torch.empty(kv_layer_shape(cfg, 1, 1, 16)).stride())
              for i in range(cfg.num_hidden_layers)]
    with pytest.raises(memory.HandleExhausted):
        mem.bind(pb.BindKVRequest(engine=pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1), page_size=16, layers=layers))
    assert mem.kv is None
    monkeypatch.undo()
    missing = pb.MemoryHandle(shm=pb.SharedMemoryHandle(name=f"dspark-test-missing-{os.getpid()}"))
    with pytest.raises(memory.HandleError) as gone:
        memory.MappedMemory(missing, "layers[0].memory", torch.device("cpu"))
    assert not isinstance(gone.value, memory.HandleExhausted)
    assert as_sidecar_error(gone.value).code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("failure", ["CUDA error: out of memory", "HIP error: out of memory",
                                     "unable to open shared memory object </torch_1_2_3> in read-write mode: "
                                     "Too many open files (24)"])
def test_a_cuda_handle_the_driver_cannot_open_for_want_of_memory_is_passing_and_given_back(failure, given_back,
                                                                                           monkeypatch):
    """torch's open of a CUDA/HIP IPC handle raised RuntimeError for the driver out of memory, or for its
    reference counter file that could not be opened (out of descriptors): answered INVALID_ARGUMENT as if
    the handle were no handle, so the engine turned its fast path off for good. Now HandleExhausted
    (UNAVAILABLE), the engine's reference given back as before; bytes that are no handle stay invalid."""
    import grpc
    import torch.multiprocessing.reductions as reductions

    from dspark_sidecar.server.errors import as_sidecar_error

    def refuse(*args, **kwargs):
        raise RuntimeError(why[0])

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", refuse)
    why = [failure]
    with pytest.raises(memory.HandleExhausted) as info:
        memory._rebuild(_ipc(32).cuda_ipc, "layers[1].memory", torch.device("cuda", 0))
    assert given_back == [(b"/torch_counter", 32)]
    err = as_sidecar_error(info.value)
    assert (err.code, err.reason, err.field) == (grpc.StatusCode.UNAVAILABLE, "MAP_EXHAUSTED", "layers[1].memory")
    why[0] = "CUDA error: invalid argument"
    with pytest.raises(memory.HandleError) as bad:
        memory._rebuild(_ipc(40).cuda_ipc, "layers[1].memory", torch.device("cuda", 0))
    assert not isinstance(bad.value, memory.HandleExhausted)
    assert as_sidecar_error(bad.value).code == grpc.StatusCode.INVALID_ARGUMENT


def test_shm_empty_on_a_full_dev_shm_raises_enospc_not_a_bus_error(tmp_path):
    """The engine's step metadata and doorbell page (client/dataplane.py) on a /dev/shm with no page left (a
    container's 64 MiB default, shared with NCCL): the segment was still created, and zero_() was a SIGBUS that
    killed the engine process. Now OSError ENOSPC (the shim then keeps the gRPC stream), and no segment left."""
    from helpers.full_shm import assert_refused_with_enospc

    assert_refused_with_enospc(tmp_path, "import torch; from dspark_sidecar.proto import memory",
                               "memory.shm_empty((1 << 20,), torch.uint8)")


@pytest.mark.parametrize("size", [1 << 63, 1 << 70], ids=["2^63", "2^70"])
def test_a_segment_larger_than_dev_shm_is_refused_before_its_name_is_made(size):
    """SharedMemory cleans up after an OSError only: past ftruncate's off_t (2^63 - 1, a shape's bytes that
    overflow) its OverflowError ("Python int too large to convert to C long") left the name in /dev/shm for good
    (never registered with the resource tracker, so not even removed at exit). Now ENOSPC naming the sizes, and
    nothing made."""
    name = f"dspark-test-huge-{os.getpid()}"
    try:
        with pytest.raises(OSError, match=f"segment of {size} bytes.*/dev/shm") as refused:
            memory.new_segment(size, name)
        assert refused.value.errno == errno.ENOSPC
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("statvfs", ["no_size_limit", "refused"])
def test_a_dev_shm_whose_size_cannot_be_read_refuses_only_what_off_t_cannot_hold(statvfs, monkeypatch):
    """A tmpfs mounted without a size limit reports 0 blocks, and statvfs may be refused: neither is a /dev/shm
    too small for every segment."""
    real_statvfs = os.statvfs

    def fake(path):
        if statvfs == "refused":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        st = real_statvfs(path)
        return type("St", (), {"f_blocks": 0, "f_frsize": st.f_frsize})()

    monkeypatch.setattr(os, "statvfs", fake)
    seg = memory.new_segment(4096)
    seg.close()
    seg.unlink()
    with pytest.raises(OSError, match="segment of 9223372036854775808 bytes"):
        memory.new_segment(1 << 63)


@pytest.fixture
def unregistered(monkeypatch) -> list:
    """The names handed to the resource tracker's unregister (a segment removed by us: once, not left to its exit)."""
    from multiprocessing import resource_tracker

    names: list = []
    real_unregister = resource_tracker.unregister
    monkeypatch.setattr(resource_tracker, "unregister", lambda n, t: (names.append(n), real_unregister(n, t)))
    return names


def test_a_segment_removed_by_another_process_while_refused_raises_the_refusal(monkeypatch, caplog, unregistered):
    """new_segment's clean-up unlinked the refused segment with SharedMemory.unlink: a name removed first by
    someone else (an operator cleaning /dev/shm, systemd's RemoveIPC) raised FileNotFoundError in place of
    the ENOSPC, skipped the close, and left the name with the resource tracker (a "leaked" warning at exit)."""
    def full_and_removed(fd, offset, size):
        os.unlink(f"/dev/shm/{os.readlink(f'/proc/self/fd/{fd}').rsplit('/', 1)[1]}")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full_and_removed)
    with pytest.raises(OSError) as refused:
        memory.new_segment(4096)
    assert refused.value.errno == errno.ENOSPC
    assert len(unregistered) == 1 and "was removed by another process" in caplog.text


def test_closing_an_exported_tensor_twice_or_after_its_segment_was_removed_raises_nothing(monkeypatch):
    """ShmTensor.close() unlinked on every call: a second close(), or one after someone else removed the
    segment (an operator cleaning /dev/shm, systemd's RemoveIPC), raised FileNotFoundError, and a caller
    closing several (StepBuffers.close) left the rest in /dev/shm. SharedMemory.unlink unregisters only
    after a successful unlink, so the resource tracker also kept the name: at exit it warned of a leak and
    unlinked it again. Each name is now removed and unregistered once."""
    from multiprocessing import resource_tracker

    real_unregister, unregistered = resource_tracker.unregister, []

    def unregister(name, rtype):
        unregistered.append(name)
        real_unregister(name, rtype)

    monkeypatch.setattr(resource_tracker, "unregister", unregister)
    twice, removed, kept = (memory.shm_empty((64,), torch.uint8) for _ in range(3))
    twice.close()
    twice.close()
    os.unlink(f"/dev/shm/{removed.segment.name}")
    removed.close()
    kept.close(unlink=False)
    assert os.path.exists(f"/dev/shm/{kept.segment.name}")  # not unlinked: still the caller's to remove
    kept.close()
    assert not os.path.exists(f"/dev/shm/{kept.segment.name}")
    assert unregistered == [f"/{m.segment.name}" for m in (twice, removed, kept)]


def test_a_symbolic_link_is_refused_as_one(segment, tmp_path):
    """O_NOFOLLOW refuses a link with ELOOP, whose words ("Too many levels of symbolic links") name neither
    the link nor what to send instead."""
    link = f"dspark-test-link-{os.getpid()}"
    os.symlink(f"/dev/shm/{segment.segment.name}", f"/dev/shm/{link}")
    try:
        with pytest.raises(memory.HandleError, match=f"/dev/shm/{link} is a symbolic link.*the segment's own name"):
            memory.MappedMemory(pb.MemoryHandle(shm=pb.SharedMemoryHandle(name=link)), "page", torch.device("cpu"))
    finally:
        os.unlink(f"/dev/shm/{link}")


def test_a_handle_s_offset_places_its_views_and_bounds_what_they_reach(segment):
    """offset_bytes starts the storage inside the segment: a view's element 0 is the byte at offset_bytes,
    never one before it (a negative view offset would reach engine memory in front of the region), and two
    mappings of one segment place the same byte at the same position (how overlapping regions are found)."""
    segment.tensor[:] = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
    handle = memory.export_handle(segment.tensor)
    handle.shm.offset_bytes = 64
    first = memory.MappedMemory(handle, "regions[0].memory", torch.device("cpu"))
    second = memory.MappedMemory(memory.export_handle(segment.tensor), "regions[1].memory", torch.device("cpu"))
    try:
        view = first.view(torch.uint8, (4,), (1,), 0, "positions")
        assert view.tolist() == [64, 65, 66, 67]
        same = second.view(torch.uint8, (4,), (1,), 64, "positions")
        assert first.place(view) == second.place(same) and first.place(view)[1] == 64
        with pytest.raises(memory.HandleError, match="positions: negative shape, stride or offset"):
            first.view(torch.uint8, (4,), (1,), -4, "positions")
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("offset, size, why", [
    (4097, 0, "offset 4097 beyond segment size 4096"),
    (0, 4097, "size_bytes 4097 outside the segment's 4096 bytes"),
    (64, 32, "size_bytes 32 outside the segment's 4096 bytes \\(or below offset_bytes 64\\)"),
])
def test_a_handle_claiming_more_than_its_segment_is_refused_and_unmapped_at_once(segment, offset, size, why):
    """A handle that claims bytes past the segment's end (a smaller segment under that name) is refused,
    and the mapping made to check it goes at once, not with the error's traceback."""
    handle = memory.export_handle(segment.tensor)
    handle.shm.offset_bytes, handle.shm.size_bytes = offset, size
    name, before = segment.segment.name, _maps_of(segment.segment.name)
    with pytest.raises(memory.HandleError, match=f"regions\\[0\\].memory: {why}") as refused:
        memory.MappedMemory(handle, "regions[0].memory", torch.device("cpu"))
    assert _maps_of(name) == before, refused.traceback  # the traceback still holds the refusing frame


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a segment a group this process is not in needs root")
def test_a_segment_shared_with_a_group_gets_that_group_not_the_process_s():
    """The group named, not the creator's own: the test above names the process's group, which the segment
    has anyway."""
    other_gid = os.getegid() + 12345
    shared = memory.shm_empty((64,), torch.uint8, group=other_gid)
    try:
        assert os.stat(f"/dev/shm/{shared.segment.name}").st_gid == other_gid
    finally:
        shared.close()


def test_a_counter_file_one_byte_short_of_torch_s_is_not_given_back_into(counter_file, given_back):
    """torch grows a shorter file to its counter file's size: the bound is the whole file, to the byte."""
    short = counter_file(memory._REF_COUNTER_FILE_BYTES - 1)
    assert "is not one of torch's ref-counter files" in memory.counter_file_problem(short)
    memory.discard_handle(pb.MemoryHandle(cuda_ipc=pb.CudaIpcHandle(ref_counter_handle=short, ref_counter_offset=3)))
    assert given_back == []


def test_a_counter_file_name_that_is_not_utf8_is_checked_as_torch_opens_it(counter_file, given_back, monkeypatch):
    """torch opens the ref_counter_handle's own bytes; the check looked up their UTF-8 decoding with each bad byte
    replaced (U+FFFD), a name that is not there, so it passed: a 1-byte file named torch_...\\xff was handed to
    torch to grow and write into (given back into here; opened, the storage's unmap writes the same way)."""
    from types import SimpleNamespace

    short = counter_file(0)[:-len(b"_dspark_test")] + b"_\xff"  # counter_file's clean-up does not know this one
    path = b"/dev/shm" + short
    with open(path, "wb") as f:
        f.write(b"\0")
    try:
        why = memory.counter_file_problem(short)
        assert why is not None and "is not one of torch's ref-counter files" in why and "1 bytes" in why, why
        memory.discard_handle(pb.MemoryHandle(cuda_ipc=pb.CudaIpcHandle(ref_counter_handle=short,
                                                                         ref_counter_offset=3)))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid="GPU-this"))
        asked = []
        _torch_like_rebuild(monkeypatch, asked)
        h = _ipc(24).cuda_ipc
        h.device_uuid, h.ref_counter_handle = "GPU-this", short
        with pytest.raises(memory.HandleError, match=r"layers\[0\].memory: ref_counter_handle .* is not one of"):
            memory._open_cuda_ipc(h, "layers[0].memory", torch.device("cuda", 0))
        assert asked == [] and given_back == []
    finally:
        os.unlink(path)


def test_a_segment_removed_by_another_process_while_shm_empty_is_refused_raises_the_refusal(monkeypatch, caplog, unregistered):
    """shm_empty's clean-up unlinked its refused segment with SharedMemory.unlink, as new_segment's once did: a
    name removed first by someone else (an operator cleaning /dev/shm, systemd's RemoveIPC) raised
    FileNotFoundError in place of the refusal (here the group's chown refused, as for a group the engine is not
    in) and left the name with the resource tracker (a "leaked" warning at exit, and a second unlink)."""
    def removed_then_refused(name, gid):
        os.unlink(f"/dev/shm/{name.lstrip('/')}")
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(memory, "_share_with_group", removed_then_refused)
    with pytest.raises(PermissionError):
        memory.shm_empty((64,), torch.uint8, group=os.getegid())
    assert len(unregistered) == 1 and "was removed by another process" in caplog.text


def test_an_offset_at_the_segment_s_very_end_maps_no_bytes_and_one_past_it_is_refused(segment):
    """offset_bytes may reach the segment's end (a storage of no bytes, which no view of an element fits in), not
    one byte past it."""
    handle = memory.export_handle(segment.tensor)
    handle.shm.offset_bytes, handle.shm.size_bytes = 4096, 0
    m = memory.MappedMemory(handle, "regions[0].memory", torch.device("cpu"))
    try:
        assert m.nbytes == 0 and m.view(torch.uint8, (0,), (1,), 0, "positions").numel() == 0
        with pytest.raises(memory.HandleError, match="positions: view needs 1 bytes, mapping has 0"):
            m.view(torch.uint8, (1,), (1,), 0, "positions")
    finally:
        m.close()
    handle.shm.offset_bytes = 4097
    with pytest.raises(memory.HandleError, match="offset 4097 beyond segment size 4096"):
        memory.MappedMemory(handle, "regions[0].memory", torch.device("cpu"))


def test_a_segment_exactly_the_size_of_dev_shm_is_made_one_byte_more_is_not(monkeypatch):
    """The refusal is for what cannot fit: a /dev/shm of 8192 bytes holds a segment of 8192."""
    real_statvfs = os.statvfs

    def fake(path):
        st = real_statvfs(path)
        return type("St", (), {"f_blocks": 8192 // st.f_frsize, "f_frsize": st.f_frsize})()

    monkeypatch.setattr(os, "statvfs", fake)
    seg = memory.new_segment(8192)
    seg.close()
    seg.unlink()
    with pytest.raises(OSError, match=r"segment of 8193 bytes cannot fit /dev/shm \(8192 bytes\)"):
        memory.new_segment(8193)


def test_a_counter_file_name_must_begin_torch_and_an_underscore(counter_file):
    """torch names its counter files torch_<pid>_...: another name beginning "torch" (a segment of another program,
    torchrun's, ...) is not one of them, whatever its size."""
    full = counter_file(memory._REF_COUNTER_FILE_BYTES)
    assert memory.counter_file_problem(full) is None
    assert "is not the name of one of torch's ref-counter files" in memory.counter_file_problem(b"/torchx" + full[7:])


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_segment_under_another_process_s_file_lease_is_refused_at_once_not_waited_on():
    """The segment was opened read/write in blocking mode: one that another process holds a file lease on (fcntl
    F_SETLEASE, which its owner may take) made the open wait until that process let go, or the kernel took the
    lease back after /proc/sys/fs/lease-break-time (45 s by default): a BindKV maps inside the rank's section,
    so steps waited with it, layer after layer, for a segment that could be refused afterwards anyway (another
    user's private one). Now the open does not wait: UNAVAILABLE (the lease is being broken: try again), naming
    the field and the segment, and nothing is left open or mapped."""
    import subprocess
    import sys

    name = f"dspark-test-leased-{os.getpid()}"
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # a read lease needs no writer holding it open
    os.ftruncate(fd, 4096)
    os.close(fd)
    # A holder that lets go as soon as the kernel asks it to (SIGIO): an open that waits for it then maps.
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, signal, sys
fd = os.open({path!r}, os.O_RDONLY)
signal.signal(signal.SIGIO, lambda *_: fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK))
try:
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
except OSError as err:  # leases off on this host (fs.leases-enable = 0)
    print("no lease:", err, flush=True)
else:
    print("leased", flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        said = holder.stdout.readline().strip()
        if said.startswith("no lease:"):
            pytest.skip(f"this host takes no file lease ({said})")
        assert said == "leased", said
        fds, maps = _fds(), _maps_of(name)
        with pytest.raises(memory.HandleExhausted) as refused:
            memory.MappedMemory(pb.MemoryHandle(shm=pb.SharedMemoryHandle(name=name)), "layers[0].memory",
                                torch.device("cpu"))
        err = as_sidecar_error(refused.value)
        assert (err.code, err.field, err.reason) == (grpc.StatusCode.UNAVAILABLE, "layers[0].memory", "MAP_EXHAUSTED")
        assert f"{path} is under another process's file lease" in str(refused.value), refused.value
        assert (_fds(), _maps_of(name)) == (fds, maps)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        os.unlink(path)


def test_a_dev_shm_entry_that_is_no_regular_file_is_refused_as_no_segment():
    """A FIFO in /dev/shm (any user may make one there) opened, and its mmap's EINVAL was the answer: "[Errno 22]
    Invalid argument", which says nothing of what the name is or what to send. Refused naming what was found."""
    name = f"dspark-test-fifo-{os.getpid()}"
    os.mkfifo(f"/dev/shm/{name}", 0o600)
    try:
        fds = _fds()
        with pytest.raises(memory.HandleError) as refused:
            memory.MappedMemory(pb.MemoryHandle(shm=pb.SharedMemoryHandle(name=name)), "regions[0].memory",
                                torch.device("cpu"))
        err = as_sidecar_error(refused.value)
        assert (err.code, err.field) == (grpc.StatusCode.INVALID_ARGUMENT, "regions[0].memory"), err
        assert f"/dev/shm/{name} is not a shared-memory segment (a regular file), it is a FIFO" in str(refused.value)
        assert _fds() == fds
    finally:
        os.unlink(f"/dev/shm/{name}")
