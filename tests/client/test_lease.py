"""client/lease.py: the engine holds one live lease, takes a new one when the sidecar's ends, binds without one
(said) where none can be had."""

from __future__ import annotations

import os
import queue
import socket
import threading

from dspark_sidecar.client.lease import EngineLease
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.lease import LeaseKeeper
from helpers.engine_fakes import short_socket_dir
from helpers.waiting import wait_until


def _keeper(path):
    lost: queue.Queue[int] = queue.Queue()
    k = LeaseKeeper(path, lost.put)
    k.lost = lost
    return k


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
    try:
        with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
            assert EngineLease().token(path, 5) == 0
            t.join(10)
        assert "closed after 3 of the token's 8 bytes" in caplog.text
    finally:
        srv.close()


def test_a_child_the_engine_forks_does_not_hold_its_lease():
    """The lease ends when its last descriptor closes: a forked child (a worker pool, a helper) that inherited it
    kept it, and with it the engine's binding, after the engine itself had ended."""
    import os

    path = short_socket_dir() / "rank0.lease"
    k = _keeper(path)
    lease = EngineLease()
    r, w = os.pipe()
    try:
        token = lease.token(str(path), 5)
        pid = os.fork()
        if pid == 0:  # the child: lives until the parent says
            os.read(r, 1)
            os._exit(0)
        try:
            lease.close()  # as the engine's exit would
            assert k.lost.get(timeout=5) == token
        finally:
            os.write(w, b"x")
            os.waitpid(pid, 0)
    finally:
        os.close(r)
        os.close(w)
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
        binder = SimpleNamespace(lease=lease, release=lambda stub, deadline: order.append("unbind"))
        shim = SimpleNamespace(binder=binder, connection=SimpleNamespace(stub=None),
                               config=SimpleNamespace(connect_deadline_s=1.0),
                               _drop_link=lambda: order.append(f"link (lease {k.live(token)})"))
        DrafterShim._release(shim)  # type: ignore[arg-type]
        assert order == ["unbind", "link (lease True)"]
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
