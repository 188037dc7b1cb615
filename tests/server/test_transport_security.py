"""Endpoints and who may register memory: unix sockets by default, loopback TCP as an option, same node only."""

from __future__ import annotations

import contextlib
from concurrent import futures
from pathlib import Path

import pytest

from dspark_sidecar.server.config import ServeConfig, ServeConfigError
from dspark_sidecar.server.healthcheck import check
from dspark_sidecar.server.servicer import _same_node
from helpers.listening import has_ipv6_loopback, is_loopback, listening_tcp
from helpers.sidecar_proc import SidecarProcess, free_port_block


@pytest.mark.parametrize("peer,local", [
    ("unix:/tmp/x/rank0.sock", True), ("unix:", True),
    ("ipv4:127.0.0.1:51234", True), ("ipv6:[::1]:51234", True), ("ipv6:%5B::1%5D:51234", True),
    ("ipv6:%5B2001:db8::1%5D:443", False),
    ("ipv4:10.1.2.3:51234", False), ("ipv6:[2001:db8::1]:443", False), ("dns:example.org:80", False),
])
def test_only_same_node_peers_may_register_memory(peer, local):
    assert _same_node(peer) is local


def test_tcp_off_loopback_needs_allow_remote():
    with pytest.raises(ServeConfigError, match="--tcp-host: 10.0.0.5 is not a loopback address"):
        ServeConfig(tcp_host="10.0.0.5", tcp_base_port=7000)
    assert ServeConfig(tcp_host="10.0.0.5", tcp_base_port=7000, allow_remote=True).endpoints(1)[1] == "10.0.0.5:7001"
    assert ServeConfig(tcp_host="::1", tcp_base_port=7000).endpoints(0)[1] == "[::1]:7000"  # IPv6 literal bracketed


def test_rank_serves_on_its_unix_socket_and_loopback_tcp(tmp_path, tiny_ckpt, monkeypatch):
    """...and nothing of a rank listens off loopback: not gRPC, not the rendezvous store rank 0 hosts
    (torch's own binds every address), not gloo's pairs (on the host name's address unless told).
    And the ranks' shared-memory board has no name left in /dev/shm once they all mapped it."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the rank sets them itself
        monkeypatch.delenv(var, raising=False)
    port = free_port_block(2)
    with SidecarProcess(tmp_path, tp=2, checkpoint=tiny_ckpt, extra_args=["--tcp-base-port", str(port)]) as sc:
        assert sc.health() == ["SERVING", "SERVING"]
        # A bound on a hang, not a timing (the 2 s default: a loaded box's first call on a fresh channel runs long).
        assert [check(f"127.0.0.1:{port + r}", 30.0) for r in range(2)] == ["SERVING", "SERVING"]
        listening = {r: listening_tcp(pid) for r, pid in enumerate(sc.rank_pids())}
        boards = {r: [m for m in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/dspark-rdv-" in m]
                  for r, pid in enumerate(sc.rank_pids())}
    # The ranks' rendezvous board is mapped by both, and its name is gone from /dev/shm: no other
    # process can open it, and nothing is left behind if the ranks are killed.
    assert all(boards.values()) and all(m.endswith("(deleted)") for ms in boards.values() for m in ms), boards
    assert ("127.0.0.1", port) in listening[0] and ("127.0.0.1", port + 1) in listening[1]
    assert len(listening[0]) > 2, listening  # gRPC, the store, gloo: the check below saw them
    assert all(is_loopback(addr) for socks in listening.values() for addr, _ in socks), listening


def test_draft_steps_from_a_remote_peer_are_refused_before_they_reach_the_rank():
    """A step writes its block K/V into the cache a same-node engine bound and may name that engine's
    registered regions: from a remote peer (--allow-remote) it would write another process's memory."""
    from types import SimpleNamespace

    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.server.errors import SidecarError
    from dspark_sidecar.server.servicer import DrafterServicer

    def never(*_a):
        raise AssertionError("a remote peer's step reached the rank loop")

    fake = SimpleNamespace(loop=SimpleNamespace(submit=never, answer=never))
    fake._require_same_node = lambda ctx, what="": DrafterServicer._require_same_node(fake, ctx, what)
    remote = SimpleNamespace(peer=lambda: "ipv4:192.0.2.2:40000")
    with pytest.raises(SidecarError, match="draft steps from ipv4:192.0.2.2:40000 refused") as err:
        DrafterServicer.DraftStep(fake, pb.DraftStepRequest(step_id=1), remote)
    assert err.value.code.name == "PERMISSION_DENIED" and err.value.reason == "REMOTE_PEER"
    with pytest.raises(SidecarError, match="draft steps from"):
        next(DrafterServicer.DraftSteps(fake, iter([pb.DraftStepRequest(step_id=1)]), remote))


@contextlib.contextmanager
def _one_method_server(method: str, handler, host: str):
    """A gRPC server on `host` with the sidecar's StatusInterceptor and one method, /t.S/<method>
    (bytes in, bytes out); yields a channel to it."""
    import grpc

    from dspark_sidecar.server.errors import StatusInterceptor

    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[StatusInterceptor()])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", {method: handler}),))
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    try:
        with grpc.insecure_channel(f"{host}:{port}") as ch:
            yield ch
    finally:
        server.stop(0)


def test_a_stream_refused_before_its_first_step_ends_with_that_status():
    """The interceptor maps a SidecarError raised by a stream handler (not only by parsing) to its status."""
    import grpc

    from dspark_sidecar.server.errors import SidecarError

    def refuse(requests, context):
        raise SidecarError(grpc.StatusCode.PERMISSION_DENIED, "no steps from there", "", "REMOTE_PEER")
        yield b""  # a generator, as DraftSteps is

    handler = grpc.stream_stream_rpc_method_handler(refuse, request_deserializer=lambda b: b,
                                                    response_serializer=lambda b: b)
    with _one_method_server("Steps", handler, "127.0.0.1") as ch:
        call = ch.stream_stream("/t.S/Steps", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter([b"x"]), timeout=10))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "no steps from there" in err.value.details()


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no ::1 on this host")
def test_a_peer_on_ipv6_loopback_is_same_node():
    """gRPC names an IPv6 peer percent-encoded ("ipv6:%5B::1%5D:port"): read as is, a sidecar on
    --tcp-host ::1 refused every BindKV, RegisterBuffers and step of its own engine (PERMISSION_DENIED)."""
    from types import SimpleNamespace

    import grpc

    from dspark_sidecar.server.servicer import DrafterServicer

    fake = SimpleNamespace()

    def bind(request, context):  # what BindKV, RegisterBuffers, DraftStep... check first
        DrafterServicer._require_same_node(fake, context)
        return context.peer().encode()

    handler = grpc.unary_unary_rpc_method_handler(bind, request_deserializer=lambda b: b,
                                                  response_serializer=lambda b: b)
    with _one_method_server("Bind", handler, "[::1]") as ch:
        call = ch.unary_unary("/t.S/Bind", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        try:
            peer = call(b"", timeout=10)
        except grpc.RpcError as err:
            pytest.fail(f"{err.code().name}: {err.details()}")
    assert peer.startswith(b"ipv6:"), peer


def _ipc(counter: bytes):  # -> pb.MemoryHandle
    from dspark_sidecar.proto import sidecar_pb2 as pb

    return pb.MemoryHandle(cuda_ipc=pb.CudaIpcHandle(ipc_handle=b"h", storage_size_bytes=64,
                                                     ref_counter_handle=counter, ref_counter_offset=8))


@pytest.mark.parametrize("rpc", ["BindKV", "RegisterBuffers", "AttachDoorbell"])
@pytest.mark.parametrize("peer,given_back", [("unix:/run/x/rank0.sock", True), ("ipv4:192.0.2.2:40000", False)])
def test_handles_refused_before_they_are_opened_are_given_back_to_a_same_node_engine(monkeypatch, rpc, peer, given_back):
    """Each CUDA IPC export holds the engine's block until the sidecar gives the reference back: a
    request refused before any handle was opened (the rank still loading; a doorbell page that is not
    shared memory) used to keep the engine's blocks until it exited. A remote peer's counter names would
    name files of this node, so its references are left alone."""
    from types import SimpleNamespace

    import torch

    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.server.app import LateServicer
    from dspark_sidecar.server.errors import SidecarError
    from dspark_sidecar.server.servicer import DrafterServicer

    released = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter",
                        lambda handle, offset, **kw: released.append((handle, offset)), raising=False)
    ctx = SimpleNamespace(peer=lambda: peer)
    if rpc == "BindKV":
        req = pb.BindKVRequest(layers=[pb.KVLayerBinding(layer=i, memory=_ipc(b"/torch_c%d" % i)) for i in range(2)])
        call = lambda: LateServicer().BindKV(req, ctx)  # noqa: E731
    elif rpc == "RegisterBuffers":
        req = pb.RegisterBuffersRequest(regions=[pb.BufferRegion(name="r", memory=_ipc(b"/torch_c0")),
                                                 pb.BufferRegion(name="s", memory=_ipc(b"/torch_c1"))])
        call = lambda: LateServicer().RegisterBuffers(req, ctx)  # noqa: E731
    else:  # a doorbell page in GPU memory, refused as not shared memory
        fake = SimpleNamespace(life=SimpleNamespace(host=None))
        fake._require_same_node = lambda c, what="": None  # the peer check is the test above's
        req = pb.AttachDoorbellRequest(page=_ipc(b"/torch_c0"), capacity_bytes=4096)
        call = lambda: DrafterServicer.AttachDoorbell(fake, req, ctx)  # noqa: E731
    with pytest.raises(SidecarError) as err:
        call()
    assert err.value.code.name == ("INVALID_ARGUMENT" if rpc == "AttachDoorbell" else "UNAVAILABLE")
    n = 1 if rpc == "AttachDoorbell" else 2
    assert released == ([(b"/torch_c%d" % i, 8) for i in range(n)] if given_back else [])
