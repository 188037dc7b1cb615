"""DoorbellChannel on a CPU page, stubs and CUDA stood in for: the ring, late answers, the wake FIFO, close."""

from __future__ import annotations

import contextlib
import gc
from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.client import dataplane
from dspark_sidecar.client.dataplane import DataPlaneError, DoorbellChannel, DoorbellClosed
from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_fakes import FakeIpcEvent

CAP = 4096


class _Stub:
    def __init__(self, resp: pb.AttachDoorbellResponse | None = None) -> None:
        self.resp = resp or pb.AttachDoorbellResponse()

    def AttachDoorbell(self, req, timeout=None):  # noqa: N802  (the gRPC method's name)
        assert timeout is not None
        return self.resp


@pytest.fixture
def channel():
    ch = DoorbellChannel(_Stub(), torch.device("cpu"), capacity=CAP, gpu_word=False)
    yield ch
    ch.close()


def _answer(ch: DoorbellChannel, step_id: int) -> None:
    """The sidecar's part: answer the step rung last."""
    ch.page.write(ch.page.resp_area, pb.DraftStepResponse(step_id=step_id).SerializeToString(), bell.RESP_LEN,
                  bell.RESP_SEQ, ch.page.word(bell.REQ_SEQ))


def test_a_request_filling_the_doorbell_s_area_exactly_is_rung_and_a_byte_more_is_refused(channel):
    channel.send_bytes(b"\x08\x01" + b"\x00" * (CAP - 2), 1)
    assert channel.page.word(bell.REQ_SEQ) == 1 and channel.page.word(bell.REQ_LEN) == CAP
    with pytest.raises(DataPlaneError, match=f"exceeds the doorbell \\({CAP}\\)"):
        channel.send_bytes(b"\x00" * (CAP + 1), 1)
    assert channel.page.word(bell.REQ_SEQ) == 1  # not rung


def test_a_late_answer_settles_the_step_and_orders_the_engine_s_stream_after_it(channel):
    """settled() after a wait that gave up: once the answer is there, the step was launched and its kernels may
    still read the input rows and write K/V; the engine's stream must wait for its "outputs written" event, as
    wait() would."""
    ordered = []
    channel._after_outputs = lambda: ordered.append(channel.page.word(bell.RESP_SEQ))  # the event wait, recorded
    channel.send(pb.DraftStepRequest(step_id=5))
    assert channel.rung_mono_ns > 0
    assert channel.wait(5, 0.01) is None
    assert not channel.settled(5) and ordered == []
    _answer(channel, 5)
    assert channel.settled(5) and ordered == [1] and channel.alive
    channel.send(pb.DraftStepRequest(step_id=6))
    _answer(channel, 6)
    assert channel.wait(6, 1.0).step_id == 6 and ordered == [1, 2]
    assert channel.answer_seen_mono_ns >= channel.rung_mono_ns  # bench.py's phases read the two


def test_an_answer_under_another_number_than_the_step_s_is_neither_its_answer_nor_its_settling(channel):
    """Only the number rung last is this step's: an answer published under the step before's (a late one) or a later
    one (a sidecar whose sequence jumped ahead, FAILURE_MODES "Known limits") is not returned by wait() and does not
    settle the step (its kernels may still run); the step's own answer then is both."""
    channel.send(pb.DraftStepRequest(step_id=1))
    _answer(channel, 1)
    assert channel.wait(1, 1.0).step_id == 1
    channel.send(pb.DraftStepRequest(step_id=2))
    for seq in (1, 3):
        channel.page.write(channel.page.resp_area, pb.DraftStepResponse(step_id=2).SerializeToString(), bell.RESP_LEN,
                           bell.RESP_SEQ, seq)
        assert channel.wait(2, 0.01) is None and not channel.settled(2), seq
    _answer(channel, 2)
    assert channel.settled(2) and channel.wait(2, 1.0).step_id == 2 and channel.alive


def test_a_doorbell_the_sidecar_closed_without_an_answer_is_dead_and_its_step_settled(channel):
    """The CLOSED word with no answer (another AttachDoorbell replaced this one, or the rank stops): the wait ends
    with DoorbellClosed, the channel is no longer alive (the shim rings it no more: its steps go over the gRPC
    stream until it attaches again) and the step is settled (nothing of it runs there any more)."""
    channel.send(pb.DraftStepRequest(step_id=3))
    channel.page.words[bell.CLOSED] = 1
    with pytest.raises(DoorbellClosed, match="without answering step 3"):
        channel.wait(3, 5.0)
    assert not channel.alive and channel.closed_by_sidecar and channel.settled(3)


def test_a_step_answered_before_the_sidecar_closed_the_page_is_that_answer_not_a_closed_doorbell(channel):
    """The sidecar stores CLOSED after any answer: a page closed right after the step's answer holds both. The answer
    is the step's (its hidden states are in the output region) and the engine's stream must wait for its "outputs
    written" event; taken as DoorbellClosed ("nothing of the step runs there any more") the engine would drop a good
    answer and skip that wait, while the launched step's kernels may still run."""
    ordered = []
    channel._after_outputs = lambda: ordered.append(channel.page.word(bell.RESP_SEQ))  # the event wait, recorded
    channel.send(pb.DraftStepRequest(step_id=7))
    _answer(channel, 7)
    channel.page.words[bell.CLOSED] = 1
    assert channel.wait(7, 1.0).step_id == 7 and ordered == [1]
    assert channel.closed_by_sidecar  # the next step attaches again


def test_a_closed_doorbell_holds_no_mapping_of_its_page():
    """close() releases the page's views with its segment: the views (header words, request and response areas)
    hold the mapping, which would stay as long as the closed channel did, and a write through them after close()
    would land in it instead of raising."""
    ch = DoorbellChannel(_Stub(), torch.device("cpu"), capacity=CAP, gpu_word=False)
    name = ch._page.segment.name
    ch.send(pb.DraftStepRequest(step_id=1))
    ch.close()
    with open("/proc/self/maps") as maps:
        assert name not in maps.read(), "the closed doorbell's page is still mapped"
    assert not ch.alive and ch.page.words is None
    assert not ch.closed_by_sidecar  # closed here, not by the sidecar: read as such, not a TypeError


def test_a_step_a_later_look_finds_closed_without_its_answer_leaves_the_doorbell_dead(channel):
    """settled(), not only wait(): a step that timed out and is then found on a page the sidecar closed without
    answering it is settled, and the channel is no longer alive (nothing serves the page: the shim's next step must
    not ring it)."""
    channel.send(pb.DraftStepRequest(step_id=4))
    assert channel.wait(4, 0.01) is None
    channel.page.words[bell.CLOSED] = 1
    assert channel.settled(4) and not channel.alive


def _stood_in_ops(monkeypatch, current: list[int]):
    """The GPU word's driver ops on a CPU box: writes and records are recorded with the raw stream they were queued
    on, which `current[0]` names (dataplane._raw_stream)."""
    class Ops:
        def __init__(self) -> None:
            self.queued: list[tuple[str, int]] = []

        def write(self, raw, address, value):
            self.queued.append(("word", raw))

        def record(self, event, raw):
            self.queued.append(("event", raw))

    ops = Ops()
    _cuda_stood_in(monkeypatch, [])
    monkeypatch.setattr(dataplane.GpuWordOps, "load", classmethod(lambda cls, d: ops))
    monkeypatch.setattr(dataplane, "_raw_stream", lambda device: current[0])
    return ops


def test_each_stream_a_step_is_rung_from_is_one_close_waits_for(monkeypatch):
    """send_bytes notes the stream each step's GPU word is queued on, whenever it is another than the last one's:
    close() must not unmap the page under a write still queued there. Were it noted only at the first ring, a
    step rung from a second stream (an engine staging from two) would leave close() waiting on the first alone."""
    current = [0xA]
    ops = _stood_in_ops(monkeypatch, current)
    ch = DoorbellChannel(_Stub(pb.AttachDoorbellResponse(gpu_word=True, output_event=b"e" * 64)),
                         torch.device("cuda", 0))
    try:
        for raw in (0xA, 0xB, 0xB, 0xA):
            current[0] = raw
            ch.send_bytes(b"\x08\x01", 1)
        assert ch._sent_on == [0xB, 0xA]
        assert [raw for what, raw in ops.queued if what == "word"] == [0xA, 0xB, 0xB, 0xA]
    finally:
        ch._stream_passed = lambda timeout_s: True  # CUDA's streams are not there to wait on
        ch.close()


def test_a_step_staged_from_another_stream_waits_for_the_last_answer_and_its_reader(monkeypatch):
    """order_inputs, before the next step's inputs are copied in: from the stream the last answer was waited on,
    nothing to do; from another, that stream waits for the sidecar's "outputs written" event and for the work
    queued on the waiting stream (the engine's copy of the answer). Skipped, the next step's copies would
    overwrite rows the last step's kernels still read, and its answer could land before the engine had copied the
    last one out (helper 80's hazard 2)."""
    current = [0xA]
    monkeypatch.setattr(dataplane, "_raw_stream", lambda device: current[0])
    ch = DoorbellChannel(_Stub(), torch.device("cpu"), capacity=CAP, gpu_word=False)
    try:
        ordered: list = []
        ch._after_outputs = lambda: ordered.append("outputs")
        ch._after_stream = lambda raw: ordered.append(raw)
        ch.order_inputs()
        assert ordered == []  # no answer waited on yet
        ch._ordered_on = 0xA  # where wait() ordered the engine after the last answer
        ch.order_inputs()
        assert ordered == []  # the same stream: ordered already
        current[0] = 0xB
        ch.order_inputs()
        assert ordered == ["outputs", 0xA]
    finally:
        ch.close()


def test_waiting_for_a_stream_that_never_passes_ends_at_its_bound_not_later(monkeypatch):
    """The bound itself, on a clock of the test's own (no wall-clock timing): _stream_passed gives up once its
    timeout has passed, within one poll of it. CUDA's events stood in for: never complete."""
    class Event:
        def record(self, stream=None):
            pass

        def query(self):
            return False

    now = [100.0]

    def sleep(s):
        now[0] += s

    monkeypatch.setattr(dataplane.torch.cuda, "Event", Event)
    monkeypatch.setattr(dataplane.torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(dataplane, "time", SimpleNamespace(monotonic=lambda: now[0], sleep=sleep))
    probe = DoorbellChannel.__new__(DoorbellChannel)
    probe.device, probe._sent_on = torch.device("cuda", 0), []
    assert not probe._stream_passed(2.0)
    assert 102.0 <= now[0] <= 102.01, now[0]


def test_a_wake_that_cannot_be_written_still_leaves_the_step_rung(channel, caplog):
    """The sidecar's FIFO refusing the wake byte: the ring is already in the page, so the step is in flight and its
    wait must run. Raised out of the send, the shim took the step for never sent (not unsettled)."""
    class Ringer:
        def wake_if_asleep(self, page):
            raise OSError(5, "Input/output error")

        def close(self):
            pass

    channel.ringer = Ringer()
    with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
        channel.send(pb.DraftStepRequest(step_id=1))
    assert channel.page.word(bell.REQ_SEQ) == 1 and "could not wake the sidecar's doorbell thread" in caplog.text
    _answer(channel, 1)
    assert channel.wait(1, 1.0).step_id == 1


def test_a_wake_fifo_this_process_cannot_open_leaves_the_channel_polled_not_refused():
    """A NUL byte in the answered path is a ValueError, not an OSError: it escaped after the attach succeeded and
    left the page and its registration to the process's exit."""
    ch = DoorbellChannel(_Stub(pb.AttachDoorbellResponse(wake_fifo="/tmp/no\0fifo")), torch.device("cpu"),
                         capacity=CAP, gpu_word=False)
    try:
        assert ch.alive and ch.ringer is None
    finally:
        ch.close()


def test_waiting_for_a_stream_that_never_passes_gives_up_at_the_bound(monkeypatch):
    """close()'s wait for the engine's stream (which may wait on a wedged sidecar's event) must end: False, and
    the page is kept, rather than a close() that never returns. CUDA's events stood in for: never complete."""
    class Event:
        def record(self, stream=None):
            pass

        def query(self):
            return False

    monkeypatch.setattr(dataplane.torch.cuda, "Event", Event)
    monkeypatch.setattr(dataplane.torch.cuda, "current_stream", lambda device=None: "stream")
    probe = DoorbellChannel.__new__(DoorbellChannel)
    probe.device, probe._sent_on = torch.device("cuda", 0), []
    assert not probe._stream_passed(0.05)


def _cuda_stood_in(monkeypatch, unregistered: list) -> None:
    """CUDA's events, device and streams, the GPU word's ops and the page's registration stood in for on a CPU box."""
    class Header:
        def __init__(self, ops, ptr):
            self.device_ptr = 0x7000

        def close(self):
            unregistered.append(True)

    monkeypatch.setattr(dataplane.torch.cuda, "Event", FakeIpcEvent)
    monkeypatch.setattr(dataplane.torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(dataplane.torch.cuda, "current_stream", lambda device=None: "stream")
    monkeypatch.setattr(dataplane.GpuWordOps, "load", classmethod(lambda cls, d: object()))
    monkeypatch.setattr(dataplane, "RegisteredPage", Header)


def test_an_attach_refused_after_the_gpu_word_was_registered_is_the_refusal_and_frees_the_page(monkeypatch):
    """AttachDoorbell refused (an older sidecar's UNIMPLEMENTED, a busy one's DEADLINE_EXCEEDED) after the page
    was registered for the GPU word: close() read the stream list __init__ made only after the try, so an
    AttributeError replaced the refusal. The shim, which turns a refused attach into its gRPC stream, then
    never fell back, and each retry left a page and its registration behind (helper 80). CUDA stood in for."""
    import grpc

    from helpers.engine_fakes import recording_shm

    class Unimplemented(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNIMPLEMENTED

    class Stub:
        def AttachDoorbell(self, req, timeout=None):
            assert req.gpu_word  # the page was registered first
            raise Unimplemented()

    unregistered: list = []
    _cuda_stood_in(monkeypatch, unregistered)
    with recording_shm() as shm, pytest.raises(Unimplemented):
        DoorbellChannel(Stub(), torch.device("cuda", 0))
    assert unregistered == [True], "the page's GPU registration was not ended"
    assert shm.created and shm.left() == set()


@pytest.mark.parametrize("accepted", [True, False], ids=["pre-launching", "declined"])
def test_the_gpu_word_is_written_only_where_the_sidecar_pre_launches(monkeypatch, accepted):
    """sidecar.proto AttachDoorbellResponse.gpu_word: False, "the engine writes nothing" (an older sidecar, one
    started with --no-prelaunch); the page is registered all the same when offered, and unregistered at close."""
    unregistered: list = []
    _cuda_stood_in(monkeypatch, unregistered)
    ch = DoorbellChannel(_Stub(pb.AttachDoorbellResponse(gpu_word=accepted, output_event=b"e" * 64)),
                         torch.device("cuda", 0))
    try:
        assert ch.copies_raw
        assert ch.word_address == (0x7000 + bell.GPU_WORD_OFFSET if accepted else 0)
    finally:
        ch.close()
    assert unregistered == [True]


@pytest.mark.parametrize("why", ["stream not passed", "unregister refused"])
def test_a_page_kept_for_its_gpu_registration_stays_mapped_once_the_channel_is_dropped(monkeypatch, why):
    """close() keeps the page mapped while its GPU registration lives: the engine's stream has not passed a queued
    write of its word within CLOSE_WAIT_S (a wedged sidecar's event), or the driver refused the unregistration. It
    kept it on the channel itself, which the shim drops right after close (_drop_link): collected, the page was
    unmapped under the live registration ("stays mapped until the process exits", the warning said), whose range a
    later page mapped at that address then meets. CUDA stood in for."""
    closed = []

    class Header:
        def close(self):
            closed.append(True)
            if why == "unregister refused":
                raise dataplane.GpuWordError("cuMemHostUnregister: CUDA_ERROR_UNKNOWN (test)")

    ch = DoorbellChannel(_Stub(), torch.device("cpu"), capacity=CAP, gpu_word=False)
    name = ch._page.segment.name
    ch._header = Header()  # as registered for the GPU word
    monkeypatch.setattr(dataplane.torch.cuda, "device", lambda d: contextlib.nullcontext())
    ch._stream_passed = lambda timeout_s: why != "stream not passed"  # not monkeypatch: it would hold the channel
    raised = None
    try:
        ch.close()
    except dataplane.GpuWordError as err:
        raised = str(err)  # not the exception: its traceback would hold the channel
    assert (raised is not None, closed) == ((True, [True]) if why == "unregister refused" else (False, []))
    del ch
    gc.collect()
    with open("/proc/self/maps") as maps:
        assert name in maps.read(), "the page was unmapped while its GPU registration lived"
    dataplane._KEPT.pop()[2].close()  # the test's own: its segment goes now, not at exit


def test_a_channel_made_on_a_thread_whose_current_gpu_is_another_registers_its_word_and_event_on_its_own(monkeypatch):
    """A TP rank's channel on cuda:1 made from a thread whose current device is cuda:0 (connect() from another
    thread than the engine's, which set its device on its own): the page's registration went to the current context
    (GpuWordOps._bind refuses another GPU's: the GPU word was dropped without a word) and torch made the input event,
    lazily at ipc_handle(), on the current GPU, where recording it on the engine's stream at each send raised. Both
    are made under this channel's device now, and the caller's device is left as it was. CUDA stood in for: the
    thread's current device, torch's lazy event, the driver's refusal of another GPU's context."""
    current = [0]

    @contextlib.contextmanager
    def device(d):
        prev, current[0] = current[0], d.index
        try:
            yield
        finally:
            current[0] = prev

    class Event(FakeIpcEvent):
        made_on: list = []

        def __init__(self, *args, **kwargs) -> None:
            self.on = None

        def _made(self, index):
            if self.on is None:
                self.on = index
                Event.made_on.append(index)

        def ipc_handle(self) -> bytes:
            self._made(current[0])  # torch: created on the current device if no record made it yet
            return super().ipc_handle()

        def record(self, stream=None) -> None:
            self._made(current[0] if stream is None else stream)

    class Header:
        def __init__(self, ops, ptr):
            if current[0] != 1:
                raise dataplane.GpuWordError(f"this thread's CUDA context is device {current[0]}, not 1")
            self.device_ptr = 0x7000

        def close(self):
            pass

    monkeypatch.setattr(dataplane.torch.cuda, "Event", Event)
    monkeypatch.setattr(dataplane.torch.cuda, "device", device)
    monkeypatch.setattr(dataplane.torch.cuda, "current_stream", lambda device=None: device.index)
    monkeypatch.setattr(dataplane.GpuWordOps, "load", classmethod(lambda cls, d: object()))
    monkeypatch.setattr(dataplane, "RegisteredPage", Header)
    ch = DoorbellChannel(_Stub(pb.AttachDoorbellResponse(gpu_word=True, output_event=b"e" * 64)),
                         torch.device("cuda", 1))
    try:
        assert ch.copies_raw and ch.word_address == 0x7000 + bell.GPU_WORD_OFFSET, "the GPU word was dropped"
        assert ch.input_event.on == 1 and Event.made_on == [1, 1]  # the waited and the input event
        assert current == [0]  # the caller's device, as it was
    finally:
        ch._stream_passed = lambda timeout_s: True
        ch.close()


def test_a_page_the_driver_will_not_register_offers_no_gpu_word_and_says_so(monkeypatch, caplog):
    """The page's registration refused (GpuWordError): the channel works the ordinary way (torch's copies, no word
    written), tells the sidecar it writes no word, and the warning says the steps are not pre-launched (it said
    nothing: the GPU word was lost without a trace). CUDA stood in for."""
    sent = []

    class Stub(_Stub):
        def AttachDoorbell(self, req, timeout=None):  # noqa: N802
            sent.append(req)
            return super().AttachDoorbell(req, timeout)

    class Refused:
        def __init__(self, ops, ptr):
            raise dataplane.GpuWordError("cuMemHostRegister_v2 failed with driver code 201")

    _cuda_stood_in(monkeypatch, [])
    monkeypatch.setattr(dataplane, "RegisteredPage", Refused)
    with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
        ch = DoorbellChannel(Stub(pb.AttachDoorbellResponse(gpu_word=True, output_event=b"e" * 64)),
                             torch.device("cuda", 0))
    try:
        assert not ch.copies_raw and ch.word_address == 0 and not sent[0].gpu_word
        assert "driver code 201" in caplog.text and "not pre-launched" in caplog.text
    finally:
        ch.close()


def test_the_stream_an_answer_was_waited_on_is_the_one_a_step_from_another_stream_orders_after(monkeypatch):
    """wait() orders the current stream after the sidecar's "outputs written" event and remembers it: a step staged
    next from another stream then waits there for that event and for the stream that waited (order_inputs), and
    one staged from the same stream queues nothing more. Unremembered, order_inputs never saw another stream. CUDA
    stood in for: the driver's waits and records are recorded with the raw stream they were queued on."""
    current = [0xA]
    ops = _stood_in_ops(monkeypatch, current)
    ops.wait_event = lambda raw, event: ops.queued.append(("wait", raw))
    ch = DoorbellChannel(_Stub(pb.AttachDoorbellResponse(output_event=b"e" * 64)), torch.device("cuda", 0))
    try:
        ch.send(pb.DraftStepRequest(step_id=1))
        _answer(ch, 1)
        assert ch.wait(1, 1.0).step_id == 1
        assert ops.queued[-1] == ("wait", 0xA)  # the answer's outputs, on the waiting stream
        del ops.queued[:]
        ch.order_inputs()
        assert ops.queued == []  # the same stream: ordered already
        current[0] = 0xB
        ch.order_inputs()
        assert ops.queued == [("wait", 0xB), ("event", 0xA), ("wait", 0xB)]  # the outputs, then the waiting stream
    finally:
        ch._stream_passed = lambda timeout_s: True
        ch.close()


def test_the_gpu_word_carries_the_step_s_number_and_launch_key_ahead_of_its_input_event(monkeypatch):
    """sidecar.proto AttachDoorbellResponse.gpu_word: word 5 = seq << 32 | launch_key, written at the page's device
    address on the stream the step was staged from, before the "inputs written" event (the pre-launched step starts
    at the word; the event is for a step run the ordinary way). A word without the key, or another step's number,
    never starts the step the sidecar queued for this one. CUDA stood in for."""
    current = [0xA]
    ops = _stood_in_ops(monkeypatch, current)
    ops.write = lambda raw, address, value: ops.queued.append(("word", raw, address, value))
    ch = DoorbellChannel(_Stub(pb.AttachDoorbellResponse(gpu_word=True, output_event=b"e" * 64)),
                         torch.device("cuda", 0))
    try:
        ch.send_bytes(b"\x08\x01", 7)
        current[0] = 0xB
        ch.send_bytes(b"\x08\x02", 9)
        at = 0x7000 + bell.GPU_WORD_OFFSET
        assert ops.queued == [("word", 0xA, at, 1 << 32 | 7), ("event", 0xA), ("word", 0xB, at, 2 << 32 | 9),
                              ("event", 0xB)]
    finally:
        ch._stream_passed = lambda timeout_s: True
        ch.close()


def test_a_step_number_whose_gpu_word_may_be_queued_is_never_rung_again(monkeypatch):
    """send_bytes numbers a step before its driver calls, and a call that raises after the word's write (the input
    event's record) leaves the word (seq, key) queued on the engine's stream: the sidecar's pre-launched copy may run
    on it. Given back, the number would be rung again for the next step, under the same layout's key, and the
    sidecar would answer that step from the copy that ran the failed one's inputs (server/prelaunch.py offer: same
    seq, key and layout). The number stays used: the next step is the one after it, its word and the page say so,
    and its answer (the sidecar answers whatever number it finds rung) is taken. CUDA stood in for."""
    current = [0xA]
    ops = _stood_in_ops(monkeypatch, current)
    words: list[int] = []
    ops.write = lambda raw, address, value: words.append(value)
    ops.wait_event = lambda raw, event: None
    refuse = [True]

    def record(event, raw):
        if refuse:
            refuse.pop()
            raise dataplane.GpuWordError("cuEventRecord: CUDA_ERROR_UNKNOWN (test)")

    ops.record = record
    ch = DoorbellChannel(_Stub(pb.AttachDoorbellResponse(gpu_word=True, output_event=b"e" * 64)),
                         torch.device("cuda", 0))
    try:
        with pytest.raises(dataplane.GpuWordError):
            ch.send(pb.DraftStepRequest(step_id=1))
        assert ch.page.word(bell.REQ_SEQ) == 0  # not rung
        ch.send(pb.DraftStepRequest(step_id=2))
        assert words == [1 << 32, 2 << 32] and ch.page.word(bell.REQ_SEQ) == 2
        _answer(ch, 2)
        assert ch.wait(2, 1.0).step_id == 2
    finally:
        ch._stream_passed = lambda timeout_s: True
        ch.close()


def test_a_stream_that_waited_and_is_gone_since_costs_a_device_sync_not_an_unordered_step(monkeypatch, caplog):
    """order_inputs from another stream than the one the last answer was waited on, where that stream has been
    destroyed since (the driver refuses the record on it): its queued reads of the last answer may still run, so
    the device is synchronized before the next step's copies, not skipped. CUDA stood in for."""
    current = [0xA]
    ops = _stood_in_ops(monkeypatch, current)
    ops.wait_event = lambda raw, event: ops.queued.append(("wait", raw))
    synced: list = []
    monkeypatch.setattr(dataplane.torch.cuda, "synchronize", lambda device=None: synced.append(device))
    ch = DoorbellChannel(_Stub(pb.AttachDoorbellResponse(output_event=b"e" * 64)), torch.device("cuda", 0))
    try:
        ch.send(pb.DraftStepRequest(step_id=1))
        _answer(ch, 1)
        assert ch.wait(1, 1.0).step_id == 1 and synced == []

        def record(event, raw):
            raise RuntimeError("CUDA error: invalid resource handle (test)")

        ops.record = record
        current[0] = 0xB
        with caplog.at_level("INFO", logger="dspark_sidecar.client"):
            ch.order_inputs()
        assert synced == [torch.device("cuda", 0)] and "waiting for the device" in caplog.text
    finally:
        ch._stream_passed = lambda timeout_s: True
        ch.close()
