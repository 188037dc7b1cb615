"""Exceptions to gRPC status: one mapping for every RPC and the stream."""

from __future__ import annotations

import grpc

from dspark_sidecar.proto.memory import HandleError, HandleUncheckable
from dspark_sidecar.server.errors import as_sidecar_error, to_status, to_step_error


def test_unmappable_handle_is_invalid_argument_naming_the_field():
    err = as_sidecar_error(HandleError("layers[2].memory: cannot open shared memory 'psm_x'"))
    assert (err.code, err.field, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "layers[2].memory", "INVALID_FIELD")
    assert err.message == "layers[2].memory: cannot open shared memory 'psm_x'"
    assert to_status(err).code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and len(to_status(err).details) == 2
    assert to_step_error(err).field == "layers[2].memory"


def test_a_handle_the_sidecar_could_not_check_is_unavailable_not_invalid():
    """The driver's query failed (run 266: status 201 on a thread with no context): nothing in the handle is
    wrong, so the engine must not read it as a permanent refusal (client/binding.py's INVALID_ARGUMENT)."""
    err = as_sidecar_error(HandleUncheckable("layers[0].memory: cannot check the handle's storage (status 201)"))
    assert (err.code, err.field, err.reason) == (grpc.StatusCode.UNAVAILABLE, "layers[0].memory", "HANDLE_UNCHECKED")
    assert err.message == "layers[0].memory: cannot check the handle's storage (status 201)"


def test_unexpected_exception_is_internal():
    err = as_sidecar_error(KeyError("boom"))
    assert err.code == grpc.StatusCode.INTERNAL and "KeyError" in err.message
