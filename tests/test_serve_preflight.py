"""`serve` refuses an unusable socket folder, a live sidecar's sockets and busy ports in the parent:
one line naming the flag, exit 2, before any rank (or socket) exists.

These used to start the ranks: a raw traceback per rank (mkdir/unlink in server/app.py, gRPC's bind
RuntimeError for --tcp-base-port, prometheus' OSError for --metrics-port only after the shard loaded,
torch's DistNetworkError for --master-port), or, on a live sidecar's folder, its socket unlinked and
taken over. Each test forbids the launcher, so a regression fails in well under a second.
"""

from __future__ import annotations

import socket
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dspark_sidecar import cli
from dspark_sidecar.server import launcher
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


@pytest.mark.parametrize("flag", ["--tcp-base-port", "--metrics-port", "--master-port"])
def test_a_port_in_use_is_one_line_naming_the_flag(flag, tiny_ckpt, tmp_path, capsys):
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and torch's store set it
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _refused(_argv(tmp_path / "sock", tiny_ckpt, flag, str(port)), capsys, flag, str(port))
    assert not list((tmp_path / "sock").glob("*.sock"))


def test_a_master_addr_that_is_not_this_host_s_is_one_line(tiny_ckpt, tmp_path, capsys):
    """Rank 0 hosts the group's store on --master-addr (not on every address, as torch's own store
    would): an address this host does not have was a rank blocked in the rendezvous until the timeout."""
    _refused(_argv(tmp_path / "sock", tiny_ckpt, "--master-addr", "192.0.2.1"), capsys, "--master-addr",
             "192.0.2.1", "not an address of this host")


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
        _refused(_argv(sock_dir, tiny_ckpt), capsys, f"--socket-dir: a sidecar is already serving on {sock_dir}")
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
