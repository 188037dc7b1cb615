"""A request past --max-message-bytes: what gRPC answers before any handler, and what sidecar.proto says of it."""

from __future__ import annotations

import re
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_status import rpc_status

import dspark_sidecar.proto as proto_pkg
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.server.errors import StatusInterceptor

LIMIT = 1 << 20  # the smallest --max-message-bytes (server/config.py)


class _Echo(pb_grpc.DrafterSidecarServicer):
    def DraftStep(self, request, context):
        return pb.DraftStepResponse(step_id=request.step_id)

    def DraftSteps(self, request_iterator, context):
        for request in request_iterator:
            yield pb.DraftStepResponse(step_id=request.step_id)


@pytest.fixture
def stub():
    """The rank's gRPC set-up (server/app.py: its limits both ways, the StatusInterceptor) around an echo."""
    opts = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[StatusInterceptor()], options=opts)
    pb_grpc.add_DrafterSidecarServicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.DrafterSidecarStub(channel)
    finally:
        channel.close()
        server.stop(None)


def _proto_text() -> str:
    return " ".join(line.strip().lstrip("/").strip()
                    for line in (Path(proto_pkg.__file__).parent / "sidecar.proto").read_text().splitlines())


def test_a_request_past_the_limit_ends_even_the_stream_and_the_proto_says_so(stub):
    """sidecar.proto listed the ways a DraftSteps stream ends ("only when ...") and promised rich details on
    every unary failure; a message past the limit is refused by gRPC before any handler, ending the stream
    with RESOURCE_EXHAUSTED and no details, which the engine read as none of the documented cases."""
    big = pb.DraftStepRequest(step_id=2, positions=pb.TensorRef(data=b"\0" * (LIMIT + 1)))
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for resp in stub.DraftSteps(iter([pb.DraftStepRequest(step_id=1), big, pb.DraftStepRequest(step_id=3)]),
                                    timeout=10):
            got.append(resp.step_id)
    assert got == [1] and err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (got, err.value.code())
    assert rpc_status.from_call(err.value) is None
    with pytest.raises(grpc.RpcError) as err:
        stub.DraftStep(big, timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and rpc_status.from_call(err.value) is None
    text = _proto_text()
    streams = re.search(r"the stream ends only when (.*?)\. A rank serves", text).group(1)
    assert "larger than Limits.max_message_bytes (RESOURCE_EXHAUSTED" in streams, streams
    assert "larger than Limits.max_message_bytes ends its call (a stream included) with RESOURCE_EXHAUSTED" in text
