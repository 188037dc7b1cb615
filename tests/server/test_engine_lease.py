"""A real sidecar releases the KV binding of an engine process that ended, however it ended (server/lease.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.proto.rich_status import error_reason
from helpers.sidecar_proc import SidecarProcess
from helpers.waiting import wait_until

TESTS = Path(__file__).resolve().parents[1]
PAGES = 16


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (the launcher's rank processes)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def _mapped(pids: list[int], names: list[str]) -> set[str]:
    """Which of the shared-memory segments `names` any of `pids` still maps."""
    found = set()
    for p in pids:
        maps = Path(f"/proc/{p}/maps").read_text()
        found |= {n for n in names if f"/dev/shm{n if n.startswith('/') else '/' + n}" in maps}
    return found


def _engine(sc: SidecarProcess, *extra: str) -> tuple[subprocess.Popen, int, list[str]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-m", "helpers.lease_engine", sc.socket(0), str(PAGES), "float32",
                              *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = child.stdout.readline().split()
    assert line, f"the engine process ended before binding (rc {child.wait()})"
    return child, int(line[0]), line[1:]


def _status(stub) -> pb.StatusReport:
    return stub.GetStatus(pb.GetStatusRequest(), timeout=10)


def _unlink(names: list[str]) -> None:
    for n in names:  # what a killed engine left in /dev/shm
        Path("/dev/shm", n.lstrip("/")).unlink(missing_ok=True)


@pytest.mark.parametrize("how", ["SIGKILL", "exit"])
def test_the_binding_of_an_engine_that_ended_is_released_and_its_cache_unmapped(tmp_path, tiny_ckpt, how):
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        assert _status(stub).lease_socket.endswith("rank0.lease")
        child, binding, segments = _engine(sc, "--buffers")  # the cache, the doorbell and the step buffers
        try:
            assert len(segments) == 9  # 5 layers, the doorbell's page, 3 regions
            pids = _tree(sc.proc.pid)
            kv = _status(stub).kv
            assert kv.bound and kv.binding_id == binding
            assert _mapped(pids, segments) == set(segments)  # the sidecar maps the engine's cache, page and buffers
            if how == "SIGKILL":
                child.send_signal(signal.SIGKILL)
            else:
                child.stdin.write("\n")
                child.stdin.flush()
            child.wait(10)
            wait_until(lambda: not _status(stub).kv.bound, 10, lambda: f"still bound:\n{sc.log_tail()}")
            wait_until(lambda: not _mapped(pids, segments), 10, lambda: f"still mapped: {_mapped(pids, segments)}")
            assert "closed its lease" in sc.log_tail() and "the doorbell is stopped" in sc.log_tail()
            assert sc.health() == ["SERVING"]  # the rank serves on, for the engine's next start
        finally:
            child.kill()
            child.wait()
            _unlink(segments)


def test_a_binding_made_without_a_lease_outlives_its_engine_and_a_lost_lease_is_refused(tmp_path, tiny_ckpt):
    """Lease 0 keeps the old contract (bound until UnbindKV, a re-bind or the exit); a token the rank never handed
    out is FAILED_PRECONDITION LEASE_LOST, and binds nothing."""
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        child, binding, segments = _engine(sc, "--no-lease")
        try:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            kv = _status(stub).kv
            assert kv.bound and kv.binding_id == binding  # no lease: nothing tells the sidecar
            with pytest.raises(grpc.RpcError) as err:
                stub.BindKV(pb.BindKVRequest(lease=12345), timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and error_reason(err.value) == "LEASE_LOST"
            assert "StatusReport.lease_socket" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                stub.RegisterBuffers(pb.RegisterBuffersRequest(lease=12345), timeout=10)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and error_reason(err.value) == "LEASE_LOST"
            assert _status(stub).kv.binding_id == binding  # the refusal left the binding in place
        finally:
            child.kill()
            child.wait()
            _unlink(segments)


@pytest.mark.gpu
@pytest.mark.parametrize("data_plane", [False, True], ids=["cache", "cache+doorbell+buffers"])
def test_a_killed_engine_s_gpu_cache_is_freed_while_the_sidecar_serves_on(tmp_path, tiny_ckpt, data_plane):
    """The case leases are for: CUDA IPC keeps an exporter's memory allocated while an importer maps it (run 299),
    so the killed engine's cache (here 4 GiB, one allocation as vLLM's) came back only when the sidecar let go.
    With the data plane: its doorbell (input event, GPU word, a pre-launching rank) and CUDA regions under the
    same lease, stopped and released with the cache."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gib = 4
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        stub = pb_grpc.DrafterSidecarStub(grpc.insecure_channel(sc.socket(0)))
        base = torch.cuda.mem_get_info(0)[0]
        child, binding, segments = _engine(sc, "--cuda", str(gib), *(["--buffers"] if data_plane else []))
        try:
            assert _status(stub).kv.binding_id == binding
            held = base - torch.cuda.mem_get_info(0)[0]
            assert held >= gib << 30, f"the engine holds {held / 2**30:.2f} GiB"
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            wait_until(lambda: base - torch.cuda.mem_get_info(0)[0] < (1 << 30), 15,
                       lambda: f"{(base - torch.cuda.mem_get_info(0)[0]) / 2**30:.2f} GiB still held; bound: "
                               f"{_status(stub).kv.bound}\n{sc.log_tail()}")
            assert not _status(stub).kv.bound and sc.health() == ["SERVING"]
            if data_plane:  # the doorbell stopped: its page unmapped by the rank
                wait_until(lambda: not _mapped(_tree(sc.proc.pid), segments), 10, "the doorbell's page unmapped")
                assert "the doorbell is stopped" in sc.log_tail()
        finally:
            child.kill()
            child.wait()
            _unlink(segments)


@pytest.mark.gpu
@pytest.mark.ends_mps_clients
def test_a_rank_whose_stream_waits_on_a_killed_engine_s_event_exits_for_a_restart(tmp_path, tiny_ckpt):
    """Run 301 (an H100): a stream waiting on a killed engine's interprocess event that its GPU had not yet
    recorded never goes on (without MPS), so the rank's later steps and releases would wait behind it for good;
    under MPS the engine's end with GPU work in flight leaves the sidecar's context with a sticky error. Either
    way the rank exits 3 for its supervisor to restart it, within the doorbell's stop and the device bound."""
    import torch

    from dspark_sidecar.server.doorbell import STOP_S
    from dspark_sidecar.server.servicer import GONE_ENGINE_DEVICE_S

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--device", "cuda"]) as sc:
        child, _, segments = _engine(sc, "--cuda", "0", "--buffers", "--ring-behind", "300")
        try:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            rc = sc.proc.wait(STOP_S + GONE_ENGINE_DEVICE_S + 30)
            log = sc.log_tail(200)  # under MPS the rank's line comes with the CUDA error's traceback
            # The rank's own exit 3, which the launcher reports as its group's 1: any other end of the rank (a
            # signal, a crash) also made the launcher's code non-zero.
            assert rc == 1 and "sidecar rank 0 exited with code 3;" in log, log
            assert "has not got past the gone engine" in log or "the device failed" in log, log
        finally:
            child.kill()
            child.wait()
            _unlink(segments)


def test_a_lost_lease_s_refusal_says_to_send_the_call_it_refused_again():
    """Every call a lease may name (BindKV, RegisterBuffers, AttachDoorbell) is refused LEASE_LOST for a token that
    names no open lease, and the message told each to "bind again": an engine whose registration or doorbell was
    refused re-bound its cache (a new generation, its steps in flight stale) and still had no buffers or doorbell."""
    from types import SimpleNamespace

    import torch

    from dspark_sidecar.server.errors import SidecarError
    from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle

    ctx = SimpleNamespace(rank=0, fast=None, memory=SimpleNamespace(kv=None),
                          model=SimpleNamespace(device=torch.device("cpu")))
    svc = DrafterServicer(ctx, SimpleNamespace(graphs=None), Lifecycle(), pb.Limits(), pb.Parallel(), "mxfp8")
    peer = SimpleNamespace(peer=lambda: "unix:/run/dspark/rank0.sock", is_active=lambda: True,
                           time_remaining=lambda: None)
    page = pb.MemoryHandle(shm=pb.SharedMemoryHandle(name="dspark-never-opened"))
    for call, request, again in (
            (svc.BindKV, pb.BindKVRequest(lease=7), "bind again"),
            (svc.RegisterBuffers, pb.RegisterBuffersRequest(lease=7), "register again"),
            (svc.AttachDoorbell, pb.AttachDoorbellRequest(page=page, capacity_bytes=4096, lease=7), "attach again")):
        with pytest.raises(SidecarError) as err:
            call(request, peer)
        assert (err.value.code, err.value.reason, err.value.field) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                                        "LEASE_LOST", "lease")
        assert "StatusReport.lease_socket" in err.value.message and err.value.message.endswith(again), err.value.message


class _Keeper:
    """LeaseKeeper as the servicer asks it: the lease is live for its first `live_looks` looks, ended after."""

    path = "/run/dspark/rank0.lease"

    def __init__(self, live_looks: int) -> None:
        self.looks, self.live_looks = 0, live_looks

    def live(self, token: int) -> bool:
        self.looks += 1
        return self.looks <= self.live_looks


def _leased_rank(live_looks: int, kv=None):
    """(servicer, what it released, publishes) over fakes: a binding and regions registered under lease 5."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle

    released, made = [], SimpleNamespace(binding_id=9, generation=1, lease=5, num_pages=4, page_size=16)

    class Memory:
        def __init__(self) -> None:
            self.kv = kv

        def bind(self, request, retire=None):
            self.kv = made
            return made

        def unbind(self, binding_id, retire=None):
            released.append(("binding", binding_id))
            self.kv = None

        def register(self, request):
            return [11]

        def retire_if_idle(self, ids, owner=0, lease=0):
            return False  # taken as holding some: the release is recorded below

        def unregister(self, ids, owner=0, lease=0):
            released.append(("regions", lease))
            return []

        def leases_regions(self, lease):
            return False

    ctx = SimpleNamespace(rank=0, fast=None, memory=Memory(), model=SimpleNamespace(device=torch.device("cpu")),
                          metrics=SimpleNamespace(bound=lambda: None))
    loop = SimpleNamespace(graphs=None, after_device=lambda fn: fn(),
                           exclusive=lambda wait=True, give_up=None: contextlib.nullcontext())
    life = Lifecycle()
    svc = DrafterServicer(ctx, loop, life, pb.Limits(), pb.Parallel(), "mxfp8")
    svc.leases = _Keeper(live_looks)
    published = []
    life.on_change.append(lambda: published.append(ctx.memory.kv))
    return svc, released, published



@pytest.mark.parametrize("call", ["BindKV", "RegisterBuffers"])
def test_a_lease_that_ends_while_the_call_maps_releases_what_it_mapped(call):
    """The lease is live at the call's first look and ends while it maps (the keeper marks it gone, then its release
    finds nothing of it yet): the call itself releases what it made, and answers LEASE_LOST. Kept, the gone
    engine's cache (or buffers) stayed mapped, and under CUDA IPC allocated, until the sidecar's exit."""
    from types import SimpleNamespace

    from dspark_sidecar.server.errors import SidecarError

    svc, released, published = _leased_rank(live_looks=1)
    peer = SimpleNamespace(peer=lambda: "unix:/run/dspark/rank0.sock", is_active=lambda: True,
                           time_remaining=lambda: None)
    request = pb.BindKVRequest(lease=5) if call == "BindKV" else pb.RegisterBuffersRequest(lease=5)
    with pytest.raises(SidecarError) as err:
        getattr(svc, call)(request, peer)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "LEASE_LOST")
    assert released == [("binding", 9) if call == "BindKV" else ("regions", 5)]
    if call == "BindKV":
        assert svc.ctx.memory.kv is None and published == [None]  # health judged again, on no binding


def test_a_lease_s_end_releases_its_binding_though_it_registered_no_buffers():
    """lease_lost: a lease that holds a binding and no regions releases the binding (and publishes health)."""
    from types import SimpleNamespace

    kv = SimpleNamespace(binding_id=9, generation=1, lease=5)
    svc, released, published = _leased_rank(live_looks=0, kv=kv)
    svc.lease_lost(5)
    assert released == [("binding", 9)] and svc.ctx.memory.kv is None and published == [None]
    svc.ctx.memory.kv = kv
    svc.lease_lost(6)  # another lease's end: the binding stands, and no section quiesces the rank
    assert released == [("binding", 9)] and svc.ctx.memory.kv is kv
