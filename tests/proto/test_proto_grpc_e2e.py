"""The generated stubs serve real gRPC calls over a unix socket: unary, bidi stream, health, reflection."""

from __future__ import annotations

import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf import any_pb2, descriptor_pool
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from grpc_status import rpc_status

from dspark_sidecar.proto import SERVICE_NAME, codec
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

HIDDEN = 16
GENERATION = 5
BINDING_ID = 7


class _StepFailure(Exception):
    def __init__(self, code: int, message: str, field: str = "", reason: str = ""):
        super().__init__(message)
        self.code, self.message, self.field, self.reason = code, message, field, reason


class _ToySidecar(pb_grpc.DrafterSidecarServicer):
    """A stand-in servicer: 'computes' hidden = 2 * inputs_embeds, checks the binding generation."""

    def GetStatus(self, request, context):
        return pb.StatusReport(
            model=pb.ModelSummary(architecture="DSparkMiniMaxDraftModel", hidden_size=HIDDEN,
                                  num_layers=5, compute_dtype="bf16"),
            limits=pb.Limits(qpr=7, launch_reqs=8, max_reqs=32, max_message_bytes=1 << 22),
            parallel=pb.Parallel(tp_size=1, tp_rank=0, dist_backend="gloo", device="cpu"),
            backend="torch", fast_path_refusal="not gfx950", serving=True, state="SERVING",
            kv=pb.KVBindingState(bound=True, binding_id=BINDING_ID, generation=GENERATION,
                                 kv_dtype=pb.DTYPE_BF16),
            latencies=[pb.LatencySummary(name="total", count=3, p50_ns=1000, p99_ns=5000)],
        )

    def BindKV(self, request, context):
        tp = request.engine.tp_size
        return pb.BindKVResponse(
            binding_id=BINDING_ID, generation=GENERATION + len(request.layers),
            fast_path_refusal="" if tp == 4 else f"TP {tp} != 4", backend="torch",
        )

    def UnbindKV(self, request, context):
        if request.binding_id != BINDING_ID:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no binding {request.binding_id}")
        return pb.UnbindKVResponse()

    def RegisterBuffers(self, request, context):
        return pb.RegisterBuffersResponse(region_ids=[100 + i for i in range(len(request.regions))])

    def _step(self, request: pb.DraftStepRequest) -> pb.DraftStepResponse:
        if request.binding_generation != GENERATION:
            raise _StepFailure(code_pb2.FAILED_PRECONDITION, "stale KV binding",
                               "binding_generation", "STALE_BINDING")
        try:
            embeds = codec.from_tensor_ref(request.inputs_embeds, "inputs_embeds")
        except ValueError as e:
            raise _StepFailure(code_pb2.INVALID_ARGUMENT, str(e), "inputs_embeds",
                               "INVALID_TENSOR") from e
        hidden = (embeds.float() * 2).to(torch.bfloat16)
        return pb.DraftStepResponse(
            step_id=request.step_id, hidden_states=codec.to_tensor_ref(hidden),
            timings=pb.StepTimings(total_ns=1, launches=1),
        )

    def DraftStep(self, request, context):
        try:
            return self._step(request)
        except _StepFailure as f:
            details = [error_details_pb2.ErrorInfo(reason=f.reason, domain="dspark.sidecar.v1")]
            if f.code == code_pb2.INVALID_ARGUMENT:
                details.append(error_details_pb2.BadRequest(field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=f.field, description=f.message)
                ]))
            packed = []
            for d in details:
                a = any_pb2.Any()
                a.Pack(d)
                packed.append(a)
            context.abort_with_status(rpc_status.to_status(
                status_pb2.Status(code=f.code, message=f.message, details=packed)))

    def DraftSteps(self, request_iterator, context):
        for request in request_iterator:
            try:
                yield self._step(request)
            except _StepFailure as f:
                yield pb.DraftStepResponse(step_id=request.step_id, error=pb.StepError(
                    code=f.code, message=f.message, field=f.field, reason=f.reason))


@pytest.fixture
def channel(tmp_path):
    sock = tmp_path / "sidecar.sock"
    if len(str(sock)) > 100:  # sun_path holds 108 bytes
        sock = Path(tempfile.mkdtemp(prefix="dsp-")) / "s.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_DrafterSidecarServicer_to_server(_ToySidecar(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME), server)
    assert server.add_insecure_port(f"unix:{sock}") != 0
    server.start()
    ch = grpc.insecure_channel(f"unix:{sock}")
    try:
        yield ch
    finally:
        ch.close()
        server.stop(None)


def _step(step_id: int, rows: int, generation: int = GENERATION) -> tuple[pb.DraftStepRequest, torch.Tensor]:
    embeds = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(step_id)).to(torch.bfloat16)
    req = pb.DraftStepRequest(
        step_id=step_id, binding_id=BINDING_ID, binding_generation=generation,
        num_requests=rows // 7,
        positions=codec.to_tensor_ref(torch.arange(rows, dtype=torch.int64)),
        inputs_embeds=codec.to_tensor_ref(embeds),
    )
    return req, (embeds.float() * 2).to(torch.bfloat16)


def test_control_plane_unary_calls(channel):
    stub = pb_grpc.DrafterSidecarStub(channel)
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert status.serving and status.state == "SERVING"
    assert status.fast_path_refusal == "not gfx950" and status.kv.generation == GENERATION
    assert status.latencies[0].p99_ns == 5000

    layer = pb.KVLayerBinding(
        layer=0, dtype=pb.DTYPE_BF16, shape=[2, 10, 16, 1, 128],
        strides=[20480, 2048, 128, 128, 1], storage_offset=0,
        memory=pb.MemoryHandle(shm=pb.SharedMemoryHandle(name="kv0", size_bytes=81920)),
    )
    bound = stub.BindKV(pb.BindKVRequest(
        engine=pb.EngineFacts(tp_size=2, dp_size=1, pp_size=1, speculative_method="dspark",
                              num_speculative_tokens=7, device="cpu"),
        layers=[layer] * 5, page_size=16), timeout=10)
    assert (bound.binding_id, bound.generation, bound.fast_path_refusal) == (BINDING_ID, GENERATION + 5, "TP 2 != 4")

    regions = stub.RegisterBuffers(pb.RegisterBuffersRequest(regions=[
        pb.BufferRegion(name="in", size_bytes=64, memory=pb.MemoryHandle(
            cuda_ipc=pb.CudaIpcHandle(ipc_handle=b"\x01" * 64, event_sync_required=True))),
        pb.BufferRegion(name="out", size_bytes=64),
    ]), timeout=10)
    assert list(regions.region_ids) == [100, 101]

    assert stub.UnbindKV(pb.UnbindKVRequest(binding_id=BINDING_ID), timeout=10) == pb.UnbindKVResponse()
    with pytest.raises(grpc.RpcError) as err:
        stub.UnbindKV(pb.UnbindKVRequest(binding_id=99), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_unary_draft_step_and_rich_error_status(channel):
    stub = pb_grpc.DrafterSidecarStub(channel)
    req, want = _step(1, 14)
    resp = stub.DraftStep(req, timeout=10)
    assert resp.step_id == 1 and resp.WhichOneof("result") == "hidden_states"
    assert torch.equal(codec.from_tensor_ref(resp.hidden_states, "hidden_states"), want)

    stale, _ = _step(2, 7, generation=GENERATION - 1)
    with pytest.raises(grpc.RpcError) as err:
        stub.DraftStep(stale, timeout=10)
    st = rpc_status.from_call(err.value)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and st.code == code_pb2.FAILED_PRECONDITION
    info = error_details_pb2.ErrorInfo()
    assert st.details[0].Unpack(info) and info.reason == "STALE_BINDING"

    bad, _ = _step(3, 7)
    bad.inputs_embeds.data = bad.inputs_embeds.data[:-2]
    with pytest.raises(grpc.RpcError) as err:
        stub.DraftStep(bad, timeout=10)
    st = rpc_status.from_call(err.value)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = error_details_pb2.BadRequest()
    assert st.details[1].Unpack(violations)
    assert [v.field for v in violations.field_violations] == ["inputs_embeds"]
    assert "payload has" in violations.field_violations[0].description


def test_bidi_stream_keeps_order_and_survives_failed_steps(channel):
    stub = pb_grpc.DrafterSidecarStub(channel)
    plan = [(10, 7, GENERATION), (11, 7, GENERATION - 1), (12, 21, GENERATION), (13, 14, None),
            (14, 56, GENERATION)]
    requests, wants = [], {}
    for step_id, rows, gen in plan:
        req, want = _step(step_id, rows, GENERATION if gen is None else gen)
        if gen is None:  # corrupt the payload: one step with a bad size
            req.inputs_embeds.data = req.inputs_embeds.data + b"\0"
        requests.append(req)
        wants[step_id] = want
    responses = list(stub.DraftSteps(iter(requests), timeout=20))
    assert [r.step_id for r in responses] == [10, 11, 12, 13, 14]
    kinds = [r.WhichOneof("result") for r in responses]
    assert kinds == ["hidden_states", "error", "hidden_states", "error", "hidden_states"]
    assert (responses[1].error.code, responses[1].error.field, responses[1].error.reason) == (
        code_pb2.FAILED_PRECONDITION, "binding_generation", "STALE_BINDING")
    assert (responses[3].error.code, responses[3].error.field) == (code_pb2.INVALID_ARGUMENT, "inputs_embeds")
    for r in responses:
        if r.WhichOneof("result") == "hidden_states":
            assert torch.equal(codec.from_tensor_ref(r.hidden_states, "hidden_states"), wants[r.step_id])


def test_health_service_answers_for_the_sidecar_name(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for name in (SERVICE_NAME, ""):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_the_service(channel):
    db = ProtoReflectionDescriptorDatabase(channel)
    services = db.get_services()
    assert SERVICE_NAME in services and health.SERVICE_NAME in services
    svc = descriptor_pool.DescriptorPool(db).FindServiceByName(SERVICE_NAME)
    assert sorted(m.name for m in svc.methods) == sorted(
        ["GetStatus", "BindKV", "UnbindKV", "RegisterBuffers", "DraftStep", "DraftSteps", "AttachDoorbell",
         "UnregisterBuffers"])
