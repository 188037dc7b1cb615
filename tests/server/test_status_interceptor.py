"""StatusInterceptor end to end: what a handler raises reaches the client as its status with rich details."""

from __future__ import annotations

import contextlib
import logging
import threading
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from dspark_sidecar.proto import INSTANCE_METADATA
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.proto.memory import HandleError
from dspark_sidecar.server.errors import (DOMAIN, MESSAGE_LIMIT, SidecarError, StatusInterceptor, invalid,
                                          out_of_range, to_step_error)
from dspark_sidecar.server.servicer import MAX_STREAMS, DrafterServicer


class _Raising(pb_grpc.DrafterSidecarServicer):
    """GetStatus and DraftSteps raise `exc` where one is set (DraftSteps before its first step), else answer."""

    exc: BaseException | None = None

    def GetStatus(self, request, context):
        if self.exc is not None:
            raise self.exc
        return pb.StatusReport(state="SERVING", serving=True)

    def DraftSteps(self, request_iterator, context):
        if self.exc is not None:
            raise self.exc
        for request in request_iterator:
            yield pb.DraftStepResponse(step_id=request.step_id)


@contextlib.contextmanager
def _served(svc, tmp_path):
    """(svc, stub): the rank's interceptor around `svc`, on a unix socket; the stub's channel as stub.channel."""
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[StatusInterceptor()])
    pb_grpc.add_DrafterSidecarServicer_to_server(svc, server)
    target = f"unix:{tmp_path / 's.sock'}"
    server.add_insecure_port(target)
    server.start()
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.DrafterSidecarStub(channel)
    stub.channel = channel
    try:
        yield svc, stub
    finally:
        channel.close()
        server.stop(None)


@pytest.fixture
def rig(tmp_path):
    """(servicer, stub): the rank's interceptor around _Raising, on a unix socket."""
    with _served(_Raising(), tmp_path) as served:
        yield served


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def _rich(err: grpc.RpcError) -> tuple[error_details_pb2.ErrorInfo, list[tuple[str, str]]]:
    """The call's ErrorInfo and its BadRequest's (field, description) pairs; the status must agree with the call."""
    status = rpc_status.from_call(err)
    assert status is not None, f"no rich details: {err.code()} {err.details()}"
    assert status.code == err.code().value[0] and status.message == err.details()
    info, bad = error_details_pb2.ErrorInfo(), error_details_pb2.BadRequest()
    assert status.details[0].Unpack(info), status.details
    violations = []
    for d in status.details[1:]:
        assert d.Unpack(bad), d
        violations += [(v.field, v.description) for v in bad.field_violations]
    return info, violations


@pytest.mark.parametrize("exc, code, reason, field", [
    (invalid("layers[1].shape", "[3], expected [4]"), grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD",
     "layers[1].shape"),
    (out_of_range("num_requests", "9 outside 1..8"), grpc.StatusCode.OUT_OF_RANGE, "OUT_OF_RANGE", "num_requests"),
    (SidecarError(grpc.StatusCode.UNAVAILABLE, "rank is still loading", "", "LOADING"), grpc.StatusCode.UNAVAILABLE,
     "LOADING", ""),
    (SidecarError(grpc.StatusCode.NOT_FOUND, "region 7 is not registered"), grpc.StatusCode.NOT_FOUND, "NOT_FOUND", ""),
    (HandleError("regions[0].memory: cannot open shared memory 'psm_x'"), grpc.StatusCode.INVALID_ARGUMENT,
     "INVALID_FIELD", "regions[0].memory"),
])
def test_a_refusal_reaches_the_engine_with_its_code_reason_and_field_and_the_server_serves_on(rig, exc, code, reason,
                                                                                              field):
    """The engine switches on ErrorInfo.reason and reads the field from BadRequest (proto/rich_status.py);
    a refusal with no field carries no BadRequest."""
    svc, stub = rig
    svc.exc = exc
    err = _refused(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=10))
    assert err.code() == code, (err.code(), err.details())
    info, violations = _rich(err)
    assert (info.reason, info.domain, info.metadata["field"]) == (reason, DOMAIN, field)
    assert violations == ([(field, err.details())] if field else [])
    assert err.details() == str(exc) and (not field or err.details().startswith(f"{field}: "))
    svc.exc = None
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).serving


@pytest.mark.parametrize("exc", [KeyError("boom"), Exception("boom")], ids=["KeyError", "Exception"])
def test_an_unexpected_exception_is_internal_with_a_message_not_a_traceback(rig, caplog, exc):
    """A plain Exception too: only the bare one grpc's context.abort() raises passes through untouched."""
    svc, stub = rig
    svc.exc = exc
    with caplog.at_level(logging.ERROR, "dspark_sidecar.server"):
        err = _refused(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=10))
    assert err.code() == grpc.StatusCode.INTERNAL and err.details() == f"internal error: {type(exc).__name__}: {exc}"
    assert _rich(err) == (error_details_pb2.ErrorInfo(reason="INTERNAL", domain=DOMAIN, metadata={"field": ""}), [])
    # The trace goes to the log, for the operator; the engine gets the line above.
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [type(exc)]
    svc.exc = None
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).serving


class _CodeThenRaise(_Raising):
    """GetStatus sets a code of its own (context.set_code), then fails with an Exception that has words."""

    def GetStatus(self, request, context):
        context.set_code(grpc.StatusCode.NOT_FOUND)
        raise Exception("boom after set_code")


def test_an_exception_with_words_after_the_handler_set_a_code_is_still_internal(tmp_path, caplog):
    """Only the bare Exception() of grpc's abort() passes through: one with words is a failure of the handler's,
    a code it set before or not. Passed through, grpc would answer with that code and its own "Exception calling
    application: ..." and no ErrorInfo."""
    with _served(_CodeThenRaise(), tmp_path) as (_, stub), caplog.at_level(logging.ERROR, "dspark_sidecar.server"):
        err = _refused(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=10))
        assert (err.code(), err.details()) == (grpc.StatusCode.INTERNAL,
                                               "internal error: Exception: boom after set_code")
        assert _rich(err)[0].reason == "INTERNAL"


class _CallFailed(grpc.RpcError):
    """The failure of a call the handler made itself (its client side): an RpcError on a stream still open."""

    def __str__(self) -> str:
        return "a call of the handler's own failed"


def test_an_rpc_error_of_the_handler_s_own_on_an_open_stream_ends_it_internal_not_ok(rig):
    """Only a call that is over (its client gone, or the server's stop) ends the stream quietly on an RpcError: on
    one still open, a quiet return would end it OK with no answer, the engine taking it for closed by itself."""
    svc, stub = rig
    svc.exc = _CallFailed()
    err = _refused(lambda: list(stub.DraftSteps(iter([pb.DraftStepRequest(step_id=1)]), timeout=10)))
    assert (err.code(), err.details()) == (grpc.StatusCode.INTERNAL, "internal error: _CallFailed: a call of the "
                                                                     "handler's own failed")
    assert _rich(err)[0].reason == "INTERNAL"
    svc.exc = None
    assert [r.step_id for r in stub.DraftSteps(iter([pb.DraftStepRequest(step_id=2)]), timeout=10)] == [2]


@pytest.mark.parametrize("char", ["x", "\u00e9", "\u20ac"])  # 1, 2 and 3 UTF-8 bytes: a cut never splits one
def test_a_message_quoting_a_huge_input_is_clipped_and_still_goes_out_with_its_status(rig, char):
    """Unclipped, a message past gRPC's trailer limit came out RESOURCE_EXHAUSTED (server/errors.py)."""
    svc, stub = rig
    svc.exc = invalid("inputs_embeds", "shape " + char * 20_000)
    err = _refused(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details()[:200])
    raw = err.details().encode()
    assert MESSAGE_LIMIT - 3 <= len(raw) <= MESSAGE_LIMIT, len(raw)
    assert err.details().startswith("inputs_embeds: shape " + char) and err.details().endswith(" bytes, clipped)")
    assert _rich(err)[1] == [("inputs_embeds", err.details())]


def test_a_message_at_the_limit_is_kept_whole():
    whole = "y" * (MESSAGE_LIMIT - len("f: "))
    assert invalid("f", whole).message == f"f: {whole}"
    assert invalid("f", whole + "y").message.endswith(f" ... ({MESSAGE_LIMIT + 1} bytes, clipped)")


def test_a_step_error_carries_code_field_and_reason():
    step = to_step_error(out_of_range("block_tables", "block_tables[0][3] = 99 outside the bound cache"))
    assert (step.code, step.field, step.reason) == (grpc.StatusCode.OUT_OF_RANGE.value[0], "block_tables",
                                                    "OUT_OF_RANGE")
    assert step.message == "block_tables: block_tables[0][3] = 99 outside the bound cache"


def test_a_stream_refused_at_its_opening_carries_rich_details(rig):
    """As the unary calls: the engine reads TOO_MANY_STREAMS (or LOADING, REMOTE_PEER) from ErrorInfo."""
    svc, stub = rig
    svc.exc = SidecarError(grpc.StatusCode.RESOURCE_EXHAUSTED, "8 DraftSteps streams are open", "", "TOO_MANY_STREAMS")
    err = _refused(lambda: list(stub.DraftSteps(iter([pb.DraftStepRequest(step_id=1)]), timeout=10)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.details() == "8 DraftSteps streams are open"
    assert _rich(err)[0].reason == "TOO_MANY_STREAMS"
    svc.exc = None
    assert [r.step_id for r in stub.DraftSteps(iter([pb.DraftStepRequest(step_id=2)]), timeout=10)] == [2]


def test_a_stream_s_place_is_free_again_once_it_ends():
    """MAX_STREAMS open streams refuse the next (TOO_MANY_STREAMS); one that ends, or is cancelled, frees its
    place. Kept, every stream an engine ever opened held one, and after MAX_STREAMS reconnects the rank
    refused every stream for good."""
    answered = []

    def submitted(r):
        fut = futures.Future()
        fut.set_result(r)
        return fut

    fake = SimpleNamespace(_streams=threading.BoundedSemaphore(MAX_STREAMS), instance="i0",
                           loop=SimpleNamespace(submit=submitted,
                                                answer=lambda r, fut: answered.append(r.step_id) or fut.result()),
                           _require_same_node=lambda ctx, what="": None)
    sent = []
    context = SimpleNamespace(send_initial_metadata=sent.append, is_active=lambda: True)

    def opened(step_id: int):
        stream = DrafterServicer.DraftSteps(fake, iter([pb.DraftStepRequest(step_id=step_id)]), context)
        assert next(stream).step_id == step_id  # open, and waiting for its next request
        return stream

    streams = [opened(i) for i in range(MAX_STREAMS)]
    with pytest.raises(SidecarError) as err:
        opened(99)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "TOO_MANY_STREAMS"
    streams.pop().close()  # cancelled (GeneratorExit)
    streams.append(opened(100))
    assert list(streams.pop()) == []  # half-closed by the client: it ends
    streams.append(opened(101))
    for s in streams:
        s.close()
    assert answered == [*range(MAX_STREAMS), 100, 101]
    # Each accepted stream named the instance before its first answer; the refused one sent nothing.
    assert sent == [((INSTANCE_METADATA, "i0"),)] * (MAX_STREAMS + 2)
    # What sidecar.proto promises the engine (its generated docstring).
    doc = " ".join(pb_grpc.DrafterSidecarServicer.DraftSteps.__doc__.split())
    assert f"A rank serves at most {MAX_STREAMS} open streams" in doc



@pytest.mark.parametrize("end", ["the server's stop", "the client's cancel"])
def test_a_stream_ended_by_the_server_s_stop_or_the_client_s_cancel_is_no_internal_error(end, tmp_path, caplog):
    """An engine keeps its DraftSteps stream open between steps. The sidecar's stop cancels it once its grace has
    passed (teardown.SERVER_GRACE_S), an engine that leaves or reconnects cancels it, and the request iterator then
    raises grpc.RpcError: the interceptor logged it as "internal error while serving a request", with a traceback,
    at every stop of a sidecar with an engine attached and every engine gone mid-stream, and answered INTERNAL to
    a call already over."""
    ended = threading.Event()  # the stream's handler has ended

    class Open(_Raising):
        def DraftSteps(self, request_iterator, context):
            try:
                yield from super().DraftSteps(request_iterator, context)
            finally:
                ended.set()

    pool = futures.ThreadPoolExecutor(2)
    server = grpc.server(pool, interceptors=[StatusInterceptor()])
    pb_grpc.add_DrafterSidecarServicer_to_server(Open(), server)
    target = f"unix:{tmp_path / 's.sock'}"
    server.add_insecure_port(target)
    server.start()
    channel = grpc.insecure_channel(target)
    more = threading.Event()

    def steps():
        yield pb.DraftStepRequest(step_id=1)
        more.wait(30)  # open, between steps

    try:
        with caplog.at_level(logging.ERROR, logger="dspark_sidecar"):
            call = pb_grpc.DrafterSidecarStub(channel).DraftSteps(steps())
            assert next(call).step_id == 1
            if end == "the server's stop":
                server.stop(grace=0.1).wait(10)
            else:
                call.cancel()
            assert ended.wait(10), "the stream's handler never ended"
            with pytest.raises(grpc.RpcError) as err:
                next(call)
            server.stop(None).wait(10)
            pool.shutdown(wait=True)  # every handler has returned, the interceptor's part of it included
        assert err.value.code() == (grpc.StatusCode.UNAVAILABLE if end == "the server's stop"
                                    else grpc.StatusCode.CANCELLED)
        assert not caplog.records, caplog.text
    finally:
        more.set()
        channel.close()
        server.stop(None)


def test_a_step_message_that_does_not_parse_ends_the_stream_invalid_argument_after_the_steps_before_it(rig):
    """No step id to answer it under: the stream ends, INVALID_ARGUMENT naming why (not grpc's UNKNOWN)."""
    _, stub = rig
    steps = stub.channel.stream_stream("/dspark.sidecar.v1.DrafterSidecar/DraftSteps")  # bytes in, bytes out
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for raw in steps(iter([pb.DraftStepRequest(step_id=1).SerializeToString(), b"\x0a\xff"]), timeout=10):
            got.append(pb.DraftStepResponse.FromString(raw).step_id)
    assert got == [1] and err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (got, err.value.code())
    assert "does not parse" in err.value.details()
    assert [field for field, _ in _rich(err.value)[1]] == ["request"]


@pytest.mark.parametrize("rpc, req", [
    ("BindKV", pb.BindKVRequest()), ("UnbindKV", pb.UnbindKVRequest()),
    ("RegisterBuffers", pb.RegisterBuffersRequest()), ("UnregisterBuffers", pb.UnregisterBuffersRequest()),
    ("AttachDoorbell", pb.AttachDoorbellRequest()), ("DraftStep", pb.DraftStepRequest()),
])
def test_every_rpc_but_get_status_refuses_a_remote_peer_before_it_looks_at_the_request(rpc, req):
    """sidecar_pb2_grpc.py: PERMISSION_DENIED, reason REMOTE_PEER, before the request is looked at (the servicer
    here has no rank behind it: anything past the check fails otherwise)."""
    svc = DrafterServicer.__new__(DrafterServicer)
    remote = SimpleNamespace(peer=lambda: "ipv4:192.0.2.2:40000")
    with pytest.raises(SidecarError) as err:
        getattr(svc, rpc)(req, remote)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.PERMISSION_DENIED, "REMOTE_PEER")
    assert "ipv4:192.0.2.2:40000 refused" in err.value.message


@pytest.mark.parametrize("make", [lambda: RuntimeError("cannot open /dev/shm/psm_\udcff"),
                                  lambda: invalid("layers[0].memory", "segment '/dev/shm/psm_\udcff' is gone")],
                         ids=["internal", "invalid"])
def test_a_message_with_an_undecodable_byte_still_goes_out_with_its_status(rig, make):
    """An OS string Python decoded with surrogateescape (a path or name with a non-UTF-8 byte) carries a lone
    surrogate, which UTF-8 refuses: clip_message's encode raised UnicodeEncodeError from inside the mapping, and the
    engine got UNKNOWN "Exception calling application" instead of the status and its reason (on the stream,
    rank.answer raised it too, ending the whole stream)."""
    svc, stub = rig
    exc = svc.exc = make()  # built in the test: an invalid() that raises fails it, not the collection
    err = _refused(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=10))
    want = grpc.StatusCode.INTERNAL if isinstance(exc, RuntimeError) else grpc.StatusCode.INVALID_ARGUMENT
    assert err.code() == want, (err.code(), err.details())
    assert "psm_\\udcff" in err.details()  # the byte shown, escaped, not dropped
    assert _rich(err)[0].reason == ("INTERNAL" if want == grpc.StatusCode.INTERNAL else "INVALID_FIELD")
    svc.exc = None
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).serving


def test_a_method_the_server_does_not_have_is_unimplemented_and_the_server_serves_on(rig):
    """A newer engine calling an RPC this sidecar lacks must read UNIMPLEMENTED (and fall back), not UNKNOWN: the
    interceptor passes grpc's "no handler" through untouched instead of wrapping it."""
    _, stub = rig
    missing = stub.channel.unary_unary("/dspark.sidecar.v1.DrafterSidecar/NoSuchRpc")
    err = _refused(lambda: missing(b"", timeout=10))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED, (err.code(), err.details())
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).serving


class _Aborting(_Raising):
    """GetStatus aborts with its own status; DraftSteps answers its first step, then raises `exc` (or aborts)."""

    def GetStatus(self, request, context):
        if self.exc is not None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no such thing: ask another rank")
        return pb.StatusReport(state="SERVING", serving=True)

    def DraftSteps(self, request_iterator, context):
        for request in request_iterator:
            yield pb.DraftStepResponse(step_id=request.step_id)
            if self.exc is not None:
                if isinstance(self.exc, grpc.StatusCode):
                    context.abort(self.exc, "the handler's own abort")
                raise self.exc


@pytest.fixture
def aborting(tmp_path):
    """(servicer, stub): as rig, around _Aborting."""
    with _served(_Aborting(), tmp_path) as served:
        yield served


def test_a_handler_s_own_abort_goes_out_untouched_and_the_server_serves_on(aborting):
    """grpc's abort() raises a bare Exception once the status is set: mapped, it became INTERNAL
    "internal error: Exception: ", the handler's code and message lost."""
    svc, stub = aborting
    svc.exc = RuntimeError()
    err = _refused(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=10))
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "no such thing: ask another rank")
    svc.exc = None
    assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).serving


@pytest.mark.parametrize("exc, code, details, reason", [
    (RuntimeError("worker died"), grpc.StatusCode.INTERNAL, "internal error: RuntimeError: worker died", "INTERNAL"),
    (invalid("step_id", "reused"), grpc.StatusCode.INVALID_ARGUMENT, "step_id: reused", "INVALID_FIELD"),
    (grpc.StatusCode.ABORTED, grpc.StatusCode.ABORTED, "the handler's own abort", None),
], ids=["unexpected", "sidecar", "abort"])
def test_a_failure_after_answered_steps_ends_the_stream_with_its_status_and_the_server_serves_on(aborting, exc, code,
                                                                                                   details, reason):
    """Unmapped, an unexpected exception mid-stream reached the engine as UNKNOWN "Exception iterating responses:
    ..." with no ErrorInfo; a handler's own abort keeps its status."""
    svc, stub = aborting
    svc.exc, got = exc, []
    with pytest.raises(grpc.RpcError) as err:
        for r in stub.DraftSteps(iter([pb.DraftStepRequest(step_id=1), pb.DraftStepRequest(step_id=2)]), timeout=10):
            got.append(r.step_id)
    assert got == [1] and (err.value.code(), err.value.details()) == (code, details)
    if reason is None:
        assert rpc_status.from_call(err.value) is None
    else:
        assert _rich(err.value)[0].reason == reason
    svc.exc = None
    assert [r.step_id for r in stub.DraftSteps(iter([pb.DraftStepRequest(step_id=3)]), timeout=10)] == [3]
