"""The data plane (registered regions + shm doorbell) against a real 4-rank sidecar, on CPU shared memory."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.client.dataplane import DoorbellChannel, StepBuffers
from helpers.engine_sim import PAGE, EngineSim
from helpers.sidecar_proc import SidecarProcess
from helpers.waiting import wait_until

TP = 4
LENS = [3, 90, 4096 + 20, 17, 250]
PAGES = sum(scenario.pages_needed(c + 7, PAGE) for c in LENS) + 4


@contextlib.contextmanager
def _tp1_data_plane(tmp_path, cfg, ckpt, pages: int, max_reqs: int):
    """A TP-1 CPU sidecar with one engine rank bound and its data plane attached: (sidecar, engine, buffers, bell)."""
    with SidecarProcess(tmp_path, tp=1, checkpoint=ckpt) as sc:
        eng = EngineSim(cfg, [sc.socket(0)], pages, torch.float32)
        eng.bind()
        cpu = torch.device("cpu")
        bufs = StepBuffers(eng.stubs[0], cfg.hidden_size, max_reqs, 300, torch.float32, cpu)
        bell = DoorbellChannel(eng.stubs[0], cpu)
        try:
            yield sc, eng, bufs, bell
        finally:
            bell.close()
            bufs.close()
            eng.close()


def _ring(bufs: StepBuffers, bell: DoorbellChannel, binding: tuple[int, int], step_id: int, step,
          **override) -> tuple[pb.DraftStepRequest, pb.DraftStepResponse | None, torch.Tensor]:
    """One step over the data plane: fill the registered regions, ring, wait; (request, answer, hidden view)."""
    bid, gen = binding
    fields = dict(step_id=step_id, binding_id=bid, binding_generation=gen, num_requests=step.meta.num_reqs)
    req = pb.DraftStepRequest(**(fields | override))
    view = bufs.fill(req, step.inputs_embeds, step.positions, step.meta)
    bell.send(req)
    return req, bell.wait(step_id, 30.0), view


def test_doorbell_steps_equal_grpc_steps(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    with SidecarProcess(tmp_path, tp=TP, checkpoint=tiny_ckpt) as sc:
        eng = EngineSim(tiny_cfg, [sc.socket(r) for r in range(TP)], PAGES, torch.float32)
        eng.bind()
        step = scenario.random_step(tiny_cfg, LENS, PAGE, PAGES, tiny_embed, seed=21)
        via_grpc = [codec.from_tensor_ref(x.hidden_states, "h") for x in eng.step_all(1, step)]
        cpu = torch.device("cpu")
        bufs = [StepBuffers(eng.stubs[r], tiny_cfg.hidden_size, 8, 300, torch.float32, cpu) for r in range(TP)]
        bells = [DoorbellChannel(eng.stubs[r], cpu) for r in range(TP)]
        out: dict[int, object] = {}

        def rank(r: int, step_id: int, **override) -> None:
            _, resp, view = _ring(bufs[r], bells[r], eng.bindings[r], step_id, step, **override)
            out[r] = (resp, view.clone())

        for step_id, override in ((2, {}), (3, {"binding_generation": 99}), (4, {})):
            ts = [threading.Thread(target=rank, args=(r, step_id), kwargs=override if r == 1 else {})
                  for r in range(TP)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            for r in range(TP):
                resp, hidden = out[r]
                if step_id == 3:  # rank 1 sent a stale generation: it is refused, its peers abort
                    assert resp.HasField("error"), r
                    assert resp.error.reason == ("STALE_BINDING" if r == 1 else "ABORTED"), resp.error
                    continue
                assert resp.HasField("hidden_states") and resp.hidden_states.HasField("region"), resp
                assert torch.equal(hidden, via_grpc[r]), f"step {step_id} rank {r}: doorbell != gRPC result"
        for b in bells:
            b.close()
        for b in bufs:
            b.close()
        eng.close()


def test_doorbell_alternating_shapes_match_grpc(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """Steps of different R and block-table widths, back to back: the engine's per-shape request
    templates and the sidecar's cached region views must never mix one shape's slices with another's."""
    cases = [[5, 40], [4096 + 20, 3, 90], [17], [5, 40], [250, 4096 + 20, 3, 90], [17]]
    pages = max(sum(scenario.pages_needed(c + 7, PAGE) for c in lens) for lens in cases) + 2
    keys = {}
    with _tp1_data_plane(tmp_path, tiny_cfg, tiny_ckpt, pages, 8) as (_, eng, bufs, bell):
        assert bell.word_address == 0  # no GPU word on CPU: nothing is pre-launched
        for i, lens in enumerate(cases):
            step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=40 + i)
            (want,) = (codec.from_tensor_ref(x.hidden_states, "h") for x in eng.step_all(100 + i, step))
            req, resp, view = _ring(bufs, bell, eng.bindings[0], 200 + i, step)
            assert list(req.block_tables.shape) == list(step.meta.block_tables.shape)
            assert resp is not None and resp.HasField("hidden_states"), resp
            assert not resp.timings.prelaunched
            assert torch.equal(view, want), f"case {i} ({lens}): doorbell != gRPC"
            keys.setdefault(tuple(lens), set()).add(req.launch_key)
    # One launch key per layout (sidecar.proto DraftStepRequest.launch_key), never 0, never shared.
    assert all(len(k) == 1 for k in keys.values()), keys
    flat = [next(iter(k)) for k in keys.values()]
    assert 0 not in flat and len(set(flat)) == len(flat), keys


def test_idle_doorbell_sleeps_on_its_fifo_and_wakes_for_the_next_step(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """Between bursts the doorbell thread blocks on the wake FIFO (page word 4 up) instead of polling;
    the engine's ring wakes it, and the FIFO is gone when the sidecar stops."""
    from dspark_sidecar.proto import doorbell as page_words

    lens = [5, 40]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens) + 2
    with _tp1_data_plane(tmp_path, tiny_cfg, tiny_ckpt, pages, 4) as (sc, eng, bufs, bell):
        assert bell.ringer is not None
        step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=3)
        (want,) = (codec.from_tensor_ref(x.hidden_states, "h") for x in eng.step_all(1, step))
        for i in range(2):
            # The sidecar dozes off a few ms after a step.
            wait_until(lambda: bell.page.word(page_words.ASLEEP), 5, "the idle doorbell sleeps on its FIFO",
                       interval_s=0.001)
            _, resp, view = _ring(bufs, bell, eng.bindings[0], 10 + i, step)
            assert resp is not None and resp.HasField("hidden_states"), resp
            assert torch.equal(view, want)
        fifos = list(Path(sc.socket(0).split(":", 1)[1]).parent.glob("rank0.wake*"))
        assert len(fifos) == 1 and fifos[0].is_fifo()
    assert not fifos[0].exists()  # removed at shutdown


class _RecordingOps:
    """Stands in for GpuWordOps where there is no GPU: records the stream operations asked of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def write(self, stream, addr, value):
        self.calls.append(("write", stream, addr, value))

    def record(self, event, stream):
        self.calls.append(("record", event, stream))

    def wait_event(self, stream, event):
        self.calls.append(("wait_event", stream, event))


def test_the_engine_orders_its_stream_after_the_answer_through_the_driver(tmp_path, tiny_cfg, tiny_ckpt,
                                                                         tiny_embed, monkeypatch):
    """With the GPU word's ops, the answer's event is waited on from the raw current stream, as the
    input event is recorded (torch's current_stream() stays off the answer's path); on a GPU the data
    plane's gpu tests run the real calls."""
    from dspark_sidecar.client import dataplane

    pages = scenario.pages_needed(60 + 7, PAGE) + 2
    with _tp1_data_plane(tmp_path, tiny_cfg, tiny_ckpt, pages, 1) as (_, eng, bufs, bell):
        ops, answered = _RecordingOps(), object()  # the sidecar's "outputs written" event
        bell._ops, bell.output_event = ops, answered
        monkeypatch.setattr(dataplane, "_raw_stream", lambda device: 0xABC)
        step = scenario.random_step(tiny_cfg, [60], PAGE, pages, tiny_embed, seed=7)
        _, resp, _ = _ring(bufs, bell, eng.bindings[0], 300, step)
        assert resp is not None and resp.HasField("hidden_states"), resp
        assert ops.calls == [("record", None, 0xABC), ("wait_event", 0xABC, answered)]


def test_a_step_staged_from_another_stream_waits_for_the_last_answer_first(tmp_path, tiny_cfg, tiny_ckpt,
                                                                            tiny_embed, monkeypatch):
    """`wait` orders only the stream current there after the answer's event; a next step staged from another
    stream copied its inputs over rows the last step's kernels might still read (helper 80's hazard 2).
    order_inputs makes that stream wait for the event first, and costs nothing on the stream that waited."""
    from dspark_sidecar.client import dataplane

    pages = scenario.pages_needed(60 + 7, PAGE) + 2
    with _tp1_data_plane(tmp_path, tiny_cfg, tiny_ckpt, pages, 1) as (_, eng, bufs, bell):
        ops, answered = _RecordingOps(), object()
        bell._ops, bell.output_event = ops, answered
        current = {"raw": 0xABC}
        monkeypatch.setattr(dataplane, "_raw_stream", lambda device: current["raw"])
        bell.order_inputs()  # no step answered yet: nothing to order after
        assert ops.calls == []
        step = scenario.random_step(tiny_cfg, [60], PAGE, pages, tiny_embed, seed=7)
        _, resp, _ = _ring(bufs, bell, eng.bindings[0], 300, step)
        assert resp is not None and ops.calls[-1] == ("wait_event", 0xABC, answered)
        del ops.calls[:]
        bell.order_inputs()  # the stream that waited: already after the event
        assert ops.calls == []
        current["raw"] = 0xDEF
        bell.order_inputs()
        assert ops.calls == [("wait_event", 0xDEF, answered)]
        bell.order_inputs()  # once per stream change, not per call
        assert ops.calls == [("wait_event", 0xDEF, answered)]


def test_a_step_staged_from_another_stream_waits_for_the_reads_of_the_last_answer_queued_on_the_first(
        tmp_path, tiny_cfg, tiny_ckpt, tiny_embed, monkeypatch):
    """The shim reads an answer (hidden(): a copy out of the output region) on the stream that waited for it.
    A next step staged from another stream waited only for the sidecar's event: its step could then write the
    output region before that copy, still queued behind the first stream's work, had read it, and the engine
    got the next step's hidden states as this one's. order_inputs makes the new stream wait for the work queued
    on the stream that waited too; a stream that cannot be recorded on any more (destroyed) costs a device sync."""
    from dspark_sidecar.client import dataplane
    from dspark_sidecar.proto.gpu_word import GpuWordError

    pages = scenario.pages_needed(60 + 7, PAGE) + 2
    with _tp1_data_plane(tmp_path, tiny_cfg, tiny_ckpt, pages, 1) as (_, eng, bufs, bell):
        ops, answered, read = _RecordingOps(), object(), object()
        bell._ops, bell.output_event, bell._waited_event = ops, answered, read
        current = {"raw": 0xABC}
        monkeypatch.setattr(dataplane, "_raw_stream", lambda device: current["raw"])
        step = scenario.random_step(tiny_cfg, [60], PAGE, pages, tiny_embed, seed=7)
        _, resp, _ = _ring(bufs, bell, eng.bindings[0], 300, step)
        assert resp is not None and ops.calls[-1] == ("wait_event", 0xABC, answered)
        del ops.calls[:]
        current["raw"] = 0xDEF
        bell.order_inputs()
        assert ("record", read, 0xABC) in ops.calls  # the first stream's queued reads, then the wait for them
        assert ops.calls.index(("record", read, 0xABC)) < ops.calls.index(("wait_event", 0xDEF, read))
        del ops.calls[:]
        bell.order_inputs()  # once per stream change
        assert ops.calls == []

        def gone(event, stream):
            raise GpuWordError(f"cuEventRecord: invalid resource handle (stream {stream:#x})")

        synced = []
        monkeypatch.setattr(ops, "record", gone)
        monkeypatch.setattr(dataplane.torch.cuda, "synchronize", lambda device=None: synced.append(device))
        current["raw"] = 0x123
        bell.order_inputs()
        assert synced == [bell.device]  # whatever the destroyed stream still had queued is done


def test_a_bad_output_slice_is_refused_before_the_step_writes_its_kv(tmp_path, tiny_cfg, tiny_ckpt, tiny_embed):
    """An output slice in no registered region used to be found only after the step ran: the engine's
    cache held the step's K/V for an answer that was an error. It is now checked with the request."""
    lens = [5, 40]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens) + 2
    with _tp1_data_plane(tmp_path, tiny_cfg, tiny_ckpt, pages, 4) as (_, eng, bufs, bell):
        step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=5)
        before = [t.clone() for t in eng.kv_tensors(0)]
        bid, gen = eng.bindings[0]
        req = pb.DraftStepRequest(step_id=1, binding_id=bid, binding_generation=gen, num_requests=len(lens))
        bufs.fill(req, step.inputs_embeds, step.positions, step.meta)
        req.output.CopyFrom(pb.RegionSlice(region_id=999))  # after fill, whose layout names the real one
        bell.send(req)
        resp = bell.wait(1, 30.0)
        assert resp is not None and resp.WhichOneof("result") == "error", resp
        assert resp.error.code == 3 and resp.error.field == "output" and "not registered" in resp.error.message
        assert all(torch.equal(a, b) for a, b in zip(before, eng.kv_tensors(0)))  # no K/V written
        _, resp, _ = _ring(bufs, bell, eng.bindings[0], 2, step)  # the rank serves on
        assert resp is not None and resp.HasField("hidden_states"), resp
        assert not all(torch.equal(a, b) for a, b in zip(before, eng.kv_tensors(0)))


def _mapped_elsewhere(name: str) -> int:
    """How many mappings of shared-memory segment `name` other processes hold (the sidecar's ranks)."""
    import os

    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                count += sum(name in line for line in maps)
        except OSError:  # gone, or not ours to read
            continue
    return count


def test_unregistered_buffers_are_unmapped_and_refused_and_the_rank_serves_on(tmp_path, tiny_cfg, tiny_ckpt,
                                                                               tiny_embed):
    """A shim that drops its data plane releases its regions (StepBuffers.close): the sidecar unmaps
    them, refuses steps that still name them, refuses unknown ids without releasing anything, and
    serves the next registration. Before UnregisterBuffers a rank kept every registration mapped
    until it exited (under CUDA IPC, the engine's buffers with it)."""
    import grpc

    lens = [5, 40]
    pages = sum(scenario.pages_needed(c + 7, PAGE) for c in lens) + 2
    with _tp1_data_plane(tmp_path, tiny_cfg, tiny_ckpt, pages, 4) as (_, eng, bufs, bell):
        stub = eng.stubs[0]
        step = scenario.random_step(tiny_cfg, lens, PAGE, pages, tiny_embed, seed=5)
        _, resp, view = _ring(bufs, bell, eng.bindings[0], 1, step)
        assert resp is not None and resp.HasField("hidden_states"), resp
        want = view.clone()
        old = [bufs.embeds_id, bufs.hidden_id, bufs.meta_id]
        segments = [held.segment.name for held in bufs._shm]
        assert all(_mapped_elsewhere(name) for name in segments)
        with pytest.raises(grpc.RpcError) as err:
            stub.UnregisterBuffers(pb.UnregisterBuffersRequest(region_ids=[old[0], 12345]), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "12345 is not registered" in err.value.details()
        _, resp, _ = _ring(bufs, bell, eng.bindings[0], 2, step)  # all or none: nothing was released
        assert resp is not None and resp.HasField("hidden_states"), resp

        stub.UnregisterBuffers(pb.UnregisterBuffersRequest(region_ids=old), timeout=10)
        assert [_mapped_elsewhere(name) for name in segments] == [0, 0, 0]
        req = pb.DraftStepRequest(step_id=3, binding_id=eng.bindings[0][0], binding_generation=eng.bindings[0][1],
                                  num_requests=len(lens))
        bufs.fill(req, step.inputs_embeds, step.positions, step.meta)
        bell.send(req)
        resp = bell.wait(3, 30.0)
        assert resp is not None and resp.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], resp
        assert "not registered" in resp.error.message
        with pytest.raises(grpc.RpcError) as err:  # released once: a second release names it unknown
            stub.UnregisterBuffers(pb.UnregisterBuffersRequest(region_ids=old[:1]), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        again = StepBuffers(stub, tiny_cfg.hidden_size, 4, 300, torch.float32, torch.device("cpu"))
        try:
            assert not set(old) & {again.embeds_id, again.hidden_id, again.meta_id}  # ids are never reused
            _, resp, view = _ring(again, bell, eng.bindings[0], 4, step)
            assert resp is not None and resp.HasField("hidden_states"), resp
            assert torch.equal(view, want)
        finally:
            again.close()
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).serving


def test_a_registration_whose_answer_the_engine_lost_is_released_by_its_owner(tmp_path, tiny_cfg, tiny_ckpt):
    """RegisterBuffers completed on the sidecar, but the engine's call gave up first (the answer is lost
    here, as after a DEADLINE_EXCEEDED): StepBuffers releases the regions by the owner token it sent,
    the sidecar unmaps them, and a registration under that token that arrives only now is refused."""
    import grpc

    class _AnswerLost:
        def __init__(self, stub) -> None:
            self.stub, self.sent = stub, []

        def RegisterBuffers(self, req, timeout=None):  # noqa: N802  (the gRPC method's name)
            self.sent.append(req)
            self.stub.RegisterBuffers(req, timeout=timeout)  # the sidecar maps and registers them
            raise _Deadline()

        def UnregisterBuffers(self, req, timeout=None):  # noqa: N802
            return self.stub.UnregisterBuffers(req, timeout=timeout)

    class _Deadline(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.DEADLINE_EXCEEDED

    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt) as sc:
        eng = EngineSim(tiny_cfg, [sc.socket(0)], 8, torch.float32)
        try:
            lost = _AnswerLost(eng.stubs[0])
            with pytest.raises(grpc.RpcError):
                StepBuffers(lost, tiny_cfg.hidden_size, 4, 300, torch.float32, torch.device("cpu"))
            (req,) = lost.sent
            assert req.owner and [_mapped_elsewhere(r.memory.shm.name) for r in req.regions] == [0, 0, 0]
            late = memory.shm_empty((4096,), torch.uint8)  # a registration under the token, arriving after its release
            try:
                region = pb.BufferRegion(name="late", memory=memory.export_handle(late.tensor), size_bytes=4096)
                with pytest.raises(grpc.RpcError) as err:
                    eng.stubs[0].RegisterBuffers(pb.RegisterBuffersRequest(regions=[region], owner=req.owner),
                                                 timeout=10)
                assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert f"owner: {req.owner} was released" in err.value.details()
                assert _mapped_elsewhere(late.segment.name) == 0
            finally:
                late.close()
            assert eng.stubs[0].GetStatus(pb.GetStatusRequest(), timeout=10).serving
        finally:
            eng.close()


def _maps_here(name: str) -> int:
    with open("/proc/self/maps") as maps:
        return sum(name in line for line in maps)


@pytest.mark.parametrize("refusal", ["count", "size 0", "size past the mapping", "handle"])
def test_a_refused_registration_maps_nothing_and_gives_each_unopened_handle_back_once(monkeypatch, refusal):
    """RegisterBuffers is all or none: a refused request leaves none of its regions mapped, names the
    field, and gives the engine back each CUDA IPC handle it never opened exactly once (MappedMemory gives
    back the one it refuses itself; a second give-back frees a block another consumer still maps)."""
    import grpc

    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.server.errors import SidecarError, as_sidecar_error
    from dspark_sidecar.server.kv_binding import MAX_REGIONS, MemoryBindings

    released = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter",
                        lambda handle, offset, **kw: released.append(handle), raising=False)
    seg = memory.shm_empty((4096,), torch.uint8)
    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    try:
        def shm(size=4096):
            return pb.BufferRegion(name="shm", memory=memory.export_handle(seg.tensor), size_bytes=size)

        def ipc(i):
            return pb.BufferRegion(name="ipc", size_bytes=64, memory=pb.MemoryHandle(cuda_ipc=pb.CudaIpcHandle(
                ipc_handle=b"h", storage_size_bytes=64, ref_counter_handle=b"/torch_r%d" % i, ref_counter_offset=8)))

        ids = mem.register(pb.RegisterBuffersRequest(regions=[shm() for _ in range(MAX_REGIONS)]))  # the most
        assert len(set(ids)) == MAX_REGIONS
        mem.unregister(ids)
        before = _maps_here(seg.segment.name)
        if refusal == "count":
            regions, want = [shm(), *(ipc(i) for i in range(1, MAX_REGIONS + 1))], (grpc.StatusCode.OUT_OF_RANGE, "regions")
            given = list(range(1, MAX_REGIONS + 1))
        elif refusal == "handle":
            regions, want, given = [shm(), ipc(1), ipc(2)], (grpc.StatusCode.INVALID_ARGUMENT, "regions[1].memory"), [1, 2]
        else:
            size = 0 if refusal == "size 0" else 4097
            regions, want, given = [shm(), shm(size), ipc(2)], (grpc.StatusCode.INVALID_ARGUMENT, "regions[1].size_bytes"), [2]
        with pytest.raises((SidecarError, memory.HandleError)) as err:
            mem.register(pb.RegisterBuffersRequest(regions=regions))
        e = as_sidecar_error(err.value)
        assert (e.code, e.field) == want, e
        assert released == [b"/torch_r%d" % i for i in given]
        assert _maps_here(seg.segment.name) == before and mem.region_count == 0
    finally:
        mem.close()
        seg.close()


def test_a_region_slice_is_resolved_at_its_own_bytes_or_refused():
    """MemoryBindings.resolve: a slice is viewed at exactly its offset_bytes, inside the region's size_bytes;
    an offset not aligned for the dtype is refused, not rounded down to the element before it (which
    would read or write the bytes in front of the slice the step named)."""
    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.server.kv_binding import MemoryBindings

    seg = memory.shm_empty((4096,), torch.uint8)
    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    try:
        h = memory.export_handle(seg.tensor)
        h.shm.offset_bytes = 1024
        rid, = mem.register(pb.RegisterBuffersRequest(regions=[pb.BufferRegion(name="r", memory=h, size_bytes=256)]))
        seg.tensor.view(torch.float32).copy_(torch.arange(1024, dtype=torch.float32))  # float k at byte 4k
        view = mem.resolve(pb.RegionSlice(region_id=rid, offset_bytes=8), torch.float32, (2, 3), "output")
        assert view.is_contiguous() and view.flatten().tolist() == [258.0 + k for k in range(6)], view
        for offset, shape, why in ((6, (2,), "not aligned"), (0, (65,), "view needs"), (252, (2,), "view needs")):
            with pytest.raises(ValueError, match=why):
                mem.resolve(pb.RegionSlice(region_id=rid, offset_bytes=offset), torch.float32, shape, "output")
        with pytest.raises(ValueError, match="not registered"):
            mem.resolve(pb.RegionSlice(region_id=rid + 1), torch.float32, (2,), "output")
        del view
    finally:
        mem.close()
        seg.close()
