"""The ranks' group listens on the rendezvous address only: torch's store, gloo and NCCL."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch.distributed as dist

from dspark_sidecar.server.config import ServeConfigError
from dspark_sidecar.server.process_group import COLLECTIVE_IFNAMES, keep_collectives_local, rendezvous_store
from helpers.listening import has_ipv6_loopback, is_loopback, listening_tcp

TIMEOUT = datetime.timedelta(seconds=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank_0_s_store_listens_on_the_rendezvous_address_only():
    """torch's own TCPStore(is_master=True) listens on [::]:PORT, every interface of the node; the
    store rank 0 hosts here listens on 127.0.0.1:PORT, and a second rank reaches it there."""
    port = _free_port()
    before = set(listening_tcp(os.getpid()))
    store = rendezvous_store("127.0.0.1", port, 0, 2, TIMEOUT)
    opened = set(listening_tcp(os.getpid())) - before
    assert opened == {("127.0.0.1", port)}, opened
    peer = rendezvous_store("127.0.0.1", port, 1, 2, TIMEOUT)
    peer.set("from-1", "x")
    assert store.get("from-1") == b"x"
    del peer, store


def test_torch_s_own_store_would_listen_on_every_address():
    """Why rendezvous_store exists: if torch's store ever binds its host argument, this fails and the
    module's listening socket of its own can go."""
    port = _free_port()
    before = set(listening_tcp(os.getpid()))
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    opened = set(listening_tcp(os.getpid())) - before
    assert opened and not all(is_loopback(a) for a, _ in opened), opened
    del store


def test_a_busy_rendezvous_port_is_one_line_naming_the_flag():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ServeConfigError, match=rf"--master-port: rank 0 cannot listen on 127.0.0.1:{port}"):
            rendezvous_store("127.0.0.1", port, 0, 2, TIMEOUT)


@pytest.mark.parametrize("addr", ["no-such-host.invalid", "pod..svc", "a" * 64])
def test_an_unresolvable_rendezvous_address_is_one_line(addr):
    """An empty label or one past 63 characters fails IDNA before any lookup: UnicodeError, a traceback from
    rank 0 started by hand (serve's parent and torchrun resolve the name first)."""
    with pytest.raises(ServeConfigError, match="--master-addr: cannot resolve"):
        rendezvous_store(addr, _free_port(), 0, 2, TIMEOUT)


@pytest.mark.parametrize("addr,expect_lo", [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                            ("10.0.0.7", False), ("node-3", False)])
def test_collectives_default_to_loopback_with_a_loopback_rendezvous(addr, expect_lo):
    env: dict[str, str] = {}
    set_now = keep_collectives_local(addr, env)
    assert env == set_now
    assert set_now == ({k: "lo" for k in COLLECTIVE_IFNAMES} if expect_lo else {})


def test_an_operator_s_interface_choice_is_kept():
    env = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": ""}
    assert keep_collectives_local("127.0.0.1", env) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert env == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "lo"}



def test_a_store_torch_closed_on_a_failed_start_is_not_closed_again(monkeypatch):
    """torch's store server takes the listening descriptor when it starts; a later step of the
    constructor that fails (its own client cannot connect) closes it. Closing it again here closed
    whatever the number belonged to by then: in a rank, a socket of its gRPC server."""
    from dspark_sidecar.server import process_group

    taken = []

    def fails_after_taking(host, port, world, is_master, timeout, wait_for_workers, master_listen_fd):
        os.close(master_listen_fd)
        taken.append(os.open(os.devnull, os.O_RDONLY))  # another thread's file, under the freed number
        raise dist.DistNetworkError("The client socket has timed out")

    monkeypatch.setattr(process_group.dist, "TCPStore", fails_after_taking)
    with pytest.raises(dist.DistNetworkError):
        rendezvous_store("127.0.0.1", _free_port(), 0, 2, TIMEOUT)
    try:
        os.fstat(taken[0])  # EBADF if it was closed as the listener
    finally:
        os.close(taken[0])


def test_a_store_that_never_took_the_descriptor_closes_it(monkeypatch):
    from dspark_sidecar.server import process_group

    seen = []

    def refuses(host, port, world, is_master, timeout, wait_for_workers, master_listen_fd):
        seen.append(master_listen_fd)
        raise ValueError("listen fd is bound to another port")

    monkeypatch.setattr(process_group.dist, "TCPStore", refuses)
    port = _free_port()
    with pytest.raises(ValueError):
        rendezvous_store("127.0.0.1", port, 0, 2, TIMEOUT)
    assert ("127.0.0.1", port) not in listening_tcp(os.getpid())


@pytest.mark.skipif(not has_ipv6_loopback(), reason="no ::1 on this host")
def test_a_bracketed_ipv6_rendezvous_address_works():
    """`[::1]`, as --master-addr took it while it went into torch's tcp:// URL (is_loopback accepts it
    too): torch's store cannot resolve the brackets and waited out its timeout."""
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    short = datetime.timedelta(seconds=3)
    store = rendezvous_store("[::1]", port, 0, 2, short)
    assert ("::1", port) in listening_tcp(os.getpid())
    peer = rendezvous_store("[::1]", port, 1, 2, short)
    peer.set("from-1", "x")
    assert store.get("from-1") == b"x"
    del peer, store


def test_a_name_s_first_address_that_cannot_be_bound_falls_to_the_next(monkeypatch):
    """'localhost' is often ::1 first, then 127.0.0.1; in a container without IPv6 ::1 cannot be bound
    (the preflight's check_port passes on the next address, rank 0 then failed on the first)."""
    from dspark_sidecar.server import process_group

    real = socket.getaddrinfo

    def v6_first(host, port, *a, **kw):
        if host != "localhost":
            return real(host, port, *a, **kw)
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("2001:db8::1", port, 0, 0)),  # not this host's
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(process_group.socket, "getaddrinfo", v6_first)
    port = _free_port()
    store = rendezvous_store("localhost", port, 0, 1, TIMEOUT)
    assert ("127.0.0.1", port) in listening_tcp(os.getpid())
    del store


def test_an_address_that_is_not_this_host_s_is_one_line_saying_so():
    with pytest.raises(ServeConfigError, match=r"--master-addr: rank 0 cannot listen on 192\.0\.2\.1:\d+ for the "
                                               r"ranks' rendezvous: Cannot assign requested address; it is not "
                                               r"an address of this host"):
        rendezvous_store("192.0.2.1", _free_port(), 0, 2, TIMEOUT)


def test_under_torchrun_each_restart_attempt_has_keys_of_its_own():
    """torchrun's agent store outlives a restart of the ranks (--max-restarts): without a prefix per
    attempt, a restarted rank 0 read the dead group's gloo addresses from it and its connect timed
    out (reproduced with two gloo ranks over one store). torch's own tcp:// and env:// rendezvous
    added this prefix in the releases that had it (2.4 does; 2.13 does not)."""
    port = _free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    first = rendezvous_store("127.0.0.1", port, 0, 2, TIMEOUT, agent_attempt=0)
    first.set("0/rank_1", "address of a rank that died")
    second = rendezvous_store("127.0.0.1", port, 0, 2, TIMEOUT, agent_attempt=1)
    assert not second.check(["0/rank_1"])
    second.set("0/rank_1", "address of the restarted rank")
    assert first.get("0/rank_1") == b"address of a rank that died"
    del first, second, agent


def test_a_torch_whose_libuv_store_cannot_take_a_listening_socket_gets_the_older_store(monkeypatch):
    """From torch 2.4 (libuv the default store) until pytorch#150215 (2025), TCPStore raised
    NotImplementedError for master_listen_fd unless use_libuv=False: every rank 0 failed to start
    with that traceback. The older store takes the socket as well (this torch still has it)."""
    from dspark_sidecar.server import process_group

    real = dist.TCPStore
    calls = []

    def torch_2_4(*args, use_libuv=True, **kw):
        calls.append(use_libuv)
        if kw.get("master_listen_fd") is not None and use_libuv:
            raise NotImplementedError("The libuv TCPStore backend does not support initialization with an listen "
                                      "fd. Please switch to the legacy TCPStore by setting environment variable "
                                      "USE_LIBUV to \"0\".")
        return real(*args, use_libuv=use_libuv, **kw)

    monkeypatch.setattr(process_group.dist, "TCPStore", torch_2_4)
    port = _free_port()
    before = set(listening_tcp(os.getpid()))
    store = rendezvous_store("127.0.0.1", port, 0, 2, TIMEOUT)
    assert set(listening_tcp(os.getpid())) - before == {("127.0.0.1", port)}
    peer = rendezvous_store("127.0.0.1", port, 1, 2, TIMEOUT)
    peer.set("from-1", "x")
    assert store.get("from-1") == b"x" and calls[:2] == [True, False]
    del peer, store


# join_group in a process of its own: a failed init_process_group must not leave this one's default group half made.
JOIN = """
import sys
from dspark_sidecar.server.config import ServeConfig, ServeConfigError
from dspark_sidecar.server.process_group import PeerLost, join_group
cfg = ServeConfig().replace(master_addr=sys.argv[5], master_port=int(sys.argv[1]), dist_timeout_s=int(sys.argv[4]))
try:
    join_group(cfg, "gloo", int(sys.argv[2]), int(sys.argv[3]))
except (PeerLost, ServeConfigError) as err:
    print(type(err).__name__, err)
"""
STORE_HOST_DIES = """
import datetime, os, sys, time
from dspark_sidecar.server.process_group import rendezvous_store
store = rendezvous_store("127.0.0.1", int(sys.argv[1]), 0, 3, datetime.timedelta(seconds=30))
before = store.num_keys()
deadline = time.monotonic() + 30
while store.num_keys() == before and time.monotonic() < deadline:  # until rank 1 has joined and waits on rank 2
    time.sleep(0.05)
time.sleep(0.5)
os._exit(1)
"""


def _join(port: int, rank: int, world: int, timeout_s: int, addr: str = "127.0.0.1") -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", JOIN, str(port), str(rank), str(world), str(timeout_s), addr],
                          capture_output=True, text=True, timeout=60)
    return done.stdout.strip()


def test_a_peer_that_never_joins_is_one_line_naming_the_timeout():
    """Rank 0 reached its own store; rank 1 never came (still starting past --dist-timeout-s, or dead). torch's
    DistStoreError ("wait timeout ..., keys: /0//cpu//0/1") went out as a traceback, from every rank that waited."""
    line = _join(_free_port(), 0, 2, 1)
    assert line.startswith("PeerLost rank 0: a peer rank left during start-up or did not join the group within "
                           "--dist-timeout-s 1 s (wait timeout"), line


def test_a_store_host_that_dies_while_a_rank_joins_is_a_lost_peer_not_a_refused_flag():
    """Rank 1 reached rank 0's store, then rank 0 ended: that was ServeConfigError naming --master-addr (exit 2),
    and the launcher, seeing an exit 2, reported the whole group as refusing its configuration with that code."""
    import subprocess
    import sys

    port = _free_port()
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST_DIES, str(port)])
    try:
        line = _join(port, 1, 3, 30)
    finally:
        host.kill()
        host.wait()
    assert line.startswith("PeerLost rank 1: a peer rank left during start-up"), line


def test_a_rendezvous_that_cannot_be_reached_is_still_the_flags():
    """An address that is not this host's: rank 0, on this node as every rank, can never host the store there."""
    line = _join(_free_port(), 1, 2, 1, addr="192.0.2.1")  # TEST-NET-1: no host of ours
    assert line.startswith("ServeConfigError --master-addr/--master-port: rank 1 cannot join the rendezvous"), line


def test_a_rank_0_not_hosting_the_store_in_time_on_this_host_s_address_is_a_lost_peer():
    """The address is this host's (rank 0 binds it, or refuses it itself, exit 2): nobody hosting there within
    --dist-timeout-s is rank 0, dead or slower than this rank (reproduced: rank 0 twelve seconds behind with
    --dist-timeout-s 2). As ServeConfigError (exit 2) the launcher stopped the group as refusing its flags, with
    exit 2, which systemd's RestartPreventExitStatus=2 never restarts, while rank 0 was alive."""
    line = _join(_free_port(), 1, 2, 1)  # nobody hosts the store there
    assert line.startswith("PeerLost rank 1: a peer rank (rank 0) did not host the rendezvous at 127.0.0.1:"), line
    assert "within --dist-timeout-s 1 s" in line, line


@pytest.mark.parametrize("value, missing", [("bogus0", "bogus0"), ("lo,bogus0", "bogus0")])
def test_a_gloo_interface_this_host_lacks_is_one_line_naming_the_variable(monkeypatch, value, missing):
    """GLOO_SOCKET_IFNAME naming no interface of this host fails gloo's device in this rank alone. On a GPU
    rank the first gloo group is the start-up group (startup.StartUp.group), where every error is a peer lost: each
    rank printed "a peer rank left during start-up ... the peer's own line says why" and exited 1 (restarted
    for ever), and no peer had a line; on a CPU rank init_process_group's traceback. It is the operator's
    value: one line naming it, exit 2, before the rendezvous."""
    if "lo" not in {name for _, name in socket.if_nameindex()}:
        pytest.skip("no loopback interface named lo")
    from dspark_sidecar.server.config import ServeConfig
    from dspark_sidecar.server.process_group import join_group

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", value)
    cfg = ServeConfig(tp=1, master_addr="127.0.0.1", master_port=_free_port(), dist_timeout_s=5)
    with pytest.raises(ServeConfigError, match=rf"^GLOO_SOCKET_IFNAME={value}: this host has no network "
                                               rf"interface {missing} \(it has .*\blo\b"):
        join_group(cfg, "gloo", 0, 1)
    assert not dist.is_initialized()


def test_rank_0_s_store_port_is_free_again_at_once_after_it_closed_connections():
    """Rank 0 closes its store's connections first as it ends, which leaves them in TIME_WAIT on its port for a
    minute: without SO_REUSEADDR a rank 0 restarted on a fixed --master-port could not listen there (exit 75)."""
    from dspark_sidecar.server.process_group import _listen

    port = _free_port()
    listener = _listen("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server's end first: TIME_WAIT on 127.0.0.1:port
    client.close()
    listener.close()
    _listen("127.0.0.1", port).close()


def test_a_peer_lost_line_is_one_line_of_bounded_length():
    """torch's errors can run over many lines (TORCH_SHOW_CPP_STACKTRACES adds the C++ frames): the line keeps the
    first, cut short, so the launcher's log stays one line per rank."""
    from dspark_sidecar.server.process_group import PeerLost

    line = str(PeerLost.of(1, RuntimeError("wait timeout after 1000ms\nException raised from ...\nframe #0 " + "x" * 400)))
    assert "\n" not in line and "wait timeout after 1000ms" in line and "frame #0" not in line
    assert str(PeerLost.of(1, RuntimeError("q" * 400))).count("q") == 160
    assert "(RuntimeError)" in str(PeerLost.of(1, RuntimeError()))


def test_rank_0_that_cannot_reach_the_store_it_hosts_is_not_a_lost_peer(monkeypatch):
    """Only ranks that join rank 0's store blame rank 0 for its absence: rank 0 failing on its own store is the
    address's (ServeConfigError), not 'a peer rank (rank 0)'."""
    from dspark_sidecar.server import process_group
    from dspark_sidecar.server.config import ServeConfig

    def unreachable(*a, **kw):
        raise dist.DistNetworkError("The client socket has timed out after 1000ms")

    monkeypatch.setattr(process_group, "rendezvous_store", unreachable)
    monkeypatch.setattr(process_group, "keep_collectives_local", lambda addr, env: {})
    cfg = ServeConfig(tp=2, master_addr="127.0.0.1", master_port=_free_port(), dist_timeout_s=1)
    with pytest.raises(ServeConfigError, match="rank 0 cannot join the rendezvous"):
        process_group.join_group(cfg, "gloo", 0, 2)
    with pytest.raises(process_group.PeerLost, match=r"rank 1: a peer rank \(rank 0\) did not host"):
        process_group.join_group(cfg, "gloo", 1, 2)
    with pytest.raises(ServeConfigError, match="rank 1 cannot join the rendezvous"):  # torchrun's agent hosts it
        process_group.join_group(cfg, "gloo", 1, 2, agent_attempt=0)
