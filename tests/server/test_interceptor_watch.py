"""StatusInterceptor around health's Watch: a subscriber must not hold one of the rank's gRPC handler threads."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dspark_sidecar.server.errors import StatusInterceptor

THREADS = 2  # the pool's size: a rank's is GRPC_THREADS (server/app.py), as many Watch streams fill it the same way


def test_open_health_watches_leave_the_handler_threads_to_the_other_calls(tmp_path):
    """grpc_health's Watch is non-blocking (experimental_non_blocking: it answers through a callback and
    returns). Wrapped by the interceptor as a plain generator it lost that mark, so grpc ran it as a blocking
    stream: each open Watch held a handler thread for as long as it stayed open. As many subscribers as the
    pool has threads left every unary call and health Check waiting for a thread for ever (the probes then
    read UNREACHABLE DEADLINE_EXCEEDED and the pod was restarted)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=THREADS), interceptors=[StatusInterceptor()])
    hs = health.HealthServicer()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    target = f"unix:{tmp_path / 'h.sock'}"
    server.add_insecure_port(target)
    server.start()
    watches = []
    try:
        with grpc.insecure_channel(target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for _ in range(THREADS + 1):
                call = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
                watches.append(call)
                assert next(call).status == health_pb2.HealthCheckResponse.SERVING
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=3)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            # The subscribers still get each change.
            hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            for call in watches:
                assert next(call).status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        for call in watches:
            call.cancel()
        server.stop(None)


def test_a_watch_request_that_does_not_parse_is_still_invalid_argument(tmp_path):
    """The non-blocking Watch is parsed by the interceptor as before: bytes that do not parse end it with
    INVALID_ARGUMENT naming why, not grpc's INTERNAL."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=THREADS), interceptors=[StatusInterceptor()])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    target = f"unix:{tmp_path / 'h.sock'}"
    server.add_insecure_port(target)
    server.start()
    try:
        with grpc.insecure_channel(target) as ch:
            with pytest.raises(grpc.RpcError) as err:
                list(ch.unary_stream("/grpc.health.v1.Health/Watch")(b"\x0a\xff", timeout=5))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
        assert "does not parse" in err.value.details()
    finally:
        server.stop(None)
