"""The committed stubs match sidecar.proto, import through the package, and describe the intended service."""

from __future__ import annotations

import re
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10, which requires-python admits: the test extra's backport
    import tomli as tomllib

import grpc
import pytest
from google.protobuf import descriptor_pb2

import dspark_sidecar.proto as proto_pkg
from dspark_sidecar.proto import generate, sidecar_pb2, sidecar_pb2_grpc

PROTO_DIR = Path(proto_pkg.__file__).resolve().parent


def test_regenerated_stubs_are_byte_identical_to_committed(tmp_path):
    """THE stubs-match-the-.proto check: regenerate with the same generator and compare bytes."""
    from grpc_tools import grpc_version

    written = generate.generate(tmp_path)
    assert [p.name for p in written] == list(generate.GENERATED)
    for path in written:
        committed = (PROTO_DIR / path.name).read_bytes()
        assert path.read_bytes() == committed, (
            f"{path.name} differs from a fresh generation with grpcio-tools "
            f"{grpc_version.VERSION}: run `python -m dspark_sidecar.proto.generate`"
            " (with grpcio-tools 1.84.0) and commit the result"
        )


def test_the_generator_refuses_a_grpcio_tools_of_another_minor_and_writes_nothing(tmp_path, monkeypatch):
    """pip's pick for a bare `grpcio-tools` is 1.85: it stamps its version into sidecar_pb2_grpc.py (and its
    protoc's into sidecar_pb2.py), which the device's grpcio 1.84 refuses at import. The generator wrote them
    over the committed stubs all the same; the byte-identity test above, regenerating with those tools, passed
    on that machine (only the test extra's pin check, tests/test_readme_install.py, told, until it was bumped)."""
    from grpc_tools import grpc_version

    monkeypatch.setattr(grpc_version, "VERSION", "1.85.0")
    out = tmp_path / "stubs"
    with pytest.raises(RuntimeError, match=r"^grpcio-tools 1\.85\.0 is not 1\.84\.0: .*grpcio-tools==1\.84\.0"):
        generate.generate(out)
    assert not out.exists()


def test_the_generator_refuses_another_patch_release_of_the_pinned_minor(tmp_path, monkeypatch):
    """The stubs stamp grpcio-tools' whole version (GRPC_GENERATED_VERSION = '1.84.1'), not its minor: a 1.84.1
    wrote stubs that differ from the committed ones and that grpcio 1.84.0, which the package accepts, refuses
    at import. The generator checked the minor only and wrote them."""
    from grpc_tools import grpc_version

    monkeypatch.setattr(grpc_version, "VERSION", "1.84.1")
    out = tmp_path / "stubs"
    with pytest.raises(RuntimeError, match=r"^grpcio-tools 1\.84\.1 is not 1\.84\.0: .*grpcio-tools==1\.84\.0"):
        generate.generate(out)
    assert not out.exists()


def test_the_generator_requires_the_grpcio_tools_the_test_extra_pins():
    """One version in both places: the test extra installs what the generator accepts, and the stubs say it."""
    extras = tomllib.loads((PROTO_DIR.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = [d for d in extras["test"] if d.startswith("grpcio-tools")]
    assert pin == f"grpcio-tools=={generate.TOOLS_VERSION}"
    grpc_src = (PROTO_DIR / "sidecar_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{generate.TOOLS_VERSION}'" in grpc_src


def _floor(dist: str) -> tuple[int, ...]:
    """The lowest version of `dist` the package's runtime dependencies accept (pyproject.toml)."""
    deps = tomllib.loads((PROTO_DIR.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if re.match(rf"{dist}\s*>=", d)]
    return tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec)[1].split("."))


def _padded(v: tuple[int, ...]) -> tuple[int, ...]:
    return v + (0,) * (3 - len(v))


def test_the_committed_stubs_import_with_the_oldest_grpcio_and_protobuf_the_package_accepts():
    """The stubs refuse, at import, a grpcio older than the grpcio-tools that wrote them and a protobuf older
    than its protoc. The byte-identity test compares them with whatever grpcio-tools is installed, so stubs
    written by a newer one (with the test extra's pin bumped to match) passed it and failed on the device."""
    grpc_src = (PROTO_DIR / "sidecar_pb2_grpc.py").read_text()
    stamped = tuple(int(x) for x in re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_src)[1].split("."))
    assert _padded(stamped) <= _padded(_floor("grpcio")), (
        f"sidecar_pb2_grpc.py needs grpcio >= {stamped}, the package accepts {_floor('grpcio')}")
    pb2_src = (PROTO_DIR / "sidecar_pb2.py").read_text()
    gencode = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb2_src)
    protoc = tuple(int(x) for x in gencode.groups())
    assert _padded(protoc) <= _padded(_floor("protobuf")), (
        f"sidecar_pb2.py needs protobuf >= {protoc}, the package accepts {_floor('protobuf')}")


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


# Field numbers of every message, frozen: fields are added, never renumbered, and a removed one's
# number and name are `reserved` (sidecar.proto's compatibility rules). Only the hot-path messages were
# listed, so renumbering e.g. BindKVRequest.page_size or DraftStepRequest.launch_key (with the stubs
# regenerated) passed every test while an engine on the old contract sent garbage. A field or message
# added to the .proto is added here too, or the test says so.
FROZEN_NUMBERS = {
    "RegionSlice": {"region_id": 1, "offset_bytes": 2},
    "TensorRef": {"dtype": 1, "shape": 2, "data": 10, "region": 11},
    "SharedMemoryHandle": {"name": 1, "size_bytes": 2, "offset_bytes": 3},
    "CudaIpcHandle": {"device_index": 1, "device_uuid": 2, "ipc_handle": 3, "storage_size_bytes": 4,
        "storage_offset_bytes": 5, "ref_counter_handle": 6, "ref_counter_offset": 7, "event_handle": 8,
        "event_sync_required": 9},
    "MemoryHandle": {"shm": 1, "cuda_ipc": 2},
    "GetStatusRequest": {},
    "ModelSummary": {"architecture": 1, "preset": 2, "num_layers": 3, "hidden_size": 4,
        "num_attention_heads": 5, "num_kv_heads": 6, "head_dim": 7, "ffn_hidden_size": 8, "vocab_size": 9,
        "sliding_window": 10, "block_size": 11, "weight_format": 12, "compute_dtype": 13},
    "Limits": {"qpr": 1, "launch_reqs": 2, "max_reqs": 3, "max_message_bytes": 4},
    "Parallel": {"tp_size": 1, "tp_rank": 2, "dist_backend": 3, "device": 4},
    "KVBindingState": {"bound": 1, "binding_id": 2, "generation": 3, "num_layers": 4, "num_pages": 5,
        "page_size": 6, "kv_dtype": 7},
    "Counters": {"steps_ok": 1, "steps_aborted": 2, "steps_invalid": 3, "steps_failed": 4, "requests": 5,
        "rows": 6, "launches": 7, "kv_binds": 8, "steps_prelaunched": 9, "prelaunch_misses": 10,
        "steps_refused": 11},
    "LatencySummary": {"name": 1, "count": 2, "p50_ns": 3, "p99_ns": 4},
    "StatusReport": {"model": 1, "limits": 2, "parallel": 3, "backend": 10, "fast_path_refusal": 11,
        "serving": 12, "state": 13, "server_version": 14, "state_reason": 15, "instance": 16, "lease_socket": 17,
        "kv": 20, "counters": 21, "latencies": 22},
    "EngineFacts": {"engine_rank": 1, "tp_size": 2, "dp_size": 3, "pp_size": 4, "speculative_method": 5,
        "num_speculative_tokens": 6, "device": 7, "device_uuid": 8},
    "KVLayerBinding": {"layer": 1, "memory": 2, "dtype": 3, "shape": 4, "strides": 5, "storage_offset": 6},
    "BindKVRequest": {"engine": 1, "layers": 2, "page_size": 3, "lease": 4},
    "BindKVResponse": {"binding_id": 1, "generation": 2, "fast_path_refusal": 3, "backend": 4},
    "UnbindKVRequest": {"binding_id": 1},
    "UnbindKVResponse": {},
    "BufferRegion": {"name": 1, "memory": 2, "size_bytes": 3},
    "RegisterBuffersRequest": {"regions": 1, "owner": 2, "lease": 3},
    "RegisterBuffersResponse": {"region_ids": 1},
    "UnregisterBuffersRequest": {"region_ids": 1, "owner": 2},
    "UnregisterBuffersResponse": {},
    "DraftStepRequest": {"step_id": 1, "binding_id": 2, "binding_generation": 3, "num_requests": 4,
        "positions": 10, "inputs_embeds": 11, "input_ids": 12, "seq_lens": 13, "block_tables": 14,
        "slot_mapping": 15, "output": 20, "deadline_ms": 21, "launch_key": 22},
    "StepError": {"code": 1, "message": 2, "field": 3, "reason": 4},
    "StepTimings": {"queue_ns": 1, "rendezvous_ns": 2, "compute_ns": 3, "total_ns": 4, "launches": 5,
        "prelaunched": 6, "validate_ns": 7, "gpu_start_wait_ns": 8, "output_ns": 9, "gpu_word_wait_ns": 10,
        "seen_mono_ns": 11, "published_mono_ns": 12},
    "DraftStepResponse": {"step_id": 1, "hidden_states": 2, "error": 3, "timings": 4},
    "AttachDoorbellRequest": {"page": 1, "capacity_bytes": 2, "input_event": 3, "gpu_word": 4, "lease": 5},
    "AttachDoorbellResponse": {"output_event": 1, "wake_fifo": 2, "gpu_word": 3},
}


def _reserved(desc) -> tuple[set[int], set[str]]:
    proto = descriptor_pb2.DescriptorProto()
    desc.CopyToProto(proto)
    numbers = {n for r in proto.reserved_range for n in range(r.start, r.end)}  # end exclusive
    return numbers, set(proto.reserved_name)


@pytest.mark.parametrize("message", sorted(FROZEN_NUMBERS))
def test_field_numbers_are_frozen(message):
    desc = sidecar_pb2.DESCRIPTOR.message_types_by_name.get(message)
    assert desc is not None, f"message {message} was removed from sidecar.proto: the contract only adds"
    numbers = {f.name: f.number for f in desc.fields}
    reserved_numbers, reserved_names = _reserved(desc)
    for name, number in FROZEN_NUMBERS[message].items():
        if name in numbers:
            assert numbers[name] == number, f"{message}.{name} renumbered {number} -> {numbers[name]}"
        else:  # removed: its number and name may never come back
            assert number in reserved_numbers and name in reserved_names, (
                f"{message}.{name} = {number} was removed without `reserved {number};` and "
                f"`reserved \"{name}\";`")
    new = {k: v for k, v in numbers.items() if k not in FROZEN_NUMBERS[message]}
    assert not new, f"{message}: add {new} to FROZEN_NUMBERS (after checking no number was reused)"


# Each field's type, frozen like its number: a field whose wire type changes (uint64 -> fixed64, a scalar ->
# a message) is skipped as unknown by a peer on the old contract, which then reads the default (0, empty).
# With the stubs regenerated, RegionSlice.offset_bytes as a fixed64 passed every test in tests/proto.
FROZEN_TYPES = {
    "RegionSlice": {"region_id": "uint64", "offset_bytes": "uint64"},
    "TensorRef": {"dtype": "DType", "shape": "repeated int64", "data": "bytes", "region": "RegionSlice"},
    "SharedMemoryHandle": {"name": "string", "size_bytes": "uint64", "offset_bytes": "uint64"},
    "CudaIpcHandle": {"device_index": "int32", "device_uuid": "string", "ipc_handle": "bytes",
        "storage_size_bytes": "uint64", "storage_offset_bytes": "uint64", "ref_counter_handle": "bytes",
        "ref_counter_offset": "uint64", "event_handle": "bytes", "event_sync_required": "bool"},
    "MemoryHandle": {"shm": "SharedMemoryHandle", "cuda_ipc": "CudaIpcHandle"},
    "GetStatusRequest": {},
    "ModelSummary": {"architecture": "string", "preset": "string", "num_layers": "uint32", "hidden_size": "uint32",
        "num_attention_heads": "uint32", "num_kv_heads": "uint32", "head_dim": "uint32",
        "ffn_hidden_size": "uint32", "vocab_size": "uint32", "sliding_window": "uint32", "block_size": "uint32",
        "weight_format": "string", "compute_dtype": "string"},
    "Limits": {"qpr": "uint32", "launch_reqs": "uint32", "max_reqs": "uint32", "max_message_bytes": "uint64"},
    "Parallel": {"tp_size": "uint32", "tp_rank": "uint32", "dist_backend": "string", "device": "string"},
    "KVBindingState": {"bound": "bool", "binding_id": "uint64", "generation": "uint64", "num_layers": "uint32",
        "num_pages": "uint64", "page_size": "uint32", "kv_dtype": "DType"},
    "Counters": {"steps_ok": "uint64", "steps_aborted": "uint64", "steps_invalid": "uint64",
        "steps_failed": "uint64", "requests": "uint64", "rows": "uint64", "launches": "uint64",
        "kv_binds": "uint64", "steps_prelaunched": "uint64", "prelaunch_misses": "uint64", "steps_refused": "uint64"},
    "LatencySummary": {"name": "string", "count": "uint64", "p50_ns": "uint64", "p99_ns": "uint64"},
    "StatusReport": {"model": "ModelSummary", "limits": "Limits", "parallel": "Parallel", "backend": "string",
        "fast_path_refusal": "string", "serving": "bool", "state": "string", "server_version": "string",
        "state_reason": "string", "instance": "string", "lease_socket": "string", "kv": "KVBindingState",
        "counters": "Counters",
        "latencies": "repeated LatencySummary"},
    "EngineFacts": {"engine_rank": "uint32", "tp_size": "uint32", "dp_size": "uint32", "pp_size": "uint32",
        "speculative_method": "string", "num_speculative_tokens": "uint32", "device": "string",
        "device_uuid": "string"},
    "KVLayerBinding": {"layer": "uint32", "memory": "MemoryHandle", "dtype": "DType", "shape": "repeated int64",
        "strides": "repeated int64", "storage_offset": "int64"},
    "BindKVRequest": {"engine": "EngineFacts", "layers": "repeated KVLayerBinding", "page_size": "uint32",
        "lease": "uint64"},
    "BindKVResponse": {"binding_id": "uint64", "generation": "uint64", "fast_path_refusal": "string",
        "backend": "string"},
    "UnbindKVRequest": {"binding_id": "uint64"},
    "UnbindKVResponse": {},
    "BufferRegion": {"name": "string", "memory": "MemoryHandle", "size_bytes": "uint64"},
    "RegisterBuffersRequest": {"regions": "repeated BufferRegion", "owner": "uint64", "lease": "uint64"},
    "RegisterBuffersResponse": {"region_ids": "repeated uint64"},
    "UnregisterBuffersRequest": {"region_ids": "repeated uint64", "owner": "uint64"},
    "UnregisterBuffersResponse": {},
    "DraftStepRequest": {"step_id": "uint64", "binding_id": "uint64", "binding_generation": "uint64",
        "num_requests": "uint32", "positions": "TensorRef", "inputs_embeds": "TensorRef", "input_ids": "TensorRef",
        "seq_lens": "TensorRef", "block_tables": "TensorRef", "slot_mapping": "TensorRef", "output": "RegionSlice",
        "deadline_ms": "uint32", "launch_key": "uint32"},
    "StepError": {"code": "int32", "message": "string", "field": "string", "reason": "string"},
    "StepTimings": {"queue_ns": "uint64", "rendezvous_ns": "uint64", "compute_ns": "uint64", "total_ns": "uint64",
        "launches": "uint32", "prelaunched": "bool", "validate_ns": "uint64", "gpu_start_wait_ns": "uint64",
        "output_ns": "uint64", "gpu_word_wait_ns": "uint64", "seen_mono_ns": "uint64", "published_mono_ns": "uint64"},
    "DraftStepResponse": {"step_id": "uint64", "hidden_states": "TensorRef", "error": "StepError",
        "timings": "StepTimings"},
    "AttachDoorbellRequest": {"page": "MemoryHandle", "capacity_bytes": "uint64", "input_event": "bytes",
        "gpu_word": "bool", "lease": "uint64"},
    "AttachDoorbellResponse": {"output_event": "bytes", "wake_fifo": "string", "gpu_word": "bool"},
}


def _types(desc) -> dict[str, str]:
    """Each field's type as FROZEN_TYPES writes it, from the descriptor proto (label and type name
    are there in every protobuf runtime)."""
    proto = descriptor_pb2.DescriptorProto()
    desc.CopyToProto(proto)
    f = descriptor_pb2.FieldDescriptorProto
    kinds = {}
    for field in proto.field:
        kind = field.type_name.rsplit(".", 1)[-1] if field.type_name else f.Type.Name(field.type)[len("TYPE_"):].lower()
        kinds[field.name] = ("repeated " if field.label == f.LABEL_REPEATED else "") + kind
    return kinds


@pytest.mark.parametrize("message", sorted(FROZEN_TYPES))
def test_field_types_are_frozen(message):
    assert set(FROZEN_TYPES[message]) == set(FROZEN_NUMBERS[message]), f"{message}: add its fields to both tables"
    for name, kind in _types(sidecar_pb2.DESCRIPTOR.message_types_by_name[message]).items():
        was = FROZEN_TYPES[message].get(name, "absent from FROZEN_TYPES")
        assert kind == was, f"{message}.{name} changed type {was} -> {kind}: a peer on the old contract drops it"


def test_every_message_is_frozen():
    assert sorted(sidecar_pb2.DESCRIPTOR.message_types_by_name) == sorted(FROZEN_NUMBERS)


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
