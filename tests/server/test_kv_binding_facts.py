"""BindKV's engine facts (server/kv_binding.py): a request that carries none is told so."""

from __future__ import annotations

import grpc
import pytest
import torch

from dspark_sidecar.drafter.config import load_config
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.kv_binding import MemoryBindings


@pytest.mark.parametrize("engine", [None, pb.EngineFacts(engine_rank=0, dp_size=1, pp_size=1)])
def test_a_bind_without_the_engines_tp_size_is_invalid_not_a_tp_mismatch(engine):
    """EngineFacts unset (or its tp_size left 0: proto3's "not set") was FAILED_PRECONDITION TP_MISMATCH,
    "engine TP 0 != sidecar TP 1: start the sidecar with --tp 0": advice no one can follow, for a field
    the request did not send. It is INVALID_ARGUMENT naming engine.tp_size."""
    mem = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    req = pb.BindKVRequest(page_size=16)
    if engine is not None:
        req.engine.CopyFrom(engine)
    with pytest.raises(SidecarError) as err:
        mem.bind(req)
    e = err.value
    assert (e.code, e.field, e.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "engine.tp_size", "INVALID_FIELD"), e
    assert "--tp 0" not in e.message and "not set" in e.message, e.message
    assert mem.kv is None


@pytest.mark.parametrize("field", ["dp_size", "pp_size"])
def test_a_bind_without_the_engines_dp_or_pp_size_is_invalid_not_a_dp_or_pp_above_one(field):
    """dp_size or pp_size left 0 (proto3's "not set") was bound, and the fast path's refusal then read "DP > 1" or
    "PP > 1" of an engine that never said so. Refused as tp_size 0 is, naming the field, before any layer opens."""
    cfg = load_config("tiny")
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    facts = dict(engine_rank=0, tp_size=1, dp_size=1, pp_size=1)
    facts[field] = 0
    with pytest.raises(SidecarError) as err:
        mem.bind(pb.BindKVRequest(engine=pb.EngineFacts(**facts), page_size=16))
    e = err.value
    assert (e.code, e.field, e.reason) == (grpc.StatusCode.INVALID_ARGUMENT, f"engine.{field}", "INVALID_FIELD"), e
    assert "not set" in e.message and "1 for none" in e.message, e.message
    assert mem.kv is None


def _ipc(counter: bytes) -> pb.MemoryHandle:
    return pb.MemoryHandle(cuda_ipc=pb.CudaIpcHandle(device_uuid="GPU-other", ipc_handle=b"h", storage_size_bytes=64,
                                                     ref_counter_handle=counter, ref_counter_offset=8))


def test_facts_naming_another_gpu_than_the_ranks_own_are_refused_and_the_handles_given_back(monkeypatch):
    """EngineFacts.device_uuid was documented as compared with the sidecar's own GPU, and never was
    (only each IPC handle's). Refused as a handle from another GPU is, before any layer is opened."""
    from dspark_sidecar.server import kv_binding

    released = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter",
                        lambda handle, offset, **kw: released.append((handle, offset)), raising=False)
    monkeypatch.setattr(kv_binding, "gpu_uuid", lambda device: "GPU-this", raising=False)  # this rank's own GPU
    cfg = load_config("tiny")
    mem = MemoryBindings(cfg, 1, 0, torch.float32, torch.device("cpu"))
    layers = [pb.KVLayerBinding(layer=i, memory=_ipc(b"/torch_c%d" % i)) for i in range(cfg.num_hidden_layers)]
    req = pb.BindKVRequest(engine=pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1,
                                                 device_uuid="GPU-other"), layers=layers, page_size=16)
    with pytest.raises(SidecarError) as err:
        mem.bind(req)
    e = err.value
    assert (e.code, e.field, e.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "engine.device_uuid", "INVALID_FIELD"), e
    assert "GPU GPU-other, this rank runs on GPU GPU-this" in e.message, e.message
    assert released == [(b"/torch_c%d" % i, 8) for i in range(cfg.num_hidden_layers)] and mem.kv is None
    # Not named (the shim sends none today), or named alike: the check passes, and the binding goes on
    # to its layers (refused here further on: the tiny layers have no shape).
    for named in ("", "GPU-this"):
        req.engine.device_uuid = named
        with pytest.raises(SidecarError) as err:
            mem.bind(req)
        assert err.value.field != "engine.device_uuid", err.value
