"""error_reason reads the sidecar's ErrorInfo back from a real failed call, and "" from any other failure."""

from __future__ import annotations

import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest
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
    folder = Path(tempfile.mkdtemp(prefix="dsp-"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_DrafterSidecarServicer_to_server(_Refusing(rich), server)
    server.add_insecure_port(f"unix:{folder}/s.sock")
    server.start()
    try:
        with grpc.insecure_channel(f"unix:{folder}/s.sock") as ch, pytest.raises(grpc.RpcError) as err:
            pb_grpc.DrafterSidecarStub(ch).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_reason(err.value) == want
    finally:
        server.stop(0).wait()
        (folder / "s.sock").unlink(missing_ok=True)
        folder.rmdir()


def test_error_reason_of_something_that_is_not_a_call():
    assert error_reason(grpc.RpcError("no call behind it")) == ""
