"""The doorbell's thread on CPU stand-ins: between steps it lets the pre-launch time a cooldown step's word."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch

pytest.importorskip("triton")  # the doorbell imports the pre-launch, which imports its metadata program

from dspark_sidecar.proto import doorbell as bell  # noqa: E402
from dspark_sidecar.server import doorbell as doorbell_mod  # noqa: E402
from dspark_sidecar.server.doorbell import Doorbell  # noqa: E402
from helpers.waiting import wait_until  # noqa: E402

CAPACITY = 4096


class _Page:
    """What the doorbell uses of its MappedMemory: the bytes, and close."""

    def __init__(self) -> None:
        self.storage = torch.zeros(bell.HEADER + 2 * CAPACITY, dtype=torch.uint8)
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Loop:
    """What the doorbell uses of its RankLoop when no step is rung."""

    graphs = None

    def on_quiesce(self, fn, old=None) -> None:
        pass

    def on_device_wait(self, fn, old=None) -> None:
        pass

    @contextlib.contextmanager
    def exclusive(self, wait: bool = True, quiesce: bool = True, give_up=None):
        yield

    def after_device(self, fn, wait=None) -> None:  # no GPU: nothing queued ahead
        fn()

    def sweep_idle(self, poke: bool = False) -> None:
        pass


class _Prelaunch:
    """Counts the idle loop's watch() calls (server/prelaunch.py times a cooldown step's word there)."""

    def __init__(self) -> None:
        self.watches, self.closed, self.seen = 0, False, threading.Event()
        self.passing = False  # no released step waits (Prelaunch.repass)

    def watch(self) -> None:
        self.watches += 1
        if self.watches >= 3:
            self.seen.set()

    def release(self, wait: bool = False) -> None:
        pass

    def repass(self) -> bool:
        return True

    def detach(self):
        return self.close

    def close(self) -> None:
        self.closed = True


def test_the_idle_doorbell_lets_the_prelaunch_watch_between_steps():
    db = Doorbell(_Page(), CAPACITY, _Loop(), torch.device("cpu"), b"")
    pl = db.prelaunch = _Prelaunch()  # on a GPU the doorbell builds it from the GPU word's ops
    db.start()
    try:
        assert pl.seen.wait(timeout=10), "the idle loop never called watch()"
    finally:
        db.stop()
    assert not db.is_alive() and pl.closed and db.prelaunch is None
    n = pl.watches
    time.sleep(0.05)
    assert pl.watches == n  # stopped: no more polling


class _RecordingLoop(_Loop):
    """Records the idle loop's sweeps and the pokes hooked and unhooked."""

    def __init__(self) -> None:
        self.sweeps, self.hooks = [], []

    def sweep_idle(self, poke: bool = False) -> None:
        self.sweeps.append(poke)

    def on_device_wait(self, fn, old=None) -> None:
        self.hooks.append((fn, old))


def test_the_idle_doorbell_pokes_while_a_released_step_waits_and_not_otherwise():
    loop = _RecordingLoop()
    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"")
    pl = db.prelaunch = _Prelaunch()
    db.start()
    try:
        assert pl.seen.wait(timeout=10)
        assert loop.sweeps and not any(loop.sweeps)  # nothing released: the plain sweep
        pl.passing = True  # a released step not yet seen finished (Prelaunch.repass)
        wait_until(lambda: any(loop.sweeps), 10, "the idle doorbell pokes")
    finally:
        db.stop()


def test_a_stopped_doorbell_unhooks_its_poke_and_sets_closed_even_when_its_finish_fails(caplog):
    """The page's CLOSED word tells the engine to attach again: a pre-launch whose finish raised used to
    skip the page's close, and the engine's step stayed unsettled for the sidecar's life."""
    loop, page = _RecordingLoop(), _Page()
    db = Doorbell(page, CAPACITY, loop, torch.device("cpu"), b"")
    pl = db.prelaunch = _Prelaunch()

    def failing() -> None:
        raise RuntimeError("injected: unregistering the header failed")

    pl.detach = lambda: failing
    with pytest.raises(RuntimeError, match="injected"):
        db.stop()  # never started: stop releases at once, on this thread
    assert (None, pl.repass) in loop.hooks
    assert int(page.storage[8 * bell.CLOSED : 8 * bell.CLOSED + 8].view(torch.int64)) == 1
    # The registrations finish could not end may still name the page: it stays mapped (helper 74).
    assert not page.closed and db.memory in doorbell_mod._KEPT
    doorbell_mod._KEPT.remove(db.memory)


class _LockedLoop(_Loop):
    """A loop whose exclusive section is a real lock, recording whether each unhook ran inside it."""

    def __init__(self) -> None:
        self.lock, self.seen, self.inside = threading.RLock(), [], 0

    @contextlib.contextmanager
    def exclusive(self, wait: bool = True, quiesce: bool = True, give_up=None):
        with self.lock:
            self.inside += 1
            try:
                yield
            finally:
                self.inside -= 1

    def on_quiesce(self, fn, old=None) -> None:
        self.seen.append(("quiesce", self.inside > 0))


def test_the_quiesce_is_unhooked_inside_the_section_that_detaches():
    """Unhooked before the lock, a gRPC step or a binding let in between would use the device without
    releasing the queued step first (helper 73; this test helper 74's)."""
    loop = _LockedLoop()
    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"")
    pl = db.prelaunch = _Prelaunch()
    pl.detach = lambda: (lambda: None)
    db.stop()
    assert loop.seen == [("quiesce", True)]


def test_a_doorbell_too_small_for_an_error_answer_is_refused():
    """With a 64-byte area even the error answer to a ring cannot be written: the thread died and the
    rank went on reporting SERVING while every ring went unanswered. AttachDoorbell refuses it."""
    from dspark_sidecar.server.errors import SidecarError

    with pytest.raises(SidecarError, match="capacity_bytes: 64 is below the 4096 bytes"):
        Doorbell(_Page(), 64, _Loop(), torch.device("cpu"), b"")
    # The bound itself: one byte below it is refused, the bound (room for any error answer) is served.
    with pytest.raises(SidecarError, match=f"capacity_bytes: {bell.MIN_CAPACITY - 1} is below"):
        Doorbell(_Page(), bell.MIN_CAPACITY - 1, _Loop(), torch.device("cpu"), b"")
    assert Doorbell(_Page(), bell.MIN_CAPACITY, _Loop(), torch.device("cpu"), b"").page.capacity == bell.MIN_CAPACITY


class _LimitLoop(_Loop):
    """Records what each step is told of where its answer goes (answer_now's answer_limit and seen_ns)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        from dspark_sidecar.proto import sidecar_pb2 as pb

        self.calls.append((answer_limit, seen_ns))
        return pb.DraftStepResponse(step_id=req.step_id)


def test_a_doorbell_step_is_told_its_answer_goes_into_the_page_s_response_area():
    """answer_limit is the page's capacity: validate refuses a step whose inline hidden states cannot fit the
    response area before it runs (RESOURCE_EXHAUSTED); told no limit, the step ran, wrote its K/V, and only
    its answer said RESPONSE_TOO_LARGE."""
    from dspark_sidecar.proto import sidecar_pb2 as pb

    loop = _LimitLoop()
    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"")
    db.start()
    try:
        db.page.write(db.page.req_area, pb.DraftStepRequest(step_id=3).SerializeToString(), bell.REQ_LEN,
                      bell.REQ_SEQ, 1)
        wait_until(lambda: db.page.word(bell.RESP_SEQ) == 1, 10, "the ring answered", watch=db)
    finally:
        db.stop()
    [(limit, seen)] = loop.calls
    assert limit == CAPACITY and seen == db._seen_ns > 0


class _Ops:
    """A GPU word's ops as the doorbell sees them: only passed on to the pre-launch."""


class _BuiltPrelaunch(_Prelaunch):
    """Stands in for Prelaunch as the doorbell builds it (server/prelaunch.py), or refuses with GpuWordError."""

    refuse = False

    def __init__(self, ops, page, page_ptr, graphs, window, count, exchange=None, device=None, max_reqs=0,
                 behind_s=0.0, output_of=None) -> None:
        from dspark_sidecar.proto.gpu_word import GpuWordError

        if self.refuse:
            raise GpuWordError("injected: the driver refused the page's registration")
        super().__init__()
        self.ops, self.exchange = ops, exchange


@pytest.mark.parametrize("world", [1, 2])
def test_a_doorbell_with_a_gpu_word_hooks_its_prelaunch_into_the_loop_and_unhooks_it_at_stop(monkeypatch, world):
    """A doorbell built with the GPU word's ops over a loop with graphs pre-launches: its release runs before
    other device work (on_quiesce) and its repass while a host waits for the device (on_device_wait). Unhooked
    from the waits, a released step that an engine's late word blocked again was never stored again while a
    BindKV or a gRPC step waited for the device, which then waited for good. At TP > 1 the flags are exchanged.
    A pre-launch the driver refuses (GpuWordError) leaves the doorbell serving without one, hooked nowhere."""
    from types import SimpleNamespace

    class Loop(_RecordingLoop):
        graphs = object()
        ctx = SimpleNamespace(world=world, max_reqs=8, metrics=SimpleNamespace(prelaunch=lambda hit: None))
        output_view = None

        def __init__(self) -> None:
            super().__init__()
            self.quiesce = []

        def on_quiesce(self, fn, old=None) -> None:
            self.quiesce.append((fn, old))

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(doorbell_mod, "Prelaunch", _BuiltPrelaunch)
    loop, ops = Loop(), _Ops()
    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"", word_ops=ops)
    pl = db.prelaunch
    assert isinstance(pl, _BuiltPrelaunch) and pl.ops is ops and (pl.exchange is None) == (world == 1)
    assert loop.quiesce == [(pl.release, None)] and loop.hooks == [(pl.repass, None)]
    db.stop()  # never started: released here
    assert loop.quiesce[-1] == (None, pl.release) and loop.hooks[-1] == (None, pl.repass) and pl.closed
    monkeypatch.setattr(_BuiltPrelaunch, "refuse", True)
    loop = Loop()
    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"", word_ops=ops)
    assert db.prelaunch is None and loop.quiesce == [] and loop.hooks == []


class _FailingLoop(_Loop):
    """A loop whose every step raises, with an answer that never fits: the thread must outlive both."""

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        raise RuntimeError("x" * (2 * CAPACITY))


def test_the_doorbell_thread_outlives_a_failed_step_and_a_failed_error_answer(monkeypatch):
    db = Doorbell(_Page(), CAPACITY, _FailingLoop(), torch.device("cpu"), b"")
    published = []
    real = db._publish

    def publish(seq, resp):
        published.append(seq)
        if len(published) == 1:
            raise ValueError("the page refused the answer")  # the error answer fails once
        real(seq, resp)

    monkeypatch.setattr(db, "_publish", publish)
    db.start()
    try:
        for seq in (1, 2):  # two rings: the first answer is lost, the second one gets through
            db.page.write(db.page.req_area, b"", bell.REQ_LEN, bell.REQ_SEQ, seq)
            wait_until(lambda: seq in published, 10, lambda: f"ring {seq} published: {published}", watch=db)
        wait_until(lambda: db.page.word(bell.RESP_SEQ) == 2, 10,
                   lambda: f"the second ring answered: RESP_SEQ {db.page.word(bell.RESP_SEQ)}")
        assert db.is_alive()
    finally:
        db.stop()


class _Event:
    """Stands in for the doorbell's output event: records each record() in the shared order list."""

    def __init__(self, order: list) -> None:
        self.order = order

    def record(self, stream=None) -> None:
        self.order.append("record")


def _ring_once_recording(monkeypatch, loop, request: bytes) -> list:
    """Ring a CPU doorbell over `loop` once with `request`; the order of its output event's records and its answers
    (publish, seq, error code, reason)."""
    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"")
    order: list = []
    db.output_event = _Event(order)  # on a GPU, the interprocess event the engine waits on
    real = db._publish

    def publish(seq, resp):
        order.append(("publish", seq, resp.error.code, resp.error.reason))
        real(seq, resp)

    monkeypatch.setattr(db, "_publish", publish)
    db.start()
    try:
        db.page.write(db.page.req_area, request, bell.REQ_LEN, bell.REQ_SEQ, 1)
        wait_until(lambda: db.page.word(bell.RESP_SEQ) == 1, 10, lambda: f"the ring answered: {order}", watch=db)
    finally:
        db.stop()
    return order


def test_a_step_that_raises_still_records_the_output_event_before_its_error_answer(monkeypatch):
    """The engine orders its stream after the output event for every answer, an error one included (an
    answer means the step may have launched: client/dataplane.py's wait). A step that raised out of
    answer_now skipped the record: the engine's fallback then ran after only the previous step's event, beside
    whatever this step had queued on the K/V cache (review 300's left-alone)."""
    order = _ring_once_recording(monkeypatch, _FailingLoop(), b"")
    assert order == ["record", ("publish", 1, 13, "INTERNAL")], order  # google.rpc INTERNAL (sidecar.proto StepError)


def test_a_garbled_ring_still_records_the_output_event_before_its_error_answer(monkeypatch):
    """An unreadable request is answered too (INVALID_FIELD), and the engine orders its stream after the output
    event for that answer as for any (client/dataplane.py's wait). With steps pre-launched, the copy queued after
    the last step sits on the sidecar's stream behind the page's GPU word and may run the rung step for real (its
    word landed before the release's store): the answer to a garbled ring skipped the record, and the engine's
    fallback for the step ran after only the previous step's event, beside that copy's K/V writes and its reads
    of the regions the engine rewrites next (the unreadable twin of review 300's raise path)."""
    order = _ring_once_recording(monkeypatch, _CountingLoop(), b"\xff" * 16)
    assert order == ["record", ("publish", 1, 3, "INVALID_FIELD")], order  # google.rpc INVALID_ARGUMENT


def _last_of_two_rings(loop):
    """Ring a doorbell over `loop` twice, each answered (so its thread lived past the first), and the last answer."""
    from dspark_sidecar.proto import sidecar_pb2 as pb

    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"")
    db.start()
    try:
        for seq in (1, 2):
            db.page.write(db.page.req_area, b"", bell.REQ_LEN, bell.REQ_SEQ, seq)
            wait_until(lambda: db.page.word(bell.RESP_SEQ) == seq, 10, f"ring {seq} answered", watch=db)
        return pb.DraftStepResponse.FromString(db.page.read(db.page.resp_area, bell.RESP_LEN))
    finally:
        db.stop()


class _UndecodableLoop(_Loop):
    """A loop whose step raises with an OS string's undecodable byte in its words (surrogateescape: a path)."""

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        raise OSError("cannot open " + b"/dev/shm/x\xff".decode(errors="surrogateescape"))


def test_a_step_that_raises_with_an_undecodable_byte_in_its_words_still_gets_its_error_answer():
    """The error answer's message went into the protobuf as the exception's text: a lone surrogate (an OS name's
    undecodable byte) made building the answer raise outside the thread's guard, and the doorbell thread ended,
    every later ring unanswered (the engine timing out each until it attached again). Escaped as a status's is."""
    resp = _last_of_two_rings(_UndecodableLoop())
    assert resp.error.code == 13 and "\\udcff" in resp.error.message, resp.error


class _Unprintable(Exception):
    def __str__(self):
        raise ValueError("no text")


class _UnprintableLoop(_Loop):
    """A loop whose step raises an exception whose own str() raises (a third-party exception's broken __str__)."""

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        raise _Unprintable()


def test_a_step_that_raises_an_exception_whose_text_cannot_be_formatted_still_gets_its_error_answer():
    """The error answer formatted the exception's text inside the thread's except clause: an exception whose __str__
    raises raised again there, past the guard, and the doorbell thread ended, every later ring unanswered."""
    resp = _last_of_two_rings(_UnprintableLoop())
    assert resp.error.code == 13, resp.error
    assert resp.error.message == "internal error: _Unprintable: <its message could not be formatted: ValueError>"


def test_attaching_a_doorbell_replaces_the_last_one_even_when_it_does_not_close_cleanly():
    """One doorbell per rank, attached one at a time: the replaced one is stopped (its failure to close
    is logged), the new one runs, and concurrent attaches end with exactly one running."""
    from types import SimpleNamespace

    from dspark_sidecar.proto import memory
    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.server.kv_binding import MemoryBindings
    from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle

    ctx = SimpleNamespace(rank=0, fast=None, memory=MemoryBindings(None, 1, 0, torch.float32, torch.device("cpu")),
                          model=SimpleNamespace(device=torch.device("cpu")), cfg=SimpleNamespace(sliding_window=64))
    svc = DrafterServicer(ctx, _Loop(), Lifecycle(), None, None, "")  # type: ignore[arg-type]
    # Four attaches at once wait for the attach lock, asking their client on the way (servicer._until_gone).
    context = SimpleNamespace(peer=lambda: "unix:/tmp/engine.sock", is_active=lambda: True, time_remaining=lambda: None)
    pages = [memory.shm_empty((bell.HEADER + 2 * CAPACITY,), torch.uint8) for _ in range(6)]
    try:
        def attach(i):
            svc.AttachDoorbell(pb.AttachDoorbellRequest(page=memory.export_handle(pages[i].tensor),
                                                        capacity_bytes=CAPACITY), context)

        attach(0)
        first = svc.doorbell

        def failing_stop():
            Doorbell.stop(first)
            raise BufferError("cannot close a memoryview in use")

        first.stop = failing_stop
        attach(1)
        assert svc.doorbell is not first and svc.doorbell.is_alive() and not first.is_alive()
        ts = [threading.Thread(target=attach, args=(i,)) for i in range(2, 6)]
        [t.start() for t in ts]
        [t.join(timeout=30) for t in ts]
        running = [t for t in threading.enumerate() if t.name == "dspark-doorbell" and t.is_alive()]
        assert running == [svc.doorbell]
    finally:
        if svc.doorbell is not None:
            svc.doorbell.stop()
        for p in pages:
            p.close()


class _SlowLoop(_Loop):
    """A step that takes longer than stop() waits (STOP_S, cut to 0.2 s by the test)."""

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        from dspark_sidecar.proto import sidecar_pb2 as pb

        time.sleep(1.0)
        return pb.DraftStepResponse(step_id=req.step_id)


class _QueueingPrelaunch(_Prelaunch):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def settle(self) -> None:
        pass

    def hook(self, seq, req):
        return None

    def after(self, seq, resp) -> None:
        assert not self.closed, "queueing on a closed pre-launch"
        self.events.append(f"queued after {seq}")

    def close(self) -> None:
        self.events.append("closed")
        super().close()


def test_stop_during_a_step_lets_it_queue_the_next_before_the_prelaunch_goes(monkeypatch):
    """stop() (AttachDoorbell replacing this doorbell, or shutdown) waited 2 s, then closed the
    pre-launch under a step still running: that step then skipped the queueing its peers did after
    it (or raised on the closed pre-launch), and at TP > 1 the ranks' collectives paired with the
    wrong steps. The thread now releases the pre-launch itself, after its step. The step must outlast
    stop()'s wait: against STOP_S's 10 s the 2.5 s step this test had ended inside it, and a stop()
    that dropped the pre-launch after its wait passed here."""
    monkeypatch.setattr(doorbell_mod, "STOP_S", 0.2)
    page = _Page()
    db = Doorbell(page, CAPACITY, _SlowLoop(), torch.device("cpu"), b"")
    pl = db.prelaunch = _QueueingPrelaunch()
    db.start()
    db.page.write(db.page.req_area, b"", bell.REQ_LEN, bell.REQ_SEQ, 1)
    wait_until(lambda: db._seen_ns != 0, 5, "the step under way", interval_s=0.005)
    db.stop()  # returns after STOP_S, the step still running
    assert db.is_alive() and pl.events == [], pl.events  # nothing dropped under the step
    db.join(10)
    assert not db.is_alive() and pl.events == ["queued after 1", "closed"] and db.prelaunch is None
    assert int(page.storage[: bell.HEADER].view(torch.int64)[bell.RESP_SEQ]) == 1  # answered, then released


class _DeferringLoop(_Loop):
    """A TP > 1 rank's loop: what after_device is given waits for the test to say the device passed."""

    def __init__(self) -> None:
        self.held: list = []

    def after_device(self, fn, wait=None) -> None:
        self.held.append(fn)


def test_a_stopped_doorbell_keeps_its_page_until_the_device_has_passed():
    """The pre-launch registered the page's header with the GPU: a released copy still queued (at
    TP > 1 until its peers' copies run) writes through it, so the page outlives stop() until then."""
    loop = _DeferringLoop()
    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"")
    pl = db.prelaunch = _Prelaunch()
    db.start()
    db.stop()
    assert not db.is_alive() and db.prelaunch is None and not pl.closed and db.page.words is not None
    [done] = loop.held
    done()
    assert pl.closed and db.page.words is None


class _OffsetPage(_Page):
    """A page mapped `offset` bytes into its segment (AttachDoorbell's page.shm.offset_bytes)."""

    def __init__(self, offset: int) -> None:
        self._whole = torch.zeros(offset + bell.HEADER + 2 * CAPACITY + 64, dtype=torch.uint8)
        base = (-self._whole.data_ptr()) % 64  # a 64-byte-aligned start, then the request's offset
        self.storage = self._whole[base + offset : base + offset + bell.HEADER + 2 * CAPACITY]


@pytest.mark.parametrize("offset", [4, 8, 32])
def test_a_page_whose_words_are_not_cache_line_aligned_is_refused(offset):
    """The ring's words are single 8-byte stores read by another process: a word across two cache
    lines may be seen half written (a torn sequence number could serve a step twice), and the GPU word
    is written by cuStreamWriteValue64. A page offset that is not a multiple of 64 is an
    INVALID_ARGUMENT naming the page; 0 and 64 are served."""
    from dspark_sidecar.server.errors import SidecarError

    with pytest.raises(SidecarError, match=rf"page: the page starts {offset} bytes past a multiple of 64"):
        Doorbell(_OffsetPage(offset), CAPACITY, _Loop(), torch.device("cpu"), b"")
    for ok in (0, 64):
        Doorbell(_OffsetPage(ok), CAPACITY, _Loop(), torch.device("cpu"), b"")


def test_an_input_event_the_driver_will_not_open_is_an_invalid_argument(monkeypatch):
    """On a GPU sidecar torch raises RuntimeError for bytes that are not an event handle (not 64 bytes,
    or refused by the driver): it reached the engine as INTERNAL. Now INVALID_ARGUMENT naming the field.
    The GPU calls are stood in for (no GPU here); the refusal comes before any of them is needed."""
    from dspark_sidecar.server.errors import SidecarError

    def refuse(device, handle):
        raise RuntimeError("CUDA error: invalid resource handle")

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda.Event, "from_ipc_handle", staticmethod(refuse))
    with pytest.raises(SidecarError, match="input_event: cannot open the engine's interprocess event on cuda:0: "
                                           "CUDA error: invalid resource handle") as err:
        Doorbell(_Page(), CAPACITY, _Loop(), torch.device("cuda", 0), b"\x01" * 64)
    assert err.value.code.name == "INVALID_ARGUMENT"


def _cpu_servicer():
    """(A rank's servicer on CPU with the test loop, its MemoryBindings, an engine's RPC context) for AttachDoorbell."""
    from types import SimpleNamespace

    from dspark_sidecar.server.kv_binding import MemoryBindings
    from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle

    mem = MemoryBindings(None, 1, 0, torch.float32, torch.device("cpu"))
    ctx = SimpleNamespace(rank=0, fast=None, memory=mem, model=SimpleNamespace(device=torch.device("cpu")),
                          cfg=SimpleNamespace(sliding_window=64))
    svc = DrafterServicer(ctx, _Loop(), Lifecycle(), None, None, "")  # type: ignore[arg-type]
    return svc, mem, SimpleNamespace(peer=lambda: "unix:/tmp/engine.sock", is_active=lambda: True,
                                     time_remaining=lambda: None)


def test_an_input_event_sent_to_a_cpu_rank_is_refused_before_the_page_is_taken():
    """AttachDoorbellRequest.input_event promises that the sidecar's stream waits on the engine's
    "inputs written" event before reading a step. A rank on CPU has no stream and opened no event: it
    dropped the bytes and read each step as soon as it was rung, before an engine on a GPU had finished
    writing its inputs. Now FAILED_PRECONDITION naming the field, before the page is mapped or claimed;
    without an event the same page attaches."""
    from dspark_sidecar.proto import memory
    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.server.errors import SidecarError

    svc, mem, context = _cpu_servicer()
    page = memory.shm_empty((bell.HEADER + 2 * CAPACITY,), torch.uint8)
    req = pb.AttachDoorbellRequest(page=memory.export_handle(page.tensor), capacity_bytes=CAPACITY,
                                   input_event=b"\x07" * 64)
    try:
        with pytest.raises(SidecarError) as err:
            svc.AttachDoorbell(req, context)
        assert (err.value.code.name, err.value.field, err.value.reason) == ("FAILED_PRECONDITION", "input_event",
                                                                            "NO_DEVICE_EVENTS")
        assert err.value.message.startswith("input_event: this rank computes on cpu")
        assert svc.doorbell is None and not mem._pages  # nothing attached, the page not claimed
        req.input_event = b""
        svc.AttachDoorbell(req, context)
        assert svc.doorbell is not None and svc.doorbell.is_alive()
    finally:
        if svc.doorbell is not None:
            svc.doorbell.stop()
        page.close()


def test_a_doorbell_whose_thread_cannot_start_gives_its_page_back(monkeypatch):
    """AttachDoorbell claims the page, builds the doorbell, retires the old one and starts the new one's thread. A
    start that raised (RuntimeError "can't start new thread": a process at its thread limit) left the page claimed
    and mapped, with no doorbell to release it: a range of the engine's memory that no later attach, region or
    binding could use. Now the failed doorbell releases it as a never-started one does, and the error goes to the
    caller. Found by helper 286's review."""
    from dspark_sidecar.proto import memory
    from dspark_sidecar.proto import sidecar_pb2 as pb

    svc, mem, context = _cpu_servicer()
    page = memory.shm_empty((bell.HEADER + 2 * CAPACITY,), torch.uint8)
    pages = [page]
    req = pb.AttachDoorbellRequest(page=memory.export_handle(page.tensor), capacity_bytes=CAPACITY)
    real_start = Doorbell.start

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    try:
        monkeypatch.setattr(Doorbell, "start", no_thread)
        with pytest.raises(RuntimeError, match="can't start new thread"):
            svc.AttachDoorbell(req, context)
        assert svc.doorbell is None
        assert not mem._pages, "the page stayed claimed by a doorbell that never ran"
        monkeypatch.setattr(Doorbell, "start", real_start)
        # The page is marked closed for good (a stopped doorbell's word): the engine attaches a fresh one.
        fresh = memory.shm_empty((bell.HEADER + 2 * CAPACITY,), torch.uint8)
        pages.append(fresh)
        req.page.CopyFrom(memory.export_handle(fresh.tensor))
        svc.AttachDoorbell(req, context)
        assert svc.doorbell is not None and svc.doorbell.is_alive()
    finally:
        if svc.doorbell is not None:
            svc.doorbell.stop()
        for p in pages:
            p.close()


def test_a_swapped_wake_fifo_still_releases_the_queued_step_and_the_page(tmp_path):
    """The wake FIFO lives in the socket folder (mode 0770: the engine's group may write it). Its path
    replaced by a directory (a buggy engine-side process, a cleanup script), Waker.close's unlink raised
    IsADirectoryError and Doorbell._release stopped before the pre-launch was dropped and the page closed:
    the queued GPU wait was never released by this doorbell, and on_close (MemoryBindings.release_page)
    never ran. Found by helper 72's review."""
    closed = []
    page = _Page()
    db = Doorbell(page, CAPACITY, _Loop(), torch.device("cpu"), b"", wake_path=str(tmp_path / "rank0.wake1"),
                  on_close=lambda: closed.append(True))
    pl = db.prelaunch = _Prelaunch()
    db.start()
    time.sleep(0.1)
    os.unlink(db.waker.path)
    os.mkdir(db.waker.path)  # the folder is group-writable: the path now names a directory
    db.stop()
    assert not db.is_alive()
    assert pl.closed, "the queued step's wait was never released (GPU stream stays blocked)"
    assert page.closed and closed, "the page was never closed / release_page never ran"


class _LargeAnswerLoop(_Loop):
    """A step whose inline answer does not fit the page's response area."""

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        from dspark_sidecar.proto import sidecar_pb2 as pb

        return pb.DraftStepResponse(step_id=req.step_id, hidden_states=pb.TensorRef(data=b"x" * (2 * CAPACITY)))


def test_an_answer_too_large_for_the_page_still_carries_the_doorbell_timings():
    """sidecar.proto StepTimings: over the doorbell a failed step's answer carries seen_mono_ns and
    published_mono_ns. The RESPONSE_TOO_LARGE answer was built afresh after they were set, so it
    carried neither, and the engine could not place that step's time."""
    from dspark_sidecar.proto import sidecar_pb2 as pb

    db = Doorbell(_Page(), CAPACITY, _LargeAnswerLoop(), torch.device("cpu"), b"")
    db.start()
    try:
        db.page.write(db.page.req_area, pb.DraftStepRequest(step_id=9).SerializeToString(), bell.REQ_LEN,
                      bell.REQ_SEQ, 1)
        wait_until(lambda: db.page.word(bell.RESP_SEQ) == 1, 10, "the step answered", watch=db, interval_s=0.005)
        resp = pb.DraftStepResponse.FromString(db.page.read(db.page.resp_area, bell.RESP_LEN))
    finally:
        db.stop()
    assert resp.step_id == 9 and resp.error.reason == "RESPONSE_TOO_LARGE"
    assert 0 < resp.timings.seen_mono_ns <= resp.timings.published_mono_ns


class _SizedAnswerLoop(_Loop):
    """A step whose answer, with the timings the doorbell adds, is `CAPACITY + over` bytes."""

    def __init__(self, over: int) -> None:
        self.over = over

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        from dspark_sidecar.proto import sidecar_pb2 as pb

        def sized(n: int) -> pb.DraftStepResponse:
            return pb.DraftStepResponse(step_id=req.step_id, hidden_states=pb.TensorRef(data=b"x" * n))

        now = time.monotonic_ns()  # the timings' varints: as long as the doorbell's, set around this step
        probe = sized(0)
        probe.timings.seen_mono_ns = probe.timings.published_mono_ns = now
        n = CAPACITY + self.over - probe.ByteSize()
        while True:  # the data's length prefix grows with it
            probe = sized(n)
            probe.timings.seen_mono_ns = probe.timings.published_mono_ns = now
            if probe.ByteSize() <= CAPACITY + self.over:
                break
            n -= 1
        assert probe.ByteSize() == CAPACITY + self.over
        return sized(n)


@pytest.mark.parametrize("over", [0, 1, 20])
def test_an_answer_that_fills_the_response_area_is_published_and_one_byte_more_is_response_too_large(over):
    """The bound is the area itself: an answer of exactly `capacity` bytes goes out as it is; past it, by one
    byte or a few, the answer is RESPONSE_TOO_LARGE (register an output region), never an INTERNAL error from
    the page's own refusal of the write."""
    from dspark_sidecar.proto import sidecar_pb2 as pb

    db = Doorbell(_Page(), CAPACITY, _SizedAnswerLoop(over), torch.device("cpu"), b"")
    db.start()
    try:
        db.page.write(db.page.req_area, pb.DraftStepRequest(step_id=9).SerializeToString(), bell.REQ_LEN,
                      bell.REQ_SEQ, 1)
        wait_until(lambda: db.page.word(bell.RESP_SEQ) == 1, 10, "the step answered", watch=db, interval_s=0.005)
        length = db.page.word(bell.RESP_LEN)
        resp = pb.DraftStepResponse.FromString(db.page.read(db.page.resp_area, bell.RESP_LEN))
    finally:
        db.stop()
    assert resp.step_id == 9
    if over == 0:
        assert not resp.HasField("error") and length == CAPACITY, (length, resp.error)
    else:
        assert resp.error.reason == "RESPONSE_TOO_LARGE", resp.error


class _SweepingLoop(_Loop):
    """A TP 1 rank's loop: a step answers, and what after_device runs fails as RankLoop._sweep lets it
    (logged, its memory left mapped)."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.ctx = SimpleNamespace(world=1)

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        from dspark_sidecar.proto import sidecar_pb2 as pb

        return pb.DraftStepResponse(step_id=req.step_id)

    def after_device(self, fn, wait=None) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001  (as RankLoop._sweep)
            doorbell_mod.log.exception("deferred release failed; its memory stays mapped")


class _FailingQueuePrelaunch(_QueueingPrelaunch):
    def after(self, seq, resp) -> None:
        raise RuntimeError("injected: queueing the next step failed")

    def detach(self):
        def finish() -> None:
            raise RuntimeError("injected: unregistering the header failed")

        return finish


def test_a_page_whose_registration_outlived_a_dropped_prelaunch_stays_mapped_when_the_doorbell_stops():
    """A failed queueing drops the pre-launch while the doorbell serves on; when its finish could not end
    the page's registrations, the page was unmapped at the doorbell's stop all the same (only a stop's own
    drop kept it, _KEPT), under a registration the driver may still use."""
    page = _Page()
    db = Doorbell(page, CAPACITY, _SweepingLoop(), torch.device("cpu"), b"")
    db.prelaunch = _FailingQueuePrelaunch()
    db.start()
    try:
        db.page.write(db.page.req_area, b"", bell.REQ_LEN, bell.REQ_SEQ, 1)
        wait_until(lambda: db.prelaunch is None and db.page.word(bell.RESP_SEQ) == 1, 10,
                   lambda: f"the step answered, the pre-launch dropped: prelaunch {db.prelaunch}, "
                           f"RESP_SEQ {db.page.word(bell.RESP_SEQ)}", watch=db, interval_s=0.005)
    finally:
        db.stop()
    assert int(page.storage[8 * bell.CLOSED : 8 * bell.CLOSED + 8].view(torch.int64)) == 1
    assert not page.closed and db.memory in doorbell_mod._KEPT
    doorbell_mod._KEPT.remove(db.memory)


@pytest.mark.parametrize("world", [1, 2])
def test_a_failed_queueing_exits_the_rank_at_tp_above_1_and_drops_the_prelaunch_at_tp_1(monkeypatch, world):
    """Every peer queued the next step (the verdict's QUEUE_NEXT): a rank that could not would pair their queued
    collectives with its next ordinary step, so at TP > 1 the rank exits (3) once the step is answered, as after
    a failed launch. At TP 1 there is no peer: steps go on the ordinary way, the pre-launch dropped."""
    exits: list[int] = []
    monkeypatch.setattr(doorbell_mod.os, "_exit", exits.append)  # recorded: the rank would end here
    loop = _SweepingLoop()
    loop.ctx.world = world

    class Failing(_QueueingPrelaunch):
        def after(self, seq, resp) -> None:
            raise RuntimeError("injected: queueing the next step failed")

    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"")
    pl = db.prelaunch = Failing()
    db.start()
    try:
        db.page.write(db.page.req_area, b"", bell.REQ_LEN, bell.REQ_SEQ, 1)
        wait_until(lambda: exits or db.prelaunch is None, 10, "the failed queueing handled", watch=db)
        assert db.page.word(bell.RESP_SEQ) == 1  # answered first
    finally:
        db.stop()
    assert exits == ([3] if world > 1 else []) and pl.closed


class _CountingLoop(_Loop):
    """Answers every step it is given, and counts them."""

    def __init__(self) -> None:
        self.served: list[int] = []

    def answer_now(self, req, hook=None, answer_limit=0, seen_ns=0):
        from dspark_sidecar.proto import sidecar_pb2 as pb

        self.served.append(req.step_id)
        return pb.DraftStepResponse(step_id=req.step_id)


def test_a_garbled_ring_is_answered_invalid_argument_naming_the_request_and_the_thread_serves_on():
    """Bytes that do not decode, or a length past the request area, are the engine's fault: INVALID_ARGUMENT
    naming the request (the shim drops the link and re-reads the limits), not INTERNAL, and never a step run.
    The next ring is served as usual."""
    from dspark_sidecar.proto import sidecar_pb2 as pb

    loop = _CountingLoop()
    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"")
    db.start()
    answers = []
    try:
        for seq, data, length in ((1, b"\xff" * 16, None), (2, b"", (1 << 64) - 1),
                                  (3, pb.DraftStepRequest(step_id=9).SerializeToString(), None)):
            db.page.write(db.page.req_area, data, bell.REQ_LEN, bell.REQ_SEQ, seq)
            if length is not None:  # after the ring: the length word as a broken engine leaves it
                db.page.words[bell.REQ_LEN] = length
            wait_until(lambda: db.page.word(bell.RESP_SEQ) == seq, 10, lambda: f"ring {seq} answered", watch=db)
            answers.append(pb.DraftStepResponse.FromString(db.page.read(db.page.resp_area, bell.RESP_LEN)))
        assert db.is_alive()
    finally:
        db.stop()
    for resp in answers[:2]:
        assert (resp.error.code, resp.error.field, resp.error.reason) == (3, "request", "INVALID_FIELD"), resp
        assert resp.error.message.startswith("request: unreadable: ")
    assert "exceeds the doorbell's 4096-byte area" in answers[1].error.message
    assert answers[2].step_id == 9 and not answers[2].HasField("error") and loop.served == [9]


class _SettlingPrelaunch(_QueueingPrelaunch):
    """Records, at each settle(), the response sequence the engine could read then."""

    def __init__(self, page) -> None:
        super().__init__()
        self.page = page

    def settle(self) -> None:
        self.events.append(("settle", self.page.word(bell.RESP_SEQ)))


def test_what_a_step_left_queued_is_settled_before_its_answer_is_published():
    """Prelaunch.settle releases a queued step the ring did not take. After the answer the engine's stream
    may already write the next step's word, which the release's store would lower: it runs before the
    answer is out, while the engine still reads the previous sequence."""
    db = Doorbell(_Page(), CAPACITY, _CountingLoop(), torch.device("cpu"), b"")
    pl = db.prelaunch = _SettlingPrelaunch(db.page)
    db.start()
    try:
        db.page.write(db.page.req_area, b"", bell.REQ_LEN, bell.REQ_SEQ, 1)
        wait_until(lambda: "queued after 1" in pl.events, 10, lambda: f"step 1 answered: {pl.events}", watch=db)
    finally:
        db.stop()
    assert pl.events[:2] == [("settle", 0), "queued after 1"], pl.events


def test_a_wake_fifo_that_fails_to_close_still_closes_the_page_and_releases_the_prelaunch():
    """_release closes the FIFO first; whatever that raises, the queued step's wait is released and the
    page is closed (its CLOSED word tells a waiting engine to attach again), and the error is not lost."""
    from types import SimpleNamespace

    closed = []
    page = _Page()
    db = Doorbell(page, CAPACITY, _Loop(), torch.device("cpu"), b"", on_close=lambda: closed.append(True))
    pl = db.prelaunch = _Prelaunch()

    def failing_close() -> None:
        raise OSError(5, "injected: closing the wake FIFO failed")

    db.waker = SimpleNamespace(close=failing_close, path="")
    with pytest.raises(OSError, match="injected"):
        db.stop()  # never started: released on this thread
    assert pl.closed and page.closed and closed
    assert int(page.storage[8 * bell.CLOSED : 8 * bell.CLOSED + 8].view(torch.int64)) == 1


def test_a_ring_that_waits_for_the_loop_s_lock_counts_that_wait_against_its_deadline():
    """deadline_ms runs from the step's receipt, the ring seen (sidecar.proto): a step queued behind a stall must
    never launch after its engine gave up and ran its own layers. The doorbell takes the loop's lock before the step
    (one hold from the step through the queueing of the next), and answer_now measured the deadline from its own
    start, after that wait: a ring held up behind a gRPC step or a BindKV for longer than its deadline was posted
    as fresh, and launched late."""
    from types import SimpleNamespace

    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.server.metrics import Metrics
    from dspark_sidecar.server.rank import RankContext, RankLoop
    from helpers.rank_fakes import RefusingRendezvous

    rdv = RefusingRendezvous()
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    loop = RankLoop(RankContext(0, 2, SimpleNamespace(), model, None, None, Metrics(0), 8), rdv, None)
    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"")
    held, deadline_ms = 0.2, 50
    db.start()
    try:
        with loop.exclusive():  # another section (a BindKV, a gRPC step) holds the rank: the ring waits
            # Refused on the host (num_requests 0), its copy posted all the same: the post is what the coordinator
            # judges the deadline by.
            db.page.write(db.page.req_area, pb.DraftStepRequest(step_id=1, num_requests=0, deadline_ms=deadline_ms)
                          .SerializeToString(), bell.REQ_LEN, bell.REQ_SEQ, 1)
            wait_until(lambda: db._seen_ns, 10, "the ring seen", watch=db, interval_s=0.005)
            time.sleep(held)  # the stall the ring waits out, longer than its deadline
        wait_until(lambda: db.page.word(bell.RESP_SEQ) == 1, 10, "the step answered", watch=db, interval_s=0.005)
        resp = pb.DraftStepResponse.FromString(db.page.read(db.page.resp_area, bell.RESP_LEN))
    finally:
        db.stop()
        loop.close()
    (post,) = rdv.posts
    assert post.expires_ns == resp.timings.seen_mono_ns + deadline_ms * 1_000_000, (
        f"posted expiry {(post.expires_ns - resp.timings.seen_mono_ns) / 1e6:.1f} ms after the ring, not {deadline_ms}")


def test_any_change_of_the_request_sequence_is_a_ring_a_lower_number_too():
    """sidecar.proto: each side reads nothing before it sees the sequence change, and the engine's shim numbers
    its steps from the page's word as it finds it (client/dataplane.py): a ring is a sequence word other than the
    last one served, never only a higher one (a number below it went unanswered, its engine waiting out its
    deadline on every such step)."""
    from dspark_sidecar.proto import sidecar_pb2 as pb

    loop = _CountingLoop()
    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"")
    db.start()
    try:
        for step_id, seq in ((1, 5), (2, 3)):
            db.page.write(db.page.req_area, pb.DraftStepRequest(step_id=step_id).SerializeToString(), bell.REQ_LEN,
                          bell.REQ_SEQ, seq)
            wait_until(lambda: db.page.word(bell.RESP_SEQ) == seq, 10, lambda: f"ring {seq} answered", watch=db)
    finally:
        db.stop()
    assert loop.served == [1, 2]


def test_an_idle_doorbell_with_a_wake_fifo_sleeps_on_it_with_the_page_s_asleep_word_set(tmp_path):
    """AttachDoorbellResponse.wake_fifo: after a few milliseconds without steps the thread stops polling and
    blocks on the FIFO, with word [4] set, which tells the engine to write a wake byte after its ring; a ring
    then wakes it and is answered, and the word is clear while the thread is awake."""
    from dspark_sidecar.proto import sidecar_pb2 as pb

    loop = _CountingLoop()
    db = Doorbell(_Page(), CAPACITY, loop, torch.device("cpu"), b"", wake_path=str(tmp_path / "rank0.wake1"))
    db.start()
    idle_since = time.perf_counter()
    try:
        # Past DOZE_S of idleness (10 times it): asleep then, not only in the thread's first few milliseconds.
        wait_until(lambda: time.perf_counter() - idle_since > 10 * bell.DOZE_S and db.page.word(bell.ASLEEP) == 1,
                   10, "the idle doorbell asleep on its FIFO", watch=db, interval_s=0.0005)
        ringer = bell.Ringer(db.wake_fifo)
        try:
            db.page.write(db.page.req_area, pb.DraftStepRequest(step_id=7).SerializeToString(), bell.REQ_LEN,
                          bell.REQ_SEQ, 1)
            ringer.wake_if_asleep(db.page)
        finally:
            ringer.close()
        wait_until(lambda: db.page.word(bell.RESP_SEQ) == 1, 10, "the ring answered", watch=db)
    finally:
        db.stop()
    assert loop.served == [7]
