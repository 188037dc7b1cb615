"""`serve` refuses an unusable socket folder, a live sidecar's sockets and busy ports in the parent:
one line naming the flag, before any rank (or socket) exists. Exit 2 for what only a change of
configuration fixes; exit 75 (EX_TEMPFAIL) for a port or socket that another process holds now,
which may be free at the next start (systemd restarts it; RestartPreventExitStatus=2 stops only 2).

These used to start the ranks: a raw traceback per rank (mkdir/unlink in server/app.py, gRPC's bind
RuntimeError for --tcp-base-port, prometheus' OSError for --metrics-port only after the shard loaded,
torch's DistNetworkError for --master-port), or, on a live sidecar's folder, its socket unlinked and
taken over. Each test forbids the launcher, so a regression fails in well under a second.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dspark_sidecar import cli, layout
from dspark_sidecar.server import launcher, preflight, sockdir
from dspark_sidecar.server.config import ServeConfig, ServeConfigError
from helpers.refusals import refused as _refused


pytestmark = pytest.mark.usefixtures("no_launch")  # tests/conftest.py


def _argv(sock_dir, tiny_ckpt, *extra) -> list[str]:
    return ["serve", "--tp", "1", "--device", "cpu", "--socket-dir", str(sock_dir),
            "--checkpoint", str(tiny_ckpt[0]), "--target-checkpoint", str(tiny_ckpt[1]), *extra]


def test_a_socket_dir_that_is_a_file_is_one_line(tiny_ckpt, tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    _refused(_argv(f, tiny_ckpt), capsys, "--socket-dir", "not a folder")


def test_a_socket_dir_that_cannot_be_created_is_one_line(tiny_ckpt, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    _refused(_argv(tmp_path / "afile" / "sock", tiny_ckpt), capsys, "--socket-dir", "cannot create")


def test_a_rank_socket_path_that_is_a_folder_is_one_line(tiny_ckpt, tmp_path, capsys):
    (tmp_path / "sock" / "rank0.sock").mkdir(parents=True)
    _refused(_argv(tmp_path / "sock", tiny_ckpt), capsys, "--socket-dir", "rank0.sock", "not a socket")


@pytest.mark.parametrize("what", ["folder", "file"])
@pytest.mark.parametrize("where", ["parent", "rank"])  # cli's check before launch; claim_socket under torchrun
def test_a_rank_lease_socket_path_that_is_not_a_socket_is_refused_before_the_shard_loads(what, where, tmp_path):
    """The engine-lease socket (DIR/rank{r}.lease) is bound after the shard loads (server/lease.py), and it removed
    whatever sat at its path: a file of someone's silently, a folder with a traceback and exit 1 on every restart.
    Refused up front as the gRPC socket's path is; the file is kept."""
    d = tmp_path / "sock"
    d.mkdir(mode=0o770)
    lease = d / "rank1.lease"
    lease.mkdir() if what == "folder" else lease.write_text("notes")
    cfg = ServeConfig(tp=2, socket_dir=d)
    with pytest.raises(ServeConfigError, match=r"rank1\.lease exists and is not a socket"):
        preflight.check_socket_dir(cfg) if where == "parent" else preflight.claim_socket(cfg, 1)
    assert lease.is_dir() if what == "folder" else lease.read_text() == "notes"


@pytest.mark.parametrize("flag", ["--tcp-base-port", "--metrics-port", "--master-port"])
def test_a_port_in_use_is_one_line_naming_the_flag(flag, tiny_ckpt, tmp_path, capsys):
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and torch's store set it
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _refused(_argv(tmp_path / "sock", tiny_ckpt, flag, str(port)), capsys, flag, str(port), status=75)
    assert not list((tmp_path / "sock").glob("*.sock"))


def test_a_master_addr_that_is_not_this_host_s_is_one_line(tiny_ckpt, tmp_path, capsys):
    """Rank 0 hosts the group's store on --master-addr (not on every address, as torch's own store
    would): an address this host does not have was a rank blocked in the rendezvous until the timeout."""
    _refused(_argv(tmp_path / "sock", tiny_ckpt, "--master-addr", "192.0.2.1"), capsys, "--master-addr",
             "192.0.2.1", "not an address of this host")


def _no_ipv6_kernel(monkeypatch) -> None:
    """A host booted with ipv6.disable=1: 'localhost' still resolves to ::1 first (/etc/hosts, no
    AI_ADDRCONFIG), but no AF_INET6 socket can be made at all (EAFNOSUPPORT), not just bound."""
    import errno

    real_gai, real_socket = socket.getaddrinfo, socket.socket

    def v6_first(host, port, *a, **kw):
        if host != "localhost":
            return real_gai(host, port, *a, **kw)
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    class NoV6(real_socket):
        def __init__(self, family=-1, *a, **kw):
            if family == socket.AF_INET6:
                raise OSError(errno.EAFNOSUPPORT, os.strerror(errno.EAFNOSUPPORT))
            super().__init__(family, *a, **kw)

    monkeypatch.setattr(preflight.socket, "getaddrinfo", v6_first)
    monkeypatch.setattr(preflight.socket, "socket", NoV6)


def test_a_name_with_an_address_family_the_kernel_lacks_is_checked_on_its_other_addresses(monkeypatch):
    """check_port made a socket per address outside its try: on a kernel without IPv6 'localhost' (::1
    first) was an OSError traceback from the parent's check, and serve could not start at all, though
    rank 0 binds the store on the next address (process_group._listen skips such a family)."""
    _no_ipv6_kernel(monkeypatch)
    with socket.socket() as busy:  # the IPv4 address is still checked: a busy port there is refused
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ServeConfigError, match=rf"--master-addr/--master-port: cannot listen on localhost:{port}: "
                                                   r"Address already in use"):
            preflight.check_port("--master-addr/--master-port", "localhost", port)
    preflight.check_port("--master-addr/--master-port", "localhost", 0)  # no traceback: 127.0.0.1 will do


def test_a_name_whose_every_address_family_the_kernel_lacks_is_one_line(monkeypatch):
    """No address of the name can even have a socket: one line naming the flag and why, not a traceback."""
    import errno

    _no_ipv6_kernel(monkeypatch)
    monkeypatch.setattr(preflight.socket, "getaddrinfo", lambda host, port, *a, **kw: [
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", port, 0, 0))])
    with pytest.raises(ServeConfigError, match=rf"--tcp-base-port: cannot listen on ::1:0: "
                                               rf"{os.strerror(errno.EAFNOSUPPORT)}"):
        preflight.check_port("--tcp-base-port", "::1", 0)


@pytest.mark.parametrize("flag, host", [("--metrics-port", "pod..svc"), ("--master-port", "a" * 64)])
def test_a_host_name_the_resolver_cannot_encode_is_one_line(flag, host, tiny_ckpt, tmp_path, capsys):
    """A name with an empty label (a typo's double dot) or a label past 63 characters fails before any
    lookup, in Python's IDNA encoding: a UnicodeError, not a gaierror, and check_port let it out as a
    traceback from the parent (and from a rank under torchrun, whose bind failure asks check_port why)."""
    host_flag = {"--metrics-port": "--metrics-host", "--master-port": "--master-addr"}[flag]
    port = ["--metrics-port", "50070"] if flag == "--metrics-port" else []
    line = _refused(_argv(tmp_path / "sock", tiny_ckpt, host_flag, host, *port), capsys, "cannot resolve host",
                    repr(host))
    assert ("--metrics-port" if flag == "--metrics-port" else "--master-addr") in line
    with pytest.raises(ServeConfigError, match=r"^--tcp-base-port: rank 2 cannot resolve host"):
        preflight.check_port("--tcp-base-port", host, 50070, who="rank 2 ")


def test_an_empty_master_addr_is_a_config_error(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """torch asserted "hostname cannot be None" in every rank."""
    monkeypatch.setenv("DSPARK_MASTER_ADDR", "")
    _refused(_argv(tmp_path / "sock", tiny_ckpt), capsys, "--master-addr", "empty")


def test_a_running_sidecar_on_the_socket_dir_is_not_displaced(tiny_ckpt, tmp_path, capsys):
    """A second serve unlinked the live rank0.sock (server/app.py _start_grpc) and took it over."""
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir()
    hs = health.HealthServicer()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    live = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(hs, live)
    live.add_insecure_port(f"unix:{sock_dir / 'rank0.sock'}")
    live.start()
    try:
        ino = (sock_dir / "rank0.sock").stat().st_ino
        _refused(_argv(sock_dir, tiny_ckpt), capsys, f"--socket-dir: a sidecar is already serving on {sock_dir}",
                 status=75)
        assert (sock_dir / "rank0.sock").stat().st_ino == ino  # the live socket is left alone
        with grpc.insecure_channel(f"unix:{sock_dir / 'rank0.sock'}") as ch:
            st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert st.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        live.stop(0)


def test_a_stale_socket_file_does_not_stop_a_restart(tiny_ckpt, tmp_path, monkeypatch):
    """A socket left by a kill -9: nobody answers on it, so the launch goes ahead (the rank replaces it)."""
    sock_dir = tmp_path / "sock"
    sock_dir.mkdir()
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_dir / "rank0.sock"))  # closed without unlinking: what a killed server leaves
    launched = []
    monkeypatch.setattr(launcher, "launch", lambda cfg, argv, on_ready=None: launched.append(cfg) or 0)
    assert cli.main(_argv(sock_dir, tiny_ckpt)) == 0 and len(launched) == 1


# The socket folder's owner and mode (server/sockdir.py). Another user who made the folder, or any user
# where it is writable by all, could take a rank's socket name and receive an engine's connection (and
# its IPC handles). These run as root (CI) and as a normal user: a foreign owner is real as root (chown)
# and, as a normal user, stands in by the sidecar's effective uid being another one.
OTHER_UID = 4242


def _owned_by_another_user(path, monkeypatch, link=False) -> int:
    """Make `path` belong to a user other than the sidecar's; returns that uid as serve will report it."""
    if os.geteuid() == 0:
        os.lchown(path, OTHER_UID, -1) if link else os.chown(path, OTHER_UID, -1)
        return OTHER_UID
    monkeypatch.setattr(sockdir, "effective_uid", lambda: os.geteuid() + 1)
    return os.geteuid()


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
@pytest.mark.parametrize("where", ["parent", "rank"])  # cli's check before launch; claim_socket under torchrun
def test_a_socket_dir_serve_makes_is_0770_and_its_parents_not_writable_by_others(umask, where, tmp_path):
    """Under umask 000 serve made the folder (and its parents) 0777: anyone could replace a socket."""
    d = tmp_path / "a" / "b" / "sock"
    cfg = ServeConfig(tp=1, socket_dir=d)
    old = os.umask(umask)
    try:
        preflight.check_socket_dir(cfg) if where == "parent" else preflight.claim_socket(cfg, 0)
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o770
    for parent in (d.parent, d.parent.parent):
        assert stat.S_IMODE(parent.stat().st_mode) == 0o755 & ~umask


def test_a_setgid_parent_s_group_is_kept_on_the_folder_serve_makes(tmp_path):
    """The group a setgid parent hands down is how the engine opens the 0660 sockets."""
    tmp_path.chmod(0o2770)
    preflight.check_socket_dir(ServeConfig(tp=1, socket_dir=tmp_path / "sock"))
    assert stat.S_IMODE((tmp_path / "sock").stat().st_mode) == 0o2770


@pytest.mark.skipif(os.geteuid() != 0, reason="a parent of another group than the sidecar user's needs chown (root)")
def test_a_setgid_parent_s_group_is_kept_when_the_sidecar_s_user_is_not_in_it(tmp_path):
    """Root made the parent for the sidecar's user with the engine's group (setgid), the user not in it. The
    chmod that gave back the group's bits is one the kernel answers by clearing the setgid bit of a folder
    whose group the caller is not in: the sockets then got the sidecar's own group, and no engine connected."""
    uid, engine_gid = OTHER_UID, OTHER_UID + 1
    top = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is root's 0700: the user could not reach it
    try:
        top.chmod(0o755)
        srv = top / "srv"
        srv.mkdir()
        os.chown(srv, uid, engine_gid)
        srv.chmod(0o2770)
        d = srv / "sock"
        pid = os.fork()
        if pid == 0:  # the sidecar, as that user (no supplementary groups)
            code = 1
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.umask(0o022)
                sockdir.prepare(d)
                code = 0
            finally:
                os._exit(code)
        assert os.waitpid(pid, 0)[1] == 0, "prepare refused the folder"
        st = d.stat()
        assert (st.st_gid, stat.S_IMODE(st.st_mode) & stat.S_ISGID) == (engine_gid, stat.S_ISGID), oct(st.st_mode)
        assert not st.st_mode & 0o007
    finally:
        shutil.rmtree(top)


@pytest.mark.skipif(os.geteuid() != 0, reason="a parent of a group root is not in needs chown (root)")
def test_a_root_sidecar_keeps_a_setgid_parent_s_group_and_gives_it_the_folder_s_bits(tmp_path):
    """Root keeps a setgid bit through a chmod whatever the folder's group (kubelet's fsGroup emptyDir, the
    sidecar running as root, not in that group): the umask's 0750 is given back its group bits, 2770 as documented,
    not left as for a user the kernel would strip the bit from."""
    engine_gid = OTHER_UID + 1
    assert engine_gid not in os.getgroups() and engine_gid != os.getegid()
    os.chown(tmp_path, 0, engine_gid)
    tmp_path.chmod(0o2770)
    old = os.umask(0o027)
    try:
        sockdir.prepare(tmp_path / "sock")
    finally:
        os.umask(old)
    st = (tmp_path / "sock").stat()
    assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (engine_gid, 0o2770), oct(st.st_mode)


def test_a_port_another_socket_left_in_time_wait_is_not_reported_busy():
    """The server binds with SO_REUSEADDR (gRPC, prometheus' HTTP server), so a port whose last connection is in
    TIME_WAIT (a sidecar just stopped, its engine connected) is free to it: the check binding without it refused
    the restart as 'Address already in use' (exit 75) until the kernel let the port go, a minute later."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the stopped sidecar's, as gRPC sets it
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = listener.accept()
            conn.close()  # the server's end closes first: its side of the connection stays in TIME_WAIT
            assert client.recv(1) == b""
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what a bind without SO_REUSEADDR meets
    preflight.check_port("--tcp-base-port", "127.0.0.1", port)


@pytest.mark.parametrize("swap", ["link", "folder"])
def test_an_entry_swapped_in_just_after_serve_made_the_folder_is_refused_and_left_as_it_was(swap, tmp_path,
                                                                                           monkeypatch):
    """Between serve's mkdir and the chmod that gives back the group bits the umask took, whoever may rename
    entries in the parent (its group; anyone where the parent's own check refuses it, which comes later)
    could put a link or a folder of theirs at the path. The chmod by path followed the link: a root
    sidecar gave mode 0770 to whatever the link named (here a folder; a file as well), then served in it."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    d = tmp_path / "sock"
    real_mkdir = os.mkdir
    uid = None

    def raced(path, mode=0o777, **kw):
        nonlocal uid
        real_mkdir(path, mode, **kw)
        if Path(path) == d:  # the other user's move, right after ours
            os.rmdir(d)
            if swap == "link":
                d.symlink_to(victim)
            else:
                real_mkdir(d, 0o700)
                uid = _owned_by_another_user(d, monkeypatch)

    monkeypatch.setattr(os, "mkdir", raced)
    with pytest.raises(ServeConfigError) as refused:
        sockdir.prepare(d)
    why = "a symbolic link now" if swap == "link" else f"now owner uid {uid}, mode 0700"
    assert str(refused.value).startswith(f"--socket-dir: {d} is not the folder serve just made ({why})"), refused.value
    assert stat.S_IMODE((victim if swap == "link" else d).stat().st_mode) == 0o700


def test_a_parent_swapped_for_a_link_just_after_serve_made_the_folder_changes_nothing_elsewhere(tmp_path,
                                                                                                monkeypatch):
    """The descriptor that sets the folder's 0770 is opened without following a link at the folder's own
    name only: whoever may rename entries in the grandparent could, right after the mkdir, move the parent
    away and put a link in its place to where a folder of this user's has the same name. The open followed
    that link, so a root sidecar made that folder (here `elsewhere/sock`, 0700; /var/lib for a socket folder
    named lib) 0770, and then served in it. Now the folder is opened in the parent serve made it in, and one
    found at the path afterwards that is not it is refused."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "sock").mkdir(parents=True, mode=0o700)
    (elsewhere / "sock").chmod(0o700)
    parent = tmp_path / "p"
    parent.mkdir()
    d = parent / "sock"
    real_mkdir = os.mkdir

    def raced(path, mode=0o777, **kw):
        real_mkdir(path, mode, **kw)
        if Path(path) == d:  # the other user's move, right after ours: the parent, not the folder
            parent.rename(tmp_path / "p.moved")
            parent.symlink_to(elsewhere)

    monkeypatch.setattr(os, "mkdir", raced)
    with pytest.raises(ServeConfigError) as refused:
        sockdir.prepare(d)
    assert str(refused.value).startswith(f"--socket-dir: {d} is not the folder serve just made"), refused.value
    assert stat.S_IMODE((elsewhere / "sock").stat().st_mode) == 0o700, "a folder elsewhere had its mode changed"
    assert stat.S_IMODE((tmp_path / "p.moved" / "sock").stat().st_mode) == 0o770  # the one serve made


OK, MINE, ROOT = None, "mine", 0  # MINE: owned by the euid given
def _case_ids(table) -> list[str]:
    """Test ids for a table of (owner, mode, euid, words): "mine-0770-euid1000", "uid2000-0700-euid0"."""
    return [f"{o if o is MINE else f'uid{o}'}-{m & 0o7777:04o}-euid{e}" for o, m, e, _ in table]


POLICY = [
    (MINE, 0o40700, 1000, OK),
    (MINE, 0o42770, 1000, OK),  # the launch recipe with DSPARK_SOCKET_GROUP
    (MINE, 0o40770, 0, OK),  # root's own
    (ROOT, 0o40755, 1000, OK),  # a root-made folder only root writes
    (ROOT, 0o42777, 1000, OK),  # kubelet's emptyDir with an fsGroup (disk): root, setgid, 0777
    (ROOT, 0o43777, 1000, OK),  # the same on tmpfs (medium: Memory), sticky too
    (ROOT, 0o43777, 0, OK),  # that pod running as root
    (2000, 0o40700, 1000, ["belongs to another user", "owner uid 2000, mode 0700", "this user (uid 1000)"]),
    (2000, 0o42770, 1000, ["belongs to another user", "owner uid 2000, mode 2770"]),
    (2000, 0o40700, 0, ["belongs to another user", "owner uid 2000"]),  # also when the sidecar is root
    (MINE, 0o40777, 1000, ["writable by every user", "owner uid 1000, mode 0777", "chmod o-w /s"]),
    (MINE, 0o41777, 1000, ["writable by every user", "mode 1777", "chmod o-w /s"]),  # sticky: names still taken
    (MINE, 0o40772, 1000, ["writable by every user", "mode 0772"]),
    # setgid marks a folder root provisioned for a group (kubelet's emptyDir): not one of this user's own
    (MINE, 0o42777, 1000, ["writable by every user", "owner uid 1000, mode 2777", "chmod o-w /s"]),
    (ROOT, 0o41777, 1000, ["writable by every user", "owner uid 0, mode 1777", "/s/dspark-sidecar", "fsGroup"]),  # /tmp
    (ROOT, 0o40777, 1000, ["writable by every user", "mode 0777", "have root chmod o-w /s"]),  # no sticky bit:
    (ROOT, 0o40757, 1000, ["writable by every user", "have root chmod o-w /s"]),  # a folder inside is refused too
    (ROOT, 0o41777, 0, ["writable by every user", "/s/dspark-sidecar"]),  # /tmp for root: not "chmod o-w /tmp"
]


@pytest.mark.parametrize("owner,mode,euid,words", POLICY,
                         ids=_case_ids(POLICY))
def test_the_owner_and_mode_policy(owner, mode, euid, words):
    why = sockdir.problem(Path("/s"), euid if owner is MINE else owner, mode, euid)
    if words is OK:
        assert why is None
    else:
        assert why is not None and all(w in why for w in words), why
        # Never for a shared scratch folder (sticky, as /tmp): a folder of ours inside it is the way there.
        assert "chmod o-w /s" not in why or owner is MINE or not mode & stat.S_ISVTX


# The refusals that suggest a folder of the sidecar's own inside the refused one (only those: an `if` over every
# refusal asserted nothing for the others, and nothing at all had the suggestion gone).
SUGGESTS_INSIDE = [p for p in POLICY if p[3] is not OK and "/s/dspark-sidecar" in p[3]]


@pytest.mark.parametrize("owner,mode,euid,words", SUGGESTS_INSIDE, ids=_case_ids(SUGGESTS_INSIDE))
def test_a_folder_the_refusal_suggests_inside_the_refused_one_passes_the_parents_check(owner, mode, euid, words):
    """A root-owned 0777 folder's refusal said to use a folder of the sidecar's own inside it, which the
    parents' check then refused (no sticky bit: anyone may rename it away): advice that cannot work."""
    owner = euid if owner is MINE else owner
    why = sockdir.problem(Path("/s"), owner, mode, euid)
    assert why is not None and "/s/dspark-sidecar" in why, why
    assert sockdir.parent_problem(Path("/s/dspark-sidecar"), owner, mode, euid) is None, why


PARENTS = [
    (MINE, 0o40755, 1000, OK),
    (MINE, 0o40775, 1000, OK),  # group-writable: the group is trusted, as on the folder itself
    (ROOT, 0o40755, 1000, OK),  # /run, /home
    (ROOT, 0o41777, 1000, OK),  # /tmp: sticky, so others may not rename what is not theirs
    (ROOT, 0o40777, 1000, ["writable by every user without the sticky bit", "mode 0777"]),
    (MINE, 0o40757, 1000, ["writable by every user without the sticky bit"]),
    (2000, 0o40755, 1000, ["belongs to another user", "owner uid 2000, mode 0755"]),
    (2000, 0o41777, 0, ["belongs to another user"]),  # sticky does not help: its owner may rename anything
]


@pytest.mark.parametrize("owner,mode,euid,words", PARENTS,
                         ids=_case_ids(PARENTS))
def test_the_parent_folders_policy(owner, mode, euid, words):
    """Whoever may rename entries in a parent can move the socket folder away and put theirs there."""
    why = sockdir.parent_problem(Path("/p/s"), euid if owner is MINE else owner, mode, euid)
    if words is OK:
        assert why is None
    else:
        assert why is not None and all(w in why for w in words) and "rename /p/s away" in why, why


@pytest.mark.parametrize("where", ["parent", "rank"])
def test_a_socket_dir_under_a_parent_every_user_may_rename_in_is_refused(tiny_ckpt, tmp_path, capsys, where):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit
    d = shared / "sock"
    if where == "parent":
        _refused(_argv(d, tiny_ckpt), capsys, f"--socket-dir: {d}: its parent {shared} is writable by every user "
                 "without the sticky bit", sock_dir=d)
    else:
        with pytest.raises(ServeConfigError, match=f"its parent {shared} is writable by every user without"):
            preflight.claim_socket(ServeConfig(tp=1, socket_dir=d), 0)
    shared.chmod(0o1777)  # as /tmp: accepted
    preflight.check_socket_dir(ServeConfig(tp=1, socket_dir=d))


def test_a_socket_dir_another_user_made_is_one_line(tiny_ckpt, tmp_path, monkeypatch, capsys):
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    uid = _owned_by_another_user(d, monkeypatch)
    _refused(_argv(d, tiny_ckpt), capsys, f"--socket-dir: {d} belongs to another user", f"owner uid {uid}, mode 0700",
             sock_dir=d)


def test_a_rank_under_torchrun_refuses_a_socket_dir_another_user_made(tmp_path, monkeypatch):
    d = tmp_path / "sock"
    d.mkdir(mode=0o770)
    uid = _owned_by_another_user(d, monkeypatch)
    with pytest.raises(ServeConfigError, match=f"--socket-dir: {d} belongs to another user \\(owner uid {uid}"):
        preflight.claim_socket(ServeConfig(tp=1, socket_dir=d), 0)


def test_a_rank_under_torchrun_refuses_a_socket_dir_it_cannot_create_sockets_in(tmp_path, monkeypatch):
    """Under torchrun the rank's claim is the only check. It skipped the parent's writability check, so a
    folder this user may not write (root's 0755 one, a read-only mount: both pass the owner and mode
    policy) reached gRPC's bind, whose failure names no reason: the rank said "another process took it
    since the start-up checks" and exited 75, which systemd restarts for ever, not 2. (Run as root on an
    immutable folder, chattr +i, it did exactly that; here os.access stands for a user it denies.)"""
    d = tmp_path / "sock"
    d.mkdir(mode=0o770)
    real = os.access
    monkeypatch.setattr(preflight.os, "access", lambda p, mode, **kw: False if Path(p) == d else real(p, mode, **kw))
    with pytest.raises(ServeConfigError, match=f"--socket-dir: {d} is not writable by this user") as err:
        preflight.claim_socket(ServeConfig(tp=1, socket_dir=d), 0)
    assert err.value.exit_status == 2  # a change of folder or mode fixes it, not a restart


def test_a_socket_dir_writable_by_every_user_is_refused_not_tightened(tiny_ckpt, tmp_path, capsys):
    """Ours (or root's, as root): o+w is refused and left as found, sticky or not."""
    for mode in (0o777, 0o1777):
        d = tmp_path / f"sock{mode:o}"
        d.mkdir()
        d.chmod(mode)
        _refused(_argv(d, tiny_ckpt), capsys, f"--socket-dir: {d} is writable by every user", f"mode {mode:04o}",
                 sock_dir=d)
        assert stat.S_IMODE(d.stat().st_mode) == mode


def test_a_shared_scratch_folder_such_as_tmp_is_refused(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """Root's sticky world-writable /tmp: others cannot remove our sockets, but can take rank0.sock first."""
    shared = Path("/tmp")
    st = shared.stat()
    if (st.st_uid, stat.S_IMODE(st.st_mode)) != (0, 0o1777):  # an unusual /tmp: a copy of it
        shared = tmp_path / "tmp"
        shared.mkdir()
        shared.chmod(0o1777)
        if os.geteuid() != 0:  # only root can make a root-owned one: our own stands in
            monkeypatch.setattr(sockdir, "problem", lambda d, uid, mode, euid: sockdir.problem(d, 0, mode, euid))
    _refused(_argv(shared, tiny_ckpt), capsys, f"--socket-dir: {shared} is writable by every user", "mode 1777",
             str(shared / "dspark-sidecar"))


def test_a_symbolic_link_another_user_owns_is_refused(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """Its owner could point it at their own folder between our check and the engine's connect."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "sock"
    link.symlink_to(real)
    uid = _owned_by_another_user(link, monkeypatch, link=True)
    _refused(_argv(link, tiny_ckpt), capsys,
             f"--socket-dir: {link} is a symbolic link owned by another user (uid {uid})", str(real))


@pytest.mark.skipif(os.geteuid() != 0, reason="a link of another user's needs lchown (root)")
@pytest.mark.parametrize("where", ["on the path", "in a link's target"])
def test_a_symbolic_link_another_user_owns_on_the_way_to_the_folder_is_refused(tmp_path, where):
    """Not only the folder itself: a link of another user's among its parents (or among those of a
    link's target) can be pointed elsewhere as well, and the folder with it. The parents' check sees
    only the resolved path, which the link is not on."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    theirs = tmp_path / "theirs"
    theirs.symlink_to(real)
    os.lchown(theirs, OTHER_UID, -1)
    if where == "on the path":
        d = theirs / "sock"
    else:
        (tmp_path / "mine").symlink_to(theirs)
        d = tmp_path / "mine" / "sock"
    for check in (preflight.check_socket_dir, lambda cfg: preflight.claim_socket(cfg, 0)):
        with pytest.raises(ServeConfigError, match=f"--socket-dir: {d}: {theirs} is a symbolic link owned by another "
                                                   f"user \\(uid {OTHER_UID}\\), who could point it elsewhere"):
            check(ServeConfig(tp=1, socket_dir=d))


def test_a_socket_dir_that_passes_reaches_the_launcher_unchanged(tiny_ckpt, tmp_path, monkeypatch):
    """Ours at 0700/2770, group-writable, or a link of ours to one: accepted, mode left as it was."""
    launched = []
    monkeypatch.setattr(launcher, "launch", lambda cfg, argv, on_ready=None: launched.append(cfg) or 0)
    for name, mode in (("a", 0o700), ("b", 0o2770), ("c", 0o775)):
        d = tmp_path / name
        d.mkdir()
        d.chmod(mode)
        assert cli.main(_argv(d, tiny_ckpt)) == 0
        assert stat.S_IMODE(d.stat().st_mode) == mode
    (tmp_path / "link").symlink_to(tmp_path / "a")
    assert cli.main(_argv(tmp_path / "link", tiny_ckpt)) == 0 and len(launched) == 4


@pytest.mark.parametrize("lead", ["//", "//./"])
def test_a_socket_dir_with_two_leading_slashes_is_refused(lead, tmp_path):
    """unix://tmp/x/rank0.sock is a URI with authority 'tmp': grpc refuses it as a client target ("authority-based
    URIs not supported by the unix scheme") but binds it as a server address, so the ranks went SERVING at
    /tmp/x/rank0.sock while no client could connect. Three or more slashes are one for pathlib, and pass."""
    d = lead + str(tmp_path).lstrip("/")
    assert layout.socket_dir_problem(d, 1) is not None and "'//'" in layout.socket_dir_problem(d, 1)
    with pytest.raises(ServeConfigError, match="--socket-dir: .* starts with '//'"):
        ServeConfig(socket_dir=d)
    assert layout.socket_dir_problem("///" + str(tmp_path).lstrip("/"), 1) is None
    assert layout.socket_dir_problem(tmp_path, 1) is None


def test_a_stale_socket_the_rank_may_not_remove_is_one_line(tmp_path, monkeypatch):
    """Another user's stale socket in a sticky folder: unlink fails with EPERM (it was a traceback)."""
    cfg = ServeConfig(tp=1, socket_dir=tmp_path)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(cfg.socket_path(0)))

    def eperm(self, missing_ok=False):
        raise PermissionError(1, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "unlink", eperm)
    with pytest.raises(ServeConfigError, match="--socket-dir: cannot remove the stale socket .*rank0.sock"):
        preflight.claim_socket(cfg, 0)


@pytest.mark.parametrize("name", ["a?b", "c#d", "e,f", "g%41h"])
def test_a_socket_dir_grpc_would_read_as_another_target_is_one_line(name, tiny_ckpt, tmp_path, capsys):
    """gRPC parses `unix:PATH` as a URI: with '?' or '#' in the folder the ranks bound the real path and
    went SERVING, but no client (the launcher's own readiness probe, the engine's shim) could connect,
    so `serve` waited forever; ',' splits the target into two addresses; '%41' is decoded to 'A', so the
    rank's bind failed after start-up, blamed on a port "in use"."""
    d = tmp_path / name
    _refused(_argv(d, tiny_ckpt), capsys, f"--socket-dir: {d}", "'?', '#', ',' or '%'", sock_dir=d)
    assert not d.exists()  # refused before the folder is made
    with pytest.raises(ServeConfigError, match="--socket-dir: "):
        ServeConfig(socket_dir=d)


def test_a_socket_dir_whose_name_is_not_utf8_is_one_line(tiny_ckpt, tmp_path, capsys):
    """A folder name with a byte that is not UTF-8 (argv keeps it as a surrogate): gRPC takes a `unix:` target
    as UTF-8 text, so no rank could ever be reached there. The length check's encode() raised
    UnicodeEncodeError instead: a traceback and exit 1 from `serve`, and from the engine's plug-in (the same
    check, client/vllm_plugin.py)."""
    d = tmp_path / os.fsdecode(b"sock\xff")
    assert "UTF-8" in layout.socket_dir_problem(d, 4)
    _refused(_argv(d, tiny_ckpt), capsys, "--socket-dir: ", "UTF-8", sock_dir=d)
    assert not d.exists()  # refused before the folder is made


@pytest.mark.parametrize("tp", [("--tp", "1"), ("--tp", "4", "--dist-backend", "gloo")])
def test_device_cuda_with_no_gpu_visible_is_one_line_before_any_rank(tp, tiny_ckpt, tmp_path, monkeypatch, capsys):
    """`--device cuda` on a host with no GPU visible (CUDA_VISIBLE_DEVICES wrong, the driver not loaded) started
    every rank, each ended in BackendUnavailable's traceback, and the launcher exited 1, its journal naming no
    flag. Now one line before any rank, and exit 75 (EX_TEMPFAIL), not 2 (review 321): a unit started at boot
    before the GPU driver has loaded would otherwise stay failed for good (RestartPreventExitStatus=2), where a
    restart 5 s later finds the GPUs. The GPUs are counted before the checkpoint is read: each such restart read
    every tensor of --checkpoint first (about 3 GB for minimax-m3.1, review 328) only to find no GPU."""
    import torch

    from dspark_sidecar.drafter import checkpoint

    read: list = []
    monkeypatch.setattr(checkpoint, "check_checkpoint", lambda *a, **k: read.append(a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["serve", *tp, "--device", "cuda", "--socket-dir", str(tmp_path / "sock"),
            "--checkpoint", str(tiny_ckpt[0]), "--target-checkpoint", str(tiny_ckpt[1])]
    _refused(argv, capsys, "--device cuda: no CUDA/ROCm device is visible", sock_dir=tmp_path / "sock", status=75)
    assert read == []


@pytest.mark.parametrize("backend", ["triton", "flydsl"])
def test_a_gpu_backend_with_no_gpu_visible_under_device_auto_is_one_line_before_any_rank(backend, tmp_path,
                                                                                          monkeypatch, capsys):
    """`--backend triton` (or flydsl) with `--device auto` on a host that shows no GPU yet: auto put the ranks on
    the CPU, and each refused the backend only after it had started and listened (exit 2, which systemd's unit
    does not restart), where the same host with `--device cuda` exits 75 before any rank and is restarted until
    the driver shows the GPUs. Both flags ask for a GPU: the same line's kind, before any rank."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refused(["serve", "--tp", "1", "--backend", backend, "--random-weights", "--socket-dir", str(tmp_path / "sock")],
             capsys, f"--backend {backend}: no CUDA/ROCm device is visible", sock_dir=tmp_path / "sock", status=75)


def test_a_backend_a_rank_cannot_run_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """`--backend triton` on a rank without a GPU, or `--backend flydsl` on a host that fails FlyDSL's checks, is
    found in the rank (the host facts are probed there). It was a RuntimeError: a traceback per rank and the
    launcher's exit 1 (restarted for ever by systemd), where README and OPERATIONS.md promise the flag's one line
    and exit 2 (the launcher passes a rank's 2 on, adding no line)."""
    import torch

    from dspark_sidecar.server import app, backend
    from dspark_sidecar.server.refusal import HostFacts

    def serve_rank(cfg, *_a, **_k):
        return backend.choose_backend(cfg, HostFacts(on_gfx950=False, flydsl_available=False, tp_size=1),
                                      torch.device("cpu"))

    monkeypatch.setattr(app, "serve_rank", serve_rank)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    _refused(["serve", "--tp", "1", "--backend", "triton", "--random-weights", "--socket-dir", str(tmp_path / "sock")],
             capsys, "--backend triton: Triton backend needs a GPU")


def test_a_port_this_user_may_not_bind_is_exit_2_not_75(monkeypatch):
    """A privileged port for a user without CAP_NET_BIND_SERVICE (EACCES): no restart frees it, so exit 2
    (ServeConfigError), which systemd's unit does not restart; 75 (AddressInUse) is for a port held now."""
    import errno

    from dspark_sidecar.server.config import AddressInUse

    class Denied(socket.socket):
        def bind(self, addr):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(preflight.socket, "socket", Denied)
    with pytest.raises(ServeConfigError, match=r"--tcp-base-port: cannot listen on 127\.0\.0\.1:80: Permission denied; "
                                               "choose another port") as err:
        preflight.check_port("--tcp-base-port", "127.0.0.1", 80)
    assert not isinstance(err.value, AddressInUse) and err.value.exit_status == 2


def test_serve_reports_the_group_serving_only_once_every_rank_serves(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """The launcher's readiness probe (cli.py): with rank 0 SERVING and rank 1 still loading the group does not
    serve yet. Taken for serving, "TP 2 serving" went out early (a script waiting for it then reached a rank
    still loading) and the launcher stopped the group with the serving drain's grace, not the start-up stop."""
    from dspark_sidecar.server import healthcheck

    states = {"rank0.sock": "SERVING", "rank1.sock": "NOT_SERVING"}
    monkeypatch.setattr(healthcheck, "check", lambda target, timeout: states[Path(target).name])
    probes = []
    monkeypatch.setattr(launcher, "launch", lambda cfg, argv, on_ready=None: probes.append(on_ready) or 0)
    argv = ["serve", "--tp", "2", "--device", "cpu", "--socket-dir", str(tmp_path / "sock"),
            "--checkpoint", str(tiny_ckpt[0]), "--target-checkpoint", str(tiny_ckpt[1])]
    assert cli.main(argv) == 0
    (ready,) = probes
    assert ready() is False and "serving" not in capsys.readouterr().out
    states["rank1.sock"] = "SERVING"
    assert ready() is True and "dspark-sidecar: TP 2 serving" in capsys.readouterr().out


# Another serve (this process's child) whose rank (its child) listens on the socket at argv[1]: the rank prints a line
# once it listens and runs until its stdin (the serve's, inherited) closes.
_OTHER_SERVE_S_RANK = """
import subprocess, sys
rank = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8); print(flush=True); "
        "sys.stdin.read()")
subprocess.run([sys.executable, "-c", rank, sys.argv[1]])
"""


def test_serve_does_not_report_another_serve_s_ranks_as_its_group_serving(tiny_ckpt, tmp_path, monkeypatch, capsys):
    """Two serves started on one folder together both pass the check before launch; the rank that takes the socket
    first serves, the other serve's rank refuses the socket (exit 75) only seconds later. Meanwhile the winner's
    health read as the loser's group serving: the loser printed "TP 1 serving", then exited 75. A rank's socket is
    this serve's only where one of its ranks (its children) listens on it."""
    import subprocess
    import sys

    from dspark_sidecar.server import healthcheck, processes

    monkeypatch.setattr(healthcheck, "check", lambda target, timeout: "SERVING")
    probes = []
    monkeypatch.setattr(launcher, "launch", lambda cfg, argv, on_ready=None: probes.append(on_ready) or 0)
    no_proc = []  # set: /proc tells no parent (not mounted), as parent_pid answers then
    real_parent = processes.parent_pid
    monkeypatch.setattr(processes, "parent_pid", lambda pid: 0 if no_proc else real_parent(pid))
    sock = tmp_path / "sock"
    assert cli.main(["serve", "--tp", "1", "--device", "cpu", "--socket-dir", str(sock), "--checkpoint",
                     str(tiny_ckpt[0]), "--target-checkpoint", str(tiny_ckpt[1])]) == 0
    (ready,) = probes
    # Another serve's rank: its serve's child, not this process's. Not this process itself: run as the first process
    # of a pid namespace (a container's command), its parent is outside it and /proc says 0, a parent not known.
    other = subprocess.Popen([sys.executable, "-c", _OTHER_SERVE_S_RANK, str(sock / "rank0.sock")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        other.stdout.readline()  # listening
        assert ready() is False and "serving" not in capsys.readouterr().out
        no_proc.append(True)  # a parent not known is not held against the group: else it never served
        assert ready() is True and "dspark-sidecar: TP 1 serving" in capsys.readouterr().out
        no_proc.clear()
    finally:
        other.stdin.close()
        other.wait()
        other.stdout.close()
    (sock / "rank0.sock").unlink()
    rank = subprocess.Popen([sys.executable, "-c", "import socket, sys; s = socket.socket(socket.AF_UNIX); "
                             "s.bind(sys.argv[1]); s.listen(8); print(flush=True); sys.stdin.read()",
                             str(sock / "rank0.sock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:  # this serve's own rank, its child
        rank.stdout.readline()
        assert ready() is True and "dspark-sidecar: TP 1 serving" in capsys.readouterr().out
    finally:
        rank.stdin.close()
        rank.wait()
        rank.stdout.close()


def test_every_rank_s_ports_are_checked_not_rank_0_s_only(monkeypatch):
    """Rank r listens on BASE + r: a check of rank 0's port alone let a busy BASE + 1 through, and rank 1
    refused it only seconds into its start, once per serve."""
    checked = []
    monkeypatch.setattr(preflight, "check_port", lambda flag, host, port, who="": checked.append((flag, port)))
    preflight.check_ports(ServeConfig(tp=2, tcp_base_port=50051, metrics_port=50061))
    assert checked == [("--tcp-base-port", 50051), ("--tcp-base-port", 50052), ("--metrics-port", 50061),
                       ("--metrics-port", 50062), ("--master-addr/--master-port", 0)]


def test_a_live_socket_of_any_rank_is_refused_before_launch(tmp_path):
    """Not rank 0's socket only: a sidecar serving on rank1.sock is refused in the parent (exit 75), its
    socket left alone."""
    cfg = ServeConfig(tp=2, socket_dir=tmp_path)
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(cfg.socket_path(1)))
        live.listen()
        with pytest.raises(ServeConfigError, match=f"a sidecar is already serving on {cfg.socket_path(1)}") as err:
            preflight.check_socket_dir(cfg)
        assert err.value.exit_status == 75 and cfg.socket_path(1).is_socket()


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), TimeoutError("timed out")])
def test_a_socket_that_gives_no_clear_answer_is_taken_for_live_and_kept(error, tmp_path, monkeypatch):
    """Only a refused connection makes a socket file stale. Another user's socket (EACCES) or one whose server
    is too busy to accept in time may be served on: removed, that server was cut off for good."""
    cfg = ServeConfig(tp=1, socket_dir=tmp_path)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(cfg.socket_path(0)))  # not listening: only the connect's answer below says otherwise

    class Unclear(socket.socket):
        def connect(self, addr):
            raise error

    monkeypatch.setattr(preflight.socket, "socket", Unclear)
    preflight.remove_stale_socket(cfg.socket_path(0))  # the launcher's, after its ranks have gone
    assert cfg.socket_path(0).is_socket()
    with pytest.raises(ServeConfigError, match="a sidecar is already serving on"):  # a rank's (claims it)
        preflight.claim_socket(cfg, 0)
    assert cfg.socket_path(0).is_socket()


def test_a_rank_started_with_another_world_size_than_tp_is_exit_2(tmp_path):
    """torchrun --nproc-per-node 2 with --tp 4: every rank refuses in one line, exit 2 (no restart fixes it),
    before it listens; the group of 2 otherwise waited for ranks that were never started."""
    from dspark_sidecar.server import app

    with pytest.raises(ServeConfigError, match=r"--tp 4: 2 ranks were started \(WORLD_SIZE 2\)") as err:
        app.serve_rank(ServeConfig(tp=4, device="cpu", socket_dir=tmp_path), 0, 2, 0)
    assert err.value.exit_status == 2 and not list(tmp_path.iterdir())

