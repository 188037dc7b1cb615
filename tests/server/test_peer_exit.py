"""A TP-2 group whose rank 1 is SIGKILLed while serving, with no launcher to take the group down at once
(as under torchrun, whose agent looks at its workers only every --monitor-interval): rank 0 must say
promptly that its peer has EXITED, not wait out the silence timeout (PEER_SILENT_S) meant for a peer
that is alive but stopped or hung (tests/server/test_peer_silence.py keeps that one).

Both cases of the killed process: reaped by its parent at once, and a zombie (exited, not reaped yet:
`kill(pid, 0)` still succeeds on it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.server.healthcheck import check
from dspark_sidecar.server.launcher import free_port
from helpers.peer_watch import watched_peer
from helpers.waiting import wait_until

TP = 2
# The ranks run with a silence timeout of an hour: a kill reported only through the silence (the path meant for
# a peer alive but stopped) is then never reported within HANG_S, a hang guard only (the exit's report comes at
# the next beat, BEAT_S after the kill).
RANK_SILENT_FOR_AN_HOUR = """
import sys
from dspark_sidecar.server import health
health.PEER_SILENT_S = 3600.0
from dspark_sidecar import cli
sys.exit(cli.main(sys.argv[1:]))
"""
HANG_S = 30.0


def _env(rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DSPARK_LAUNCHER_PID",)}
    return dict(env, RANK=str(rank), WORLD_SIZE=str(TP), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port))


def _status(sock: str) -> pb.StatusReport:
    with grpc.insecure_channel(sock) as ch:
        return pb_grpc.DrafterSidecarStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)


@pytest.fixture
def ranks(tmp_path, tiny_ckpt):
    """Two rank processes started directly, torchrun-style (this test is their parent)."""
    port = free_port()
    sock = tmp_path / "sock"
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(TP)]
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SILENT_FOR_AN_HOUR, "serve", "--tp", str(TP), "--device", "cpu",
                               "--socket-dir", str(sock), "--checkpoint", str(tiny_ckpt[0]), "--target-checkpoint",
                               str(tiny_ckpt[1]), "--drain-s", "0"],
                              env=_env(r, port), stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True)
             for r in range(TP)]
    socks = [f"unix:{sock / f'rank{r}.sock'}" for r in range(TP)]

    def tail() -> str:
        return "\n".join(f"--- rank {r}\n" + Path(tmp_path / f"rank{r}.log").read_text(errors="replace")[-3000:]
                         for r in range(TP))

    def serving() -> bool:
        assert all(p.poll() is None for p in procs), tail()  # a rank that died never serves: fail now
        return all(Path(s[5:]).exists() and check(s, 0.5) == "SERVING" for s in socks)

    try:
        wait_until(serving, 120, lambda: f"both ranks SERVING\n{tail()}", interval_s=0.2)
        yield procs, socks, tail
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        for f in logs:
            f.close()


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_killed_peer_is_reported_exited_well_before_the_silence_timeout(ranks, reaped):
    procs, socks, tail = ranks
    assert _status(socks[0]).state == "SERVING"
    os.kill(procs[1].pid, signal.SIGKILL)
    if reaped:
        procs[1].wait(timeout=10)
    killed_at = time.monotonic()
    st = wait_until(lambda: (s := _status(socks[0])).state != "SERVING" and s, HANG_S,
                    lambda: "the exited peer reported (not only by the silence)\n" + tail(), interval_s=0.05)
    assert st.state == "PEER_SILENT" and not st.serving, st
    assert "rank(s) 1 exited" in st.state_reason and "silent" not in st.state_reason, st.state_reason
    # Health is set by the same publish as the state, just after it (health.HealthPublisher): a GetStatus on
    # another of the rank's threads can read the new state first. Within what is left of the same bound.
    wait_until(lambda: check(socks[0], 2.0) == "NOT_SERVING", HANG_S - (time.monotonic() - killed_at),
               lambda: f"health NOT_SERVING with the peer reported exited: {check(socks[0], 2.0)}\n{tail()}",
               interval_s=0.05)
    if not reaped:
        # Still unreaped when rank 0 reported it: a zombie, on which kill(pid, 0) succeeds (poll() would reap it).
        stat = Path(f"/proc/{procs[1].pid}/stat").read_text()
        assert stat.rsplit(")", 1)[1].split()[0] == "Z", stat
    assert procs[0].poll() is None, tail()


def test_an_exited_peer_stays_reported_exited_once_its_beats_are_old():
    """Not flipped to "silent" once the dead rank's last beat is PEER_SILENT_S old (the ranks above run with an
    hour's silence timeout, so this is looked at here, on a board whose beats are set)."""
    from dspark_sidecar.server.health import PEER_SILENT_S

    with watched_peer() as (life, _, board, peer, look):
        peer.kill()
        peer.wait()
        look()
        assert life.state == "PEER_SILENT" and "rank(s) 1 exited" in life.reason, life.reason
        board.beats[1] = time.monotonic_ns() - int((PEER_SILENT_S + 10) * 1e9)  # its last beat, long ago
        look()
        assert life.state == "PEER_SILENT" and "rank(s) 1 exited" in life.reason, life.reason
        assert "silent" not in life.reason, life.reason
