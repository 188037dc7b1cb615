"""StepBuffers on CPU shared memory with a stand-in stub: per-layout caching, the in-place input rows, the limits."""

from __future__ import annotations

import contextlib
from pathlib import Path

import grpc
import pytest
import torch

from dspark_sidecar.client.dataplane import DataPlaneError, StepBuffers
from dspark_sidecar.drafter import scenario
from dspark_sidecar.drafter.kv_cache import StepMetadata
from dspark_sidecar.proto import sidecar_pb2 as pb

PAGE = 16


class _Stub:
    def __init__(self, unregister_error: grpc.RpcError | None = None,
                 register_error: grpc.RpcError | None = None) -> None:
        self.released: list[list[int]] = []
        self.owners: list[int] = []  # RegisterBuffers' owner, then each UnregisterBuffers' owner
        self.unregister_error, self.register_error = unregister_error, register_error

    def RegisterBuffers(self, req, timeout=None):  # noqa: N802  (the gRPC method's name)
        assert timeout is not None
        self.owners.append(req.owner)
        if self.register_error is not None:
            raise self.register_error
        return pb.RegisterBuffersResponse(region_ids=[7, 8, 9])

    def UnregisterBuffers(self, req, timeout=None):  # noqa: N802
        assert timeout is not None  # the engine never waits without a deadline
        self.released.append(list(req.region_ids))
        self.owners.append(req.owner)
        if self.unregister_error is not None:
            raise self.unregister_error
        return pb.UnregisterBuffersResponse()


class _Error(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self):
        return self._code


def _Gone():  # noqa: N802
    return _Error(grpc.StatusCode.UNAVAILABLE)


def test_close_releases_the_regions_on_the_sidecar_once(tiny_cfg):
    stub = _Stub()
    b = StepBuffers(stub, tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    b.close()
    b.close()
    assert stub.released == [[7, 8, 9]] and b.embeds is None
    assert stub.owners == [b.owner, b.owner] and b.owner > 0  # by id and by owner (an older sidecar knows ids)


def test_a_registration_whose_answer_is_lost_is_released_by_its_owner(tiny_cfg):
    """A RegisterBuffers that timed out may have completed on the sidecar: the ids never came back,
    so the regions are released by the token the registration carried."""
    stub = _Stub(register_error=_Error(grpc.StatusCode.DEADLINE_EXCEEDED))
    with pytest.raises(grpc.RpcError):
        StepBuffers(stub, tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    assert stub.released == [[]] and len(stub.owners) == 2 and stub.owners[0] == stub.owners[1] > 0


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN])
def test_a_registration_cut_off_on_its_way_back_is_released_by_its_owner(tiny_cfg, code):
    """As a timeout, these say nothing of whether the sidecar registered the regions: a connection that broke
    after the request went out (CANCELLED, UNAVAILABLE), a handler that raised past its own undo (UNKNOWN).
    Were they not released by the owner token, the sidecar would keep the three regions (and, under CUDA IPC, the
    engine's buffers) mapped until it exited, once per such try."""
    stub = _Stub(register_error=_Error(code))
    with pytest.raises(grpc.RpcError):
        StepBuffers(stub, tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    assert stub.released == [[]] and len(stub.owners) == 2 and stub.owners[0] == stub.owners[1] > 0


def test_buffers_whose_metadata_segment_cannot_be_made_leave_no_shared_memory(tiny_cfg, monkeypatch):
    """/dev/shm full at the third segment (memory.new_segment's ENOSPC): the input and hidden segments made
    before it go at once, nothing is sent. Left to the error's traceback, they would stay in /dev/shm until exit,
    once per try of the data plane."""
    import errno

    from dspark_sidecar.client import dataplane
    from helpers.engine_fakes import recording_shm

    made = []
    real = dataplane.memory.shm_empty

    def shm_empty(*args, **kw):
        made.append(args[0])
        if len(made) == 3:  # the metadata region (the input and hidden rows come first)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(dataplane.memory, "shm_empty", shm_empty)
    stub = _Stub()
    with recording_shm() as shm, pytest.raises(OSError, match="No space"):
        StepBuffers(stub, tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    assert len(made) == 3 and len(shm.created) == 2, (made, shm.created)
    assert shm.left() == set()
    assert stub.owners == [], "a remote call for buffers that could not be made"


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_registration_refused_or_unanswered_leaves_no_shared_memory(tiny_cfg, code):
    """The three segments made for it go with the error, whether the sidecar refused the regions or its answer
    was lost: left, each try of the data plane kept three segments in /dev/shm until the process exited."""
    from helpers.engine_fakes import recording_shm

    with recording_shm() as shm, pytest.raises(grpc.RpcError):
        StepBuffers(_Stub(register_error=_Error(code)), tiny_cfg.hidden_size, 4, 40, torch.float32,
                    torch.device("cpu"))
    assert len(shm.created) == 3 and shm.left() == set(), shm.created


def test_a_refused_registration_releases_nothing(tiny_cfg):
    """A refusal (a handle the sidecar cannot map) registered none of the regions: no second call."""
    stub = _Stub(register_error=_Error(grpc.StatusCode.INVALID_ARGUMENT))
    with pytest.raises(grpc.RpcError):
        StepBuffers(stub, tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    assert stub.released == [] and len(stub.owners) == 1


def test_close_goes_on_when_the_sidecar_is_gone(tiny_cfg, caplog):
    stub = _Stub(_Gone())
    b = StepBuffers(stub, tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    name = b._shm[0].segment.name
    with caplog.at_level("INFO", logger="dspark_sidecar.client"):
        b.close()
    assert stub.released == [[7, 8, 9]] and "UnregisterBuffers: UNAVAILABLE" in caplog.text
    assert not (Path("/dev/shm") / name).exists()  # its own shared memory went all the same


@pytest.fixture
def bufs(tiny_cfg):
    b = StepBuffers(_Stub(), tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    yield b
    b.close()


def _step(cfg, embed, lens, seed=0):
    return scenario.random_step(cfg, lens, PAGE, sum(scenario.pages_needed(c + 7, PAGE) for c in lens), embed, seed=seed)


def test_fill_writes_the_regions_and_points_the_request_at_them(bufs, tiny_cfg, tiny_embed):
    step = _step(tiny_cfg, tiny_embed, [5, 300])
    req = pb.DraftStepRequest(step_id=1)
    hidden = bufs.fill(req, step.inputs_embeds, step.positions, step.meta)
    n = step.positions.numel()
    assert torch.equal(bufs.embeds[:n], step.inputs_embeds)  # copied: not the registered rows
    assert hidden.shape == (n, tiny_cfg.hidden_size) and hidden.data_ptr() == bufs.hidden.data_ptr()
    assert req.inputs_embeds.region.region_id == 7 and req.output.region_id == 8
    # The step's n rows, not the region's 7 x max_reqs: the sidecar checks the rows against the positions
    assert list(req.inputs_embeds.shape) == [n, tiny_cfg.hidden_size] and req.inputs_embeds.region.offset_bytes == 0
    raw = bufs.meta_bytes
    for field, t in (("positions", step.positions), ("seq_lens", step.meta.seq_lens),
                     ("block_tables", step.meta.block_tables), ("slot_mapping", step.meta.slot_mapping)):
        ref = getattr(req, field)
        off = ref.region.offset_bytes
        got = raw[off : off + t.numel() * t.element_size()].view(t.dtype).reshape(t.shape)
        assert ref.region.region_id == 9 and torch.equal(got, t), field


def test_staged_fields_appended_to_the_step_s_scalars_are_the_filled_request(bufs, tiny_cfg, tiny_embed):
    """DoorbellTransport rings with the step's scalars serialized and the staged layout bytes appended:
    the sidecar must parse exactly the request `fill` builds (protobuf merges concatenated messages),
    and the launch key it reports is the one the GPU word carries."""
    step = _step(tiny_cfg, tiny_embed, [5, 300])
    scalars = pb.DraftStepRequest(step_id=9, binding_id=3, binding_generation=2, num_requests=2, deadline_ms=500)
    filled = pb.DraftStepRequest()
    filled.CopyFrom(scalars)
    bufs.fill(filled, step.inputs_embeds, step.positions, step.meta)
    staged = bufs.stage(step.inputs_embeds, step.positions, step.meta)
    wire = pb.DraftStepRequest.FromString(scalars.SerializeToString() + staged.fields)
    assert wire == filled and wire.step_id == 9 and wire.positions.region.region_id == 9
    assert staged.launch_key == filled.launch_key != 0
    assert staged.hidden.data_ptr() == bufs.hidden.data_ptr()


def test_launch_keys_are_never_shared_by_two_step_buffers_of_one_process(bufs, tiny_cfg, tiny_embed):
    """Keys come from one sequence per process: a second StepBuffers (a re-registration, or two on one
    doorbell) numbering its layouts from 1 again named a key the first had used for other slices, and
    the GPU would accept a step queued for one's layout on the other's word."""
    other = StepBuffers(_Stub(), tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    try:
        keys = []
        for lens in ([5, 300], [17], [5, 300]):  # the third: a layout each has already, its key again
            step = _step(tiny_cfg, tiny_embed, lens)
            keys.append([b.stage(step.inputs_embeds, step.positions, step.meta).launch_key for b in (bufs, other)])
        assert keys[2] == keys[0]  # the same slices: the same key, every step
        flat = [k for pair in keys[:2] for k in pair]
        assert len(set(flat)) == 4 and 0 not in flat, keys
    finally:
        other.close()


def test_rows_written_in_place_are_not_copied(bufs, tiny_cfg, tiny_embed, monkeypatch):
    """An engine that wrote its embeddings into input_view(n) hands that view back: fill copies nothing
    into the input rows (a copy of the view onto itself would look the same, so copies are counted)."""
    step = _step(tiny_cfg, tiny_embed, [5, 300])
    n = step.positions.numel()
    view = bufs.input_view(n)
    view.copy_(step.inputs_embeds)
    into_inputs = []
    real = torch.Tensor.copy_

    def spy(self, src, *args, **kw):
        if self.data_ptr() == bufs.embeds.data_ptr():
            into_inputs.append(src)
        return real(self, src, *args, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    bufs.fill(pb.DraftStepRequest(step_id=1), view, step.positions, step.meta)
    assert into_inputs == [] and torch.equal(bufs.embeds[:n], step.inputs_embeds)
    # Same layout, other rows: a tensor that is not the view is copied in.
    other = step.inputs_embeds + 1
    bufs.fill(pb.DraftStepRequest(step_id=2), other, step.positions, step.meta)
    assert len(into_inputs) == 1 and torch.equal(bufs.embeds[:n], other)


def test_views_the_engine_still_holds_stay_valid_memory_after_close(tiny_cfg, tiny_embed):
    """An engine writes its embeddings into input_view(n) (the out= of its lookup) and may hold it, or a
    step's hidden view, across a dropped link: close() unmapped the shared memory under them, and the
    next write crashed the engine (SIGSEGV). The segments are unlinked; the views keep their memory."""
    b = StepBuffers(_Stub(), tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    step = _step(tiny_cfg, tiny_embed, [5, 300])
    n = step.positions.numel()
    inputs = b.input_view(n)
    hidden = b.fill(pb.DraftStepRequest(step_id=1), step.inputs_embeds, step.positions, step.meta)
    names = [held.segment.name for held in b._shm]
    b.close()
    assert not any((Path("/dev/shm") / name).exists() for name in names)
    with open("/proc/self/maps") as maps:  # checked before the write: unmapped, it would crash this run
        mapped = maps.read()
    assert all(name in mapped for name in names[:2]), "a view's memory was unmapped under it"
    inputs.copy_(step.inputs_embeds)  # a write: into memory still mapped, nobody else's
    assert torch.equal(inputs, step.inputs_embeds) and hidden.sum().item() == 0


def test_a_step_beyond_the_registered_buffers_is_refused(bufs, tiny_cfg, tiny_embed):
    step = _step(tiny_cfg, tiny_embed, [5, 6, 7, 8, 9])  # 5 requests, 4 registered
    with pytest.raises(DataPlaneError, match="exceeds the registered buffers"):
        bufs.fill(pb.DraftStepRequest(step_id=1), step.inputs_embeds, step.positions, step.meta)
    wide = _step(tiny_cfg, tiny_embed, [41 * PAGE])  # 42 pages, 40 registered
    with pytest.raises(DataPlaneError, match="exceeds the registered buffers"):
        bufs.fill(pb.DraftStepRequest(step_id=2), wide.inputs_embeds, wide.positions, wide.meta)
    # The step's requests are its seq_lens, whatever rows its table has: 5 of them with a table cut to 4 rows
    cut = StepMetadata(step.meta.seq_lens, step.meta.block_tables[:4], step.meta.slot_mapping)
    with pytest.raises(DataPlaneError, match="step of 5 requests"):
        bufs.fill(pb.DraftStepRequest(step_id=3), step.inputs_embeds, step.positions, cut)


def test_metadata_of_each_step_is_written_whatever_its_layout_in_memory(bufs, tiny_cfg, tiny_embed):
    """The metadata is copied byte for byte into the cached layout's slots on every step: a second step
    of the same shapes overwrites the first's, and a non-contiguous source (a strided view of a
    wider block table) is copied element by element, not as its raw bytes."""
    def meta_of(req, field, t):
        off = getattr(req, field).region.offset_bytes
        return bufs.meta_bytes[off : off + t.numel() * t.element_size()].view(t.dtype).reshape(t.shape)

    for seed in (1, 2):
        step = _step(tiny_cfg, tiny_embed, [5, 300], seed=seed)
        req = pb.DraftStepRequest(step_id=seed)
        bufs.fill(req, step.inputs_embeds, step.positions, step.meta)
        for field, t in (("positions", step.positions), ("seq_lens", step.meta.seq_lens),
                         ("block_tables", step.meta.block_tables), ("slot_mapping", step.meta.slot_mapping)):
            assert torch.equal(meta_of(req, field, t), t), (seed, field)
    tables = step.meta.block_tables
    wide = torch.full((tables.shape[0], 2 * tables.shape[1]), -5, dtype=tables.dtype)
    wide[:, ::2] = tables
    strided = wide[:, ::2]
    assert not strided.is_contiguous() and torch.equal(strided, tables)
    meta = type(step.meta)(step.meta.seq_lens, strided, step.meta.slot_mapping)
    req = pb.DraftStepRequest(step_id=3)
    bufs.meta_bytes.zero_()
    bufs.fill(req, step.inputs_embeds, step.positions, meta)
    assert torch.equal(meta_of(req, "block_tables", tables), tables)


class _ClosedChannel(_Stub):
    def UnregisterBuffers(self, req, timeout=None):  # noqa: N802
        raise ValueError("Cannot invoke RPC on closed channel!")  # what grpc raises there


def test_close_frees_its_own_memory_when_the_channel_is_already_closed(tiny_cfg, caplog):
    b = StepBuffers(_ClosedChannel(), tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    name = b._shm[0].segment.name
    with caplog.at_level("INFO", logger="dspark_sidecar.client"):
        b.close()
    assert "UnregisterBuffers not sent" in caplog.text
    assert not (Path("/dev/shm") / name).exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_closing_a_doorbell_waits_for_the_engine_stream_within_a_bound():
    """DoorbellChannel.close unmaps its page only once the engine's stream has passed its last step,
    which may wait on a wedged sidecar's event: the wait is bounded (close keeps the page instead)."""
    from dspark_sidecar.client.dataplane import DoorbellChannel

    dev = torch.device("cuda", 0)
    probe = DoorbellChannel.__new__(DoorbellChannel)
    probe.device, probe._sent_on = dev, []
    with torch.cuda.device(dev):
        torch.cuda._sleep(2_000_000_000)  # about a second of a busy stream
        assert not probe._stream_passed(0.05)
        assert probe._stream_passed(30.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_closing_a_doorbell_waits_for_the_stream_the_step_was_sent_from():
    """An engine may close from another thread than the one that rang, whose current stream is another
    one. The wait must cover the sender's stream, where the GPU word's write may still be queued:
    before, close() looked at its own idle stream and unmapped the page under that write."""
    from dspark_sidecar.client.dataplane import DoorbellChannel

    dev = torch.device("cuda", 0)
    probe = DoorbellChannel.__new__(DoorbellChannel)
    probe.device = dev
    with torch.cuda.device(dev):
        side = torch.cuda.Stream(dev)
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # the sender's stream, busy for about a second
        probe._sent_on = [side.cuda_stream]
        assert not probe._stream_passed(0.05)  # this thread's current stream is idle all along
        assert probe._stream_passed(30.0)


def test_the_segments_are_shared_with_the_sidecar_socket_s_group_when_this_process_may(tmp_path, monkeypatch):
    """Who may connect to the rank's unix socket (its group) may map the engine's segments; a TCP
    endpoint, a socket that is gone, or a group this process is not in leave them owner-only."""
    import os
    import socket

    from dspark_sidecar.client import dataplane

    path = tmp_path / "rank0.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        os.chown(path, -1, os.getegid())
        assert dataplane.ipc_group(f"unix:{path}") == os.getegid()
        assert dataplane.ipc_group("127.0.0.1:7000") is None
        # Not even where the endpoint past its first five characters names a file (here, in the working directory)
        monkeypatch.chdir(tmp_path)
        (tmp_path / ".0.1:7000").touch()
        assert dataplane.ipc_group("127.0.0.1:7000") is None
        assert dataplane.ipc_group(f"unix:{tmp_path / 'gone.sock'}") is None
        other = os.getegid() + 4242
        monkeypatch.setattr(dataplane.os, "stat", lambda p: type("St", (), {"st_gid": other})())
        monkeypatch.setattr(dataplane.os, "geteuid", lambda: 1000)
        monkeypatch.setattr(dataplane.os, "getgroups", lambda: [os.getegid()])
        assert dataplane.ipc_group(f"unix:{path}") is None  # not a member: fchown would fail
        monkeypatch.setattr(dataplane.os, "getgroups", lambda: [os.getegid(), other])
        assert dataplane.ipc_group(f"unix:{path}") == other


@pytest.mark.parametrize("hidden, max_reqs", [(0, 4), (16, 0)], ids=["hidden_size_0", "max_reqs_0"])
def test_buffers_that_cannot_be_made_are_refused_before_the_doorbell_is_attached(hidden, max_reqs):
    """A StatusReport's hidden_size 0 (answer fuzz): the doorbell was attached first, then the buffers failed
    here (torch cannot view the 1-byte minimum segment as floats) and the page was dropped while the sidecar
    rank kept polling it. Refused now before any remote call."""
    from dspark_sidecar.client.dataplane import DataPlaneError
    from dspark_sidecar.client.doorbell_transport import DoorbellTransport

    class _Recorder:
        def __init__(self) -> None:
            self.called: list[str] = []

        def __getattr__(self, rpc):
            return lambda *a, **k: self.called.append(rpc)

    class _Conn:
        endpoint = "127.0.0.1:7000"
        stub = _Recorder()

        def stream(self):
            raise AssertionError("no step stream for a refused data plane")

    conn = _Conn()
    with pytest.raises(DataPlaneError, match=f"hidden size {hidden} and {max_reqs} requests"):
        DoorbellTransport(conn, hidden, max_reqs, 40, torch.float32, torch.device("cpu"), 1.0)
    assert conn.stub.called == []


class _EventRefused(RuntimeError):
    pass


@pytest.mark.parametrize("fails", ["cuda_event", "page_views"])
def test_a_doorbell_that_fails_before_it_attaches_leaves_no_shared_memory(monkeypatch, fails):
    """The doorbell page (a shared-memory segment) is made first; what came after it and before the try
    (the page's views, the CUDA event, the GPU word's probe) raised past it, and the segment stayed in
    /dev/shm until the process exited. Each is made to raise here, on a CPU box: the CUDA event through
    a device of type cuda (torch.cuda.Event replaced), the page's views through bell.Page."""
    from dspark_sidecar.client import dataplane
    from helpers.engine_fakes import recording_shm

    def refuse(*a, **k):
        raise _EventRefused(fails)

    if fails == "cuda_event":
        monkeypatch.setattr(dataplane.torch.cuda, "Event", refuse)
        monkeypatch.setattr(dataplane.torch.cuda, "device", lambda d: contextlib.nullcontext())  # no GPU here
        dev = torch.device("cuda", 0)
    else:
        monkeypatch.setattr(dataplane.bell, "Page", refuse)
        dev = torch.device("cpu")

    class _NoCall:
        def __getattr__(self, rpc):
            raise AssertionError(f"{rpc}: no remote call before the page and the event exist")

    with recording_shm() as shm, pytest.raises(_EventRefused):
        dataplane.DoorbellChannel(_NoCall(), dev, gpu_word=False)
    assert shm.created, "the page's segment was not recorded"
    assert shm.left() == set()


def _closing_probe(monkeypatch, sent_on: list[int], destroyed: tuple[str, ...] = ()):
    """A DoorbellChannel with only what close()'s stream wait reads, and CUDA's streams and events stood in
    for: streams are named, each event records into the returned list (a destroyed stream's record raises)."""
    from dspark_sidecar.client import dataplane
    from dspark_sidecar.client.dataplane import DoorbellChannel

    recorded = []

    class Event:
        def record(self, stream):
            if stream in destroyed:
                raise RuntimeError("CUDA error: invalid resource handle")
            recorded.append(stream)

        def query(self):
            return True

    cuda = dataplane.torch.cuda
    monkeypatch.setattr(cuda, "Event", Event)
    monkeypatch.setattr(cuda, "current_stream", lambda device=None: "closing thread's")
    monkeypatch.setattr(cuda, "default_stream", lambda device=None: "default")
    monkeypatch.setattr(cuda, "ExternalStream", lambda handle, device=None: f"stream {handle:#x}")
    probe = DoorbellChannel.__new__(DoorbellChannel)
    probe.device, probe._sent_on = torch.device("cuda", 0), sent_on
    return probe, recorded


def test_closing_a_doorbell_waits_for_every_stream_steps_were_sent_from_the_default_one_too(monkeypatch):
    """The default stream's raw handle is 0, which close() once took for "nothing sent" (helper 73): it then
    waited on the closing thread's stream only. Now it waits on that one and on each stream a step was sent
    from (the last SENT_STREAMS), each through an event recorded there (CUDA calls stood in for)."""
    from dspark_sidecar.client.dataplane import SENT_STREAMS

    probe, recorded = _closing_probe(monkeypatch, [])
    for raw in (0, 0xA, 0, 0xB, 0xC, 0xD):  # as send_bytes notes them
        if not probe._sent_on or probe._sent_on[-1] != raw:
            probe._note_stream(raw)
    assert probe._sent_on == [0, 0xB, 0xC, 0xD] and len(probe._sent_on) == SENT_STREAMS
    assert probe._stream_passed(1.0)
    assert recorded == ["closing thread's", "default", "stream 0xb", "stream 0xc", "stream 0xd"]


def test_closing_a_doorbell_skips_a_sender_stream_destroyed_since(monkeypatch, caplog):
    """An engine may destroy a stream an earlier step was sent from: recording on its stale handle raises,
    and close() raised with it, leaving the header registered and the page mapped (helper 74)."""
    probe, recorded = _closing_probe(monkeypatch, [0xA, 0xB], destroyed=("stream 0xa",))
    with caplog.at_level("INFO", logger="dspark_sidecar.client"):
        assert probe._stream_passed(1.0)
    assert recorded == ["closing thread's", "stream 0xb"] and "not waiting on stream 0xa" in caplog.text


def test_the_transport_orders_the_stream_after_the_last_answer_before_it_copies_a_step_in():
    """DoorbellTransport.send: the doorbell's order_inputs comes before the buffers' staging copies, which
    overwrite the rows the last step read (helper 80's hazard 2); stand-ins record the order."""
    from types import SimpleNamespace

    from dspark_sidecar.client.doorbell_transport import DoorbellTransport

    calls = []
    t = DoorbellTransport.__new__(DoorbellTransport)
    t.liveness = SimpleNamespace(alive=True)
    t.bell = SimpleNamespace(order_inputs=lambda: calls.append("order"),
                             send_bytes=lambda data, key: calls.append("ring"), copies_raw=False)
    t.buffers = SimpleNamespace(stage=lambda *a: calls.append("stage") or SimpleNamespace(
        hidden=None, fields=b"", launch_key=1))
    t.send(pb.DraftStepRequest(step_id=1), None, None, None)
    assert calls == ["order", "stage", "ring"]


def test_a_liveness_stream_that_cannot_be_opened_releases_the_attached_doorbell_and_buffers():
    """The idle liveness stream is opened last, after the doorbell is attached and the buffers registered. It
    was outside the cleanup: a stream that could not be opened (no thread left for its reader, a channel
    closed under it) left the three regions registered on the sidecar and all four segments in /dev/shm
    until exit, and the shim turned the data plane off for good on that connection."""
    from dspark_sidecar.client.doorbell_transport import DoorbellTransport
    from dspark_sidecar.proto import sidecar_pb2 as pb
    from helpers.engine_fakes import recording_shm

    class _Stub:
        def __init__(self) -> None:
            self.unregistered: list = []

        def AttachDoorbell(self, req, timeout=None):
            return pb.AttachDoorbellResponse()

        def RegisterBuffers(self, req, timeout=None):
            return pb.RegisterBuffersResponse(region_ids=[11, 12, 13])

        def UnregisterBuffers(self, req, timeout=None):
            self.unregistered.append(sorted(req.region_ids))
            return pb.UnregisterBuffersResponse()

    class _Conn:
        endpoint = "127.0.0.1:7000"
        stub = _Stub()

        def stream(self):
            raise RuntimeError("can't start new thread")

    conn = _Conn()
    with recording_shm() as shm, pytest.raises(RuntimeError, match="new thread"):
        DoorbellTransport(conn, 16, 2, 4, torch.float32, torch.device("cpu"), 1.0)
    assert len(shm.created) == 4, shm.created  # the page and the three regions
    assert shm.left() == set()
    assert conn.stub.unregistered == [[11, 12, 13]]


def test_input_rows_of_another_shape_are_refused_not_broadcast(bufs, tiny_cfg, tiny_embed):
    """The request always names [n, hidden] input rows (n from the positions). A copy_ of embeddings of another
    shape broadcast where it could: one row [1, hidden] filled all n registered rows, and the step ran on that
    row n times (the K/V it wrote and the hidden states it answered were wrong) where the gRPC path refuses the
    shape (INVALID_ARGUMENT inputs_embeds). A same-address view with other strides was taken as written in
    place, and the sidecar read rows the engine never wrote."""
    step = _step(tiny_cfg, tiny_embed, [5, 300])
    n = step.positions.numel()
    for bad in (step.inputs_embeds[:1], step.inputs_embeds[:, :1]):
        with pytest.raises(DataPlaneError, match="inputs_embeds"):
            bufs.stage(bad, step.positions, step.meta)
    assert not bufs.embeds.any()  # nothing was copied in
    strided = bufs.embeds[: 2 * n : 2]  # the registered rows' address and shape, every other row
    strided.copy_(step.inputs_embeds)
    bufs.stage(strided, step.positions, step.meta)
    assert torch.equal(bufs.embeds[:n], step.inputs_embeds)


def test_the_transport_names_the_engine_s_lease_in_its_doorbell_and_its_buffers():
    """Both under the lease: its end (the engine gone) stops the sidecar's doorbell and releases the regions. The
    doorbell went without one, and a gone engine's doorbell polled its page on until the next attach."""
    from dspark_sidecar.client.doorbell_transport import DoorbellTransport

    leases: dict[str, int] = {}

    class _Stub:
        def AttachDoorbell(self, req, timeout=None):
            leases["AttachDoorbell"] = req.lease
            return pb.AttachDoorbellResponse()

        def RegisterBuffers(self, req, timeout=None):
            leases["RegisterBuffers"] = req.lease
            return pb.RegisterBuffersResponse(region_ids=[11, 12, 13])

        def UnregisterBuffers(self, req, timeout=None):
            return pb.UnregisterBuffersResponse()

    class _Conn:
        endpoint = "127.0.0.1:7000"
        stub = _Stub()

        def stream(self):
            return None

    t = DoorbellTransport(_Conn(), 16, 2, 4, torch.float32, torch.device("cpu"), 1.0, lease=0x5EED)
    try:
        assert leases == {"AttachDoorbell": 0x5EED, "RegisterBuffers": 0x5EED}
    finally:
        t.close()


@pytest.mark.parametrize("ids", [[0, 8, 9], [7, 7, 9], [7, 8]], ids=["a zero id", "a repeated id", "two ids"])
def test_region_ids_that_cannot_name_three_regions_are_refused_and_released_by_owner(tiny_cfg, ids):
    """A sidecar answering ids a request cannot use (0 reads as unset in a RegionSlice, two regions under one id):
    refused, and whatever it did register is released by the registration's owner token, with nothing left here."""
    from helpers.engine_fakes import recording_shm

    class Stub(_Stub):
        def RegisterBuffers(self, req, timeout=None):  # noqa: N802
            self.owners.append(req.owner)
            return pb.RegisterBuffersResponse(region_ids=ids)

    stub = Stub()
    with recording_shm() as shm, pytest.raises(DataPlaneError, match="not three distinct ones"):
        StepBuffers(stub, tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    assert stub.released == [[]] and len(stub.owners) == 2 and stub.owners[0] == stub.owners[1] > 0
    assert len(shm.created) == 3 and shm.left() == set()


def test_metadata_that_does_not_fit_the_registered_region_is_refused(bufs, tiny_cfg, tiny_embed):
    """The region is sized for int32 seq lens and block tables: wider ones (the StepBuffers API takes any dtype)
    are a DataPlaneError naming the field, not a torch error from viewing a slice cut short at the region's end."""
    step = _step(tiny_cfg, tiny_embed, [5, 6, 7, 8])  # 4 requests, as registered
    wide = torch.zeros(4, 40, dtype=torch.int64)  # 40 pages, as registered, of int64
    wide[:, : step.meta.block_tables.shape[1]] = step.meta.block_tables
    meta = type(step.meta)(step.meta.seq_lens, wide, step.meta.slot_mapping)
    with pytest.raises(DataPlaneError, match="block_tables \\[4, 40\\] does not fit the registered metadata region"):
        bufs.stage(step.inputs_embeds, step.positions, meta)


def test_closed_buffers_hold_no_mapping_of_their_regions(tiny_cfg, tiny_embed):
    """close() drops the cached layouts with the regions: each holds views of them (the metadata slots, the input
    and hidden rows), which kept the three mappings alive as long as the closed StepBuffers was."""
    b = StepBuffers(_Stub(), tiny_cfg.hidden_size, 4, 40, torch.float32, torch.device("cpu"))
    step = _step(tiny_cfg, tiny_embed, [5, 300])
    b.fill(pb.DraftStepRequest(step_id=1), step.inputs_embeds, step.positions, step.meta)
    names = [held.segment.name for held in b._shm]
    b.close()
    with open("/proc/self/maps") as maps:
        mapped = maps.read()
    assert not [name for name in names if name in mapped]
    with pytest.raises(AttributeError):  # nothing left to stage into
        b.stage(step.inputs_embeds, step.positions, step.meta)


def test_launch_keys_are_never_0_nor_the_sidecar_s_skip_key_even_past_the_wrap(monkeypatch):
    """0 is "no key" (never pre-launched) and SKIP_KEY the sidecar's own release word, which would ring a step
    queued under it (server/prelaunch.py): the keys run 1 .. SKIP_KEY - 1 and wrap to 1."""
    import itertools

    from dspark_sidecar.client import dataplane
    from dspark_sidecar.proto import doorbell as bell

    monkeypatch.setattr(dataplane, "_LAUNCH_KEYS", itertools.count())
    assert [dataplane._next_launch_key() for _ in range(2)] == [1, 2]
    monkeypatch.setattr(dataplane, "_LAUNCH_KEYS", itertools.count(bell.SKIP_KEY - 3))
    assert [dataplane._next_launch_key() for _ in range(3)] == [bell.SKIP_KEY - 2, bell.SKIP_KEY - 1, 1]


def test_the_layout_cache_is_bounded(bufs, tiny_cfg, tiny_embed):
    """An engine's block-table width follows its longest request page by page: one layout per width and request
    count, without a bound a long run's cache (each entry with views and a serialized template) only grew."""
    step = _step(tiny_cfg, tiny_embed, [5])
    tables = torch.zeros(1, 40, dtype=step.meta.block_tables.dtype)
    for width in range(1, 41):
        for r in (1, 2):  # 80 layouts
            meta = type(step.meta)(step.meta.seq_lens.repeat(r), tables[:, :width].repeat(r, 1),
                                   step.meta.slot_mapping.repeat(r))
            bufs.stage(step.inputs_embeds.repeat(r, 1), step.positions.repeat(r), meta)
            assert len(bufs._layouts) <= 64


def test_an_engine_user_s_own_group_is_shared_with_when_the_group_list_leaves_it_out(tmp_path, monkeypatch):
    """getgroups() need not list the effective group (POSIX leaves it open): a socket of this process's own group
    is still one it may give its segments. A process not root is stood in for (root may give any group)."""
    import os
    import socket

    from dspark_sidecar.client import dataplane

    path = tmp_path / "rank0.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        os.chown(path, -1, os.getegid())
        monkeypatch.setattr(dataplane.os, "geteuid", lambda: 1000)
        monkeypatch.setattr(dataplane.os, "getgroups", lambda: [])
        assert dataplane.ipc_group(f"unix:{path}") == os.getegid()


def test_metadata_filling_the_registered_region_to_its_last_byte_is_staged_and_a_wider_one_refused():
    """The metadata region's bound is inclusive: 1 request of 7 pages, every field int64, fills the region sized for
    it (2 x 7 x 8 + 4 + 7 x 4 + 32 bytes) exactly, and is written there whole; a slot more does not fit."""
    b = StepBuffers(_Stub(), 8, 1, 7, torch.float32, torch.device("cpu"))
    try:
        assert b.meta_bytes.numel() == 176
        wide = torch.int64
        positions, slots = torch.arange(7, dtype=wide) + 100, torch.arange(7, dtype=wide) + 200
        seq_lens, tables = torch.tensor([107], dtype=wide), torch.arange(7, dtype=wide).reshape(1, 7) + 300
        req = pb.DraftStepRequest.FromString(
            b.stage(torch.zeros(7, 8), positions, StepMetadata(seq_lens, tables, slots)).fields)
        assert req.slot_mapping.region.offset_bytes + 7 * 8 == 176
        assert torch.equal(b.meta_bytes[120:].view(wide), slots) and torch.equal(b.meta_bytes[64:120].view(wide), tables[0])
        with pytest.raises(DataPlaneError, match="slot_mapping \\[8\\] does not fit"):
            b.stage(torch.zeros(7, 8), positions, StepMetadata(seq_lens, tables, torch.arange(8, dtype=wide)))
    finally:
        b.close()


def test_a_step_of_more_input_rows_than_registered_is_refused_before_anything_is_written():
    """The regions hold QPR x max_reqs input and hidden rows. A step whose positions name more rows, with requests
    and pages that fit, was taken: its inputs_embeds and hidden views were cut short at the region's end, so
    embeddings of the registered row count were staged under a request naming [n, hidden] rows the region does not
    have (and a hidden view shorter than the answer), and embeddings of n rows were refused as "for a step of
    [rows, hidden] input rows", naming the wrong count. input_view(n) handed the same short view as "the registered
    input rows [n, hidden]": an engine's out= then resizes it, which on a GPU moves the whole input region's storage
    away from the memory the sidecar mapped. Refused now, naming the rows, and the next step that fits still works."""
    from dspark_sidecar import layout

    b = StepBuffers(_Stub(), 8, 2, 4, torch.float32, torch.device("cpu"))
    try:
        rows = layout.QPR * 2
        assert b.embeds.shape[0] == rows
        n = rows + 1  # 1 request of 1 page, but a row more than registered: its positions fit the metadata region
        meta = StepMetadata(torch.full((1,), 3, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                            torch.zeros(layout.QPR, dtype=torch.int64))
        for embeds in (torch.ones(rows, 8), torch.ones(n, 8)):
            with pytest.raises(DataPlaneError, match=f"{n} input rows exceeds the registered buffers \\({rows} rows"):
                b.stage(embeds, torch.arange(n), meta)
        with pytest.raises(DataPlaneError, match=f"{n} input rows exceeds the registered buffers"):
            b.input_view(n)
        assert not b.embeds.any() and not b.meta_bytes.any()  # nothing was written
        assert b.input_view(rows).shape == (rows, 8)
        fits = StepMetadata(torch.full((2,), 3, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32),
                            torch.arange(rows, dtype=torch.int64))
        staged = b.stage(torch.ones(rows, 8), torch.arange(rows), fits)
        req = pb.DraftStepRequest.FromString(staged.fields)
        assert list(req.inputs_embeds.shape) == [rows, 8] and staged.hidden.shape == (rows, 8)
        assert bool((b.embeds == 1).all())
    finally:
        b.close()


@pytest.mark.parametrize("change", ["block-table width", "slot dtype", "seq_lens dtype"])
def test_a_step_differing_from_the_last_in_one_table_s_shape_or_dtype_gets_a_layout_of_its_own(change):
    """The layout cache is keyed by every field's shape and dtype: a step of the same request count whose block
    table is a page wider (an engine's table follows its longest request page by page), or whose slots or lengths
    come in another integer dtype, reusing the last step's layout would name that step's shapes and dtypes and
    copy that step's byte count out of this one's tensor (a short table read past its end, a wider one cut)."""
    b = StepBuffers(_Stub(), 8, 2, 6, torch.float32, torch.device("cpu"))
    try:
        rows = 14
        positions, embeds = torch.arange(rows) + 40, torch.ones(rows, 8)
        first = StepMetadata(torch.tensor([47, 48], dtype=torch.int32),
                             torch.arange(8, dtype=torch.int32).reshape(2, 4) + 10, torch.arange(rows) + 70)
        b.stage(embeds, positions, first)
        if change == "block-table width":
            second = StepMetadata(first.seq_lens, torch.arange(10, dtype=torch.int32).reshape(2, 5) + 20,
                                  first.slot_mapping)
        elif change == "slot dtype":
            second = StepMetadata(first.seq_lens, first.block_tables, (torch.arange(rows) + 90).to(torch.int32))
        else:
            second = StepMetadata(torch.tensor([49, 50], dtype=torch.int64), first.block_tables, first.slot_mapping)
        req = pb.DraftStepRequest.FromString(b.stage(embeds, positions, second).fields)
        for field, t in (("seq_lens", second.seq_lens), ("block_tables", second.block_tables),
                         ("slot_mapping", second.slot_mapping)):
            ref = getattr(req, field)
            assert list(ref.shape) == list(t.shape), field
            off = ref.region.offset_bytes
            got = b.meta_bytes[off : off + t.numel() * t.element_size()].view(t.dtype).reshape(t.shape)
            assert torch.equal(got, t), field
        assert len(b._layouts) == 2
    finally:
        b.close()


def test_a_step_of_the_registered_pages_is_staged_and_one_page_more_refused():
    """The bound on pages is inclusive, as the one on requests: max_pages is staged, a page more refused
    (DoorbellTransport.fits sends such a step over the gRPC stream before it gets here)."""
    b = StepBuffers(_Stub(), 8, 1, 4, torch.float32, torch.device("cpu"))
    try:
        seq, slots = torch.tensor([64], dtype=torch.int32), torch.arange(7)
        staged = b.stage(torch.ones(7, 8), torch.arange(7), StepMetadata(seq, torch.zeros(1, 4, dtype=torch.int32), slots))
        assert list(pb.DraftStepRequest.FromString(staged.fields).block_tables.shape) == [1, 4]
        with pytest.raises(DataPlaneError, match="1 requests x 5 pages, 7 input rows exceeds the registered buffers"):
            b.stage(torch.ones(7, 8), torch.arange(7), StepMetadata(seq, torch.zeros(1, 5, dtype=torch.int32), slots))
    finally:
        b.close()


def test_input_rows_of_another_width_refused_leave_the_next_step_s_request_naming_the_registered_width():
    """A step whose embeddings are of another width than the registered rows is refused; the layout built for it
    (keyed by that width) must not be the one the next step of the same metadata shapes, of the right width, gets:
    its request would name the refused width's [n, hidden] rows."""
    b = StepBuffers(_Stub(), 8, 1, 4, torch.float32, torch.device("cpu"))
    try:
        meta = StepMetadata(torch.tensor([30], dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32), torch.arange(7))
        with pytest.raises(DataPlaneError, match="inputs_embeds \\[7, 6\\] for a step of \\[7, 8\\] input rows"):
            b.stage(torch.ones(7, 6), torch.arange(7), meta)
        req = pb.DraftStepRequest.FromString(b.stage(torch.ones(7, 8), torch.arange(7), meta).fields)
        assert list(req.inputs_embeds.shape) == [7, 8]
    finally:
        b.close()
