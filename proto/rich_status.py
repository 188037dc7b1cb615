"""Reading the sidecar's rich gRPC status (google.rpc.Status with an ErrorInfo) back out of a failed call."""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2
from grpc_status import rpc_status


def error_reason(err: grpc.RpcError) -> str:
    """The ErrorInfo.reason the sidecar attached to `err` ("LOADING", "BAD_SHAPE", ...), or "" when the error
    carries none: then it is not the sidecar's own answer (a dead socket, a deadline, another server)."""
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    # Not a call, a status whose code/message disagree, or a details trailer that is no google.rpc.Status (another
    # server's, a proxy's): DecodeError is no ValueError, and it escaped BindKV's error path in place of its BindError.
    except (AttributeError, ValueError, TypeError, DecodeError):
        return ""
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        try:
            if detail.Unpack(info):
                return info.reason
        except DecodeError:  # an ErrorInfo that does not parse says nothing; a later one may
            continue
    return ""
