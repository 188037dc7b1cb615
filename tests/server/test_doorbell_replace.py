"""A rank's doorbells at shutdown and across a re-attach: the teardown and an attach never race, and a
new doorbell serves only after a replaced one still inside a step has ended."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.proto import doorbell as bell  # noqa: E402
from dspark_sidecar.proto import memory  # noqa: E402
from dspark_sidecar.proto import sidecar_pb2 as pb  # noqa: E402
from dspark_sidecar.server.kv_binding import MemoryBindings  # noqa: E402
from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle  # noqa: E402
from helpers.rank_fakes import IdleLoop  # noqa: E402
from helpers.waiting import wait_until  # noqa: E402

CAP = 4096


class _Loop(IdleLoop):
    def on_device_wait(self, fn, old=None):  # a dropped pre-launch unhooks its repass (Doorbell._drop_prelaunch)
        pass

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):  # a step that takes a while (a capture, a slow rendezvous)
        time.sleep(1.5)
        return pb.DraftStepResponse(step_id=req.step_id)


def _svc(tmp_path, loop=None):
    ctx = SimpleNamespace(rank=0, fast=None, memory=MemoryBindings(None, 1, 0, torch.float32, torch.device("cpu")),
                          model=SimpleNamespace(device=torch.device("cpu")), cfg=SimpleNamespace(sliding_window=64))
    return DrafterServicer(ctx, loop or _Loop(), Lifecycle(), None, None, "", run_dir=tmp_path)  # type: ignore[arg-type]


CTX = SimpleNamespace(peer=lambda: "unix:/tmp/engine.sock", is_active=lambda: True, time_remaining=lambda: None)


def _attach(svc, page):
    svc.AttachDoorbell(pb.AttachDoorbellRequest(page=memory.export_handle(page.tensor), capacity_bytes=CAP), CTX)


def test_teardown_during_a_reattach_waits_for_it_and_closes_each_fifo_once(tmp_path):
    """Before: the teardown stopped servicer.doorbell without the attach lock. A re-attach then in
    progress had published its new doorbell before starting it; the teardown's stop() released its
    wake FIFO, and the thread, started next, released it again: closing file descriptors that by
    then belonged to someone else (gRPC's sockets, a mapping)."""
    svc = _svc(tmp_path)
    pages = [memory.shm_empty((bell.HEADER + 2 * CAP,), torch.uint8) for _ in range(2)]
    mine = []
    try:
        _attach(svc, pages[0])
        d1 = svc.doorbell
        d1.page.write(d1.page.req_area, b"", bell.REQ_LEN, bell.REQ_SEQ, 1)  # D1 is now inside a step
        wait_until(lambda: d1._seen_ns != 0, 10, "the doorbell thread saw the ring", interval_s=0.005)
        t = threading.Thread(target=_attach, args=(svc, pages[1]))
        t.start()  # the engine re-attaches: D2 waits in D1.stop() for D1's step
        # By state, not by a nap: a teardown first refuses the attach instead.
        wait_until(svc._attach_lock.locked, 10, "the re-attach takes the attach lock", interval_s=0.005)
        svc.close_doorbell()  # SIGTERM's teardown: waits for the attach, then stops D2 (and D1)
        t.join(10)
        d2 = svc.doorbell
        assert d2 is not d1 and not d1.is_alive()
        d2.join(5)
        assert not d2.is_alive() and d2._released
        fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(4)]  # the lowest free numbers: D2's old FIFO's
        mine.extend(fds)
        d2._release()  # a second release (as the thread's end after a stop) closes nothing
        assert all(os.fstat(f) for f in fds)
    finally:
        for f in mine:
            with contextlib.suppress(OSError):
                os.close(f)
        for p in pages:
            p.close()


def test_no_doorbell_attaches_after_the_teardown_stopped_them(tmp_path):
    """Before: an attach during the drain started a doorbell nobody stopped, which went on serving
    rings while the rank loop, the graphs and the rendezvous board were torn down."""
    import grpc

    from dspark_sidecar.server.errors import SidecarError

    svc = _svc(tmp_path)
    pages = [memory.shm_empty((bell.HEADER + 2 * CAP,), torch.uint8) for _ in range(2)]
    try:
        _attach(svc, pages[0])
        svc.close_doorbell()
        with pytest.raises(SidecarError) as err:
            _attach(svc, pages[1])
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.reason == "SHUTTING_DOWN"
        running = [t for t in threading.enumerate() if t.name == "dspark-doorbell" and t.is_alive()]
        assert running == []
    finally:
        for p in pages:
            p.close()


class _LockLoop(_Loop):
    """A rank loop's lock, and a device stream modelled as: a queued copy blocks it until released."""

    def __init__(self):
        self.lock = threading.RLock()
        self.stream_free = threading.Event()
        self.stream_free.set()
        self.events = []
        self.hung = False

    @contextlib.contextmanager
    def exclusive(self, wait=True, quiesce=True, give_up=None):
        with self.lock:
            yield

    def on_quiesce(self, fn, old=None):
        with self.lock:
            pass

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        if req.step_id == 1:  # D1's step: a long rendezvous (rendezvous_ms of 10 s or more), GO at the end
            time.sleep(0.6)
        else:  # D2's step with inline output: hidden.cpu() waits for the stream
            self.events.append("D2 step")
            if not self.stream_free.wait(2.0):
                self.hung = True
        return pb.DraftStepResponse(step_id=req.step_id)


class _PL:
    passing = False  # no released step waits (Prelaunch.repass)

    def __init__(self, loop):
        self.loop = loop

    def hook(self, seq, req):
        return None

    def settle(self):
        pass

    def watch(self):
        pass

    def repass(self):  # the poke the doorbell hooks and unhooks (nothing released to store again)
        return True

    def after(self, seq, resp):  # QUEUE_NEXT agreed: the copy of seq+1 waits on the OLD page's word
        self.loop.stream_free.clear()
        self.loop.events.append("D1 queued")

    def release(self, wait=False):
        pass

    def detach(self):
        self.loop.events.append("D1 released")
        self.loop.stream_free.set()
        return lambda: None


def test_a_new_doorbell_serves_only_after_a_replaced_one_still_in_a_long_step_has_ended(tmp_path, monkeypatch):
    from dspark_sidecar.server import doorbell as db_mod

    monkeypatch.setattr(db_mod, "STOP_S", 0.2)  # stands for a step longer than STOP_S (10 s)
    loop = _LockLoop()
    ctx = SimpleNamespace(rank=0, fast=None, memory=MemoryBindings(None, 1, 0, torch.float32, torch.device("cpu")),
                          model=SimpleNamespace(device=torch.device("cpu")), cfg=SimpleNamespace(sliding_window=64))
    svc = DrafterServicer(ctx, loop, Lifecycle(), None, None, "")  # type: ignore[arg-type]
    pages = [memory.shm_empty((bell.HEADER + 2 * CAP,), torch.uint8) for _ in range(2)]
    try:
        _attach(svc, pages[0])
        d1 = svc.doorbell
        d1.prelaunch = _PL(loop)
        real_drop = d1._drop_prelaunch
        monkeypatch.setattr(d1, "_drop_prelaunch", lambda then=None: (time.sleep(0.05), real_drop(then)))
        req = pb.DraftStepRequest(step_id=1).SerializeToString()
        d1.page.write(d1.page.req_area, req, bell.REQ_LEN, bell.REQ_SEQ, 1)
        wait_until(lambda: d1._seen_ns != 0, 10, "the doorbell thread saw the ring", interval_s=0.005)
        _attach(svc, pages[1])  # returns after STOP_S with D1 still in its step
        d2 = svc.doorbell
        d2.page.write(d2.page.req_area, pb.DraftStepRequest(step_id=2).SerializeToString(), bell.REQ_LEN,
                      bell.REQ_SEQ, 1)
        d1.join(5)
        wait_until(lambda: "D2 step" in loop.events and d2.page.word(bell.RESP_SEQ) == 1, 5,
                   lambda: f"D2's step answered: {loop.events}, RESP_SEQ {d2.page.word(bell.RESP_SEQ)}")
        # Before: D2's step ran (and waited on the stream) between D1's queued copy and its release.
        assert not loop.hung and loop.events == ["D1 queued", "D1 released", "D2 step"], loop.events
    finally:
        svc.close_doorbell()
        for p in pages:
            p.close()


class _QuickLoop(_Loop):
    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        return pb.DraftStepResponse(step_id=req.step_id)


def test_an_engine_whose_doorbell_another_client_replaced_is_told_at_its_next_ring(tmp_path):
    """One doorbell per rank: a second AttachDoorbell (a second client, a tool) stops the first. Before,
    the first engine's next ring was never answered and never settled while the sidecar lived."""
    from dspark_sidecar.client.dataplane import DoorbellChannel, DoorbellClosed

    svc = _svc(tmp_path, _QuickLoop())
    stub = SimpleNamespace(AttachDoorbell=lambda req, timeout=None: svc.AttachDoorbell(req, CTX))
    engine = DoorbellChannel(stub, torch.device("cpu"), capacity=CAP, gpu_word=False)
    other = None
    try:
        engine.send(pb.DraftStepRequest(step_id=1))
        assert engine.wait(1, 5.0).step_id == 1 and not engine.closed_by_sidecar
        other = DoorbellChannel(stub, torch.device("cpu"), capacity=CAP, gpu_word=False)
        assert engine.closed_by_sidecar  # set as the old doorbell let its page go
        engine.send(pb.DraftStepRequest(step_id=2))
        with pytest.raises(DoorbellClosed, match="without answering step 2"):
            engine.wait(2, 5.0)
        assert engine.settled(2) and not engine.alive
        other.send(pb.DraftStepRequest(step_id=7))
        assert other.wait(7, 5.0).step_id == 7 and not other.closed_by_sidecar  # the new client is served
    finally:
        svc.close_doorbell()
        for ch in (engine, other):
            if ch is not None:
                ch.close()


def test_the_page_of_a_doorbell_still_attached_is_refused_and_that_doorbell_serves_on(tmp_path):
    """Attaching the very page in use again (a client's retry after a timeout, a tool) was accepted: the old
    doorbell then marked the page CLOSED as it stopped, under the new one serving it, so the engine took a
    step the new one still ran for settled (helper 79). A new page replaces a doorbell; the same one is refused."""
    import grpc

    from dspark_sidecar.client.dataplane import DoorbellChannel
    from dspark_sidecar.server.errors import SidecarError

    svc = _svc(tmp_path, _QuickLoop())
    sent = []

    def attach(req, timeout=None):
        sent.append(req)
        return svc.AttachDoorbell(req, CTX)

    engine = DoorbellChannel(SimpleNamespace(AttachDoorbell=attach), torch.device("cpu"), capacity=CAP, gpu_word=False)
    try:
        engine.send(pb.DraftStepRequest(step_id=1))
        assert engine.wait(1, 5.0).step_id == 1
        first = svc.doorbell
        with pytest.raises(SidecarError) as refused:
            svc.AttachDoorbell(sent[0], CTX)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and refused.value.field == "page"
        assert "a doorbell still attached" in str(refused.value), refused.value
        assert svc.doorbell is first and first.is_alive() and not engine.closed_by_sidecar
        engine.send(pb.DraftStepRequest(step_id=2))
        assert engine.wait(2, 5.0).step_id == 2 and not engine.closed_by_sidecar
    finally:
        svc.close_doorbell()
        engine.close()


class _CountingLoop(_QuickLoop):
    def __init__(self):
        self.served = []

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        self.served.append(req.step_id)
        return super().answer_now(req, hook, answer_limit)


def test_a_page_a_doorbell_stopped_serving_for_good_is_refused_when_attached_again(tmp_path):
    """Word [6] says a doorbell stopped serving the page for good: the engine takes a step rung there as
    unanswered, never run, and runs its own layers for it. The same page attached again once that doorbell
    was gone (a client's retry of its attach, after another client replaced it) was accepted with the word
    still set: the new doorbell ran every step the engine took for never run (the sibling of helper 79's
    page still attached)."""
    import grpc

    from dspark_sidecar.client.dataplane import DoorbellChannel, DoorbellClosed
    from dspark_sidecar.server.errors import SidecarError

    loop = _CountingLoop()
    svc = _svc(tmp_path, loop)
    sent = []

    def attach(req, timeout=None):
        sent.append(req)
        return svc.AttachDoorbell(req, CTX)

    engine = DoorbellChannel(SimpleNamespace(AttachDoorbell=attach), torch.device("cpu"), capacity=CAP, gpu_word=False)
    other = None
    try:
        other = DoorbellChannel(SimpleNamespace(AttachDoorbell=attach), torch.device("cpu"), capacity=CAP,
                                gpu_word=False)
        assert engine.closed_by_sidecar  # replaced: its page is closed for good
        try:
            svc.AttachDoorbell(sent[0], CTX)  # the first page again
        except SidecarError as refused:
            assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and refused.field == "page"
            assert "for good" in str(refused), refused
        else:  # served again: what the engine is told and what runs disagree
            engine.send(pb.DraftStepRequest(step_id=2))
            with contextlib.suppress(DoorbellClosed):
                engine.wait(2, 2.0)
            time.sleep(0.2)
            assert 2 not in loop.served, "a step the engine was told never runs was run"
            pytest.fail("a page closed for good was attached again")
        other.send(pb.DraftStepRequest(step_id=7))  # the doorbell attached before is still the one serving
        assert other.wait(7, 5.0).step_id == 7 and not other.closed_by_sidecar
    finally:
        svc.close_doorbell()
        for ch in (engine, other):
            if ch is not None:
                ch.close()
