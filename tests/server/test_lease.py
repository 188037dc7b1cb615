"""server/lease.py: a lease lasts exactly as long as its connection, whoever ends it, and the keeper outlives misuse."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from types import SimpleNamespace

import grpc
import pytest

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.lease import MAX_LEASES, TOKEN, LeaseKeeper
from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle
from helpers.engine_fakes import short_socket_dir
from helpers.waiting import wait_until


def _take(path) -> tuple[socket.socket, int]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    data = b""
    while len(data) < TOKEN.size:
        chunk = s.recv(TOKEN.size - len(data))
        assert chunk, f"closed after {len(data)} bytes"
        data += chunk
    return s, TOKEN.unpack(data)[0]


@pytest.fixture
def keeper():
    lost: queue.Queue[int] = queue.Queue()
    k = LeaseKeeper(short_socket_dir() / "rank0.lease", lost.put)
    k.lost = lost
    yield k
    k.close()


def test_a_lease_ends_when_its_engine_closes_it(keeper):
    a, ta = _take(keeper.path)
    b, tb = _take(keeper.path)
    assert ta and tb and ta != tb
    assert keeper.live(ta) and keeper.live(tb) and not keeper.live(ta ^ tb)
    a.close()
    assert keeper.lost.get(timeout=5) == ta
    assert not keeper.live(ta) and keeper.live(tb)  # the other engine's lease stands
    b.close()
    assert keeper.lost.get(timeout=5) == tb


@pytest.mark.parametrize("how", ["exit", "SIGKILL"])
def test_a_lease_ends_with_its_engine_process(keeper, how):
    """The kernel closes a process's descriptors however it ends: a killed engine is seen as surely as one that
    exited."""
    child = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sys.argv[1])\n"
        "data = b''\n"
        "while len(data) < 8: data += s.recv(8 - len(data))\n"
        "print(int.from_bytes(data, 'little'), flush=True)\n"
        "sys.stdin.readline()\n"), keeper.path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        token = int(child.stdout.readline())
        assert keeper.live(token)
        if how == "SIGKILL":
            child.send_signal(signal.SIGKILL)
        else:
            child.stdin.write("\n")
            child.stdin.flush()
        assert keeper.lost.get(timeout=10) == token
        assert not keeper.live(token)
    finally:
        child.kill()
        child.wait()


def test_bytes_from_the_engine_do_not_end_its_lease(keeper):
    s, token = _take(keeper.path)
    s.sendall(b"anything")
    t2 = _take(keeper.path)  # the keeper has served another event since: the bytes were read by then
    assert keeper.live(token) and keeper.lost.empty()
    s.close()
    t2[0].close()
    assert {keeper.lost.get(timeout=5), keeper.lost.get(timeout=5)} == {token, t2[1]}


def test_past_the_most_leases_a_new_connection_is_closed_before_its_token(keeper):
    held = [_take(keeper.path) for _ in range(MAX_LEASES)]
    extra = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    extra.settimeout(5)
    extra.connect(keeper.path)
    assert extra.recv(8) == b""  # end of file: no token
    extra.close()
    assert keeper.count == MAX_LEASES and keeper.lost.empty()  # refused: no lease, no loss
    held[0][0].close()
    assert keeper.lost.get(timeout=5) == held[0][1]
    s, token = _take(keeper.path)  # a place again
    assert keeper.live(token)
    for c, _ in held[1:] + [(s, token)]:
        c.close()


def test_a_failing_release_does_not_stop_the_keeper(caplog):
    calls: queue.Queue[int] = queue.Queue()

    def on_lost(token: int) -> None:
        calls.put(token)
        raise RuntimeError("release failed")

    k = LeaseKeeper(short_socket_dir() / "rank0.lease", on_lost)
    try:
        for _ in range(2):  # the second loss is still seen after the first release raised
            s, token = _take(k.path)
            s.close()
            assert calls.get(timeout=5) == token
        wait_until(lambda: "release failed" in caplog.text, 5, lambda: caplog.text)
    finally:
        k.close()


def test_close_ends_every_lease_and_removes_the_socket():
    lost: queue.Queue[int] = queue.Queue()
    path = short_socket_dir() / "rank0.lease"
    path.write_text("a killed run's socket")  # replaced at start
    k = LeaseKeeper(path, lost.put)
    s, token = _take(path)
    k.close()
    s.settimeout(5)
    assert s.recv(8) == b""  # the engine reads end of file
    assert not os.path.lexists(path) and not k.live(token)
    assert lost.empty()  # a shutdown releases nothing itself: the exit unmaps everything
    s.close()


class _Memory:
    """MemoryBindings' bind / unbind, with a hook inside bind (where the real one maps the engine's cache)."""

    def __init__(self, inside_bind=lambda: None) -> None:
        self.kv, self.unbound, self._inside = None, [], inside_bind

    def bind(self, req, retire):
        self._inside()
        self.kv = SimpleNamespace(binding_id=7, generation=1, lease=req.lease, num_pages=8, page_size=16)
        return self.kv

    def leased_regions(self, lease):
        return []

    def unbind(self, binding_id, retire):
        assert self.kv is not None and self.kv.binding_id == binding_id
        self.kv = None
        self.unbound.append(binding_id)


class _Loop:
    def __init__(self) -> None:
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def exclusive(self, wait=True):
        with self.lock:
            yield

    def after_device(self, fn, wait=None):
        fn()


def _servicer(memory) -> DrafterServicer:
    ctx = SimpleNamespace(rank=0, memory=memory, fast=None, metrics=SimpleNamespace(bound=lambda: None))
    svc = DrafterServicer(ctx, _Loop(), Lifecycle(), pb.Limits(), pb.Parallel(), "bf16",  # type: ignore[arg-type]
                          run_dir=short_socket_dir())
    svc.refusal = lambda: ""  # the deployment checks are not what these tests are about
    return svc


class _Context:
    def peer(self):
        return "unix:"


def test_a_lease_that_ends_while_bindkv_maps_the_cache_releases_what_it_bound():
    """The keeper marks the lease gone before its release runs, and the release waits for BindKV's section: found
    no binding under the lease there, so BindKV must see the loss itself, or the gone engine's cache stayed bound."""
    conn: list[socket.socket] = []

    def engine_dies_meanwhile():
        conn[0].close()
        wait_until(lambda: not svc.leases.live(token), 5, "the keeper to see the lease end")

    memory = _Memory(engine_dies_meanwhile)
    svc = _servicer(memory)
    try:
        sock, token = _take(svc.leases.path)
        conn.append(sock)
        with pytest.raises(SidecarError) as err:
            svc.BindKV(pb.BindKVRequest(lease=token), _Context())
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "LEASE_LOST"
        assert memory.unbound == [7] and memory.kv is None
    finally:
        svc.close_leases()


def test_a_lost_lease_releases_only_the_binding_made_under_it():
    memory = _Memory()
    svc = _servicer(memory)
    try:
        a, ta = _take(svc.leases.path)
        b, tb = _take(svc.leases.path)
        svc.BindKV(pb.BindKVRequest(lease=ta), _Context())
        svc.BindKV(pb.BindKVRequest(lease=tb), _Context())  # a re-bind under another lease (a restarted engine)
        a.close()  # the first engine's lease ends after its binding was replaced: nothing of the second goes
        wait_until(lambda: not svc.leases.live(ta), 5, "lease a to end")
        svc.lease_lost(ta)  # as the keeper's thread does (again: idempotent)
        assert memory.kv is not None and memory.kv.lease == tb and memory.unbound == []
        b.close()
        wait_until(lambda: memory.unbound == [7], 5, lambda: f"unbound {memory.unbound}")
        assert memory.kv is None
    finally:
        svc.close_leases()
