"""client/lease.py: the engine holds one live lease, takes a new one when the sidecar's ends, binds without one
(said) where none can be had; the shim binds and attaches its data plane under it, and its close() ends it."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import threading

import grpc

from dspark_sidecar.client.config import EngineConfig
from dspark_sidecar.client.forward_context import set_forward_context
from dspark_sidecar.client.lease import EngineLease
from dspark_sidecar.client.shim import DrafterShim
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto.gpu_word import GpuWordError
from dspark_sidecar.server.lease import LeaseKeeper
from helpers.engine_fakes import (
    DoorbellNeverAnswered, FakeModel, FakeServer, shm_kv_cache, short_socket_dir, step_inputs,
)
from helpers.waiting import wait_until


def _keeper(path):
    lost: queue.Queue[int] = queue.Queue()
    k = LeaseKeeper(path, lost.put)
    k.lost = lost
    return k


def _fill_backlog(path: str) -> list[socket.socket]:
    """Connections queued at the listener at `path` until its backlog is full (the next connect would block)."""
    queued = []
    while True:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            return queued
        queued.append(c)


def _token_within(path: str, caplog, deadline_s: float = 0.2) -> int:
    """The token EngineLease takes at `path` within a bind deadline of `deadline_s`, its warnings in caplog; the
    take must end by then (joined with a hang guard of 10 s only)."""
    got: list[int] = []
    taking = threading.Thread(target=lambda: got.append(EngineLease().token(path, deadline_s)), daemon=True)
    with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
        taking.start()
        taking.join(10)
    assert not taking.is_alive(), f"the lease's token at {path} was waited for past the bind deadline"
    return got[0]


def test_one_lease_is_held_and_its_close_ends_it_at_the_sidecar():
    path = short_socket_dir() / "rank0.lease"
    k = _keeper(path)
    lease = EngineLease()
    try:
        token = lease.token(str(path), 5)
        assert token and k.live(token)
        assert lease.token(str(path), 5) == token and k.count == 1  # the same lease, not a second
        lease.close()
        assert k.lost.get(timeout=5) == token
    finally:
        k.close()


def test_a_lease_the_sidecar_ended_is_taken_again_from_its_next_start():
    path = short_socket_dir() / "rank0.lease"
    first = _keeper(path)
    lease = EngineLease()
    old = lease.token(str(path), 5)
    first.close()  # the sidecar stops: the engine's end reads end of file
    second = _keeper(path)  # and starts again at the same path
    try:
        new = wait_until(lambda: lease.token(str(path), 5), 5, "a new lease")
        assert new != old and second.live(new) and not second.live(old)
    finally:
        lease.close()
        second.close()


def test_no_lease_where_the_sidecar_has_none_or_it_cannot_be_had(caplog):
    lease = EngineLease()
    assert lease.token("", 1) == 0  # a sidecar from before leases: nothing said, nothing tried
    missing = short_socket_dir() / "rank0.lease"
    with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
        assert lease.token(str(missing), 1) == 0
    assert "no lease from the sidecar's" in caplog.text and "outlive this process" in caplog.text



def test_a_sidecar_that_names_no_lease_socket_ends_the_lease_held():
    """A sidecar restarted without leases (an older one, or one with no socket folder) names none: the lease held is
    the old start's, and its token, still `held`, named in the data plane's attach, is refused LEASE_LOST by a
    sidecar that serves no lease socket (and the doorbell was then off for the link's life)."""
    path = short_socket_dir() / "rank0.lease"
    k = _keeper(path)
    lease = EngineLease()
    try:
        token = lease.token(str(path), 5)
        assert token and lease.token("", 5) == 0 and lease.held == 0
        assert k.lost.get(timeout=5) == token
    finally:
        lease.close()
        k.close()


def test_a_lease_socket_that_never_sends_its_token_gives_no_lease_within_the_deadline(caplog):
    """A listener at the path that takes the connection and sends nothing (a keeper whose thread is stuck, a stranger):
    the bind waits for the token no longer than its deadline, then goes on without a lease, said."""
    path = str(short_socket_dir() / "rank0.lease")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)  # never accepts: the connection waits in the backlog, which the kernel completes
    try:
        assert _token_within(path, caplog) == 0 and "no lease from the sidecar's" in caplog.text
    finally:
        srv.close()

def test_a_token_sent_a_byte_at_a_time_is_waited_for_no_longer_than_the_deadline(caplog):
    """The deadline was each socket call's timeout: a peer that sent the token's 8 bytes 0.3 s apart (each recv
    within a 0.5 s deadline) held the bind 2.4 s, with connect's own wait besides: up to 9x the deadline the
    BindKV it serves shares (client/binding.py). Now it is the whole take's."""
    path = str(short_socket_dir() / "rank0.lease")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    stop = threading.Event()

    def drip() -> None:
        c, _ = srv.accept()
        with c:
            for b in (1).to_bytes(8, "little"):
                if stop.wait(0.3):
                    return
                c.sendall(bytes([b]))

    peer = threading.Thread(target=drip, daemon=True)
    peer.start()
    got: list[int] = []
    taking = threading.Thread(target=lambda: got.append(EngineLease().token(path, 0.5)), daemon=True)
    try:
        with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
            taking.start()
            taking.join(1.5)  # the deadline (0.5 s) with room for a loaded CI host; the old wait was 2.4 s
            assert not taking.is_alive(), "the token was waited for past the deadline, a byte at a time"
        assert got == [0] and "no lease from the sidecar's" in caplog.text
    finally:
        stop.set()
        peer.join(5)
        srv.close()


def test_a_lease_socket_whose_backlog_is_full_is_waited_on_within_the_deadline(monkeypatch):
    """A unix connect() with a timeout fails at once (EAGAIN) where the listener's backlog is full, where a blocking
    one waits for room: a keeper whose accepts wait (EMFILE: it leaves connections in the backlog and tries again,
    server/lease.py) or that a burst of connects outran gave the engine no lease at once, well inside its bind
    deadline, and its binding then outlived it. The room is waited for within the deadline."""
    path = str(short_socket_dir() / "rank0.lease")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(0)
    srv.settimeout(10)
    queued = _fill_backlog(path)  # as connections the keeper has not accepted yet do
    tried = threading.Event()
    real_connect = socket.socket.connect

    def connect(self, address):
        try:
            return real_connect(self, address)
        finally:
            tried.set()

    monkeypatch.setattr(socket.socket, "connect", connect)
    got: list[int] = []
    taking = threading.Thread(target=lambda: got.append(EngineLease().token(path, 10)), daemon=True)
    try:
        taking.start()
        assert tried.wait(10)  # the engine has met the full backlog
        for _ in queued:  # the keeper accepts again, the queued connections first
            srv.accept()[0].close()
        conn, _ = srv.accept()
        with conn:
            conn.sendall((7).to_bytes(8, "little"))
            taking.join(10)
            assert got == [7]
    finally:
        for c in queued:
            c.close()
        srv.close()



def test_a_lease_socket_whose_backlog_stays_full_gives_no_lease_at_the_deadline(caplog):
    """The wait for room in a full backlog (above) ends with the deadline: a keeper that never accepts again (its
    thread wedged) holds the bind no longer than that, and the engine binds without a lease, said."""
    path = str(short_socket_dir() / "rank0.lease")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(0)
    queued = _fill_backlog(path)  # and nobody accepts
    try:
        assert _token_within(path, caplog) == 0 and "backlog stayed full" in caplog.text
    finally:
        for c in queued:
            c.close()
        srv.close()


def test_each_read_of_the_token_waits_only_for_what_is_left_of_the_deadline(monkeypatch):
    """The drip above, read closely: each recv's wait is what is left of the take's deadline, never the whole of
    it again (a first byte late in the deadline, then silence, held the bind up to twice the deadline)."""
    path, _, t, srv = _peer(b"\x01")  # one byte, then end of file
    waits: list[float] = []
    real_recv = socket.socket.recv

    def recv(self, n):
        waits.append(self.gettimeout())
        return real_recv(self, n)

    monkeypatch.setattr(socket.socket, "recv", recv)
    try:
        assert EngineLease().token(path, 5) == 0
        t.join(10)
        assert len(waits) == 2 and all(0 < w < 5 for w in waits), waits
    finally:
        srv.close()


def _peer(sends: bytes) -> tuple[str, list[bytes], threading.Thread, socket.socket]:
    """A listener at a lease path that is no keeper: it accepts one connection, sends `sends`, reads what the
    engine does next (b"": it closed its end) into the list, and closes. (path, that list, its thread, listener)."""
    path = str(short_socket_dir() / "rank0.lease")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    got: list[bytes] = []

    def serve() -> None:
        c, _ = srv.accept()
        c.sendall(sends)
        c.settimeout(5)
        if len(sends) == 8:
            got.append(c.recv(1))
        c.close()

    t = threading.Thread(target=serve)
    t.start()
    return path, got, t, srv


def test_a_peer_that_closes_before_the_whole_token_gives_no_lease(caplog):
    """What a full keeper does (MAX_LEASES), and what a stranger listening at the path might."""
    path, _, t, srv = _peer(b"\x01\x02\x03")
    got: list[int] = []
    # On a thread: an end of file read as "no bytes yet" is a loop no deadline ends (recv returns at once).
    taking = threading.Thread(target=lambda: got.append(EngineLease().token(path, 5)), daemon=True)
    try:
        with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
            taking.start()
            taking.join(10)  # a hang guard only
            assert not taking.is_alive(), "the token's read went on past the peer's end of file"
            t.join(10)
        assert got == [0] and "closed after 3 of the token's 8 bytes" in caplog.text
    finally:
        srv.close()


def test_a_rank_that_holds_its_most_leases_is_named_as_the_cause_in_the_engine_s_warning(caplog):
    """A full rank closes a new connection before its token (server/lease.py MAX_LEASES). The engine's warning said
    only "the connection closed after 0 of the token's 8 bytes": nothing for the person reading it to act on (who
    holds the rank's leases), though the binding it goes on without outlives the engine."""
    from dspark_sidecar.server.lease import MAX_LEASES

    path = short_socket_dir() / "rank0.lease"
    k = _keeper(path)
    held = [EngineLease() for _ in range(MAX_LEASES)]
    try:
        assert all(lease.token(str(path), 5) for lease in held) and k.count == MAX_LEASES
        assert _token_within(str(path), caplog, 5) == 0
        assert f"the most leases a sidecar rank holds ({MAX_LEASES}:" in caplog.text, caplog.text
    finally:
        for lease in held:
            lease.close()
        k.close()


def test_a_child_the_engine_forks_does_not_hold_its_lease():
    """The lease ends when its last descriptor closes: a forked child (a worker pool, a helper) that inherited it
    kept it, and with it the engine's binding, after the engine itself had ended."""
    path = short_socket_dir() / "rank0.lease"
    k = _keeper(path)
    lease = EngineLease()
    try:
        token = lease.token(str(path), 5)
        with _forked_child():
            lease.close()  # as the engine's exit would
            assert k.lost.get(timeout=5) == token
    finally:
        lease.close()
        k.close()


@contextlib.contextmanager
def _forked_child():
    """A child forked here (the engine's worker, holding whatever descriptors were open), alive until the block ends."""
    r, w = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:  # the child: lives until the parent says
            os.read(r, 1)
            os._exit(0)
        try:
            yield
        finally:
            os.write(w, b"x")
            os.waitpid(pid, 0)
    finally:
        os.close(r)
        os.close(w)


def test_a_child_forked_while_the_lease_is_being_taken_does_not_hold_it():
    """The fork above, while another thread of the engine takes the lease (connected, its token not read yet: up to
    the bind's deadline from a slow keeper): the socket was not the lease's yet, so the child's copy stayed open
    (seen: the keeper read no end of the lease after the engine closed it, for as long as the child lived)."""
    path = str(short_socket_dir() / "rank0.lease")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    lease = EngineLease()
    got: list[int] = []
    taking = threading.Thread(target=lambda: got.append(lease.token(path, 10)), daemon=True)
    try:
        taking.start()
        conn, _ = srv.accept()  # the take is under way: connected, waiting for its token
        with conn, _forked_child():
            conn.sendall((7).to_bytes(8, "little"))
            taking.join(10)
            assert got == [7]
            lease.close()  # as the engine's exit would
            conn.settimeout(5)  # a bound on a hang only: the end comes at once
            try:
                end = conn.recv(1)
            except TimeoutError:
                end = None
            assert end == b"", "the forked child kept the lease open after the engine closed it"
    finally:
        lease.close()
        srv.close()


def test_a_child_forked_while_the_lease_s_socket_is_being_made_does_not_hold_it(monkeypatch):
    """The fork above, one step earlier: another engine thread forks while the take is inside socket() (the call
    lets other threads run, and the socket is no one's yet, not even the take's). The child's copy was closed by
    nothing, the parent then connected that very socket, and the gone engine's lease stayed open for as long as
    the child lived (the engine's worker pool: for good). The fork now waits for the socket to be the take's."""
    path = short_socket_dir() / "rank0.lease"
    k = _keeper(path)
    lease = EngineLease()
    go, forked = threading.Event(), threading.Event()
    r, w = os.pipe()
    children: list[int] = []

    def fork() -> None:  # the engine's other thread
        go.wait(10)
        pid = os.fork()
        if pid == 0:  # the child: lives until the test says
            os.read(r, 1)
            os._exit(0)
        children.append(pid)
        forked.set()

    made = socket.socket

    class Socket(made):  # socket() with the fork landing inside it, as it may on a busy engine
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if threading.current_thread().name == "taking":
                go.set()
                forked.wait(1)  # at once where the fork does not wait for the take (it did not)

    forker = threading.Thread(target=fork, daemon=True)
    got: list[int] = []
    taking = threading.Thread(target=lambda: got.append(lease.token(str(path), 10)), name="taking", daemon=True)
    try:
        forker.start()
        monkeypatch.setattr(socket, "socket", Socket)
        taking.start()
        taking.join(10)
        monkeypatch.undo()
        forker.join(10)
        assert got and got[0] and forked.is_set() and children
        lease.close()  # as the engine's exit would
        assert k.lost.get(timeout=5) == got[0], "the forked child kept the lease open after the engine closed it"
    finally:
        monkeypatch.undo()
        os.write(w, b"x")
        for pid in children:
            os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
        lease.close()
        k.close()


def test_a_forked_child_holds_none_of_the_parent_s_lease_and_takes_its_own_from_any_thread():
    """What the child is left with: no lease (its `held` the parent's token, it would have bound under the lease of
    another process), and a take of its own that works, on a thread the child starts too (the fork's hold on the
    take's lock is let go in the child, or such a take waited on it for good)."""
    path = short_socket_dir() / "rank0.lease"
    k = _keeper(path)
    lease = EngineLease()
    r, w = os.pipe()
    try:
        parent = lease.token(str(path), 5)
        pid = os.fork()
        if pid == 0:  # the child: its own lease, taken on a thread of its own, reported as "held token"
            got: list[str] = []

            def take() -> None:
                try:
                    got.append(f"{lease.held} {lease.token(str(path), 5)}")
                except BaseException as e:  # noqa: BLE001  (reported to the parent)
                    got.append(f"raised {e!r}")

            t = threading.Thread(target=take, daemon=True)
            t.start()
            t.join(5)
            os.write(w, (got[0] if got else "hung").encode())
            os._exit(0)
        os.close(w)
        w = -1
        with os.fdopen(r, "rb") as f:
            r = -1
            said = f.read().decode()
        os.waitpid(pid, 0)
        held, _, token = said.partition(" ")
        assert held == "0" and token.isdigit() and int(token) not in (0, parent), said
        assert k.lost.get(timeout=5) == int(token)  # the child's lease ended with the child, the parent's stands
        assert lease.token(str(path), 5) == parent and k.live(parent)
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
        lease.close()
        k.close()


def test_a_lease_from_another_socket_is_given_up_for_one_from_the_socket_named():
    """The sidecar's status named another lease socket (another rank, a new socket folder): a token of the old
    one's is LEASE_LOST there, and kept open the old lease held its binding."""
    first_path, second_path = short_socket_dir() / "rank0.lease", short_socket_dir() / "rank0.lease"
    first, second = _keeper(first_path), _keeper(second_path)
    lease = EngineLease()
    try:
        old = lease.token(str(first_path), 5)
        new = lease.token(str(second_path), 5)
        assert second.live(new) and first.lost.get(timeout=5) == old
    finally:
        lease.close()
        first.close()
        second.close()


def test_a_peer_that_sends_token_0_gives_no_lease_and_is_let_go(caplog):
    path, got, t, srv = _peer(bytes(8))
    lease = EngineLease()
    try:
        with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
            assert lease.token(path, 5) == 0 and lease.held == 0
            t.join(10)
        assert got == [b""] and "sent lease token 0" in caplog.text
    finally:
        srv.close()


def test_after_a_token_0_the_next_take_at_that_path_is_a_new_one():
    """The socket a token 0 came on is given up, not kept as the lease: the next take at the same path (a keeper
    there now) connects anew and gets its token."""
    path, _, t, srv = _peer(bytes(8))
    lease = EngineLease()
    try:
        assert lease.token(path, 5) == 0
        t.join(10)
        answer = threading.Thread(target=lambda: srv.accept()[0].sendall((7).to_bytes(8, "little")), daemon=True)
        answer.start()  # the same listener answers the next connection with a token
        assert lease.token(path, 5) == 7 and lease.held == 7
        answer.join(10)
    finally:
        lease.close()
        srv.close()


def test_the_shim_s_release_ends_its_lease_last():
    """close() (or a turn-off) ends the lease after UnbindKV and the link: kept, the engine held a lease, and a
    binding an UnbindKV that failed left, for as long as it ran."""
    from types import SimpleNamespace

    from dspark_sidecar.client.shim import DrafterShim

    path = short_socket_dir() / "rank0.lease"
    k = _keeper(path)
    order: list[str] = []
    lease = EngineLease()
    try:
        token = lease.token(str(path), 5)
        # This end's view of the lease at each call (the keeper's would lag: it reads the end on its own thread).
        binder = SimpleNamespace(lease=lease, release=lambda stub, deadline: order.append(
            f"unbind (lease {lease.held == token})"))
        shim = SimpleNamespace(binder=binder, connection=SimpleNamespace(stub=None),
                               config=SimpleNamespace(connect_deadline_s=1.0),
                               _drop_link=lambda: order.append(f"link (lease {lease.held == token})"))
        DrafterShim._release(shim)  # type: ignore[arg-type]
        assert order == ["unbind (lease True)", "link (lease True)"]
        assert k.lost.get(timeout=5) == token and lease.held == 0
    finally:
        lease.close()
        k.close()


def test_the_lease_socket_is_found_beside_the_grpc_socket_as_this_engine_reaches_it(tmp_path):
    """StatusReport.lease_socket is the server's path. An engine container that mounts the socket folder elsewhere
    found nothing there and bound without a lease (its binding then outlived it); the protocol puts the lease
    socket beside the rank's gRPC socket, which the engine reaches by its own path."""
    from types import SimpleNamespace

    from dspark_sidecar.client.lease import lease_path
    from dspark_sidecar.client.shim import DrafterShim

    here = short_socket_dir()
    k = _keeper(here / "rank0.lease")
    lease = EngineLease()
    try:
        theirs = "/run/dspark-elsewhere/rank0.lease"  # the sidecar's mount of the folder, absent in the engine's
        endpoint = f"unix:{here}/rank0.sock"
        assert lease_path(endpoint, theirs) == os.path.realpath(here / "rank0.lease")  # links resolved (below)
        shim = SimpleNamespace(connection=SimpleNamespace(endpoint=endpoint,
                                                          status=pb.StatusReport(lease_socket=theirs)))
        path = DrafterShim._lease_socket(shim)  # type: ignore[arg-type]
        token = lease.token(path, 5)
        assert token and k.live(token)
        # Where nothing is beside the endpoint (a TCP target, or a folder with no lease socket in it): the
        # status's path as it is; no leases stays no leases.
        assert lease_path("127.0.0.1:7000", theirs) == theirs
        assert lease_path(f"unix:{tmp_path}/rank0.sock", theirs) == theirs
        assert lease_path(endpoint, "") == ""
    finally:
        lease.close()
        k.close()


def test_a_link_to_the_grpc_socket_leads_to_the_lease_socket_beside_the_real_one():
    """An endpoint that is a link (in a folder others may add entries to: /tmp, sticky) to the sidecar's socket:
    the lease socket is the one beside the socket the link leads to, in the sidecar's own folder. Looked for
    beside the link, whoever put a socket of that name next to it there held the engine's lease (ending it at
    will, or keeping the gone engine's binding mapped by never ending it)."""
    from dspark_sidecar.client.lease import lease_path

    real, other = short_socket_dir(), short_socket_dir()
    k = _keeper(real / "rank0.lease")
    grpc_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    grpc_sock.bind(str(real / "rank0.sock"))  # stands for the rank's gRPC socket
    (other / "rank0.sock").symlink_to(real / "rank0.sock")
    hostile = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hostile.bind(str(other / "rank0.lease"))
    hostile.listen(1)
    lease = EngineLease()
    try:
        path = lease_path(f"unix:{other}/rank0.sock", "/run/dspark-elsewhere/rank0.lease")
        assert os.path.samefile(path, real / "rank0.lease")
        token = lease.token(path, 5)
        assert token and k.live(token)
        # gRPC's other spelling of an absolute path, unix:///abs: the same folder.
        assert lease_path(f"unix://{other}/rank0.sock", "/run/dspark-elsewhere/rank0.lease") == path
    finally:
        lease.close()
        hostile.close()
        grpc_sock.close()
        k.close()


def test_a_lease_socket_whose_resolved_path_passes_the_unix_limit_still_gives_a_lease():
    """A socket folder reached through a short link to a deep folder (the usual way round sun_path's 108 bytes;
    serve checks --socket-dir as given), or a relative endpoint under a deep working folder: the gRPC socket is
    reached by the short path, but lease_path resolves it, and the resolved path is too long for connect(). No
    lease was taken ("AF_UNIX path too long"), so a killed engine's binding stayed mapped, its memory held."""
    from dspark_sidecar import layout
    from dspark_sidecar.client.lease import lease_path

    top = short_socket_dir()
    deep = top / ("d" * (layout.SUN_PATH_MAX - len(str(top))))
    deep.mkdir()
    (top / "s").symlink_to(deep)  # --socket-dir TOP/s: its rank0.lease fits, the resolved one does not
    k = _keeper(top / "s" / "rank0.lease")
    lease = EngineLease()
    try:
        path = lease_path(f"unix:{top}/s/rank0.sock", "/run/dspark-elsewhere/rank0.lease")
        assert len(path) > layout.SUN_PATH_MAX and os.path.samefile(path, k.path)
        fds = len(os.listdir("/proc/self/fd"))
        token = lease.token(path, 5)
        assert token and k.live(token) and lease.token(path, 5) == token  # held, not taken again
        lease.close()
        assert k.lost.get(timeout=5) == token  # the keeper closed its end before it reported the loss
        # And the folder's descriptor is closed again too (waited for: another thread's may come and go meanwhile).
        wait_until(lambda: len(os.listdir("/proc/self/fd")) == fds, 2, lambda: os.listdir("/proc/self/fd"))
    finally:
        lease.close()
        k.close()



def test_a_relative_endpoint_leads_to_the_lease_socket_beside_it_by_an_absolute_path(monkeypatch):
    """unix:RELATIVE (gRPC's own form for a path from the working folder): the lease socket beside it, named from the
    root, so the lease held is the same socket's whatever folder this process is in at its next bind."""
    from dspark_sidecar.client.lease import lease_path

    here = short_socket_dir()
    k = _keeper(here / "rank0.lease")
    monkeypatch.chdir(here.parent)
    lease = EngineLease()
    try:
        path = lease_path(f"unix:{here.name}/rank0.sock", "/run/dspark-elsewhere/rank0.lease")
        assert os.path.isabs(path) and os.path.samefile(path, here / "rank0.lease")
        token = lease.token(path, 5)
        monkeypatch.chdir(here)
        assert token and k.live(token) and lease.token(path, 5) == token
    finally:
        lease.close()
        k.close()

def test_an_abstract_or_tcp_endpoint_has_no_folder_to_look_in(monkeypatch):
    """unix-abstract:NAME names no file (and dns:, ipv4: no socket folder): the status's path stands, never a
    socket of that name in whatever folder this process runs in."""
    from dspark_sidecar.client.lease import lease_path

    here = short_socket_dir()
    k = _keeper(here / "rank0.lease")
    monkeypatch.chdir(here)
    try:
        theirs = "/run/dspark-elsewhere/rank0.lease"
        for endpoint in ("unix-abstract:rank0.sock", "dns:localhost:7000", "ipv4:127.0.0.1:7000", "localhost:7000"):
            assert lease_path(endpoint, theirs) == theirs, endpoint
    finally:
        k.close()


# The shim under a lease ---------------------------------------------------------------------------------------------

class _LeasedRank(DoorbellNeverAnswered):
    """A fake sidecar rank that takes the data plane and answers no ring, with a lease socket beside its gRPC socket
    as server/lease.py and the servicer have it: its status names the socket, and BindKV, RegisterBuffers and
    AttachDoorbell must name a lease it handed out that is still open, or are refused LEASE_LOST. `seen`: (call,
    lease) as they came."""

    def __init__(self, folder) -> None:
        super().__init__(max_reqs=4)
        self.seen: list[tuple[str, int]] = []
        self.keeper = _keeper(folder / "rank0.lease")
        self.server = FakeServer(self, folder / "rank0.sock").start()

    def restart(self) -> None:
        """Stop and start again at the same paths: the old leases end, and the binding with them."""
        self.server.stop()
        self.keeper.close()
        self.binding_id = 0
        self.keeper = _keeper(self.keeper.path)
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
        self.keeper.close()

    def GetStatus(self, request, context):
        st = super().GetStatus(request, context)
        st.lease_socket = "/run/dspark-elsewhere/rank0.lease"  # the server's view: the shim looks beside the socket
        return st

    def _leased(self, call: str, lease: int, context) -> None:
        self.seen.append((call, lease))
        if not (lease and self.keeper.live(lease)):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "LEASE_LOST")

    def BindKV(self, request, context):
        self._leased("BindKV", request.lease, context)
        return super().BindKV(request, context)

    def RegisterBuffers(self, request, context):
        self._leased("RegisterBuffers", request.lease, context)
        return super().RegisterBuffers(request, context)

    def AttachDoorbell(self, request, context):
        self._leased("AttachDoorbell", request.lease, context)
        return super().AttachDoorbell(request, context)


def _doorbell_shim(endpoint: str, agree=None, **cfg) -> DrafterShim:
    kv = shm_kv_cache()
    shim = DrafterShim(EngineConfig(tp_size=4, endpoint=endpoint, transport="doorbell", **cfg), FakeModel(),
                       lambda: [s.tensor for s in kv], agree or ParallelContext(0, 1))
    shim._test_kv = kv  # kept alive with the shim
    return shim


def test_the_data_plane_is_attached_under_the_binding_s_lease_and_a_restart_gives_a_new_one():
    """The doorbell and the step buffers stop and go with the lease the binding was made under: attached under none,
    a gone engine's doorbell polled its page on and its regions stayed mapped. A restarted sidecar ended the old
    lease: the shim binds and attaches again under a new one, which its close() ends."""
    rank = _LeasedRank(short_socket_dir())
    shim = _doorbell_shim(rank.server.endpoint)
    try:
        assert shim.connect() is None and shim.doorbell is not None
        token = shim.binder.lease.held
        assert token and rank.keeper.live(token)
        assert rank.seen == [("BindKV", token), ("AttachDoorbell", token), ("RegisterBuffers", token)]
        rank.restart()
        wait_until(lambda: shim.connection.stream_ended, 10, "the shim to see the old sidecar's stream end")
        rank.seen.clear()
        assert shim.connect() is None and shim.doorbell is not None
        new = shim.binder.lease.held
        assert new != token and rank.keeper.live(new)
        assert rank.seen == [("BindKV", new), ("AttachDoorbell", new), ("RegisterBuffers", new)]
        shim.close()
        assert rank.keeper.lost.get(timeout=5) == new and shim.binder.lease.held == 0
    finally:
        shim.close()
        rank.stop()


class _CountingPeer:
    """A 2-rank agreement whose peer holds the same values; counts the pre-flights (the 5-value agreements)."""

    world_size = 2

    def __init__(self) -> None:
        self.preflights = 0

    def all_min(self, values):
        self.preflights += values.numel() == 5
        return values.clone()


def _unsettled_then_failing_check(shim: DrafterShim) -> None:
    """A doorbell step past its deadline and grace (the fake answers no ring), then a driver that refuses what
    looking at it queues (a late answer's ordering wait, DoorbellChannel.settled on a GPU): every look raises."""
    ids, pos, meta = step_inputs(2)
    with set_forward_context(meta):
        assert shim.maybe_forward(ids, pos) is None and shim._unsettled is not None

    def refused(step_id: int) -> bool:
        raise GpuWordError("cuStreamWaitEvent failed with driver code 999")

    shim.doorbell.settled = refused


def test_close_ends_the_lease_though_the_woken_step_cannot_be_looked_at():
    """close() gives an unsettled step its grace, then releases; the lease's end is the release of last resort
    (the sidecar stops the doorbell and drops the binding and the regions made under it). A look at the step that
    raised skipped the whole release: no UnbindKV, and the lease, with the binding, the regions and the doorbell
    the sidecar keeps mapped under it, held for the rest of the engine's life."""
    rank = _LeasedRank(short_socket_dir())
    shim = _doorbell_shim(rank.server.endpoint, step_deadline_s=0.2, late_grace_s=0.2)
    try:
        assert shim.connect() is None
        token = shim.binder.lease.held
        _unsettled_then_failing_check(shim)
        shim.close()
        assert shim.binder.lease.held == 0 and rank.keeper.lost.get(timeout=5) == token
        assert rank.calls["UnbindKV"] == 1
        assert shim._unsettled is not None and shim.doorbell is not None  # its link stays until it settles
    finally:
        shim.close()
        shim._unsettled = None
        shim._drop_link()  # the page and the regions, which the step kept
        rank.stop()


def test_a_closed_shim_whose_late_step_cannot_be_looked_at_still_agrees_and_returns_none():
    """After close() every maybe_forward is None and still takes part in the pre-flight (its peers wait there for
    this rank). The look at a late step it makes first raised out of maybe_forward, before the pre-flight."""
    rank = _LeasedRank(short_socket_dir())
    peer = _CountingPeer()
    shim = _doorbell_shim(rank.server.endpoint, agree=peer, step_deadline_s=0.2, late_grace_s=0.2)
    try:
        assert shim.connect() is None
        _unsettled_then_failing_check(shim)
        shim.close()
        ids, pos, meta = step_inputs(2)
        preflights = peer.preflights
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is None
        assert peer.preflights == preflights + 1
    finally:
        shim.close()
        shim._unsettled = None
        shim._drop_link()  # the page and the regions, which the step kept
        rank.stop()
