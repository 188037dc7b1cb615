"""SidecarConnection open/close and its StepStream: no half-open link or stale status left, waits within their deadline."""

from __future__ import annotations

import queue
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2

from dspark_sidecar.client.connection import SidecarConnection, StepInterrupted, StepStream, StreamBroken
from dspark_sidecar.proto import INSTANCE_METADATA
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from helpers.waiting import wait_until


class _Channel:
    """A channel whose GetStatus is interrupted (Ctrl-C, SystemExit) before the answer; records close()."""

    def __init__(self, raises: BaseException) -> None:
        self.raises, self.closed = raises, False

    def _call(self, *args, **kw):
        raise self.raises

    def unary_unary(self, *args, **kw):
        return self._call

    unary_stream = stream_unary = stream_stream = unary_unary

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("raises", [KeyboardInterrupt(), SystemExit(1)], ids=["ctrl_c", "exit"])
def test_an_open_interrupted_before_the_status_leaves_the_link_closed(raises):
    """Only grpc.RpcError closed the fresh channel: an interrupt in GetStatus left the stub set with no status,
    and the shim's next readiness check found the link open and went on with no StatusReport (its serving
    state, refusal and limits unread) over a channel nobody would close."""
    channels: list[_Channel] = []

    def factory(target: str, options: list) -> _Channel:
        channels.append(_Channel(raises))
        return channels[-1]

    conn = SidecarConnection("unix:/nonexistent", channel_factory=factory)  # type: ignore[arg-type]
    with pytest.raises(type(raises)):
        conn.open(1.0)
    assert not conn.is_open and conn.status is None
    assert channels[0].closed


class _Answering(_Channel):
    """A channel whose GetStatus answers."""

    def _call(self, *args, **kw):
        return pb.StatusReport(serving=True, state="SERVING")


def test_an_open_link_opened_again_closes_its_old_channel_and_close_forgets_the_status():
    """open() is "a fresh channel": the old one, and its stream's threads, must go, not wait for the collector.
    close() leaves no status behind: the shim reads the step's limits and compute dtype from it."""
    channels: list[_Channel] = []

    def factory(target: str, options: list) -> _Channel:
        channels.append(_Answering(None))  # type: ignore[arg-type]
        return channels[-1]

    conn = SidecarConnection("unix:/nonexistent", channel_factory=factory)  # type: ignore[arg-type]
    conn.open(1.0)
    conn.open(1.0)
    assert channels[0].closed and not channels[1].closed and conn.opens == 2
    conn.close()
    assert channels[1].closed and not conn.is_open and conn.status is None


class _Call:
    """A DraftSteps call whose answers the test feeds (None: the stream ends); cancel() ends it too."""

    def __init__(self) -> None:
        self.answers: queue.SimpleQueue = queue.SimpleQueue()
        self.cancelled = False

    def __iter__(self):
        while (resp := self.answers.get()) is not None:
            yield resp

    def cancel(self) -> None:
        self.cancelled = True
        self.answers.put(None)


class _Stub:
    def DraftSteps(self, requests):  # noqa: N802  (the gRPC method's name)
        self.requests, self.call = requests, _Call()
        return self.call


class _Streaming(_Answering):
    """A channel whose GetStatus answers (no instance: nothing to confirm) and whose DraftSteps calls are _Calls."""

    def __init__(self) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self.calls: list[tuple] = []

    def stream_stream(self, *args, **kw):
        def call(requests, *a, **k):
            self.calls.append((requests, _Call()))
            return self.calls[-1][1]
        return call


def _next_within(requests, timeout_s: float) -> list:
    """[next(requests, None)], or [] when the request iterator still waits after timeout_s: read on a daemon thread,
    so that an iterator left waiting fails the test instead of hanging the session."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(next(requests, None)), daemon=True)
    t.start()
    t.join(timeout_s)
    return got


@pytest.mark.parametrize("again", [False, True], ids=["closed", "opened_again"])
def test_a_link_closed_or_opened_again_ends_its_step_stream(again):
    """close() (and open(), which starts from a closed link) ends the step stream too: its call cancelled, and its
    request iterator ended, in which gRPC's sending thread otherwise waits for ever (one thread per reconnect).
    The link opened again opens its own stream on its new channel: the old one ended with the old channel."""
    channels: list[_Streaming] = []

    def factory(target: str, options: list) -> _Streaming:
        channels.append(_Streaming())
        return channels[-1]

    conn = SidecarConnection("unix:/nonexistent", channel_factory=factory)  # type: ignore[arg-type]
    conn.open(1.0)
    stream = conn.stream()
    assert stream.alive and conn.stream() is stream
    conn.open(1.0) if again else conn.close()
    (requests, call), = channels[0].calls
    assert call.cancelled and _next_within(requests, 5) == [None], "the old link's step stream was left running"
    if not again:
        conn.open(1.0)
    fresh = conn.stream()
    assert fresh is not stream and len(channels[-1].calls) == 1, "the reopened link handed back the old stream"
    conn.close()


def test_a_step_stream_wait_gives_up_at_its_deadline():
    stream = StepStream(_Stub())  # type: ignore[arg-type]
    try:
        stream.send(pb.DraftStepRequest(step_id=1))
        t0 = time.monotonic()
        assert stream.wait(1, 0.5) is None
        # Bounds loose for a loaded CI host; a wait of three times its deadline (1.5 s) still fails.
        assert 0.45 <= time.monotonic() - t0 < 1.4, "the wait did not end at its deadline"
    finally:
        stream.close()


def test_a_step_left_unanswered_is_settled_once_the_stream_ends():
    """A sidecar process gone writes nothing more: its unanswered step is settled, else every later step
    fell back as unsettled and the link was never dropped and reopened."""
    stub = _Stub()
    stream = StepStream(stub)  # type: ignore[arg-type]
    stream.send(pb.DraftStepRequest(step_id=1))
    assert stream.wait(1, 0.01) is None and not stream.settled(1)
    stub.call.answers.put(None)  # the sidecar process ends
    wait_until(lambda: not stream.alive, 5, "the stream ended with the sidecar process", interval_s=0.005)
    assert stream.settled(1)
    stream.close()


def test_a_closed_step_stream_ends_its_request_iterator():
    """gRPC's thread that sends the requests waits in the iterator: close() must end it, or it waits for ever."""
    stub = _Stub()
    stream = StepStream(stub)  # type: ignore[arg-type]
    stream.close()
    ended: list[bool] = []
    t = threading.Thread(target=lambda: ended.append(next(stub.requests, None) is None), daemon=True)
    t.start()
    t.join(2)
    assert ended == [True], "the request iterator still waits after close()"


class _Sidecar(pb_grpc.DrafterSidecarServicer):
    """A sidecar rank whose GetStatus names `status_instance` and whose step stream says it was taken by
    `stream_instance` (None: says nothing until the first answer, as a server that never confirms), or refuses
    it with `refuse` (a status code). `stream_ended` is set once the server sees its last stream end."""

    def __init__(self, status_instance: str, stream_instance: str | None) -> None:
        self.status_instance, self.stream_instance = status_instance, stream_instance
        self.refuse: grpc.StatusCode | None = None
        self.stream_ended = threading.Event()

    def GetStatus(self, request, context):
        return pb.StatusReport(serving=True, state="SERVING", instance=self.status_instance)

    def DraftSteps(self, request_iterator, context):
        self.stream_ended.clear()
        context.add_callback(self.stream_ended.set)
        if self.refuse is not None:
            context.abort(self.refuse, "rank is still loading; retry when health is SERVING")
        if self.stream_instance is not None:
            context.send_initial_metadata(((INSTANCE_METADATA, self.stream_instance),))
        for req in request_iterator:
            yield pb.DraftStepResponse(step_id=req.step_id)


@pytest.fixture
def serve(tmp_path):
    servers = []

    def start(status_instance: str, stream_instance: str | None) -> tuple[str, _Sidecar]:
        sidecar = _Sidecar(status_instance, stream_instance)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_DrafterSidecarServicer_to_server(sidecar, server)
        target = f"unix:{tmp_path / f's{len(servers)}.sock'}"
        server.add_insecure_port(target)
        server.start()
        servers.append(server)
        return target, sidecar

    yield start
    for s in servers:
        s.stop(None)


@pytest.mark.parametrize("instance", ["a1", ""], ids=["confirmed", "server_without_instances"])
def test_a_step_stream_that_reached_the_status_s_server_serves(serve, instance):
    target, _ = serve(instance, instance)
    conn = SidecarConnection(target)
    try:
        conn.open(5.0)
        stream = conn.stream()
        assert stream.alive, stream.end
        stream.send(pb.DraftStepRequest(step_id=1))
        assert stream.wait(1, 5).step_id == 1
    finally:
        conn.close()


def test_a_step_stream_that_reached_a_restarted_sidecar_ends_before_any_step(serve):
    """The status was read from one server instance; the stream reached another (a sidecar restarted in between,
    to which gRPC carries a call that had not yet reached the old process). Served, its steps would run under the
    old process's status (limits, compute dtype) on a server that holds none of this link's bindings."""
    target, sidecar = serve("a1", "a1")
    conn = SidecarConnection(target)
    try:
        conn.open(20.0)
        sidecar.stream_instance = "b2"  # the restart, as the stream sees it
        t0 = time.monotonic()
        stream = conn.stream()
        # Known as soon as the metadata came: waiting out open()'s deadline held the engine's pre-flight that long.
        assert time.monotonic() - t0 < 10, "the ended stream was handed back only at open()'s deadline"
        assert not stream.alive and conn.stream_ended
        assert "reached sidecar instance b2, not a1" in str(stream.end), stream.end
        with pytest.raises(StreamBroken, match="restarted in between"):
            stream.send(pb.DraftStepRequest(step_id=1))
        # Ended on the server too, the link still open: left open, it held one of the new sidecar's few stream
        # places (and a handler thread) until the link dropped.
        wait_until(sidecar.stream_ended.is_set, 5, "the stream to the other instance was cancelled", interval_s=0.01)
    finally:
        conn.close()


def test_a_step_stream_the_sidecar_refuses_ends_at_once_with_the_sidecar_s_refusal(serve):
    """A sidecar restarted since the status was read refuses the stream while it loads (UNAVAILABLE: no instance
    sent). The stream ends at once with that refusal: not at open()'s deadline, nor as another instance's."""
    target, sidecar = serve("a1", "a1")
    conn = SidecarConnection(target)
    try:
        conn.open(20.0)
        sidecar.refuse = grpc.StatusCode.UNAVAILABLE
        t0 = time.monotonic()
        stream = conn.stream()
        assert time.monotonic() - t0 < 10, "the refused stream was handed back only at open()'s deadline"
        assert not stream.alive and stream.end.code == grpc.StatusCode.UNAVAILABLE, stream.end
        assert "still loading" in str(stream.end), stream.end
    finally:
        conn.close()


def test_a_step_stream_the_sidecar_does_not_take_in_time_ends_at_open_s_deadline(serve):
    target, _ = serve("a1", None)
    conn = SidecarConnection(target)
    try:
        conn.open(0.5)
        t0 = time.monotonic()
        stream = conn.stream()
        assert 0.45 <= time.monotonic() - t0 < 4, "not bounded by open()'s deadline"
        assert not stream.alive and "did not take the step stream within 0.5 s" in str(stream.end), stream.end
        # The reader then sees its call cancelled: that end must not replace the reason given (the fallback's log).
        wait_until(lambda: not stream._reader.is_alive(), 5, "the reader saw the cancel", interval_s=0.01)
        assert "did not take the step stream within 0.5 s" in str(stream.end), stream.end
    finally:
        conn.close()


def test_giving_up_a_stream_that_already_ended_keeps_the_reason_it_ended_for():
    """give_up() races the reader: a stream the sidecar refused just as open()'s deadline ran out has ended (its
    refusal read) before connection.stream() gives it up. The sidecar's own reason must stand, not be replaced by
    "did not take the step stream in time" (the fallback's log would name the wrong cause)."""
    stub = _Stub()
    stream = StepStream(stub)  # type: ignore[arg-type]
    try:
        stub.call.answers.put(None)  # the sidecar ends the stream
        wait_until(lambda: not stream.alive, 5, "the stream ended", interval_s=0.005)
        stream.give_up("the sidecar did not take the step stream within 1 s")
        assert "closed by the server" in str(stream.end), stream.end
        assert stub.call.cancelled and not stream.alive
    finally:
        stream.close()


def test_a_wait_in_progress_wakes_with_stream_broken_when_the_stream_ends():
    """The sidecar process gone while a step waits: the wait ends with StreamBroken at once (the shim drops the
    link and reconnects), not at the step's deadline with the step then taken as a timeout (a late grace more,
    the step unsettled, the breaker counting a DEADLINE)."""
    stub = _Stub()
    stream = StepStream(stub)  # type: ignore[arg-type]
    try:
        stream.send(pb.DraftStepRequest(step_id=1))
        threading.Timer(0.2, stub.call.answers.put, (None,)).start()  # the sidecar process ends mid-wait
        t0 = time.monotonic()
        with pytest.raises(StreamBroken, match="closed by the server"):
            stream.wait(1, 30)
        assert time.monotonic() - t0 < 15, "the wait ran to its deadline after the stream ended"
    finally:
        stream.close()


def test_a_late_answer_settles_its_step_and_is_not_kept_past_the_next_step():
    """A step past its deadline is settled by its own late answer (the next step may go), and that answer, up to
    max_message_bytes of inline hidden states, is dropped when the next step is sent: kept, every late answer
    stayed in memory for the stream's life. The next step's wait sees only its own answer."""
    stub = _Stub()
    stream = StepStream(stub)  # type: ignore[arg-type]
    try:
        stream.send(pb.DraftStepRequest(step_id=1))
        assert stream.wait(1, 0.01) is None and not stream.settled(1)
        stub.call.answers.put(pb.DraftStepResponse(step_id=1))
        wait_until(lambda: stream.settled(1), 5, "the late answer settled step 1", interval_s=0.005)
        assert stream.alive, "settled by the answer, not by the stream ending"
        stream.send(pb.DraftStepRequest(step_id=2))
        assert stream.wait(2, 0.01) is None and not stream.settled(2)
        assert 1 not in stream._answers, "the late answer of step 1 is still held"
        stub.call.answers.put(pb.DraftStepResponse(step_id=2))
        assert stream.wait(2, 5).step_id == 2
    finally:
        stream.close()


def test_an_answer_to_a_step_sent_before_the_one_waited_for_is_not_kept():
    """Only the step last sent is waited for: an earlier one's answer settles it and is dropped (kept, it held
    up to max_message_bytes of hidden states that no wait would ever take)."""
    stub = _Stub()
    stream = StepStream(stub)  # type: ignore[arg-type]
    try:
        stream.send(pb.DraftStepRequest(step_id=1))
        stream.send(pb.DraftStepRequest(step_id=2))
        stub.call.answers.put(pb.DraftStepResponse(step_id=1))
        wait_until(lambda: stream.settled(1), 5, "step 1 answered", interval_s=0.005)
        assert stream._answers == {} and stream.wait(1, 0.01) is None
        stub.call.answers.put(pb.DraftStepResponse(step_id=2))
        assert stream.wait(2, 5).step_id == 2
    finally:
        stream.close()


def test_every_channel_takes_the_message_size_the_link_was_made_with():
    """Sent and received alike, on the link's channel and the health probe's: the sidecar's
    --max-message-bytes may be set above or below the default on both ends."""
    made: list[dict] = []

    def factory(target: str, options: list) -> _Channel:
        made.append(dict(options))
        return _Channel(grpc.RpcError())

    conn = SidecarConnection("unix:/nonexistent/rank0.sock", factory, max_message_bytes=3 << 20)
    with pytest.raises(grpc.RpcError):
        conn.open(0.1)
    assert conn.max_message_bytes == 3 << 20 and not conn.probe_health(0.1)
    assert len(made) == 2
    for options in made:
        assert options["grpc.max_send_message_length"] == options["grpc.max_receive_message_length"] == 3 << 20


def test_an_answer_out_of_request_order_ends_the_stream():
    """Answers come one per request, in order: an answer for a step other than the oldest unanswered one is a
    sidecar that cannot be trusted with settled() (an answer for step 2 would settle step 1 still running)."""
    stub = _Stub()
    stream = StepStream(stub)  # type: ignore[arg-type]
    try:
        stream.send(pb.DraftStepRequest(step_id=1))
        assert stream.wait(1, 0.01) is None
        stub.call.answers.put(pb.DraftStepResponse(step_id=2))
        with pytest.raises(StreamBroken, match="answer for step 2 out of order"):
            stream.wait(1, 5)
        # Cancelled, not only left: the sidecar would go on running the steps sent on it, and keep its stream place.
        assert stub.call.cancelled, "the out-of-order stream was left open at the sidecar"
    finally:
        stream.close()


def test_an_interrupted_wait_still_returns_an_answer_in_hand():
    """interrupt() (the shim closing) gives up a wait, but an answer already there is the step's result: raised
    as StepInterrupted instead, a step that had its answer fell back and was left unsettled for close() to wait on."""
    stub = _Stub()
    stream = StepStream(stub)  # type: ignore[arg-type]
    try:
        stream.send(pb.DraftStepRequest(step_id=1))
        stub.call.answers.put(pb.DraftStepResponse(step_id=1))
        wait_until(lambda: stream.settled(1), 5, "the answer came", interval_s=0.005)
        stream.interrupt()
        assert stream.wait(1, 5).step_id == 1
        stream.send(pb.DraftStepRequest(step_id=2))
        with pytest.raises(StepInterrupted):
            stream.wait(2, 30)  # at once: no answer in hand
    finally:
        stream.close()


def test_an_interrupt_wakes_a_wait_in_progress_at_once():
    """close() from another thread interrupts the step its shim waits on (link.Link.close): the wait in progress
    must end then, not at its deadline (a step_deadline_s, then close() gives up waiting for the link)."""
    stub = _Stub()
    stream = StepStream(stub)  # type: ignore[arg-type]
    try:
        stream.send(pb.DraftStepRequest(step_id=1))
        threading.Timer(0.2, stream.interrupt).start()
        t0 = time.monotonic()
        with pytest.raises(StepInterrupted):
            stream.wait(1, 30)
        assert time.monotonic() - t0 < 15, "the interrupted wait ran on to its deadline"
        assert stream.alive and not stream.settled(1), "interrupt() ends no stream and settles no step"
    finally:
        stream.close()


class _HealthChannel(_Channel):
    """A channel whose health Check answers `health` (an int enum value, or an RpcError to raise) and whose
    GetStatus answers `status`; counts the calls of each method."""

    def __init__(self, health, status: pb.StatusReport) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self.health, self.status, self.calls = health, status, []

    def unary_unary(self, method, *args, **kw):
        def call(request, timeout=None):
            self.calls.append((method.rsplit("/", 1)[-1], timeout))
            if method.endswith("/Check"):
                if isinstance(self.health, BaseException):
                    raise self.health
                return health_pb2.HealthCheckResponse(status=self.health)
            return self.status
        return call


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
_REFUSED = pb.StatusReport(serving=False, state="REFUSED")
_LOADING = pb.StatusReport(serving=False, state="LOADING")


@pytest.mark.parametrize("health,status,refuses,passes,calls", [
    (_SERVING, _LOADING, None, True, ["Check"]),
    (_NOT_SERVING, _REFUSED, None, False, ["Check"]),  # no refusal reader: NOT_SERVING fails, no GetStatus
    (_NOT_SERVING, _REFUSED, True, True, ["Check", "GetStatus"]),  # refuses for good: let through to read it
    (_NOT_SERVING, _LOADING, True, False, ["Check", "GetStatus"]),  # still loading: keep waiting
    (health_pb2.HealthCheckResponse.SERVICE_UNKNOWN, _REFUSED, True, False, ["Check"]),
    (_Unavailable(), _REFUSED, True, False, ["Check"]),
], ids=["serving", "not_serving", "refuses", "loading", "unknown", "unreachable"])
def test_the_health_probe_passes_serving_or_a_refusal_for_good_and_closes_its_channel(health, status, refuses,
                                                                                     passes, calls):
    """probe_health: SERVING passes; NOT_SERVING passes only with a StatusReport its reader finds a refusal for good
    (only GetStatus tells a loading sidecar from one that refuses). Each call carries the deadline, and the
    throwaway channel is closed whatever the answer: left open, one channel (and its socket) per probe, one probe
    per backoff period for as long as the sidecar is down."""
    channels: list[_HealthChannel] = []

    def factory(target: str, options: list) -> _HealthChannel:
        channels.append(_HealthChannel(health, status))
        return channels[-1]

    conn = SidecarConnection("unix:/nonexistent", channel_factory=factory)  # type: ignore[arg-type]
    reader = None if refuses is None else (lambda s: s.state == "REFUSED")
    assert conn.probe_health(0.25, refuses=reader) is passes
    assert len(channels) == 1 and channels[0].closed, "the probe's channel was left open"
    assert channels[0].calls == [(m, 0.25) for m in calls]
