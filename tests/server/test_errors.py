"""Exceptions to gRPC status: one mapping for every RPC and the stream."""

from __future__ import annotations

import grpc

from dspark_sidecar.proto.memory import HandleError, HandleExhausted, HandleUncheckable
from dspark_sidecar.server.errors import as_sidecar_error, invalid, precondition, to_status, to_step_error


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


def test_a_handle_not_mapped_for_want_of_descriptors_or_memory_is_unavailable_not_invalid():
    """EMFILE/ENFILE/ENOMEM opening a segment, or the driver out of memory opening a CUDA IPC handle, was
    INVALID_ARGUMENT, which client/binding.py reads as permanent: a passing shortage of the sidecar's
    turned the engine's fast path off for good. UNAVAILABLE (retried), naming the field."""
    from dspark_sidecar.client.binding import _PERMANENT_CODES

    err = as_sidecar_error(HandleExhausted("layers[3].memory: cannot open shared memory 'psm_x': [Errno 24] Too "
                                           "many open files"))
    assert (err.code, err.field, err.reason) == (grpc.StatusCode.UNAVAILABLE, "layers[3].memory", "MAP_EXHAUSTED")
    assert err.message.startswith("layers[3].memory: cannot open shared memory") and "try again" in err.message
    assert err.code not in _PERMANENT_CODES


def test_unexpected_exception_is_internal():
    err = as_sidecar_error(KeyError("boom"))
    assert err.code == grpc.StatusCode.INTERNAL and "KeyError" in err.message


def test_an_unexpected_exception_whose_text_cannot_be_formatted_is_still_internal_naming_its_type():
    """str() of a third-party exception with a broken __str__ raised inside the mapping: the call ended UNKNOWN."""
    class Unprintable(Exception):
        def __str__(self):
            raise ValueError("no text")

    err = as_sidecar_error(Unprintable())
    assert (err.code, err.reason) == (grpc.StatusCode.INTERNAL, "INTERNAL")
    assert err.message == "internal error: Unprintable: <its message could not be formatted: ValueError>"


def test_a_precondition_carries_its_reason_and_its_field():
    """precondition(message, reason, field): the engine switches on the reason (REFUSED, STORE_ORDER,
    NO_DEVICE_EVENTS...) and reads the field from BadRequest; swapped, it switched on a field name."""
    err = precondition("input_event: this rank computes on cpu", "NO_DEVICE_EVENTS", "input_event")
    assert (err.code, err.reason, err.field) == (grpc.StatusCode.FAILED_PRECONDITION, "NO_DEVICE_EVENTS", "input_event")
    assert precondition("fast path refused", "REFUSED").field == ""


def test_a_handle_error_that_names_no_field_is_invalid_argument_with_no_field():
    """No "field: " prefix: the whole text is the message, and no BadRequest names a field (a field made of the
    message would send the engine after a request field that does not exist)."""
    err = as_sidecar_error(HandleError("cannot export memory of device type meta"))
    assert (err.code, err.field, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "", "INVALID_FIELD")
    assert err.message == "cannot export memory of device type meta" and len(to_status(err).details) == 1


def test_a_step_failure_whose_text_has_a_lone_surrogate_is_still_answered():
    """The stream's path (rank.answer): as_sidecar_error and to_step_error must not raise on a message UTF-8
    cannot encode, or the exception ends the engine's whole DraftSteps stream instead of one step."""
    step = to_step_error(as_sidecar_error(RuntimeError("socket dir /run/\udcffx is gone")))
    assert step.code == grpc.StatusCode.INTERNAL.value[0] and "/run/\\udcffx" in step.message
    assert to_status(invalid("f", "\udcff")).message == "f: \\udcff"


def test_a_handle_the_sidecar_could_not_check_that_names_no_field_has_no_field():
    """As HandleError's: no "field: " prefix, no field (UNAVAILABLE all the same, and MAP_EXHAUSTED likewise)."""
    err = as_sidecar_error(HandleUncheckable("cannot check the handle's storage (status 201)"))
    assert (err.code, err.field, err.reason) == (grpc.StatusCode.UNAVAILABLE, "", "HANDLE_UNCHECKED")
    assert len(to_status(err).details) == 1
    err = as_sidecar_error(HandleExhausted("cannot open shared memory (Too many open files)"))
    assert (err.code, err.field, err.reason) == (grpc.StatusCode.UNAVAILABLE, "", "MAP_EXHAUSTED")


def test_a_step_error_carries_the_reason_not_the_code_s_name():
    """The engine switches on StepError.reason (STEP_STUCK, STORE_ORDER...), which a code's name cannot stand for."""
    step = to_step_error(precondition("step 4 ran past its deadline", "STEP_STUCK"))
    assert (step.code, step.reason) == (grpc.StatusCode.FAILED_PRECONDITION.value[0], "STEP_STUCK")
