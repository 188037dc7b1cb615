"""A client that is gone (cancel, deadline) frees the gRPC handler thread (and stream place) its call held.

A step waits its turn behind the one running, which can take as long as the rendezvous deadline (a peer's
missing copy) or for ever (STEP_STUCK). Its handler thread waited on the step's answer with no regard for its
caller: a unary DraftStep whose client's deadline had passed, or a DraftSteps stream the engine cancelled to
reconnect, still held a thread of the rank's small pool (and the stream its place) until the step ended. A few
such calls took every thread: GetStatus and the health check, which say STEP_STUCK, queued for ever. The step
itself still runs in its turn (its peers run theirs); only its answer, which nobody reads, is dropped.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import os
import tempfile
import threading
import weakref
from concurrent import futures
from types import SimpleNamespace
from typing import Iterator

import grpc
import pytest
import torch

from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.drafter.kv_cache import kv_layer_shape
from dspark_sidecar.proto import codec, memory
from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.proto.rich_status import error_reason
from dspark_sidecar.server import servicer as servicer_mod
from dspark_sidecar.server.errors import SidecarError, StatusInterceptor
from dspark_sidecar.server.kv_binding import MemoryBindings
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop
from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle
from helpers.rank_fakes import hold_steps
from helpers.waiting import wait_until

THREADS = 2  # the rank's pool, small: two waiting handlers take all of it


class StuckLoop:
    """A RankLoop whose steps are accepted and never answered (the step before them is stuck)."""

    def __init__(self) -> None:
        self.futures: list[concurrent.futures.Future] = []

    def submit(self, req: pb.DraftStepRequest) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.futures.append(fut)
        return fut

    def answer(self, req: pb.DraftStepRequest, fut: concurrent.futures.Future) -> pb.DraftStepResponse:
        return fut.result()

    def release(self) -> None:
        for fut in self.futures:
            if not fut.done():
                fut.set_result(pb.DraftStepResponse())


@contextlib.contextmanager
def _served(svc: DrafterServicer, release) -> Iterator[pb_grpc.DrafterSidecarStub]:
    """`svc` on a unix socket with a pool of THREADS handler threads; release() lets its stuck work end."""
    folder = tempfile.mkdtemp(prefix="gone", dir="/tmp")
    path = os.path.join(folder, "r0.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=THREADS), interceptors=[StatusInterceptor()])
    pb_grpc.add_DrafterSidecarServicer_to_server(svc, server)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    channel = grpc.insecure_channel(f"unix:{path}")
    try:
        yield pb_grpc.DrafterSidecarStub(channel)
    finally:
        channel.close()
        release()  # else the handler threads wait for ever and hold the interpreter's exit
        server.stop(None).wait()
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(folder)


def _stuck_rank() -> Iterator[tuple[pb_grpc.DrafterSidecarStub, StuckLoop]]:
    """A SERVING rank's servicer over a StuckLoop, served by _served: (stub, loop). The caller patches its caps first."""
    ctx = SimpleNamespace(rank=0, fast=None, cfg=load_config("tiny"), memory=SimpleNamespace(kv=None),
                          model=SimpleNamespace(dtype=torch.float32), metrics=Metrics(0))
    loop = StuckLoop()
    svc = DrafterServicer(ctx, loop, Lifecycle(state="SERVING"), pb.Limits(), pb.Parallel(), "bf16")  # type: ignore[arg-type]
    with _served(svc, loop.release) as stub:
        yield stub, loop


@pytest.fixture
def rank(monkeypatch):
    monkeypatch.setattr(servicer_mod, "MAX_STREAMS", 1)
    yield from _stuck_rank()


def test_unary_steps_whose_clients_gave_up_leave_the_threads_to_get_status(rank):
    stub, loop = rank
    for step_id in range(THREADS):
        with pytest.raises(grpc.RpcError) as err:
            stub.DraftStep(pb.DraftStepRequest(step_id=step_id), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Every pool thread served one of those steps: before, each still waited on its step's answer.
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=5.0)
    assert status.state == "SERVING"
    # The steps were taken and stay in the loop's order: they run in their turn, answered to nobody.
    assert len(loop.futures) == THREADS and not any(f.cancelled() for f in loop.futures)


@pytest.fixture
def one_unary_place(monkeypatch):
    """As `rank`, with room for one waiting unary DraftStep (MAX_UNARY_STEPS patched) and a loop that can refuse."""
    monkeypatch.setattr(servicer_mod, "MAX_UNARY_STEPS", 1)
    yield from _stuck_rank()


def test_unary_steps_without_a_deadline_never_take_the_threads_get_status_needs(one_unary_place):
    """A client with no deadline waits as long as the step before its own is stuck: uncapped, a few such calls
    held every handler thread and GetStatus, which says STEP_STUCK, and the health check queued for ever.
    Past MAX_UNARY_STEPS a call is refused at once, saying what to do; a place is given back when its call ends."""
    stub, loop = one_unary_place
    waiting = stub.DraftStep.future(pb.DraftStepRequest(step_id=1))  # no deadline: waits for its stuck step
    wait_until(lambda: len(loop.futures) == 1, 10.0, "the first step reached the loop", interval_s=0.02)
    with pytest.raises(grpc.RpcError) as err:
        stub.DraftStep(pb.DraftStepRequest(step_id=2), timeout=5.0)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error_reason(err.value) == "TOO_MANY_STEPS"
    assert err.value.details().startswith("step 2: 1 unary DraftStep calls are already waiting on this rank")
    assert "DraftSteps stream" in err.value.details() and "deadline" in err.value.details()
    assert len(loop.futures) == 1  # refused before the loop: step 2 was never queued
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=5.0).state == "SERVING"  # the pool's other thread
    loop.release()
    assert waiting.result(timeout=5.0) == pb.DraftStepResponse()
    # Its place is free again: the next call is taken; its deadline passing, it gives the place back in its
    # handler's next look at its client (CLIENT_CHECK_S), and a later call is taken in turn.
    assert _unary_taken(stub, 3) and len(loop.futures) == 2
    wait_until(lambda: _unary_taken(stub, 4), 5.0, "a call is taken once the one before gave up", interval_s=0.05)


def _unary_taken(stub, step_id: int) -> bool:
    """Whether a unary step sent now is taken (it waits behind the stuck loop until its deadline) or refused
    TOO_MANY_STEPS."""
    with pytest.raises(grpc.RpcError) as err:
        stub.DraftStep(pb.DraftStepRequest(step_id=step_id), timeout=0.3)
    assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    return err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_unary_step_the_loop_refuses_gives_its_place_back(one_unary_place, monkeypatch):
    """The loop refuses a step (a draining rank, a full queue) before any future exists: its place is returned all
    the same, or after MAX_UNARY_STEPS refusals every unary step got TOO_MANY_STEPS for good."""
    stub, loop = one_unary_place

    def draining(req):
        raise SidecarError(grpc.StatusCode.UNAVAILABLE, "rank is draining", "", "DRAINING")

    monkeypatch.setattr(loop, "submit", draining)
    for step_id in (1, 2, 3):
        with pytest.raises(grpc.RpcError) as err:
            stub.DraftStep(pb.DraftStepRequest(step_id=step_id), timeout=5.0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()


def test_a_cancelled_stream_gives_its_place_and_thread_back_while_its_step_waits(rank):
    stub, loop = rank
    gone = threading.Event()

    def steps():
        yield pb.DraftStepRequest(step_id=1)
        gone.wait(10.0)

    call = stub.DraftSteps(steps())
    wait_until(lambda: len(loop.futures) == 1, 10.0, "the stream's step reached the loop", interval_s=0.02)
    call.cancel()
    gone.set()
    # The rank serves one stream (MAX_STREAMS patched): a new one is taken once the cancelled one has let go
    # of its place, which it held until its step was answered.
    wait_until(lambda: _taken(stub), 5.0, "a new stream is taken after the cancelled one let go", interval_s=0.1)
    assert not loop.futures[0].done()  # still waiting its turn: it was never dropped from the loop


def _taken(stub) -> bool:
    """Whether a stream opened now is taken rather than refused TOO_MANY_STREAMS."""
    fresh = stub.DraftSteps(iter(()))
    try:
        for _ in fresh:
            pass
        return True
    except grpc.RpcError as err:
        return err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED


# A binding or buffer call that changes what steps read waits for the rank's lock, which a running step holds: behind
# a stuck one (a peer hung in a collective, a stalled device) for good. Its handler waited whatever its client did.
GONE_CODES = {"deadline": grpc.StatusCode.DEADLINE_EXCEEDED, "cancel": grpc.StatusCode.CANCELLED}


def _recorded(method, answers: list):
    """`method` noting how each of its calls ended on the server: (code, message), or ("OK", "")."""
    def handler(request, context):
        try:
            out = method(request, context)
        except SidecarError as err:
            answers.append((err.code, err.message))
            raise
        answers.append(("OK", ""))
        return out
    return handler


def _layer(i: int, t: torch.Tensor) -> pb.KVLayerBinding:
    return pb.KVLayerBinding(layer=i, memory=memory.export_handle(t), dtype=codec.dtype_to_proto(t.dtype),
                             shape=list(t.shape), strides=list(t.stride()), storage_offset=t.storage_offset())


@pytest.fixture
def held():
    """A CPU rank (a real RankLoop and MemoryBindings) with a KV binding and one buffer region, whose draft step 7
    then runs until the test lets it end: it holds the rank's lock, as a step stuck on the device or a peer."""
    cfg = load_config("tiny")
    cpu = torch.device("cpu")
    mem = MemoryBindings(cfg, 1, 0, torch.float32, cpu)
    model = SimpleNamespace(device=cpu, dtype=torch.float32)
    ctx = RankContext(0, 1, cfg, model, None, mem, Metrics(0), 8)  # type: ignore[arg-type]
    loop = RankLoop(ctx, SimpleNamespace(deadline_ms=200), None)  # type: ignore[arg-type]
    started, release = hold_steps(loop)
    asked = []  # the sections asked for (each call that reached the rank's lock)
    section = loop.exclusive
    loop.exclusive = lambda *a, **kw: asked.append(1) or section(*a, **kw)  # type: ignore[method-assign]
    svc = DrafterServicer(ctx, loop, Lifecycle(state="SERVING"), pb.Limits(), pb.Parallel(), "fp32")
    answers: dict[str, list] = {}
    for name in ("BindKV", "UnbindKV", "UnregisterBuffers", "AttachDoorbell"):
        setattr(svc, name, _recorded(getattr(svc, name), answers.setdefault(name, [])))
    L = cfg.num_hidden_layers
    segs = [memory.shm_empty(kv_layer_shape(cfg, 1, 4, 16), torch.float32) for _ in range(2 * L + 1)]
    facts = pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1)
    try:
        with _served(svc, release.set) as stub:
            first = [_layer(i, s.tensor) for i, s in enumerate(segs[:L])]
            bound = stub.BindKV(pb.BindKVRequest(engine=facts, page_size=16, layers=first), timeout=10)
            region = pb.BufferRegion(name="hidden", memory=memory.export_handle(segs[-1].tensor), size_bytes=256)
            rid, = stub.RegisterBuffers(pb.RegisterBuffersRequest(regions=[region], owner=77), timeout=10).region_ids
            answers["BindKV"].clear()
            step = loop.submit(pb.DraftStepRequest(step_id=7))
            assert started.wait(10)
            asked.clear()  # the worker's own, for step 7
            rebind = pb.BindKVRequest(engine=facts, page_size=16,
                                      layers=[_layer(i, s.tensor) for i, s in enumerate(segs[L:2 * L])])
            yield SimpleNamespace(stub=stub, mem=mem, bound=bound, kv=mem.kv, rid=rid, rebind=rebind, step=step,
                                  release=release, answers=answers, asked=asked, svc=svc)
    finally:
        release.set()
        loop.close()
        mem.close()
        for seg in segs:
            seg.close()


def _requests(h) -> dict:
    return {"BindKV": h.rebind, "UnbindKV": pb.UnbindKVRequest(binding_id=h.bound.binding_id),
            "UnregisterBuffers": pb.UnregisterBuffersRequest(region_ids=[h.rid], owner=77)}


@pytest.mark.parametrize("how", GONE_CODES)
@pytest.mark.parametrize("rpc", ["BindKV", "UnbindKV", "UnregisterBuffers"])
def test_a_binding_or_buffer_call_whose_client_is_gone_stops_waiting_behind_a_stuck_step(held, monkeypatch, rpc, how):
    h = held
    given_back = []
    monkeypatch.setattr(servicer_mod, "give_back_unopened", lambda peer, handles: given_back.extend(handles))
    call = getattr(h.stub, rpc)
    for i in range(THREADS):  # as many as the pool has threads: before, each held one for as long as the step ran
        if how == "deadline":
            with pytest.raises(grpc.RpcError):
                call(_requests(h)[rpc], timeout=0.3)
        else:
            pending = call.future(_requests(h)[rpc])
            wait_until(lambda: len(h.asked) > i, 10.0, f"{rpc} {i} waits for the rank's lock")
            pending.cancel()
        wait_until(lambda: len(h.answers[rpc]) > i, 10.0, f"{rpc} {i} ended on the server while the step runs")
    assert [code for code, _ in h.answers[rpc]] == [GONE_CODES[how]] * THREADS, h.answers[rpc]
    message = h.answers[rpc][0][1]
    # Says what held the rank, that nothing changed, and what to do.
    assert "step 7" in message and "nothing was" in message and "GetStatus" in message, message
    # The rank serves on, and nothing the calls asked for was done, nor half done.
    status = h.stub.GetStatus(pb.GetStatusRequest(), timeout=5.0)
    assert status.kv.binding_id == h.bound.binding_id and status.kv.generation == h.bound.generation
    assert h.mem.kv is h.kv and len(h.kv.layers) == 5 and h.mem.binds == 1 and h.mem.region_count == 1
    assert 77 not in h.mem._released_owners  # the owner's registrations are not refused either
    # A BindKV given up never opens its handles: each goes back to the engine (a CUDA IPC producer reference).
    assert given_back == (list(h.rebind.layers[i].memory for i in range(5)) * THREADS if rpc == "BindKV" else [])
    assert not h.step.done()
    h.release.set()
    assert h.step.result(10).step_id == 7
    # The lock was never taken by a call that gave up: with the step done, the same calls go through.
    for name in ("UnregisterBuffers", "UnbindKV", "BindKV"):
        getattr(h.stub, name)(_requests(h)[name], timeout=10)
    assert h.mem.region_count == 0 and h.mem.kv is not None and h.mem.kv.binding_id != h.bound.binding_id


def test_an_unregister_waiting_for_the_attach_lock_gives_up_when_its_deadline_passes(held):
    """UnregisterBuffers takes the doorbell's attach lock before the rank's: held by a lease's release waiting on
    the device, or by an UnregisterBuffers waiting behind the stuck step, it waited there for good too."""
    h = held
    h.release.set()
    assert h.step.result(10).step_id == 7
    with h.svc._attach_lock:
        with pytest.raises(grpc.RpcError):
            h.stub.UnregisterBuffers(_requests(h)["UnregisterBuffers"], timeout=0.3)
        wait_until(lambda: h.answers["UnregisterBuffers"], 10.0, "UnregisterBuffers ended with the attach lock held")
    assert h.answers["UnregisterBuffers"][0][0] == grpc.StatusCode.DEADLINE_EXCEEDED, h.answers
    assert h.mem.region_count == 1
    h.stub.UnregisterBuffers(_requests(h)["UnregisterBuffers"], timeout=10)
    assert h.mem.region_count == 0


@pytest.mark.parametrize("rpc", ["BindKV", "UnbindKV", "UnregisterBuffers"])
def test_a_given_up_call_s_error_is_freed_by_reference_counting(held, rpc):
    """Its traceback holds the handler's frames (the request, the give-up's closure): none may hold the error
    back (test_rank_cycles.py: what a rank frees must go without the cyclic collector)."""
    h = held
    past = SimpleNamespace(time_remaining=lambda: 0.0, is_active=lambda: False, peer=lambda: "unix:/engine")
    gc.disable()
    try:
        try:
            getattr(h.svc, rpc)(_requests(h)[rpc], past)
        except SidecarError as exc:
            assert exc.code == grpc.StatusCode.DEADLINE_EXCEEDED, exc
            gone = weakref.ref(exc)
        assert gone() is None, "the given-up call's error outlived its handler: a reference cycle"
    finally:
        gc.enable()


CAP = bell.MIN_CAPACITY


@contextlib.contextmanager
def _doorbell_page() -> Iterator[pb.AttachDoorbellRequest]:
    page = memory.shm_empty((bell.HEADER + 2 * CAP,), torch.uint8)
    try:
        yield pb.AttachDoorbellRequest(page=memory.export_handle(page.tensor), capacity_bytes=CAP)
    finally:
        page.close()


def _turns(svc) -> list:
    """Per call of svc's that bounds a wait (_until_gone), in order: how many times it asked whether its client is
    still there."""
    calls: list = []
    until_gone = svc._until_gone

    def noted(*args, **kwargs):
        turn, i = until_gone(*args, **kwargs), len(calls)
        calls.append(0)

        def asked():
            calls[i] += 1
            return turn()
        return asked
    svc._until_gone = noted
    return calls


@pytest.mark.parametrize("how", GONE_CODES)
def test_an_attach_waiting_for_the_attach_lock_gives_up_once_its_client_is_gone(held, how):
    """AttachDoorbell waits for the attach lock, which a lease's release holds while it waits on the device (up
    to GONE_ENGINE_DEVICE_S) or behind a stuck step, as does an UnregisterBuffers behind a stuck step: its handler
    waited whatever its client did, and a few such calls took every thread of the rank's pool."""
    h = held
    h.release.set()
    assert h.step.result(10).step_id == 7
    turns = _turns(h.svc)
    with _doorbell_page() as request:
        try:
            with h.svc._attach_lock:  # as another thread's lease release or UnregisterBuffers holds it
                for i in range(THREADS):  # as many as the pool has threads
                    if how == "deadline":
                        with pytest.raises(grpc.RpcError):
                            h.stub.AttachDoorbell(request, timeout=0.3)
                    else:
                        pending = h.stub.AttachDoorbell.future(request)
                        wait_until(lambda: len(turns) > i and turns[i], 10.0, f"attach {i} waits for the attach lock")
                        pending.cancel()
                    wait_until(lambda: len(h.answers["AttachDoorbell"]) > i, 10.0,
                               f"attach {i} ended on the server while the attach lock is held")
                # Every pool thread served one of those calls: GetStatus is served all the same.
                assert h.stub.GetStatus(pb.GetStatusRequest(), timeout=5.0).state == "SERVING"
            answers = h.answers["AttachDoorbell"]
            assert [code for code, _ in answers] == [GONE_CODES[how]] * THREADS, answers
            assert "AttachDoorbell" in answers[0][1] and "nothing was attached" in answers[0][1], answers[0][1]
            # Nothing opened, claimed or attached by the calls that gave up.
            assert h.svc.doorbell is None and h.svc._attached == 0 and not h.mem._pages
            # With the lock free, the same call attaches.
            attached = h.stub.AttachDoorbell(request, timeout=10)
            assert h.svc.doorbell is not None and h.svc.doorbell.is_alive() and h.svc._attached == 1
            assert attached.wake_fifo == "" and not attached.gpu_word  # a CPU rank without a socket folder
        finally:
            h.svc.close_doorbell()  # its thread stops, and closes its mapping, before the page goes


def test_a_given_up_attach_s_error_is_freed_by_reference_counting(held):
    """As test_a_given_up_call_s_error_is_freed_by_reference_counting, for AttachDoorbell's wait for the attach lock
    (called on a thread of its own: before, it waited there for as long as the lock was held)."""
    h = held
    past = SimpleNamespace(time_remaining=lambda: 0.0, is_active=lambda: False, peer=lambda: "unix:/engine")
    ended: list = []

    def attach(request) -> None:
        try:
            h.svc.AttachDoorbell(request, past)
        except SidecarError as exc:
            ended.append((exc.code, weakref.ref(exc)))

    with _doorbell_page() as request, h.svc._attach_lock:
        gc.disable()
        try:
            caller = threading.Thread(target=attach, args=(request,), daemon=True)
            caller.start()
            caller.join(10)
            assert not caller.is_alive(), "AttachDoorbell still waits for the attach lock past its deadline"
            (code, gone), = ended
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert gone() is None, "the given-up call's error outlived its handler: a reference cycle"
        finally:
            gc.enable()
    assert h.svc.doorbell is None and not h.mem._pages


class HookingDoorbell:
    """Doorbell's stand-in where steps are pre-launched: its constructor hooks the pre-launch's release into the rank
    loop (loop.on_quiesce and on_device_wait, as server/doorbell.py does), which takes the rank's lock."""

    built: list = []

    def __init__(self, page, capacity, loop, *args, **kwargs) -> None:
        loop.on_quiesce(self.release)
        loop.on_device_wait(self.repass)
        HookingDoorbell.built.append(self)
        self._on_close = kwargs["on_close"]

    def release(self, wait: bool) -> None:
        pass

    def repass(self) -> None:
        pass


@pytest.mark.parametrize("how", GONE_CODES)
def test_a_pre_launching_attach_gives_up_behind_a_stuck_step_before_it_opens_the_page(held, how, monkeypatch):
    """Review 322's left-alone: on a GPU rank whose steps are pre-launched, the Doorbell's constructor hooks its
    pre-launch into the rank loop (on_quiesce, on_device_wait), which take the rank's lock: behind a stuck step,
    AttachDoorbell's handler waited there for good, under the attach lock (its own wait for which is bounded), with
    the page opened and claimed. Now the call takes the rank's lock first, bounded as the other waits are, and
    gives up with nothing opened."""
    h = held
    HookingDoorbell.built = []
    monkeypatch.setattr(servicer_mod, "Doorbell", HookingDoorbell)
    h.svc.prelaunch = True
    h.svc.__dict__["_gpu_word_ops"] = object()  # the driver's stream memory operations, as probed on a GPU
    h.svc.loop.graphs = object()  # step graphs: what a Doorbell pre-launches into
    turns = _turns(h.svc)
    with _doorbell_page() as page:
        request = pb.AttachDoorbellRequest(page=page.page, capacity_bytes=CAP, gpu_word=True)
        if how == "deadline":
            with pytest.raises(grpc.RpcError) as err:
                h.stub.AttachDoorbell(request, timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            pending = h.stub.AttachDoorbell.future(request)
            wait_until(lambda: turns and turns[0] > 1, 10.0, "the attach waits for the rank's lock")
            pending.cancel()
        wait_until(lambda: h.answers["AttachDoorbell"], 10.0, "the attach ended on the server behind the stuck step")
        (code, message), = h.answers["AttachDoorbell"]
        assert code == GONE_CODES[how] and "draft step 7" in message and "nothing was attached" in message, message
        # Nothing opened, claimed, hooked or attached, and the attach lock is free again.
        assert HookingDoorbell.built == [] and h.svc.doorbell is None and h.svc._attached == 0 and not h.mem._pages
        assert h.svc._attach_lock.acquire(timeout=5)
        h.svc._attach_lock.release()


def test_an_unregister_of_an_unknown_region_is_not_found_without_entering_the_rank(held):
    """An id not registered is NOT_FOUND before the rank's section: asked for behind the stuck step, it waited
    there (and, on a free rank, stopped the pre-launched step) only to answer NOT_FOUND and release nothing."""
    h = held
    with pytest.raises(grpc.RpcError) as err:
        h.stub.UnregisterBuffers(pb.UnregisterBuffersRequest(region_ids=[h.rid + 1000]), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nothing was released" in err.value.details()
    assert not h.asked and h.mem.region_count == 1 and not h.step.done()
