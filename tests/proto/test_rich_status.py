"""error_reason reads the sidecar's ErrorInfo back from a real failed call, and "" from any other failure."""

from __future__ import annotations

import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.proto.rich_status import error_reason
from dspark_sidecar.server.errors import SidecarError, to_status


class _Refusing(pb_grpc.DrafterSidecarServicer):
    def __init__(self, rich: bool):
        self.rich = rich

    def GetStatus(self, request, context):
        if self.rich:  # what the sidecar's interceptor sends (server/errors.py)
            err = SidecarError(grpc.StatusCode.UNAVAILABLE, "rank 0 is loading its shard", reason="LOADING")
            context.abort_with_status(rpc_status.to_status(to_status(err)))
        context.abort(grpc.StatusCode.UNAVAILABLE, "rank 0 is loading its shard")  # same words, no ErrorInfo


@pytest.mark.parametrize("rich, want", [(True, "LOADING"), (False, "")])
def test_error_reason_of_a_real_call(rich, want):
    assert error_reason(_failed_get_status(_Refusing(rich))) == want


def _failed_get_status(servicer) -> grpc.RpcError:
    """The error of a GetStatus to `servicer`, served on a real unix socket; it must fail UNAVAILABLE."""
    folder = Path(tempfile.mkdtemp(prefix="dsp-"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_DrafterSidecarServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{folder}/s.sock")
    server.start()
    try:
        with grpc.insecure_channel(f"unix:{folder}/s.sock") as ch, pytest.raises(grpc.RpcError) as err:
            pb_grpc.DrafterSidecarStub(ch).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        return err.value
    finally:
        server.stop(0).wait()
        (folder / "s.sock").unlink(missing_ok=True)
        folder.rmdir()


class _Garbled(pb_grpc.DrafterSidecarServicer):
    """Another server (or a proxy) whose grpc-status-details-bin trailer is not a google.rpc.Status that parses,
    or carries an ErrorInfo that does not parse."""

    def __init__(self, how: str):
        self.how = how

    def GetStatus(self, request, context):
        if self.how == "status":
            context.set_trailing_metadata((("grpc-status-details-bin", b"\xff\xff\xff"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "not a sidecar")
        bad = any_pb2.Any(type_url="type.googleapis.com/google.rpc.ErrorInfo", value=b"\xff\xff")
        good = any_pb2.Any()
        good.Pack(error_details_pb2.ErrorInfo(reason="LOADING"))
        details = [bad] if self.how == "detail" else [bad, good]
        context.abort_with_status(rpc_status.to_status(status_pb2.Status(code=14, message="x", details=details)))


@pytest.mark.parametrize("how, want", [("status", ""), ("detail", ""), ("detail then good", "LOADING")])
def test_error_reason_of_details_that_do_not_parse_is_no_reason_not_a_decode_error(how, want):
    """error_reason promises "" for an error that is not the sidecar's own answer ("another server"). A details
    trailer, or an ErrorInfo in it, that does not parse raised protobuf's DecodeError (no ValueError): out of
    BindKV's error path (client/binding.py) in place of its BindError, and out of the health probe's and the
    CLI's status line. An ErrorInfo that does parse after one that does not is still read."""
    assert error_reason(_failed_get_status(_Garbled(how))) == want


def test_error_reason_of_something_that_is_not_a_call():
    assert error_reason(grpc.RpcError("no call behind it")) == ""
