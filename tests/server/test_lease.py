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
import torch

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.kv_binding import MemoryBindings
from dspark_sidecar.server import lease as lease_mod
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
    wait_until(lambda: len(k._sel.get_map()) == 3, 5, "the lease to be watched")  # registered after its token
    held = [key.fileobj for key in k._sel.get_map().values()]  # the listener, the wake pipe, the lease
    k.close()
    s.settimeout(5)
    assert s.recv(8) == b""  # the engine reads end of file
    assert not os.path.lexists(path) and not k.live(token)
    # Each closed by close() itself, the listener and the wake pipe too (the keeper's attributes keep them; left
    # open, the rank held their descriptors for the rest of its teardown).
    assert len(held) == 3 and all(f.fileno() == -1 for f in held + [k._listener, k._wake_r, k._wake_w])
    assert lost.empty()  # a shutdown releases nothing itself: the exit unmaps everything
    s.close()


def test_a_second_close_does_nothing_not_even_to_a_socket_made_at_the_path_since():
    """close() is the teardown's, but a second call (a retried teardown, an error path closing what the normal one
    closes too) raised OSError on the closed wake socket, and, before that, would have unlinked whatever socket
    now had the path: a newly started rank's lease socket, which its engines then could not reach."""
    path = short_socket_dir() / "rank0.lease"
    k = LeaseKeeper(path, lambda token: None)
    k.close()
    path.write_text("a later rank's lease socket")
    k.close()
    assert path.read_text() == "a later rank's lease socket"


def test_close_waits_for_a_release_already_running_before_it_closes_the_leases():
    """close(None): a release already running (it waits on the rank's loop) ends before the socket goes and the
    leases close; only close(wait_s) with a bound leaves it behind (the teardown's stuck step)."""
    path = short_socket_dir() / "rank0.lease"
    started, go, seen = threading.Event(), threading.Event(), []

    def on_lost(token: int) -> None:
        started.set()
        go.wait(10)
        seen.append(os.path.lexists(path))  # close() has not gone past its wait yet

    k = LeaseKeeper(path, on_lost)
    s, _ = _take(path)
    s.close()
    assert started.wait(5), "the release to start"
    closer = threading.Thread(target=k.close, name="closer")
    closer.start()
    try:
        closer.join(0.5)
        assert closer.is_alive(), "close() returned while a release was still running"
    finally:
        go.set()
        closer.join(10)
    assert not closer.is_alive() and seen == [True] and not os.path.lexists(path)


def test_close_ends_every_lease_though_the_socket_s_name_was_replaced_by_what_it_cannot_remove(caplog):
    """The socket folder is group-writable: the engine's group may replace the name (as the wake FIFO's, which
    Waker.close says and leaves). The unlink raised (IsADirectoryError; PermissionError for another user's file in
    a sticky folder) before anything was closed: no lease ended (the engines never read end of file), the listener
    and the wake pipe stayed open, and the teardown itself failed there."""
    path = short_socket_dir() / "rank0.lease"
    k = LeaseKeeper(path, lambda token: None)
    s, token = _take(path)
    wait_until(lambda: len(k._sel.get_map()) == 3, 5, "the lease to be watched")
    os.unlink(path)
    os.mkdir(path)  # what unlink cannot remove
    try:
        with caplog.at_level("WARNING", logger="dspark_sidecar.server"):
            k.close()
        s.settimeout(5)
        assert s.recv(8) == b""  # the engine reads end of file all the same
        assert not k.live(token) and k._listener.fileno() == -1 and k._wake_w.fileno() == -1
        assert path.is_dir()  # not ours: left as it is, and said
        assert any(str(path) in r.getMessage() and "not removed" in r.getMessage() for r in caplog.records), \
            caplog.text
    finally:
        s.close()
        os.rmdir(path)


class _Memory:
    """MemoryBindings' bind / unbind, with a hook inside bind (where the real one maps the engine's cache)."""

    def __init__(self, inside_bind=lambda: None) -> None:
        self.kv, self.unbound, self._inside = None, [], inside_bind

    def bind(self, req, retire):
        self._inside()
        self.kv = SimpleNamespace(binding_id=7, generation=1, lease=req.lease, num_pages=8, page_size=16)
        return self.kv

    def retire_if_idle(self, ids, owner=0, lease=0):
        return not ids  # no regions registered in these tests

    def unregister(self, ids, owner=0, lease=0):
        return []  # no regions registered in these tests

    def leases_regions(self, lease):
        return False

    def unbind(self, binding_id, retire):
        assert self.kv is not None and self.kv.binding_id == binding_id
        self.kv = None
        self.unbound.append(binding_id)


class _Loop:
    graphs = None  # no CUDA graphs: nothing to drop when regions go

    def __init__(self) -> None:
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def exclusive(self, wait=True, give_up=None):
        with self.lock:
            yield

    def after_device(self, fn, wait=None):
        fn()


def _servicer(memory) -> DrafterServicer:
    ctx = SimpleNamespace(rank=0, memory=memory, fast=None, metrics=SimpleNamespace(bound=lambda: None),
                          model=SimpleNamespace(device=torch.device("cpu")))
    svc = DrafterServicer(ctx, _Loop(), Lifecycle(), pb.Limits(), pb.Parallel(), "bf16",  # type: ignore[arg-type]
                          run_dir=short_socket_dir())
    svc.refusal = lambda: ""  # the deployment checks are not what these tests are about
    return svc


class _Context:
    def peer(self):
        return "unix:"


def _record_sections(svc) -> list[bool]:
    """The `wait` of each exclusive section svc's rank loop enters from now on, in order."""
    sections = []
    real = svc.loop.exclusive

    def exclusive(wait=True, give_up=None):
        sections.append(wait)
        return real(wait, give_up=give_up)

    svc.loop.exclusive = exclusive
    return sections


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


def test_a_lease_that_holds_nothing_ends_without_an_exclusive_section():
    """Every exclusive section quiesces the rank: it releases the pre-launched step the live engine's doorbell has
    queued (at TP > 1 on this rank only, so a copy that ran on the peers aborts that step, SOME_COPIES). A lease
    whose binding and regions are gone already (the shim's own close releases them first, then ends the lease; a
    re-bound engine's old lease; a client that only connects) has nothing to release, and must not cost the engine
    that serves on a step."""
    memory = _Memory()
    svc = _servicer(memory)
    sections = _record_sections(svc)
    try:
        a, ta = _take(svc.leases.path)
        b, tb = _take(svc.leases.path)
        svc.BindKV(pb.BindKVRequest(lease=tb), _Context())  # the live engine's binding, under its own lease
        sections.clear()
        a.close()  # a lease that never bound anything ends
        wait_until(lambda: not svc.leases.live(ta), 5, "lease a to end")
        svc.lease_lost(ta)  # as the keeper's thread does (again: it may still be running it)
        assert sections == [] and memory.kv is not None and memory.kv.lease == tb
        b.close()
        wait_until(lambda: memory.unbound == [7], 5, lambda: f"unbound {memory.unbound}")  # one holding some releases
    finally:
        svc.close_leases()


def test_close_that_must_not_wait_leaves_a_release_blocked_on_a_stuck_step_behind():
    """A release waits for the rank's loop, which a step stuck at shutdown holds for good: the teardown's
    close(wait_s=0) must return (and remove the socket) rather than join that thread, or the rank hung until its
    watchdog ended it with status 0 instead of STUCK_EXIT."""
    entered, stuck = threading.Event(), threading.Event()

    def on_lost(token: int) -> None:
        entered.set()
        stuck.wait()  # the loop's lock, held by the stuck step

    k = LeaseKeeper(short_socket_dir() / "rank0.lease", on_lost)
    other, _ = _take(k.path)
    s, _ = _take(k.path)
    s.close()
    assert entered.wait(5)
    closer = threading.Thread(target=k.close, kwargs={"wait_s": 0})
    closer.start()
    closer.join(5)
    try:
        assert not closer.is_alive(), "close(wait_s=0) joined the keeper's thread blocked in its release"
        assert not os.path.lexists(k.path)
        assert other.recv(1) == b""  # the other engine reads end of file: every lease closed all the same
    finally:
        stuck.set()
        closer.join(5)
        other.close()


def test_leases_are_handed_out_while_a_release_waits_for_the_rank():
    """A release waits for the rank's loop (a step in progress; a doorbell's step, up to its stop bound). Run on
    the serving thread, it kept the keeper from accepting: a restarted engine's connect waited in the backlog,
    past its bind deadline, and it bound without a lease, so its binding outlived it."""
    entered, go_on = threading.Event(), threading.Event()
    released: list[int] = []

    def on_lost(token: int) -> None:
        entered.set()
        assert go_on.wait(10)
        released.append(token)

    k = LeaseKeeper(short_socket_dir() / "rank0.lease", on_lost)
    try:
        old, t_old = _take(k.path)
        old.close()  # the engine dies: its release waits for the rank
        assert entered.wait(5)
        new, t_new = _take(k.path)  # its restart takes a lease meanwhile (_take's 5 s bound)
        assert k.live(t_new) and t_new != t_old
        go_on.set()
        wait_until(lambda: released == [t_old], 5, lambda: f"released {released}")
        new.close()
        wait_until(lambda: released == [t_old, t_new], 5, lambda: f"released {released}")  # one at a time, in order
    finally:
        go_on.set()
        k.close()


def _no_descriptors(monkeypatch, keeper, times: int) -> list[int]:
    """The keeper's accepts fail EMFILE `times` times (the connection stays in the backlog); each try recorded."""
    tries: list[int] = []
    real_accept = socket.socket.accept

    def accept(self):
        if self.fileno() == keeper._listener.fileno() and len(tries) < times:
            tries.append(1)
            raise OSError(24, "Too many open files")
        return real_accept(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    return tries


def _token_of(waiting: socket.socket) -> int:
    data = waiting.recv(TOKEN.size)
    assert len(data) == TOKEN.size, data
    return TOKEN.unpack(data)[0]


def test_a_connection_it_cannot_accept_for_want_of_descriptors_is_not_spun_on(keeper, monkeypatch):
    """EMFILE leaves the connection in the backlog and the listener readable: watched on, select returned at once
    and the keeper logged a warning per turn, a core's worth. It waits for a lease to end (a descriptor freed)."""
    monkeypatch.setattr(lease_mod, "ACCEPT_RETRY_S", 60.0)  # only a lease's end brings the listener back here
    held, token = _take(keeper.path)
    tries = _no_descriptors(monkeypatch, keeper, 1000)
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    waiting.settimeout(5)
    waiting.connect(keeper.path)
    wait_until(lambda: tries, 5, "the keeper to try the accept")
    with pytest.raises(pytest.fail.Exception):  # the bound is the assertion: 50 tries in 0.5 s is a spin
        wait_until(lambda: len(tries) >= 50, 0.5, "")
    tries.extend([1] * 1000)  # descriptors again
    held.close()  # a lease ends: a descriptor is free again
    assert keeper.lost.get(timeout=5) == token
    assert keeper.live(_token_of(waiting))  # the waiting engine got its lease
    waiting.close()


def test_a_connection_it_could_not_accept_is_tried_again_though_no_lease_ends(keeper, monkeypatch):
    """Descriptors freed elsewhere in the rank (no lease of its own ended) are found by the retry's bound."""
    monkeypatch.setattr(lease_mod, "ACCEPT_RETRY_S", 0.05)
    tries = _no_descriptors(monkeypatch, keeper, 1)
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    waiting.settimeout(5)
    waiting.connect(keeper.path)
    assert keeper.live(_token_of(waiting)) and tries == [1]
    waiting.close()


def test_a_connection_it_could_not_accept_is_tried_again_within_the_bound_though_a_lease_writes(keeper, monkeypatch):
    """The retry's bound was a second with no event at all: a lease's connection that wrote (a client outside the
    protocol) woke the selector each time, and the listener stayed unwatched, every new engine left in the backlog,
    until some lease ended."""
    monkeypatch.setattr(lease_mod, "ACCEPT_RETRY_S", 0.2)
    chatty, _ = _take(keeper.path)
    tries = _no_descriptors(monkeypatch, keeper, 1)
    stop = threading.Event()

    def chatter() -> None:
        while not stop.wait(0.02):  # well within the bound: each write a new event
            chatty.sendall(b"x")

    writer = threading.Thread(target=chatter)
    writer.start()
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    waiting.settimeout(5)
    try:
        waiting.connect(keeper.path)
        assert keeper.live(_token_of(waiting)) and tries == [1]
    finally:
        stop.set()
        writer.join(5)
        waiting.close()
        chatty.close()


def test_while_accepts_wait_a_whole_engine_s_connections_wait_in_the_backlog(keeper, monkeypatch):
    """Accepts paused (EMFILE) leave connections in the listener's backlog, which is what lets them be served once
    descriptors free up: where it is full, a connect with a timeout (the engine's, client/lease.py) fails at once
    (EAGAIN) rather than wait. It holds MAX_LEASES, the leases a rank serves."""
    monkeypatch.setattr(lease_mod, "ACCEPT_RETRY_S", 60.0)
    _no_descriptors(monkeypatch, keeper, 1000)
    waiting = []
    try:
        for _ in range(MAX_LEASES):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            waiting.append(s)
            s.setblocking(False)
            s.connect(keeper.path)  # BlockingIOError where the backlog is full
        assert keeper.count == 0
    finally:
        for s in waiting:
            s.close()


def test_an_accept_with_nothing_to_accept_does_not_pause_the_listener(keeper, monkeypatch, caplog):
    """EAGAIN from accept (the connection went between the event and the accept) is no want of descriptors: the
    listener stays watched, and the next engine gets its lease at once, not after the pause's bound."""
    monkeypatch.setattr(lease_mod, "ACCEPT_RETRY_S", 60.0)
    real_accept = socket.socket.accept
    raised: list[int] = []

    def accept(self):
        if self.fileno() == keeper._listener.fileno() and not raised:
            raised.append(1)
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real_accept(self)

    monkeypatch.setattr(socket.socket, "accept", accept)
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    waiting.settimeout(5)
    try:
        waiting.connect(keeper.path)
        assert keeper.live(_token_of(waiting)) and raised == [1]
        assert "cannot accept a lease" not in caplog.text
    finally:
        waiting.close()


def test_close_while_accepts_are_paused_closes_the_listener_too(monkeypatch):
    """A paused listener is out of the selector's map, which close() closes: it must be closed on its own, or the
    rank kept its descriptor (the keeper still holds it) for the rest of its life."""
    monkeypatch.setattr(lease_mod, "ACCEPT_RETRY_S", 60.0)
    k = LeaseKeeper(short_socket_dir() / "rank0.lease", lambda token: None)
    tries = _no_descriptors(monkeypatch, k, 1)
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        waiting.connect(k.path)
        wait_until(lambda: tries and k._accept_paused, 5, "the keeper to pause its accepts")
        k.close()
        assert k._listener.fileno() == -1 and not os.path.lexists(k.path)
    finally:
        waiting.close()


def test_a_lost_lease_releases_its_regions_though_the_engine_released_some_of_them_meanwhile():
    """The lease's release took its region ids first and released them later, all or none: an UnregisterBuffers of
    the engine's (one that timed out at the engine, say, then ran) that took some of them in between made it
    NOT_FOUND, and the lease's other regions (a data plane registered again under the same lease) stayed mapped."""
    import torch

    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.proto import memory as mem_handles
    from dspark_sidecar.server.kv_binding import MemoryBindings

    memory = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    svc = _servicer(memory)
    segs = [mem_handles.shm_empty((4096,), torch.uint8) for _ in range(2)]
    try:
        s, token = _take(svc.leases.path)
        for owner, seg in enumerate(segs, 1):  # the first data plane, then the one registered after a reconnect
            svc.RegisterBuffers(pb.RegisterBuffersRequest(
                regions=[pb.BufferRegion(name="r", memory=mem_handles.export_handle(seg.tensor), size_bytes=4096)],
                owner=owner, lease=token), _Context())
        assert memory.region_count == 2
        real = memory.unregister

        def engine_first(ids, owner=0, *args):
            if threading.current_thread().name.startswith("lease-release:") and memory.region_count == 2:
                real([], 1)  # the engine's release of its first data plane got the locks first
            return real(ids, owner, *args)

        memory.unregister = engine_first
        s.close()
        wait_until(lambda: memory.region_count == 0, 5, lambda: f"{memory.region_count} regions still registered")
    finally:
        svc.close_leases()
        for seg in segs:
            seg.close()


def test_regions_the_engine_released_are_no_longer_its_lease_s():
    """Released by owner (the engine's own UnregisterBuffers), they are off the lease's list too: left on it, the
    lease's end still found regions under it and ran a section for nothing, whose quiesce releases the live
    engine's pre-launched step (at TP > 1 on this rank alone)."""
    import torch

    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.proto import memory as mem_handles
    from dspark_sidecar.server.kv_binding import MemoryBindings

    memory = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    seg = mem_handles.shm_empty((4096,), torch.uint8)
    try:
        memory.register(pb.RegisterBuffersRequest(
            regions=[pb.BufferRegion(name="r", memory=mem_handles.export_handle(seg.tensor), size_bytes=4096)],
            owner=1, lease=5))
        assert memory.leases_regions(5)
        for m in memory.unregister([], owner=1):
            m.close()
        assert not memory.leases_regions(5) and memory.region_count == 0
    finally:
        seg.close()


def test_a_lease_that_ends_while_registerbuffers_maps_the_regions_releases_them():
    """As BindKV: the lease's own release ran before the regions were recorded under it and found none, so the
    registration must see the loss itself, or the gone engine's buffers stayed mapped."""
    import torch

    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.proto import memory as mem_handles
    from dspark_sidecar.server.kv_binding import MemoryBindings

    memory = MemoryBindings(load_config("tiny"), 1, 0, torch.float32, torch.device("cpu"))
    svc = _servicer(memory)
    seg = mem_handles.shm_empty((4096,), torch.uint8)
    released_by_keeper = threading.Event()
    real_register, real_unregister, real_holds = memory.register, memory.unregister, memory.leases_regions

    def unregister(ids, owner=0, lease=0):
        released = real_unregister(ids, owner, lease)
        if threading.current_thread().name.startswith("lease-release:"):
            released_by_keeper.set()  # once it has found (and released) what it found
        return released

    def leases_regions(lease):
        held = real_holds(lease)
        if not held and threading.current_thread().name.startswith("lease-release:"):
            released_by_keeper.set()  # it found none: its release ends here (nothing bound under it either)
        return held

    def register(req):
        conn.close()  # the engine dies while its regions are mapped
        assert released_by_keeper.wait(5)  # and the lease's release has run, finding nothing yet
        return real_register(req)

    memory.register, memory.unregister, memory.leases_regions = register, unregister, leases_regions
    try:
        conn, token = _take(svc.leases.path)
        with pytest.raises(SidecarError) as err:
            svc.RegisterBuffers(pb.RegisterBuffersRequest(
                regions=[pb.BufferRegion(name="r", memory=mem_handles.export_handle(seg.tensor), size_bytes=4096)],
                lease=token), _Context())
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "LEASE_LOST"
        assert memory.region_count == 0
    finally:
        svc.close_leases()
        seg.close()


def test_a_lease_is_no_longer_live_once_its_release_runs():
    """The keeper marks a lease gone before it hands it to on_lost: BindKV, RegisterBuffers and AttachDoorbell rely
    on it (a call that sees the lease live has what it made found by the release; one that sees it gone undoes its
    own). Handed over first, a release could run while the lease still read live, and find nothing yet."""
    seen: queue.Queue[bool] = queue.Queue()
    called = threading.Event()
    k: LeaseKeeper

    def on_lost(token: int) -> None:
        seen.put(k.live(token))
        called.set()

    k = LeaseKeeper(short_socket_dir() / "rank0.lease", on_lost)
    real_end = k._end

    def end_once_the_release_could_run(token: int) -> None:
        called.wait(0.3)  # a release handed the lease before this mark would run meanwhile (it must not)
        real_end(token)

    k._end = end_once_the_release_could_run
    try:
        s, _ = _take(k.path)
        s.close()
        assert seen.get(timeout=5) is False
    finally:
        k.close()


def test_a_connection_that_takes_no_token_holds_no_lease(keeper, monkeypatch):
    """Closed before its token could be sent (the engine gave up): no lease, and no place of MAX_LEASES held."""
    real_sendall = socket.socket.sendall

    def sendall(self, data, *args):
        if threading.current_thread() is keeper._thread:
            raise BrokenPipeError(32, "Broken pipe")
        return real_sendall(self, data, *args)

    monkeypatch.setattr(socket.socket, "sendall", sendall)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(keeper.path)
    assert s.recv(8) == b""  # the keeper closed it
    s.close()
    wait_until(lambda: keeper.count == 0, 2, lambda: f"{keeper.count} leases still counted")  # marked after the close
    assert keeper.lost.empty()


def test_an_engine_gone_before_it_read_its_token_ends_its_lease(keeper):
    """An engine killed between its connect and its read of the token: the token is still unread in its socket, and
    the kernel tells the keeper so with ECONNRESET, not end of file. That is the end of the lease all the same (taken
    for a passing error, the lease and what the engine bound meanwhile under it were never released)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(keeper.path)
    wait_until(lambda: keeper.count == 1 and len(keeper._sel.get_map()) == 3, 5, "the lease to be handed out")
    (token,) = keeper._live  # the one lease: its token sent, never read
    s.close()
    assert keeper.lost.get(timeout=5) == token and keeper.count == 0


def test_a_lost_lease_asks_the_device_before_it_releases_what_it_held(monkeypatch):
    """At TP 1 a release waits for the device, which, stuck on the gone engine's event, never lets it go: the check
    (which exits the rank) must come first, or it never ran and the rank stayed up for good, its releases waiting."""
    from dspark_sidecar.server import servicer as servicer_mod

    order: list[str] = []
    memory = _Memory()
    real_unbind = memory.unbind
    memory.unbind = lambda binding_id, retire: (order.append("released"), real_unbind(binding_id, retire))
    monkeypatch.setattr(servicer_mod, "_device_answers", lambda device: order.append("asked") or True)
    svc = _servicer(memory)
    try:
        s, token = _take(svc.leases.path)
        svc.BindKV(pb.BindKVRequest(lease=token), _Context())
        s.close()
        wait_until(lambda: memory.unbound == [7], 5, lambda: f"unbound {memory.unbound}")
        assert order == ["asked", "released"]
    finally:
        svc.close_leases()


def test_leases_that_end_while_the_keeper_closes_are_not_released():
    """Shutdown: what ended but was not yet released is left to the exit (close's docstring). Released on, the
    teardown waited on each in turn (each may wait for the rank's loop), past its watchdog."""
    calls: list[int] = []
    entered, go_on = threading.Event(), threading.Event()

    def on_lost(token: int) -> None:
        calls.append(token)
        entered.set()
        assert go_on.wait(10)

    k = LeaseKeeper(short_socket_dir() / "rank0.lease", on_lost)
    (a, ta), (b, _) = _take(k.path), _take(k.path)
    a.close()
    assert entered.wait(5)
    b.close()  # ends while a's release runs: queued behind it
    wait_until(lambda: k.count == 0, 5, "lease b to end")
    closer = threading.Thread(target=k.close)
    closer.start()
    try:
        wait_until(lambda: k._stopping, 5, "the close to begin")
    finally:
        go_on.set()
    closer.join(5)
    assert not closer.is_alive() and calls == [ta]


def test_a_lost_lease_that_held_regions_leaves_the_binding_of_another_lease():
    """The binding is released only where it was made under the lease that ended: a lease that held regions alone
    (an engine's data plane, its binding made since under its new lease, or another engine's) takes no binding
    with it, or the live engine lost its cache binding mid-serving."""
    memory = _Memory()
    svc = _servicer(memory)
    try:
        a, ta = _take(svc.leases.path)
        b, tb = _take(svc.leases.path)
        svc.BindKV(pb.BindKVRequest(lease=tb), _Context())
        memory.leases_regions = lambda lease: lease == ta  # regions registered under a, none under b
        a.close()
        wait_until(lambda: not svc.leases.live(ta), 5, "lease a to end")
        svc.lease_lost(ta)  # as the keeper's thread does (again: idempotent)
        assert memory.kv is not None and memory.kv.lease == tb and memory.unbound == []
        b.close()
    finally:
        svc.close_leases()



class _ShmCache:
    """A tiny drafter's KV cache in shared memory, as an engine on the CPU binds it (MemoryBindings, not _Memory)."""

    def __init__(self) -> None:
        from dspark_sidecar.drafter.config import load_config
        from dspark_sidecar.drafter.kv_cache import kv_layer_shape
        from dspark_sidecar.proto import memory

        self.cfg = load_config("tiny")
        self.segs = [memory.shm_empty(kv_layer_shape(self.cfg, 1, 4, 16), torch.float32)
                     for _ in range(self.cfg.num_hidden_layers)]

    def request(self, lease: int = 0) -> pb.BindKVRequest:
        from dspark_sidecar.proto import codec, memory

        return pb.BindKVRequest(engine=pb.EngineFacts(engine_rank=0, tp_size=1, dp_size=1, pp_size=1), page_size=16,
                                lease=lease, layers=[pb.KVLayerBinding(
                                    layer=i, memory=memory.export_handle(s.tensor), dtype=codec.dtype_to_proto(
                                        s.tensor.dtype), shape=list(s.tensor.shape), strides=list(s.tensor.stride()))
                                    for i, s in enumerate(self.segs)])

    def maps(self) -> list[int]:
        """How many mappings of each layer's segment this process holds."""
        with open("/proc/self/maps") as f:
            lines = f.readlines()
        return [sum(s.segment.name in line for line in lines) for s in self.segs]

    def close(self) -> None:
        for s in self.segs:
            s.close()


def test_the_binding_memorybindings_records_is_the_one_its_lease_s_end_releases_and_unmaps():
    """MemoryBindings itself, not the stand-in above: the binding BindKV made under a lease carries that token, so
    the lease's end (its engine exited) releases it and unmaps the gone engine's cache; one re-bound with no lease
    is left to UnbindKV, a re-bind or the exit. Dropped, the binding named no lease, every lease end found nothing
    under it, and a killed engine's cache stayed mapped (its memory held) until the next engine bound."""
    cache = _ShmCache()
    mem = MemoryBindings(cache.cfg, 1, 0, torch.float32, torch.device("cpu"))
    svc = _servicer(mem)
    try:
        idle = cache.maps()
        a, ta = _take(svc.leases.path)
        resp = svc.BindKV(cache.request(ta), _Context())
        assert mem.kv is not None and (mem.kv.binding_id, mem.kv.lease) == (resp.binding_id, ta)
        assert cache.maps() == [n + 1 for n in idle]
        a.close()  # the engine is gone: its lease's end releases the binding and unmaps its cache
        # The binding is taken out of use (kv None) before its cache is unmapped, on the keeper's releasing thread.
        wait_until(lambda: mem.kv is None and cache.maps() == idle, 5, lambda: f"maps {cache.maps()} of {idle}")
        b, tb = _take(svc.leases.path)
        svc.BindKV(cache.request(0), _Context())  # no lease: this binding outlives any lease's end
        b.close()
        wait_until(lambda: not svc.leases.live(tb), 5, "lease b to end")
        svc.lease_lost(tb)  # as the keeper's thread does (again: idempotent)
        assert mem.kv is not None and mem.kv.lease == 0 and cache.maps() == [n + 1 for n in idle]
    finally:
        svc.close_leases()
        mem.close()
        cache.close()


@pytest.mark.parametrize("bound", [False, True])
def test_an_unbindkv_of_a_binding_not_in_place_is_refused_without_an_exclusive_section(bound):
    """As a lease that holds nothing (above): an UnbindKV naming a binding that is not the rank's (an engine's
    late release of one a re-bind replaced, a second UnbindKV, a sidecar restarted since) releases nothing, and
    its section's quiesce released the live engine's pre-launched step on this rank alone (at TP > 1 the copy
    that ran on the peers aborts that step, SOME_COPIES). It is FAILED_PRECONDITION UNKNOWN_BINDING with no
    section; the binding in place stands, and an UnbindKV of it still releases it and unmaps its cache."""
    cache = _ShmCache()
    mem = MemoryBindings(cache.cfg, 1, 0, torch.float32, torch.device("cpu"))
    svc = _servicer(mem)
    sections = _record_sections(svc)
    try:
        idle = cache.maps()
        bid = svc.BindKV(cache.request(), _Context()).binding_id if bound else 0  # the live engine's binding
        sections.clear()
        with pytest.raises(SidecarError) as err:
            svc.UnbindKV(pb.UnbindKVRequest(binding_id=bid + 1), _Context())
        e = err.value
        assert (e.code, e.reason, e.field) == (grpc.StatusCode.FAILED_PRECONDITION, "UNKNOWN_BINDING", "binding_id"), e
        assert sections == [] and (mem.kv is not None and mem.kv.binding_id == bid) == bound
        if bound:
            svc.UnbindKV(pb.UnbindKVRequest(binding_id=bid), _Context())
            assert sections == [False] and mem.kv is None and cache.maps() == idle
    finally:
        svc.close_leases()
        mem.close()
        cache.close()
