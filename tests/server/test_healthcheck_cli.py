"""The exec probe of deploy/ (`python -m dspark_sidecar.server.healthcheck`): its flags."""

from __future__ import annotations

import grpc
import pytest

from dspark_sidecar.server import healthcheck


@pytest.mark.parametrize("flags, words", [
    (["--tp", "0"], "--tp: must be at least 1, got 0"),
    (["--tp", "-2"], "--tp: must be at least 1, got -2"),
    (["--tp", "65"], "--tp: must be 1..64 (serve's), got 65"),  # probed 65 ranks one after another, each --timeout
    (["--timeout", "0"], "--timeout: must be a number of seconds above 0, got 0.0"),
    (["--timeout", "nan"], "--timeout: must be a number of seconds above 0, got nan"),
    (["--timeout", "1e10"], "--timeout: at most 86400 s, got 1e+10"),
    (["--socket-dir", ""], "--socket-dir: empty; give a folder"),
])
def test_a_probe_flag_that_cannot_be_used_is_refused_not_answered(flags, words, tmp_path, capsys):
    """--tp 0 checked no rank and exited 0: a probe that passed with no sidecar at all (a typo in a
    manifest marked the pod healthy). A timeout of 0 or nan reported every live rank UNREACHABLE
    (DEADLINE_EXCEEDED) instead of naming the flag, and so did one past gRPC's deadline (int64 nanoseconds,
    ~292 years: 1e10 s expired at once, "no answer within 1e+10 s"). An empty --socket-dir (an unset variable
    in a manifest) probed the working directory's rank sockets, where serve refuses the same folder."""
    with pytest.raises(SystemExit) as exit_:
        healthcheck.main(["--all-ranks", "--socket-dir", str(tmp_path), *flags])
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_no_sidecar_is_not_healthy(tmp_path, capsys):
    assert healthcheck.main(["--all-ranks", "--socket-dir", str(tmp_path), "--tp", "1", "--timeout", "0.2"]) == 1
    assert "UNREACHABLE" in capsys.readouterr().out


def _serving(sock) -> grpc.Server:
    """A health service on unix:`sock` that answers SERVING (a sidecar rank, to the probe)."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from dspark_sidecar.proto import SERVICE_NAME

    server = grpc.server(futures.ThreadPoolExecutor(2))
    svc = health.HealthServicer()
    svc.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(svc, server)
    assert server.add_insecure_port(f"unix:{sock}")
    server.start()
    return server


def test_all_ranks_passes_only_when_every_rank_is_serving(tmp_path, capsys):
    """The deploy probes' contract (exit 0 iff every rank is SERVING): one rank answering, first or last, is not
    a healthy sidecar group, whichever rank it is."""
    argv = ["--all-ranks", "--socket-dir", str(tmp_path), "--tp", "2", "--timeout", "2"]
    servers = {}
    try:
        for rank in (1, 0):  # the last rank alone, then both
            servers[rank] = _serving(tmp_path / f"rank{rank}.sock")
            assert healthcheck.main(argv) == (0 if len(servers) == 2 else 1), capsys.readouterr().out
        servers.pop(1).stop(None)  # the first rank alone
        assert healthcheck.main(argv) == 1, capsys.readouterr().out
    finally:
        for server in servers.values():
            server.stop(None)


def test_a_folder_grpc_decodes_into_another_is_refused_not_passed_on_that_ones_health(tmp_path, capsys):
    """gRPC decodes '%XX' in a unix: target: --socket-dir .../a%41b asked .../aAb's ranks, and their SERVING
    passed the probe (exit 0) for a folder where no sidecar can even listen (serve refuses it)."""
    (tmp_path / "aAb").mkdir()
    server = _serving(tmp_path / "aAb" / "rank0.sock")
    try:
        with pytest.raises(SystemExit) as exit_:
            healthcheck.main(["--all-ranks", "--socket-dir", str(tmp_path / "a%41b"), "--tp", "1"])
    finally:
        server.stop(None)
    assert exit_.value.code == 2
    assert "--socket-dir: " in capsys.readouterr().err


@pytest.mark.parametrize("one", [False, True])
def test_a_socket_path_past_sun_path_is_refused_saying_so(one, tmp_path, capsys):
    """Every rank read "UNREACHABLE: UNKNOWN" under gRPC's own log lines, naming no setting."""
    folder = tmp_path / ("x" * 120)
    flags = ["--socket", str(folder / "rank0.sock")] if one else ["--all-ranks", "--socket-dir", str(folder)]
    with pytest.raises(SystemExit) as exit_:
        healthcheck.main([*flags, "--tp", "1", "--timeout", "0.2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert ("--socket: " if one else "--socket-dir: ") in err and "a unix socket path holds at most 107" in err, err


def test_a_socket_path_that_only_starts_with_three_slashes_is_probed(tmp_path, capsys):
    """unix:///PATH is a valid target: only a leading '//' (an authority) is refused."""
    server = _serving(tmp_path / "rank0.sock")
    try:
        assert healthcheck.main(["--socket", "//" + str(tmp_path / "rank0.sock"), "--timeout", "5"]) == 0
    finally:
        server.stop(None)
    assert "SERVING" in capsys.readouterr().out


def test_an_unreachable_rank_says_why(tmp_path, capsys):
    """A socket file not there, and one left by a killed rank (nobody listens), both printed
    "UNREACHABLE: UNAVAILABLE": the probe's line could not tell a rank never started from a dead one."""
    import socket

    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(tmp_path / "rank1.sock"))  # closed unlistened: connecting is refused
    assert healthcheck.main(["--all-ranks", "--socket-dir", str(tmp_path), "--tp", "2", "--timeout", "2"]) == 1
    lines = capsys.readouterr().out.splitlines()
    gone, stale = lines
    assert gone.startswith(f"{tmp_path}/rank0.sock: UNREACHABLE: UNAVAILABLE: ") and "No such file" in gone, lines
    assert stale.startswith(f"{tmp_path}/rank1.sock: UNREACHABLE: UNAVAILABLE: ") and "refused" in stale, lines


def _probe_not_serving(tmp_path, servicer, interceptors=()) -> int:
    """The probe's exit status against one rank whose health says NOT_SERVING and whose DrafterSidecar is
    `servicer` (what the probe then asks why)."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from dspark_sidecar.proto import SERVICE_NAME
    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=list(interceptors))
    svc = health.HealthServicer()
    svc.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(svc, server)
    pb_grpc.add_DrafterSidecarServicer_to_server(servicer, server)
    assert server.add_insecure_port(f"unix:{tmp_path / 'rank0.sock'}")
    server.start()
    try:
        return healthcheck.main(["--all-ranks", "--socket-dir", str(tmp_path), "--tp", "1", "--timeout", "5"])
    finally:
        server.stop(None)


@pytest.mark.parametrize("state, state_reason, refusal, words", [
    ("PEER_SILENT", "peer rank(s) 1 exited (pid 42): steps abort until the sidecar group is restarted", "",
     "NOT_SERVING (PEER_SILENT: peer rank(s) 1 exited (pid 42)"),
    ("REFUSED", "", "DP > 1", "NOT_SERVING (REFUSED: DP > 1)"),
    ("DRAINING", "", "not gfx950", "NOT_SERVING (DRAINING)"),
    # An error's lines (a HIP error's advice, a compiler's diagnostic): one rank, one line.
    ("REFUSED", "", "FlyDSL runner could not be built: OutOfMemoryError: HIP error: out of memory\nFor debugging\n",
     "NOT_SERVING (REFUSED: FlyDSL runner could not be built: OutOfMemoryError: HIP error: out of memory For debugging)\n"),
])
def test_a_rank_that_is_not_serving_says_why(state, state_reason, refusal, words, tmp_path, capsys):
    """The probe's line is what a person sees of a failed probe (a Kubernetes probe's event, the systemd
    unit's start): it read "NOT_SERVING" alike for a rank still loading, draining, refused for good
    (--strict-refusal) or waiting on a peer that exited, while the rank's GetStatus says which, and why."""
    from dspark_sidecar.proto import sidecar_pb2 as pb
    from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc

    class Status(pb_grpc.DrafterSidecarServicer):
        def GetStatus(self, request, context):
            return pb.StatusReport(state=state, state_reason=state_reason, fast_path_refusal=refusal)

    assert _probe_not_serving(tmp_path, Status()) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{tmp_path}/rank0.sock: {words}") and out.count("\n") == 1, out


def test_a_rank_still_loading_its_shard_says_so(tmp_path, capsys):
    """Before its shard is loaded a rank has no status (app.LateServicer answers GetStatus UNAVAILABLE,
    reason LOADING): the startup probe's line says LOADING, not a bare NOT_SERVING for up to 15 minutes."""
    from dspark_sidecar.server.app import LateServicer
    from dspark_sidecar.server.errors import StatusInterceptor

    assert _probe_not_serving(tmp_path, LateServicer(), [StatusInterceptor()]) == 1
    assert capsys.readouterr().out == f"{tmp_path}/rank0.sock: NOT_SERVING (LOADING)\n"


def test_a_server_without_the_sidecar_s_health_status_is_said_to_be_reached(tmp_path, capsys):
    """grpc.health.v1's Check answers NOT_FOUND for a service the server has no status for (Watch's SERVICE_UNKNOWN):
    another gRPC server on the rank's socket, or a sidecar of another service name. The probe printed it
    "UNREACHABLE: NOT_FOUND", which reads as a socket file not found, of a server that did answer."""
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)  # "" alone: SERVING
    assert server.add_insecure_port(f"unix:{tmp_path / 'rank0.sock'}")
    server.start()
    try:
        assert healthcheck.main(["--all-ranks", "--socket-dir", str(tmp_path), "--tp", "1", "--timeout", "5"]) == 1
    finally:
        server.stop(None)
    line = capsys.readouterr().out
    assert line == (f"{tmp_path}/rank0.sock: SERVICE_UNKNOWN: this server answers grpc.health.v1 but has no status "
                    "for dspark.sidecar.v1.DrafterSidecar: not a DSpark sidecar rank (another server on its socket?)\n"), line
