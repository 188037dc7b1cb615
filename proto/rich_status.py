"""Reading the sidecar's rich gRPC status (google.rpc.Status with an ErrorInfo) back out of a failed call."""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


def error_reason(err: grpc.RpcError) -> str:
    """The ErrorInfo.reason the sidecar attached to `err` ("LOADING", "BAD_SHAPE", ...), or "" when the error
    carries none: then it is not the sidecar's own answer (a dead socket, a deadline, another server)."""
    try:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
    except (AttributeError, ValueError, TypeError):  # not a call, or a status whose code/message disagree
        return ""
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""
