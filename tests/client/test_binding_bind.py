"""KVBinder.bind against a stub sidecar: refusals for good or passing, answers trusted, the unshareable memo."""

from __future__ import annotations

import sys

import grpc
import pytest
import torch

from dspark_sidecar.client import binding
from dspark_sidecar.client.binding import BindError, KVBinder, NotShareable
from dspark_sidecar.proto import memory
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_fakes import shm_kv_cache


class _Refused(grpc.RpcError):
    """A BindKV refusal as the sidecar sends it: the code, with its rich status (ErrorInfo.reason) in the trailers."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        from dspark_sidecar.server.errors import SidecarError, to_status

        self._code, self._status = code, to_status(SidecarError(code, f"refused: {reason}", "", reason))

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._status.message

    def trailing_metadata(self) -> tuple:
        return (("grpc-status-details-bin", self._status.SerializeToString()),)


class _Stub:
    """BindKV answers `answer` (a BindKVResponse, or an RpcError to raise); the requests are kept."""

    def __init__(self, answer) -> None:
        self.answer, self.requests = answer, []

    def BindKV(self, request, timeout):
        self.requests.append(request)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.fixture
def kv():
    caches = shm_kv_cache()
    yield caches
    for s in caches:
        s.close()


@pytest.mark.parametrize("code, reason, permanent", [
    (grpc.StatusCode.FAILED_PRECONDITION, "TP_MISMATCH", True),  # engine TP != sidecar TP: the deployment
    (grpc.StatusCode.FAILED_PRECONDITION, "RANK_MISMATCH", True),
    (grpc.StatusCode.PERMISSION_DENIED, "REMOTE_PEER", True),
    (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_FIELD", True),
    # For good by the code alone, whatever the reason (the sidecar's default one is the code's name).
    (grpc.StatusCode.OUT_OF_RANGE, "OUT_OF_RANGE", True),
    (grpc.StatusCode.UNIMPLEMENTED, "UNIMPLEMENTED", True),  # no BindKV there: not a sidecar this shim can use
    (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED", True),
    (grpc.StatusCode.FAILED_PRECONDITION, "LEASE_LOST", False),  # take a new lease and bind again
    (grpc.StatusCode.FAILED_PRECONDITION, "LOADING", False),
    (grpc.StatusCode.UNAVAILABLE, "MAP_EXHAUSTED", False),  # the sidecar ran short of descriptors: passing
])
def test_a_bindkv_refusal_is_for_good_by_its_code_or_its_reason(kv, code, reason, permanent):
    """FAILED_PRECONDITION is passing as a code, for good by reason where the deployment is wrong (a TP or rank
    mismatch): read as passing, the engine paid a BindKV every breaker period for its life and never turned off."""
    binder, stub = KVBinder(pb.EngineFacts()), _Stub(pb.BindKVResponse(binding_id=7, generation=1))
    bound = binder.bind(stub, [s.tensor for s in kv], 1.0)
    stub.answer = _Refused(code, reason)  # a re-bind (a catch-up, a re-allocated cache) refused
    with pytest.raises(BindError) as err:
        binder.bind(stub, [s.tensor for s in kv], 1.0)
    assert err.value.permanent is permanent and reason in str(err.value) and code.name in str(err.value)
    # Not bound: no step names it; the sidecar keeps it (a refused BindKV changes nothing), so release names it.
    assert binder.current is None and binder.generation == 0 and binder.held is bound
    assert binder.binds == 1, "a refused BindKV was counted as a bind"


@pytest.mark.parametrize("binding_id, generation, trusted", [
    (1, 1, True), ((1 << 63) - 1, (1 << 62) - 1, True),
    (0, 1, False),  # proto3's "not set"
    (1, 0, False), (1 << 63, 1, False), (1, 1 << 62, False),
])
def test_an_answer_naming_ids_no_sidecar_hands_out_is_not_taken_as_a_binding(kv, binding_id, generation, trusted):
    """The ids travel through the ranks' int64 agreement; generation 0 reads there as "not bound"."""
    binder = KVBinder(pb.EngineFacts())
    stub = _Stub(pb.BindKVResponse(binding_id=binding_id, generation=generation))
    if trusted:
        b = binder.bind(stub, [s.tensor for s in kv], 1.0)
        assert (b.binding_id, b.generation) == (binding_id, generation) and binder.held is b
    else:
        first = binder.bind(_Stub(pb.BindKVResponse(binding_id=7, generation=1)), [s.tensor for s in kv], 1.0)
        with pytest.raises(BindError, match="outside what a sidecar hands out") as err:
            binder.bind(stub, [s.tensor for s in kv], 1.0)  # a re-bind (a catch-up) answered so
        # The binding bound before is not the current one either: the sidecar may have replaced it.
        assert not err.value.permanent and binder.current is None and binder.generation == 0
        assert binder.held is first and binder.binds == 1


def test_a_cache_found_unshareable_does_not_hold_back_a_later_one_at_its_place(kv, monkeypatch):
    """The memo of the cache torch refused to export is for that cache only: once another exports, it goes. Kept,
    a cache the allocator placed where the refused one was (the same address and layout: the same identity) was
    refused unexported, without a try, for the rest of UNSHAREABLE_RETRY_S."""
    real, refusing = binding.export_handle, {"on": True}

    def export(t):
        if sys._getframe(1).f_code.co_name == "bind_request" and refusing["on"]:
            raise RuntimeError("injected: a passing driver failure")
        return real(t)

    monkeypatch.setattr(binding, "export_handle", export)
    binder, stub = KVBinder(pb.EngineFacts()), _Stub(pb.BindKVResponse(binding_id=7, generation=1))
    first = [s.tensor for s in kv]
    with pytest.raises(NotShareable):
        binder.bind(stub, first, 1.0)
    refusing["on"] = False
    other = shm_kv_cache()
    try:
        binder.bind(stub, [s.tensor for s in other], 1.0)  # the engine re-allocated: exported and bound
        stub.answer = pb.BindKVResponse(binding_id=8, generation=2)
        assert binder.bind(stub, first, 1.0).binding_id == 8  # the first cache's identity again: tried, and bound
        assert len(stub.requests) == 2
    finally:
        for s in other:
            s.close()


def test_an_fp8_e4m3_cache_is_bound_as_it_is():
    """float8_e4m3fn is the fp8 cache the sidecar serves (vllm_plugin passes e4m3 at scale 1 as it): sent as such,
    not refused with the other fp8 kinds."""
    layers = [memory.shm_empty((2, 8, 16, 1, 64), torch.float8_e4m3fn) for _ in range(5)]
    try:
        req = binding.bind_request([s.tensor for s in layers], pb.EngineFacts())
        assert [lb.dtype for lb in req.layers] == [pb.DTYPE_FP8_E4M3] * 5 and req.page_size == 16
    finally:
        for s in layers:
            s.close()


class _Clock:
    """binding's monotonic clock, moved on by hand (a lease socket that is slow to hand out its token)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_the_lease_is_taken_inside_the_binds_deadline_not_before_it(kv, monkeypatch):
    """bind() waited for the lease up to deadline_s, then gave BindKV a whole deadline_s again: a sidecar slow to
    hand out its token held the engine's step for twice bind_deadline_s, past what agreement_timeout_s counts for
    each bind (a peer waiting in the agreement gave this rank up for dead). The lease gets what the layers' export
    left of the deadline, BindKV what the lease left."""
    clock = _Clock()
    monkeypatch.setattr(binding, "time", clock)
    real_request = binding.bind_request

    def slow_export(layers, facts):
        clock.now += 0.125
        return real_request(layers, facts)

    monkeypatch.setattr(binding, "bind_request", slow_export)
    binder, stub = KVBinder(pb.EngineFacts()), _Stub(pb.BindKVResponse(binding_id=7, generation=1))
    timeouts, lease_waits = [], []

    def slow_lease(path, deadline_s):
        lease_waits.append(deadline_s)
        clock.now += 0.625
        return 0  # timed out: no lease (lease.token says so and binds without one)

    real_bind = stub.BindKV
    stub.BindKV = lambda req, timeout: (timeouts.append(timeout), real_bind(req, timeout))[1]
    monkeypatch.setattr(binder.lease, "token", slow_lease)
    assert binder.bind(stub, [s.tensor for s in kv], 1.0, "/x/rank0.lease").binding_id == 7
    assert lease_waits == [pytest.approx(0.875)] and timeouts == [pytest.approx(0.25)]


def test_release_unbinds_the_binding_held_once_and_forgets_it(kv):
    """release() names the binding the sidecar holds, then forgets it: a second release (a close after a turn-off)
    sends nothing, where it named a binding the sidecar no longer has."""
    binder, stub = KVBinder(pb.EngineFacts()), _Stub(pb.BindKVResponse(binding_id=7, generation=1))
    unbound = []
    stub.UnbindKV = lambda req, timeout: unbound.append(req.binding_id)
    binder.bind(stub, [s.tensor for s in kv], 1.0)
    binder.release(stub, 1.0)
    binder.release(stub, 1.0)
    assert unbound == [7] and binder.held is None and binder.current is None and binder.generation == 0


@pytest.mark.parametrize("how", ["link closed", "refused", "unanswered"])
def test_a_release_that_cannot_reach_the_sidecar_forgets_the_binding_without_raising(kv, how):
    """release() is best effort: with the link already dropped (no stub: a broken stream, a NOT_SERVING status), or
    an UnbindKV refused (UNKNOWN_BINDING: the sidecar restarted or was re-bound since) or past its deadline, it
    forgets the binding and returns. Raised, the shim's release stopped there (_finish_close, _disable): no link
    dropped, and no lease ended, whose end is what releases such a binding at the sidecar."""
    binder, stub = KVBinder(pb.EngineFacts()), _Stub(pb.BindKVResponse(binding_id=7, generation=1))
    binder.bind(stub, [s.tensor for s in kv], 1.0)
    asked = []

    def unbind(req, timeout):
        asked.append((req.binding_id, timeout))
        if how == "refused":
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, "UNKNOWN_BINDING")
        raise _Refused(grpc.StatusCode.DEADLINE_EXCEEDED, "")

    stub.UnbindKV = unbind
    binder.release(None if how == "link closed" else stub, 0.5)
    assert asked == ([] if how == "link closed" else [(7, 0.5)])
    assert binder.held is None and binder.current is None and binder.generation == 0
