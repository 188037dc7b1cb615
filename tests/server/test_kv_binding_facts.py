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
