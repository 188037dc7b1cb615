"""Hosts that may show stores out of order refuse the shared-memory protocols that rely on that order."""

from __future__ import annotations

import platform
from types import SimpleNamespace

import grpc
import pytest
import torch

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.doorbell import stores_in_order
from dspark_sidecar.server.app import serve_rank
from dspark_sidecar.server.config import ServeConfig, ServeConfigError
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.refusal import HostFacts
from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle


@pytest.mark.parametrize("machine,ordered", [("x86_64", True), ("AMD64", True), ("aarch64", False),
                                             ("arm64", False), ("ppc64le", False), ("riscv64", False)])
def test_only_x86_64_counts_as_ordering_stores_as_written(machine, ordered):
    assert stores_in_order(machine) is ordered


def _servicer(host: HostFacts) -> DrafterServicer:
    ctx = SimpleNamespace(rank=0, fast=None, memory=SimpleNamespace(kv=None))
    return DrafterServicer(ctx, None, Lifecycle(backend="triton", host=host), None, None, "")  # type: ignore[arg-type]


def test_the_doorbell_is_refused_on_a_weakly_ordered_host(monkeypatch):
    """FAILED_PRECONDITION with its own reason, before any memory is mapped: the shim then keeps the
    gRPC stream (client/shim.py _attach_doorbell), whose socket calls order what each side wrote."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    svc = _servicer(HostFacts(False, False, 1, stores_in_order=False))
    context = SimpleNamespace(peer=lambda: "unix:/tmp/engine.sock")
    with pytest.raises(SidecarError) as err:
        svc.AttachDoorbell(pb.AttachDoorbellRequest(), context)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "STORE_ORDER"
    assert "aarch64" in err.value.message and "gRPC stream" in err.value.message
    # On an ordered host the same (empty) request gets past that check, to the page's own.
    with pytest.raises(SidecarError) as err:
        _servicer(HostFacts(False, False, 1)).AttachDoorbell(pb.AttachDoorbellRequest(), context)
    assert err.value.reason == "INVALID_FIELD" and "POSIX shared memory" in err.value.message


def test_ranks_above_one_refuse_to_start_on_a_weakly_ordered_host(monkeypatch):
    """The ranks' step rendezvous is a shared-memory board with the same protocol: TP > 1 exits at
    once with why (before any signal handler, process group or weights); TP 1 has no board to share."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(ServeConfigError, match="--tp 2 on this aarch64 host: .*in the order written"):
        serve_rank(ServeConfig(tp=2), rank=0, world=2, local_rank=0)


@pytest.mark.parametrize("world,machine,words", [
    ("2", "aarch64", ("--tp 2 on this aarch64 host", "in the order written")),
    ("3", "x86_64", ("--tp 2", "WORLD_SIZE 3")),
])
def test_a_rank_refusing_its_tp_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path, world, machine, words):
    """A --tp the rank cannot serve (a weakly ordered host; torchrun starting another number of ranks) was a
    SystemExit with the reason: exit 1, the line without its "dspark-sidecar: ", which the launcher reports as
    a rank's failure and systemd restarts every 5 s for ever, on a host no restart changes. A rank's refusal of
    a flag its host cannot run is one line and exit 2 (OPERATIONS.md, "Stopping"; as --backend's)."""
    from helpers.refusals import refused

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world)
    sock = tmp_path / "sock"
    refused(["serve", "--tp", "2", "--random-weights", "--device", "cpu", "--socket-dir", str(sock)], capsys, *words,
            sock_dir=sock)


def test_a_cuda_ipc_page_refused_for_store_order_is_given_back(monkeypatch):
    """The STORE_ORDER refusal came before the page-kind check, which gives a GPU page back: on a weakly
    ordered host the engine's block stayed allocated (torch's producer reference) until it exited."""
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    released = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter",
                        lambda handle, offset, **kw: released.append((handle, offset)), raising=False)
    page = pb.MemoryHandle(cuda_ipc=pb.CudaIpcHandle(ipc_handle=b"h", storage_size_bytes=64,
                                                     ref_counter_handle=b"/torch_c0", ref_counter_offset=8))
    svc = _servicer(HostFacts(False, False, 1, stores_in_order=False))
    with pytest.raises(SidecarError) as err:
        svc.AttachDoorbell(pb.AttachDoorbellRequest(page=page, capacity_bytes=4096),
                           SimpleNamespace(peer=lambda: "unix:/tmp/engine.sock"))
    assert err.value.reason == "STORE_ORDER"
    assert released == [(b"/torch_c0", 8)]


def test_a_cuda_ipc_page_refused_while_the_rank_loads_is_given_back(monkeypatch):
    """While loading, LateServicer refuses every call (UNAVAILABLE, LOADING) and gives BindKV's and
    RegisterBuffers' handles back; AttachDoorbell's page was not, though the servicer gives a GPU page
    back on each of its own refusals: the engine's block stayed allocated until it exited."""
    from dspark_sidecar.server.app import LateServicer

    released = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter",
                        lambda handle, offset, **kw: released.append((handle, offset)), raising=False)
    page = pb.MemoryHandle(cuda_ipc=pb.CudaIpcHandle(ipc_handle=b"h", storage_size_bytes=64,
                                                     ref_counter_handle=b"/torch_c1", ref_counter_offset=16))
    with pytest.raises(SidecarError) as err:
        LateServicer().AttachDoorbell(pb.AttachDoorbellRequest(page=page, capacity_bytes=4096),
                                      SimpleNamespace(peer=lambda: "unix:/tmp/engine.sock"))
    assert err.value.reason == "LOADING"
    assert released == [(b"/torch_c1", 16)]
