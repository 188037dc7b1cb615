"""One engine rank's gRPC link to its sidecar rank: channel, status, health probe and the long-lived step stream."""

from __future__ import annotations

import collections
import queue
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark_sidecar.proto import INSTANCE_METADATA, SERVICE_NAME
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

DEFAULT_MAX_MESSAGE_BYTES = 256 << 20
ChannelFactory = Callable[[str, list], grpc.Channel]


def _insecure(target: str, options: list) -> grpc.Channel:
    return grpc.insecure_channel(target, options=options)


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    # Short reconnect backoff: the shim's own breaker paces reconnects; gRPC's default backoff
    # (1 s growing to 120 s) would keep a restarted sidecar unused for minutes.
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 50),
        ("grpc.min_reconnect_backoff_ms", 50),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


class StreamBroken(Exception):
    """The DraftSteps stream ended (transport failure, server gone, cancelled) before the answer came."""

    def __init__(self, code: grpc.StatusCode | None, detail: str) -> None:
        super().__init__(f"{code.name if code else 'ENDED'}: {detail}")
        self.code = code


class StepInterrupted(Exception):
    """A step's wait given up because the shim is closing (DrafterShim.close, maybe from another thread).
    The step was sent and may still run: the shim treats it as unsettled."""


class StepStream:
    """The long-lived DraftSteps bidi stream; a reader thread hands answers back by step id.

    Answers come in request order, one per request, so an answer for step k also proves every
    earlier step has been answered: `settled(k)` tells the shim a timed-out step can no longer
    touch the KV cache.
    """

    def __init__(self, stub: pb_grpc.DrafterSidecarStub, instance: str = "") -> None:
        """instance: the StatusReport.instance of the server whose status the link read ("": not checked). A
        stream that reached another instance ends at once, before any step is sent on it (_read)."""
        self._instance = instance
        # Set once the server's instance has been read from the stream's initial metadata (or the stream ended).
        self.opened = threading.Event()
        if not instance:
            self.opened.set()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._answers: dict[int, pb.DraftStepResponse] = {}
        self._outstanding: collections.deque[int] = collections.deque()  # step ids sent, not yet answered
        self._waiting: int | None = None
        self.last_answered = 0
        self.alive = True
        self.interrupted = False  # interrupt(): every wait gives up at once, for good
        self.end: StreamBroken | None = None
        self._call = stub.DraftSteps(self._request_iter())
        # Not joined: it ends with the call (cancelled by close() or give_up, or ended by the server). A daemon, as
        # gRPC's own threads are: a link kept to the process's exit (a step unsettled at close()) must not hold it.
        self._reader = threading.Thread(target=self._read, name="dspark-shim-stream", daemon=True)
        self._reader.start()

    def _request_iter(self):
        while True:
            req = self._requests.get()
            if req is None:  # half-close
                return
            yield req

    def _read(self) -> None:
        end = StreamBroken(None, "stream closed by the server")
        try:
            if self._instance:
                # The server sends its instance before any answer (sidecar.proto DraftSteps). A call that failed
                # has none: the loop below raises its error. Another instance is a sidecar restarted since the
                # status was read, to which gRPC carried a call that had not yet reached the old process.
                got = dict(self._call.initial_metadata() or ()).get(INSTANCE_METADATA, "")
                if got and got != self._instance:
                    end = StreamBroken(None, f"the step stream reached sidecar instance {got}, not {self._instance} "
                                             "whose status this link read (restarted in between)")
                    self._call.cancel()
                    return
                self.opened.set()
            for resp in self._call:
                with self._cv:
                    # One answer per request, in request order: anything else is a sidecar that
                    # cannot be trusted to say which step an answer (or a settled cache) belongs to.
                    if not self._outstanding or resp.step_id != self._outstanding[0]:
                        expected = self._outstanding[0] if self._outstanding else "none"
                        end = StreamBroken(None, f"answer for step {resp.step_id} out of order (expected {expected})")
                        self._call.cancel()
                        break
                    self._outstanding.popleft()
                    self.last_answered = resp.step_id
                    if resp.step_id == self._waiting:
                        self._answers[resp.step_id] = resp
                    self._cv.notify_all()
        except grpc.RpcError as e:
            end = StreamBroken(e.code(), e.details() or "")
        finally:
            with self._cv:
                self.alive = False
                self.end = self.end or end  # give_up's reason stands over the cancel it caused
                self._cv.notify_all()
            self.opened.set()

    def give_up(self, reason: str) -> None:
        """End the stream now, for `reason` (its StreamBroken's detail): every wait and send sees it ended."""
        with self._cv:
            if self.alive:
                self.alive = False
                self.end = StreamBroken(None, reason)
                self._cv.notify_all()
        self._call.cancel()

    def send(self, req: pb.DraftStepRequest) -> None:
        with self._cv:
            if not self.alive:
                raise self.end or StreamBroken(None, "stream ended")
            self._waiting = req.step_id
            self._answers.clear()
            self._outstanding.append(req.step_id)
        self._requests.put(req)

    def wait(self, step_id: int, timeout_s: float) -> pb.DraftStepResponse | None:
        """The answer to `step_id`, None on timeout; StreamBroken when the stream ends first,
        StepInterrupted once interrupt() was called (an answer already in hand is still returned)."""
        with self._cv:
            ok = self._cv.wait_for(lambda: step_id in self._answers or not self.alive or self.interrupted,
                                   timeout_s)
            if step_id in self._answers:
                return self._answers.pop(step_id)
            if self.interrupted:
                raise StepInterrupted(f"step {step_id}: the shim is closing")
            if not ok:
                return None
            raise self.end or StreamBroken(None, "stream ended")

    def interrupt(self) -> None:
        """Wake a wait() now, and make every later one give up at once (the shim is closing). The stream
        itself stays open: settled() still tells when the sidecar is done with the step."""
        with self._cv:
            self.interrupted = True
            self._cv.notify_all()

    def settled(self, step_id: int) -> bool:
        """True once `step_id` (or a later step) was answered, or the stream is gone."""
        with self._cv:
            return self.last_answered >= step_id or not self.alive

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()


class SidecarConnection:
    """Channel and stubs to one sidecar rank; recreated after failures (the breaker paces it)."""

    def __init__(self, endpoint: str, channel_factory: ChannelFactory = _insecure,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.endpoint = endpoint
        self._factory = channel_factory
        self._max_message_bytes = max_message_bytes
        self._channel: grpc.Channel | None = None
        self.stub: pb_grpc.DrafterSidecarStub | None = None
        self._stream: StepStream | None = None
        self.status: pb.StatusReport | None = None
        self.opens = 0
        self._deadline_s = 0.0  # open()'s: also how long a new step stream's opening is waited for (stream)

    @property
    def is_open(self) -> bool:
        return self.stub is not None

    @property
    def stream_ended(self) -> bool:
        """The step stream ended on its own since the last step (the sidecar went away meanwhile)."""
        return self._stream is not None and not self._stream.alive

    def open(self, deadline_s: float) -> pb.StatusReport:
        """A fresh channel and this rank's StatusReport; grpc.RpcError when the sidecar does not answer."""
        self.close()
        self._channel = self._factory(self.endpoint, channel_options(self._max_message_bytes))
        self.stub = pb_grpc.DrafterSidecarStub(self._channel)
        self.opens += 1
        self._deadline_s = deadline_s
        try:
            self.status = self.stub.GetStatus(pb.GetStatusRequest(), timeout=deadline_s)
        except BaseException:  # not only RpcError: an interrupt here left the link open with no status read
            self.close()
            raise
        return self.status

    def refresh_status(self, deadline_s: float) -> pb.StatusReport:
        assert self.stub is not None
        self.status = self.stub.GetStatus(pb.GetStatusRequest(), timeout=deadline_s)
        return self.status

    def stream(self) -> StepStream:
        """The step stream, opened on first use. One that ended is handed back as it is (its send raises its
        StreamBroken), never replaced on this channel: it ends when the sidecar process does, and a new stream
        would reach the restarted one with this link's status (limits, compute dtype) read from the old. The
        caller drops the link (close) and opens it again, which re-reads the status.

        A new stream is confirmed to have reached the server instance whose status the link read, within
        open()'s deadline; one that reached another (a restart since the status was read) or gave no word in
        time is handed back ended (StepStream.give_up)."""
        assert self.stub is not None
        if self._stream is None:
            instance = self.status.instance if self.status is not None else ""
            self._stream = StepStream(self.stub, instance)
            if not self._stream.opened.wait(self._deadline_s):
                self._stream.give_up(f"the sidecar did not take the step stream within {self._deadline_s:g} s")
        return self._stream

    def drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()  # ends its request iterator, whose thread would wait for ever
            self._stream = None

    @property
    def max_message_bytes(self) -> int:
        """The largest message this end's channels send or take."""
        return self._max_message_bytes

    def probe_health(self, deadline_s: float,
                     refuses: Callable[[pb.StatusReport], bool] | None = None) -> bool:
        """grpc.health.v1 Check of the sidecar service on a throwaway channel: True iff SERVING, or, with
        `refuses`, NOT_SERVING with a StatusReport (read on the same channel, its own deadline_s) that `refuses`
        finds a refusal for good. Health cannot tell a sidecar still loading from one that refuses for good
        (--strict-refusal: NOT_SERVING for good): only GetStatus says which, and a caller kept out by its probe
        would never read it. Each call is bounded by deadline_s."""
        ch = self._factory(self.endpoint, channel_options(self._max_message_bytes))
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=deadline_s)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return True
            if refuses is None or reply.status != health_pb2.HealthCheckResponse.NOT_SERVING:
                return False
            status = pb_grpc.DrafterSidecarStub(ch).GetStatus(pb.GetStatusRequest(), timeout=deadline_s)
            return bool(refuses(status))
        except grpc.RpcError:
            return False
        finally:
            ch.close()

    def close(self) -> None:
        self.drop_stream()
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self.stub = None
        self.status = None
