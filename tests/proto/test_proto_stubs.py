"""The committed stubs match sidecar.proto, import through the package, and describe the intended service."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

import dspark_sidecar.proto as proto_pkg
from dspark_sidecar.proto import generate, sidecar_pb2, sidecar_pb2_grpc

PROTO_DIR = Path(proto_pkg.__file__).resolve().parent


def test_regenerated_stubs_are_byte_identical_to_committed(tmp_path):
    """THE stubs-match-the-.proto check: regenerate with the same generator and compare bytes."""
    import grpc_tools

    written = generate.generate(tmp_path)
    assert [p.name for p in written] == list(generate.GENERATED)
    for path in written:
        committed = (PROTO_DIR / path.name).read_bytes()
        assert path.read_bytes() == committed, (
            f"{path.name} differs from a fresh generation with grpcio-tools "
            f"{getattr(grpc_tools, '__version__', '?')}: run `python -m dspark_sidecar.proto.generate`"
            " (with grpcio-tools 1.84.x) and commit the result"
        )


def test_generator_cli_writes_to_out(tmp_path):
    assert generate.main(["--out", str(tmp_path / "stubs")]) == 0
    assert sorted(p.name for p in (tmp_path / "stubs").iterdir()) == sorted(generate.GENERATED)


def test_grpc_stub_imports_pb2_through_the_package():
    src = (PROTO_DIR / "sidecar_pb2_grpc.py").read_text()
    assert "from dspark_sidecar.proto import sidecar_pb2" in src
    assert "\nimport sidecar_pb2" not in src
    assert sidecar_pb2_grpc.dspark__sidecar_dot_proto_dot_sidecar__pb2 is sidecar_pb2


def test_service_methods_and_streaming_kinds():
    service = sidecar_pb2.DESCRIPTOR.services_by_name["DrafterSidecar"]
    assert service.full_name == proto_pkg.SERVICE_NAME == "dspark.sidecar.v1.DrafterSidecar"
    proto = descriptor_pb2.ServiceDescriptorProto()
    service.CopyToProto(proto)
    kinds = {
        m.name: (m.input_type.rsplit(".", 1)[1], m.output_type.rsplit(".", 1)[1],
                 m.client_streaming, m.server_streaming)
        for m in proto.method
    }
    assert kinds == {
        "GetStatus": ("GetStatusRequest", "StatusReport", False, False),
        "BindKV": ("BindKVRequest", "BindKVResponse", False, False),
        "UnbindKV": ("UnbindKVRequest", "UnbindKVResponse", False, False),
        "RegisterBuffers": ("RegisterBuffersRequest", "RegisterBuffersResponse", False, False),
        "DraftStep": ("DraftStepRequest", "DraftStepResponse", False, False),
        "DraftSteps": ("DraftStepRequest", "DraftStepResponse", True, True),
        "AttachDoorbell": ("AttachDoorbellRequest", "AttachDoorbellResponse", False, False),
        "UnregisterBuffers": ("UnregisterBuffersRequest", "UnregisterBuffersResponse", False, False),
    }
    # The generated client stub and servicer base expose exactly these methods (channels
    # connect lazily, so a stub on a socket nobody listens to is fine for introspection).
    with grpc.insecure_channel("unix:/nonexistent/dspark-sidecar.sock") as channel:
        stub = sidecar_pb2_grpc.DrafterSidecarStub(channel)
        for name in kinds:
            assert callable(getattr(stub, name))
            assert callable(getattr(sidecar_pb2_grpc.DrafterSidecarServicer, name))


def test_oneofs_of_the_step_messages():
    req = sidecar_pb2.DraftStepRequest.DESCRIPTOR
    assert [f.name for f in req.oneofs_by_name["input"].fields] == ["inputs_embeds", "input_ids"]
    resp = sidecar_pb2.DraftStepResponse.DESCRIPTOR
    assert [f.name for f in resp.oneofs_by_name["result"].fields] == ["hidden_states", "error"]
    ref = sidecar_pb2.TensorRef.DESCRIPTOR
    assert [f.name for f in ref.oneofs_by_name["payload"].fields] == ["data", "region"]
    mem = sidecar_pb2.MemoryHandle.DESCRIPTOR
    assert [f.name for f in mem.oneofs_by_name["kind"].fields] == ["shm", "cuda_ipc"]


def test_dtype_enum_values():
    assert dict(sidecar_pb2.DType.items()) == {
        "DTYPE_UNSPECIFIED": 0, "DTYPE_BF16": 1, "DTYPE_FP16": 2, "DTYPE_FP32": 3,
        "DTYPE_INT32": 4, "DTYPE_INT64": 5, "DTYPE_FP8_E4M3": 6, "DTYPE_UINT8": 7,
    }


# Field numbers of the hot-path messages, frozen: fields are added, never renumbered.
FROZEN_NUMBERS = {
    "RegionSlice": {"region_id": 1, "offset_bytes": 2},
    "TensorRef": {"dtype": 1, "shape": 2, "data": 10, "region": 11},
    "DraftStepRequest": {
        "step_id": 1, "binding_id": 2, "binding_generation": 3, "num_requests": 4,
        "positions": 10, "inputs_embeds": 11, "input_ids": 12, "seq_lens": 13,
        "block_tables": 14, "slot_mapping": 15, "output": 20, "deadline_ms": 21,
    },
    "DraftStepResponse": {"step_id": 1, "hidden_states": 2, "error": 3, "timings": 4},
    "StepError": {"code": 1, "message": 2, "field": 3, "reason": 4},
    "StepTimings": {"queue_ns": 1, "rendezvous_ns": 2, "compute_ns": 3, "total_ns": 4,
                    "launches": 5},
}


@pytest.mark.parametrize("message", sorted(FROZEN_NUMBERS))
def test_hot_path_field_numbers_are_frozen(message):
    desc = sidecar_pb2.DESCRIPTOR.message_types_by_name[message]
    numbers = {f.name: f.number for f in desc.fields}
    # Every frozen field still has its number; new fields may exist beyond these.
    assert {k: numbers.get(k) for k in FROZEN_NUMBERS[message]} == FROZEN_NUMBERS[message]


def _source_descriptor(tmp_path) -> descriptor_pb2.FileDescriptorProto:
    """The .proto's descriptor with comments (source info), compiled by grpc_tools.protoc."""
    from grpc_tools import protoc

    out = tmp_path / "sidecar.desc"
    rc = protoc.main([
        "grpc_tools.protoc", f"-I{generate.VIRTUAL_DIR}={PROTO_DIR}", "--include_source_info",
        f"--descriptor_set_out={out}", f"{generate.VIRTUAL_DIR}/{generate.PROTO_NAME}",
    ])
    assert rc == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fd,) = fds.file
    return fd


def test_every_element_of_the_proto_is_documented(tmp_path):
    fd = _source_descriptor(tmp_path)
    comments = {tuple(loc.path): loc.leading_comments.strip() for loc in fd.source_code_info.location}
    # descriptor.proto field numbers: file.message_type=4, message.field=2, message.oneof_decl=8,
    # file.enum_type=5, enum.value=2, file.service=6, service.method=2.
    undocumented = []

    def need(path, what):
        if not comments.get(tuple(path)):
            undocumented.append(what)

    for i, msg in enumerate(fd.message_type):
        need([4, i], msg.name)
        for j, field in enumerate(msg.field):
            need([4, i, 2, j], f"{msg.name}.{field.name}")
        for j, oneof in enumerate(msg.oneof_decl):
            need([4, i, 8, j], f"{msg.name}.{oneof.name} (oneof)")
    for i, enum in enumerate(fd.enum_type):
        need([5, i], enum.name)
        for j, value in enumerate(enum.value):
            need([5, i, 2, j], f"{enum.name}.{value.name}")
    for i, svc in enumerate(fd.service):
        need([6, i], svc.name)
        for j, method in enumerate(svc.method):
            need([6, i, 2, j], f"{svc.name}.{method.name}")
    assert len(fd.message_type) >= 25
    assert undocumented == []


def test_header_states_compatibility_rule_and_health_name():
    text = (PROTO_DIR / "sidecar.proto").read_text()
    header = text[: text.index("syntax =")]
    assert "never renumbered" in header
    assert '"dspark.sidecar.v1.DrafterSidecar"' in header
