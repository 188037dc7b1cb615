"""SidecarConnection open/close and its StepStream: no half-open link or stale status left, waits within their deadline."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from dspark_sidecar.client.connection import SidecarConnection, StepStream
from dspark_sidecar.proto import sidecar_pb2 as pb
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

    def __iter__(self):
        while (resp := self.answers.get()) is not None:
            yield resp

    def cancel(self) -> None:
        self.answers.put(None)


class _Stub:
    def DraftSteps(self, requests):  # noqa: N802  (the gRPC method's name)
        self.requests, self.call = requests, _Call()
        return self.call


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
