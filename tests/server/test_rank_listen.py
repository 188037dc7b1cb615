"""In the rank (under torchrun there is no parent check): its socket path and ports, one line each.

The rank used to unlink whatever sat at DIR/rank{r}.sock, a live sidecar's socket included, and to
raise raw tracebacks for a folder it could not make or a port gRPC could not bind.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import grpc
import pytest

from dspark_sidecar.server.config import AddressInUse, ServeConfig, ServeConfigError
from dspark_sidecar.server.process_group import PeerLost
from dspark_sidecar.server.rendezvous import Board


def test_a_stale_socket_is_replaced_a_live_one_refused_a_folder_refused(tmp_path):
    from dspark_sidecar.server import preflight

    cfg = ServeConfig(tp=1, socket_dir=tmp_path)
    path = cfg.socket_path(0)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        s.listen()  # live: something accepts on it
        with pytest.raises(ServeConfigError, match="a sidecar is already serving on"):
            preflight.claim_socket(cfg, 0)
        assert path.is_socket()
    preflight.claim_socket(cfg, 0)  # the listener is gone, its file stale: removed
    assert not path.exists()
    path.mkdir()
    with pytest.raises(ServeConfigError, match="not a socket"):
        preflight.claim_socket(cfg, 0)


def test_a_socket_another_serve_s_rank_has_claimed_but_not_bound_yet_is_refused(tmp_path):
    """gRPC's bind unlinks whatever socket sits at the path, a live server's too: two serves on one folder
    whose ranks both probed rank0.sock before either had bound it both passed claim_socket, and the second's
    bind cut the first off unseen (its rank serving on a name no longer its). The claim now holds until the
    rank exits."""
    from dspark_sidecar.server import preflight

    cfg = ServeConfig(tp=1, socket_dir=tmp_path)
    first = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from dspark_sidecar.server import preflight; "
         "from dspark_sidecar.server.config import ServeConfig; "
         f"preflight.claim_socket(ServeConfig(tp=1, socket_dir=Path({str(tmp_path)!r})), 0); "
         "print('claimed', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline() == "claimed\n"
        with pytest.raises(AddressInUse, match="another sidecar is starting or serving on") as err:
            preflight.claim_socket(cfg, 0)
        assert err.value.exit_status == 75
    finally:
        first.stdin.close()
        assert first.wait(timeout=30) == 0
    preflight.claim_socket(cfg, 0)  # the first rank has gone (its claim with it, even after kill -9)


def test_a_busy_tcp_port_in_the_rank_is_one_line_not_grpcs_runtime_error(tmp_path):
    from grpc_health.v1 import health

    from dspark_sidecar.server.app import LateServicer, _start_grpc

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = ServeConfig(tp=1, socket_dir=tmp_path, tcp_base_port=busy.getsockname()[1])
        with pytest.raises(AddressInUse, match="--tcp-base-port: rank 0 cannot listen on 127.0.0.1:") as err:
            _start_grpc(cfg, 0, health.HealthServicer(), LateServicer())
    assert err.value.exit_status == 75  # held now: systemd's unit restarts it (it does not restart exit 2)


def test_the_owner_closing_a_board_someone_removed_is_a_warning_not_a_traceback(caplog):
    """Someone removed the board's name before rank 0 did (an operator cleaning /dev/shm; before the
    names were random, a second serve's rank 0 taking it for stale): teardown raised FileNotFoundError."""
    board = Board(None, 1, create=True)  # a fixed name is refused (O_EXCL) after a run killed before its close
    subprocess.run([sys.executable, "-c", f"import _posixshmem; _posixshmem.shm_unlink('/{board.name}')"], check=True)
    board.close()
    assert "was removed by another process" in caplog.text


def test_a_peer_lost_during_start_up_is_one_line_and_what_start_up_made_goes(tmp_path, monkeypatch):
    """A peer that failed to start (and printed why) reaches the others as a gloo error in a start-up
    barrier: they used to print its traceback, which reads as a second failure, and leave the board."""
    import threading

    from dspark_sidecar.server import app

    def closed(group=None):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:18611.\nmore")

    monkeypatch.setattr(app.dist, "barrier", closed)
    start_up = app.StartUp(0, threading.Event())
    start_up.socket = tmp_path / "rank0.sock"
    start_up.socket.touch()
    start_up.board = Board(None, 2, create=True)
    try:
        with pytest.raises(PeerLost, match=r"rank 0: a peer rank left during start-up \(.*Connection closed"):
            start_up.barrier(None)
        assert not start_up.socket.exists()
        with pytest.raises(FileNotFoundError):
            Board(start_up.board.shm.name, 2, create=False)  # unlinked: a later start finds no stale board
    finally:
        start_up.board.shm.close()


def test_a_draft_stream_while_the_rank_loads_ends_unavailable_with_the_loading_reason(tmp_path):
    """The stream was refused with a bare abort, on the belief that stream handlers miss the interceptor;
    they do not, and the stream now ends as a unary call does: UNAVAILABLE, the LOADING reason attached."""
    from grpc_health.v1 import health
    from grpc_status import rpc_status

    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
    from dspark_sidecar.server.app import LateServicer, _start_grpc

    cfg = ServeConfig(tp=1, socket_dir=tmp_path)
    server = _start_grpc(cfg, 0, health.HealthServicer(), LateServicer())
    try:
        with grpc.insecure_channel(cfg.endpoints(0)[0]) as ch:
            stream = pb_grpc.DrafterSidecarStub(ch).DraftSteps(iter([pb.DraftStepRequest(step_id=1)]), timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "still loading" in err.value.details()
        status = rpc_status.from_call(err.value)
        assert status is not None and any(b"LOADING" in d.value for d in status.details), status
    finally:
        server.stop(None)


def test_a_fifo_at_the_lock_file_s_name_is_refused_not_waited_on(tmp_path):
    """The claim opened DIR/rank{r}.sock.lock read-only, which on a FIFO (the engine's group may create
    entries in the folder) waits for a writer: the rank hung before it listened, saying nothing."""
    os.mkfifo(tmp_path / "rank0.sock.lock")
    probe = subprocess.run(
        [sys.executable, "-c", "from pathlib import Path; from dspark_sidecar.server import preflight; "
         "from dspark_sidecar.server.config import ServeConfig; "
         f"preflight.claim_socket(ServeConfig(tp=1, socket_dir=Path({str(tmp_path)!r})), 0)"],
        capture_output=True, text=True, timeout=20)
    assert probe.returncode == 1
    assert "is not a regular file; remove it" in probe.stderr


def test_the_socket_s_0660_is_never_given_through_a_link_swapped_in_after_the_bind(tmp_path, monkeypatch):
    """The folder's group (the engine's) may create and rename entries in it. Between gRPC's bind and the
    chmod that gives the socket its 0660, one of them could rename a symbolic link over rank0.sock: the
    chmod by path followed it, and made the link's target (any file the sidecar's user owns; as root, any
    file at all) 0660, readable and writable by that group. The doorbell's FIFO and the folder itself were
    closed against the same swap; the socket was not."""
    import stat

    from grpc_health.v1 import health

    from dspark_sidecar.server.app import LateServicer, _start_grpc

    victim = tmp_path / "private"
    victim.write_text("secret")
    victim.chmod(0o600)
    cfg = ServeConfig(tp=1, socket_dir=tmp_path / "sock")
    real_server, started = grpc.server, []

    class Swapped:  # the server, whose start is followed at once by the group's rename of a link over the socket
        def __init__(self, *a, **kw):
            self.inner = real_server(*a, **kw)
            started.append(self.inner)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def start(self):
            self.inner.start()
            link = cfg.socket_dir / "planted"
            link.symlink_to(victim)
            os.replace(link, cfg.socket_path(0))

    monkeypatch.setattr(grpc, "server", Swapped)
    try:
        with pytest.raises(AddressInUse, match=r"rank 0's socket .*rank0\.sock is no longer the one it bound "
                                               r"\(a symbolic link now\)") as err:
            _start_grpc(cfg, 0, health.HealthServicer(), LateServicer())
        assert err.value.exit_status == 75
        assert stat.S_IMODE(victim.stat().st_mode) == 0o600  # was 0660
    finally:
        for s in started:
            s.stop(None)


def test_get_status_in_the_warm_up_answers_from_the_servicer_while_draft_calls_are_still_refused():
    """During the warm-up the servicer exists but takes no draft calls yet: GetStatus reads it (state LOADING),
    so `status` shows the rank's backend and model while it warms up; every other call is still UNAVAILABLE."""
    from dspark_sidecar.server.app import LateServicer
    from dspark_sidecar.server.errors import SidecarError

    class Warming:  # the servicer made before the warm-up (app._serve_rank: late.status_source)
        def GetStatus(self, request, context):
            return "its report"

    late = LateServicer()
    late.status_source = Warming()
    assert late.GetStatus(None, None) == "its report"
    with pytest.raises(SidecarError) as err:
        late.DraftStep(None, None)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.reason == "LOADING"


def test_the_socket_s_0660_is_never_given_to_another_user_s_socket_put_in_its_place(tmp_path, monkeypatch):
    """A member of the folder's group may rename a socket of its own over rank0.sock after the bind: the rank must
    refuse it (its engines would talk to that user's server), not make it 0660 (as root the chmod succeeds)."""
    import stat

    from dspark_sidecar.server import app

    path = tmp_path / "rank0.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        path.chmod(0o600)
        owner = path.lstat().st_uid
        monkeypatch.setattr(app.os, "geteuid", lambda: owner + 1)  # the rank runs as another user than the socket's
        with pytest.raises(AddressInUse, match=rf"no longer the one it bound \(now a socket, owner uid {owner}\)"):
            app._give_socket_mode(path, 0)
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_the_socket_is_0660_whatever_the_umask(tmp_path, umask):
    """SECURITY.md: the socket is 0660 (the engine's group connects; bind made it 0777 less the umask)."""
    import stat

    from grpc_health.v1 import health

    from dspark_sidecar.server.app import LateServicer, _start_grpc

    cfg = ServeConfig(tp=1, socket_dir=tmp_path / "sock")
    old = os.umask(umask)
    try:
        server = _start_grpc(cfg, 0, health.HealthServicer(), LateServicer())
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(cfg.socket_path(0).lstat().st_mode) == 0o660
    finally:
        server.stop(None)


def test_a_failed_serve_s_launcher_leaves_the_socket_of_a_rank_another_serve_has_claimed(tmp_path):
    """A second serve on the folder of one starting: its ranks exit 75 (the first's claim), and its launcher
    then removed each rank's socket file that did not answer. The first serve's rank, holding the claim,
    may be between its bind and its listen (or have just replaced a stale file of a killed run): the file
    not answering yet was removed, and that rank served on a name no longer its, reached by no engine."""
    import types

    from dspark_sidecar.server import launcher

    cfg = ServeConfig(tp=1, socket_dir=tmp_path)
    path = cfg.socket_path(0)
    first = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys; from pathlib import Path; from dspark_sidecar.server import "
         "preflight; from dspark_sidecar.server.config import ServeConfig; "
         f"cfg = ServeConfig(tp=1, socket_dir=Path({str(tmp_path)!r})); preflight.claim_socket(cfg, 0); "
         "s = socket.socket(socket.AF_UNIX); s.bind(str(cfg.socket_path(0))); "  # bound, not listening yet
         "print('bound', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    refused = types.SimpleNamespace(returncode=75)  # the second serve's rank 0, gone
    try:
        assert first.stdout.readline() == "bound\n"
        launcher._remove_stale_sockets(cfg, [refused])
        assert path.is_socket()  # the first serve's, left alone
    finally:
        first.stdin.close()
        assert first.wait(timeout=30) == 0
    launcher._remove_stale_sockets(cfg, [refused])  # nobody claims it now: a stale file, removed
    assert not path.exists()
