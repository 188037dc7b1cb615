"""client/lease.py: the engine holds one live lease, takes a new one when the sidecar's ends, binds without one
(said) where none can be had."""

from __future__ import annotations

import queue
import socket
import threading

from dspark_sidecar.client.lease import EngineLease
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


def test_a_peer_that_closes_before_the_whole_token_gives_no_lease(caplog):
    """What a full keeper does (MAX_LEASES), and what a stranger listening at the path might."""
    path = short_socket_dir() / "rank0.lease"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    lease = EngineLease()
    try:
        with caplog.at_level("WARNING", logger="dspark_sidecar.client"):
            def half():
                c, _ = srv.accept()
                c.sendall(b"\x01\x02\x03")
                c.close()

            t = threading.Thread(target=half)
            t.start()
            assert lease.token(str(path), 5) == 0
            t.join()
        assert "closed after 3 of the token's 8 bytes" in caplog.text
    finally:
        srv.close()
