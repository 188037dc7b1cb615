"""A re-bind that fails leaves the sidecar's binding as it was: the shim still releases it when it lets go.

A refused BindKV changes nothing on the sidecar (MemoryBindings.bind: "the binding in place stands"), but
KVBinder.bind forgot the binding on any failure, and the shim's release (UnbindKV) names only the binding
it knows. An engine whose re-bind failed (its cache re-allocated, then the BindKV refused for good, or the
new cache not exportable) and which was then turned off or closed the shim sent no UnbindKV: the sidecar
kept the engine's old cache mapped (on a GPU, through torch's IPC limbo, still allocated on the engine's
side) until the sidecar restarted.
"""

from __future__ import annotations

import sys

import grpc
import pytest

from dspark_sidecar.client import shim as S
from dspark_sidecar.client.config import EngineConfig
from dspark_sidecar.client.forward_context import set_forward_context
from dspark_sidecar.client.shim import DrafterShim
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_fakes import FakeModel, FakeServer, FakeSidecar, shm_kv_cache, short_socket_dir, step_inputs


class _Recording(FakeSidecar):
    """Unbinds only the binding it holds, by id, as the sidecar does; records what it was asked to unbind."""

    def __init__(self) -> None:
        super().__init__(max_reqs=4)
        self.unbound: list[int] = []

    def UnbindKV(self, request, context):
        self.calls["UnbindKV"] += 1
        self.unbound.append(request.binding_id)
        if request.binding_id != self.binding_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "UNKNOWN_BINDING")
        self.binding_id = 0
        return pb.UnbindKVResponse()


@pytest.mark.parametrize("failure", ["refused for good", "not shareable"])
def test_a_binding_left_by_a_failed_rebind_is_released(failure, monkeypatch):
    """The engine re-allocates its cache and the re-bind fails: refused for good (INVALID_ARGUMENT: the shim
    turns itself off at once), or the new cache cannot be exported (the shim stays on, falling back, until
    close()). Either way the sidecar still holds the old binding, and the release names it."""
    from dspark_sidecar.client import binding

    server = FakeServer(_Recording(), short_socket_dir() / "rank0.sock").start()
    fake = server.sidecar
    kv = shm_kv_cache()
    shim = DrafterShim(EngineConfig(endpoint=server.endpoint, tp_size=4, step_deadline_s=2.0), FakeModel(),
                       lambda: [s.tensor for s in kv], ParallelContext(0, 1))
    ids, pos, meta = step_inputs(1)
    try:
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is not None
            held = fake.binding_id
            assert held
            old = list(kv)
            kv[:] = shm_kv_cache(num_pages=12)  # the engine re-allocates
            for s in old:
                s.close()
            if failure == "refused for good":
                fake.bind_error = (grpc.StatusCode.INVALID_ARGUMENT, "layers[0].dtype: refused")
            else:
                real = binding.export_handle

                def refuse(t):  # the export only (the identity's segment lookup goes through it too, on CPU)
                    if sys._getframe(1).f_code.co_name == "bind_request":
                        raise RuntimeError("injected: CUDA IPC handle refused for memory from expandable segments")
                    return real(t)
                monkeypatch.setattr(binding, "export_handle", refuse)
            assert shim.maybe_forward(ids, pos) is None
        if failure == "refused for good":  # turned off: the release has run
            assert not shim.enabled and fake.calls["BindKV"] == 2
        else:
            assert shim.enabled and fake.calls["BindKV"] == 1 and fake.binding_id == held
            assert shim.stats.fallbacks == {S.KV_NOT_SHAREABLE: 1}, shim.stats.fallbacks
            shim.close()
        assert fake.unbound == [held] and fake.binding_id == 0
    finally:
        shim.close()
        for s in kv:
            s.close()
        server.stop()


def _counting_exports(monkeypatch, fail_at: int | None = None) -> tuple[list, list]:
    """binding.export_handle faked as a CUDA IPC export (each one counts a consumer in torch's ref-counter file),
    refusing the export of layer `fail_at`; memory.discard_handle records what is given back. (The identity's
    segment lookup on CPU goes through export_handle too, and is answered by the real one.)"""
    from dspark_sidecar.client import binding
    from dspark_sidecar.proto import memory

    real, exported, given_back = binding.export_handle, [], []

    def export(t):
        if sys._getframe(1).f_code.co_name != "bind_request":
            return real(t)
        if len(exported) == fail_at:
            raise RuntimeError("injected: the driver refused the IPC handle")
        h = pb.MemoryHandle(cuda_ipc=pb.CudaIpcHandle(
            ipc_handle=b"h", storage_size_bytes=64, ref_counter_handle=b"torch_1_2", ref_counter_offset=len(exported)))
        exported.append(h)
        return h

    monkeypatch.setattr(binding, "export_handle", export)
    monkeypatch.setattr(memory, "discard_handle", given_back.append)
    return exported, given_back


def test_handles_exported_for_layers_before_one_that_fails_are_given_back(monkeypatch):
    """Each CUDA IPC export counts the sidecar as a consumer of the block until it lets go (torch's IPC limbo);
    the sidecar gives back the handles it is sent but never opens (MemoryBindings._discard), but handles a failed
    bind_request exported and never sent had no one to give them back: the engine's blocks stayed allocated after
    it freed that cache, until it exited (and each retry of the same cache, every UNSHAREABLE_RETRY_S, added one)."""
    import torch

    from dspark_sidecar.client import binding

    exported, given_back = _counting_exports(monkeypatch, fail_at=3)
    layers = [torch.zeros(2, 4, 16, 1, 8, dtype=torch.bfloat16) for _ in range(5)]
    with pytest.raises(binding.NotShareable, match="KV layer 3"):
        binding.bind_request(layers, pb.EngineFacts())
    assert len(exported) == 3 and given_back == exported
    # A layer whose dtype the wire has no name for: refused before its memory is exported, not after.
    exported[:], given_back[:] = [], []
    with pytest.raises(binding.BindError, match="KV layer 0.*no wire DType") as err:
        binding.bind_request([torch.zeros(2, 4, 16, 1, 8, dtype=torch.float64)] * 5, pb.EngineFacts())
    assert err.value.permanent and given_back == exported == []


def test_handles_of_a_bindkv_never_sent_are_given_back(monkeypatch):
    """The lease is taken after the layers are exported; a lease that raises (socket() out of descriptors) ended
    bind() with the request's handles exported and never sent."""
    import torch

    from dspark_sidecar.client.binding import KVBinder

    exported, given_back = _counting_exports(monkeypatch)
    binder = KVBinder(pb.EngineFacts())

    def no_lease(path, deadline_s):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(binder.lease, "token", no_lease)
    sent = []
    stub = type("Stub", (), {"BindKV": lambda self, req, timeout: sent.append(req)})()
    with pytest.raises(OSError):
        binder.bind(stub, [torch.zeros(2, 4, 16, 1, 8, dtype=torch.bfloat16) for _ in range(5)], 1.0, "/x/rank0.lease")
    assert not sent and len(exported) == 5 and given_back == exported
    assert binder.current is None and binder.held is None


def test_a_lease_that_takes_the_whole_deadline_sends_nothing_and_gives_the_handles_back(monkeypatch):
    """The bind's deadline spent waiting for the lease: BindKV is not sent with a deadline already past (or, before,
    with a fresh one: the bind ran past bind_deadline_s), the bind fails as passing, and its handles go back."""
    import torch

    from dspark_sidecar.client import binding
    from dspark_sidecar.client.binding import KVBinder

    exported, given_back = _counting_exports(monkeypatch)
    now = [50.0]
    monkeypatch.setattr(binding, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))
    binder = KVBinder(pb.EngineFacts())

    def slow_lease(path, deadline_s):
        now[0] += deadline_s
        return 0

    monkeypatch.setattr(binder.lease, "token", slow_lease)
    sent = []
    stub = type("Stub", (), {"BindKV": lambda self, req, timeout: sent.append(req)})()
    with pytest.raises(binding.BindError, match="DEADLINE_EXCEEDED") as err:
        binder.bind(stub, [torch.zeros(2, 4, 16, 1, 8, dtype=torch.bfloat16) for _ in range(5)], 1.0, "/x/rank0.lease")
    assert not err.value.permanent and not sent and len(exported) == 5 and given_back == exported
    assert binder.current is None
