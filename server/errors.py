"""Step and RPC failures: one exception type, its rich-status mapping (unary) and StepError form (stream)."""

from __future__ import annotations

import logging

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.memory import HandleError, HandleExhausted, HandleUncheckable

log = logging.getLogger("dspark_sidecar.server")

DOMAIN = "dspark.sidecar.v1"
# A message quotes the offending input (a shape, a shm name), which can be as long as the request.
# Unclipped it overflowed gRPC's trailers (16 KiB hard limit: the client saw RESOURCE_EXHAUSTED
# "received metadata size exceeds hard limit") and the doorbell's 4096-byte answer area (answered
# RESPONSE_TOO_LARGE). 1024 UTF-8 bytes keep the trailers under gRPC's 8 KiB soft limit: the message
# goes out percent-encoded (up to 3x) and twice more, base64, in the status details.
MESSAGE_LIMIT = 1024


def clip_message(message: str) -> str:
    """`message` as it may go out in a status or a report: at most a KiB of UTF-8, any undecodable byte escaped."""
    # backslashreplace: a lone surrogate (an OS string's undecodable byte, surrogateescape) made encode() raise
    # here, inside the mapping, and the engine got UNKNOWN instead of the status; now it shows as "\udcff".
    raw = message.encode(errors="backslashreplace")
    if len(raw) <= MESSAGE_LIMIT:
        return raw.decode()
    tail = f" ... ({len(raw)} bytes, clipped)"
    return raw[: MESSAGE_LIMIT - len(tail)].decode(errors="ignore") + tail


def internal_message(exc: BaseException) -> str:
    """"internal error: <type>: <text>" for an unexpected exception, even one whose own str() raises (a
    third-party exception with a broken __str__): formatted inside an except clause, that raised again, past
    the guard that answers the step, and the doorbell thread ended (every later ring unanswered)."""
    try:
        text = str(exc)
    except Exception as err:  # noqa: BLE001  (any failure of the text still leaves the type to name)
        text = f"<its message could not be formatted: {type(err).__name__}>"
    return f"internal error: {type(exc).__name__}: {text}"


class SidecarError(Exception):
    """A request the sidecar refuses or could not serve: a gRPC code, the offending field, a reason.

    `reason` is a stable UPPER_SNAKE token (ErrorInfo.reason) an engine can switch on;
    the message is for a person and says what to do.
    """

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "", reason: str = "") -> None:
        message = clip_message(message)
        super().__init__(message)
        self.code, self.message, self.field = code, message, field
        self.reason = reason or code.name


def invalid(field: str, message: str) -> SidecarError:
    return SidecarError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}", field, "INVALID_FIELD")


def out_of_range(field: str, message: str) -> SidecarError:
    return SidecarError(grpc.StatusCode.OUT_OF_RANGE, f"{field}: {message}", field, "OUT_OF_RANGE")


def precondition(message: str, reason: str, field: str = "") -> SidecarError:
    return SidecarError(grpc.StatusCode.FAILED_PRECONDITION, message, field, reason)


def as_sidecar_error(exc: BaseException) -> SidecarError:
    """Any exception as a SidecarError; unexpected ones become INTERNAL (and are logged with a trace)."""
    if isinstance(exc, SidecarError):
        return exc
    if isinstance(exc, HandleError):  # a memory handle the engine sent cannot be mapped: "field: why"
        field, _, msg = str(exc).partition(": ")
        if isinstance(exc, HandleUncheckable):  # our failure to check it, not the engine's input: try again later
            return SidecarError(grpc.StatusCode.UNAVAILABLE, str(exc), field if msg else "", "HANDLE_UNCHECKED")
        if isinstance(exc, HandleExhausted):  # this process or host ran short (fds, memory): passing, as above
            return SidecarError(grpc.StatusCode.UNAVAILABLE, f"{exc}; nothing in the handle is wrong: try again",
                                field if msg else "", "MAP_EXHAUSTED")
        return invalid(field, msg) if msg else SidecarError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), "", "INVALID_FIELD")
    log.exception("internal error while serving a request")
    return SidecarError(grpc.StatusCode.INTERNAL, internal_message(exc), "", "INTERNAL")


def to_status(err: SidecarError) -> status_pb2.Status:
    """google.rpc.Status with ErrorInfo (reason, domain) and, for a bad field, BadRequest."""
    details = []
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata={"field": err.field}))
    details.append(info)
    if err.field:
        bad = any_pb2.Any()
        bad.Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=err.field, description=err.message)]))
        details.append(bad)
    return status_pb2.Status(code=err.code.value[0], message=err.message, details=details)


def to_step_error(err: SidecarError) -> pb.StepError:
    """The stream's per-step form of the same failure (the stream itself goes on)."""
    return pb.StepError(code=err.code.value[0], message=err.message, field=err.field, reason=err.reason)


def _abort(context, err: SidecarError) -> None:
    """End the call with err's status and rich details (raises, as grpc's abort does)."""
    context.abort_with_status(rpc_status.to_status(to_status(err)))


def _aborted(context, exc: Exception) -> bool:
    """True where `exc` is what grpc's context.abort() raises (a bare Exception, the call's code already set): the
    handler's own status (or ours, from a request that did not parse) goes out untouched. Mapped, it became
    INTERNAL "internal error: Exception: ", the handler's code and message lost."""
    return type(exc) is Exception and not exc.args and context.code() is not None


class StatusInterceptor(grpc.ServerInterceptor):
    """Maps exceptions escaping unary handlers and the step stream to gRPC status with rich details, and requests
    that do not parse to INVALID_ARGUMENT (unary and streaming); servicers stay on the happy path. A handler's own
    context.abort() passes through untouched."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        method, decode = handler_call_details.method, handler.request_deserializer

        # Requests are decoded here, not by grpc: bytes that do not parse would otherwise be answered
        # INTERNAL ("Exception deserializing request!") before any handler could say why.
        def parsed(raw: bytes):
            try:
                return decode(raw) if decode is not None else raw
            except DecodeError as exc:
                raise invalid("request", f"the message does not parse as {method}'s request ({exc}): "
                                         "client and server protos disagree?") from None

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def guarded(raw: bytes, context):
                try:
                    return inner(parsed(raw), context)
                except Exception as exc:  # noqa: BLE001  (every failure becomes a status; none escapes)
                    if _aborted(context, exc):
                        raise
                    _abort(context, as_sidecar_error(exc))

            return grpc.unary_unary_rpc_method_handler(
                guarded, request_deserializer=None, response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:  # DraftSteps: its handler answers per step; only parsing is ours
            inner_stream = handler.stream_stream

            def guarded_stream(raw_iterator, context):
                def requests():
                    for raw in raw_iterator:
                        try:
                            yield parsed(raw)
                        except SidecarError as err:  # the stream ends with it: no step id to answer under
                            _abort(context, err)

                try:
                    yield from inner_stream(requests(), context)
                # Refused before any step (e.g. a remote peer), or a failure outside any step's answer: the stream
                # ends with it. Unmapped, an unexpected one reached the engine as UNKNOWN "Exception iterating
                # responses: ..." with no ErrorInfo to switch on.
                except Exception as exc:  # noqa: BLE001
                    if _aborted(context, exc):
                        raise
                    if isinstance(exc, grpc.RpcError) and not context.is_active():
                        # The request iterator's end of a call that is over: the engine cancelled it (it left, or
                        # reconnects) or the server's stop did, past its grace, with the stream open between steps.
                        # Nobody to answer; logged as an internal error, it was a traceback at every such stop.
                        return
                    _abort(context, as_sidecar_error(exc))

            return grpc.stream_stream_rpc_method_handler(
                guarded_stream, request_deserializer=None, response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:  # health's Watch: as the stream, only parsing is ours
            inner_watch = handler.unary_stream

            def guarded_watch(raw: bytes, context, send_response_callback=None):
                try:
                    request = parsed(raw)
                except SidecarError as err:
                    _abort(context, err)
                if send_response_callback is None:
                    return inner_watch(request, context)
                return inner_watch(request, context, send_response_callback)

            # grpc_health's Watch is non-blocking: it answers through grpc's callback and returns. Wrapped
            # without these marks grpc ran it as a blocking stream, each open Watch holding a handler
            # thread until it closed: as many subscribers as GRPC_THREADS left the unary calls and the
            # health Check waiting for a thread for ever.
            guarded_watch.experimental_non_blocking = getattr(inner_watch, "experimental_non_blocking", False)
            guarded_watch.experimental_thread_pool = getattr(inner_watch, "experimental_thread_pool", None)
            return grpc.unary_stream_rpc_method_handler(
                guarded_watch, request_deserializer=None, response_serializer=handler.response_serializer)
        return handler


