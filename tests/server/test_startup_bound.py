"""The start-up collectives' bound (--startup-timeout-s) and a rank's socket file on a failed bind.

- The start-up gloo group was made by new_group without a timeout: torch's default, 30 minutes, so on
  NCCL a peer hung while loading held the others that long, and one that never came failed new_group with
  a traceback. On gloo the start-up barriers ran on the world group instead, under --dist-timeout-s (60 s):
  a rank whose load ran a minute behind its peers' failed the group.
- A rank refused its --tcp-base-port had already bound its unix socket, and left the file (under torchrun
  nothing else removes it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from dspark_sidecar.server.launcher import free_port

# Two ranks on gloo with --dist-timeout-s 1: join, make the start-up group, meet at a barrier. Rank 1 is
# `late` s late: before the barrier (mode "barrier": a slow load, or a hung one) or before the group ("group").
RANK = """
import sys, threading, time
from dspark_sidecar.server import startup
from dspark_sidecar.server.config import ServeConfig
from dspark_sidecar.server.process_group import PeerLost, join_group
port, rank, late, bound, mode = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
cfg = ServeConfig(tp=2).replace(master_addr="127.0.0.1", master_port=port, dist_timeout_s=1, startup_timeout_s=bound)
print("imported", flush=True)
sys.stdin.readline()  # both ranks join together: their imports' skew is not the 1 s join's to absorb
join_group(cfg, "gloo", rank, 2)
start_up = startup.StartUp(rank, threading.Event())
try:
    if rank == 1 and mode == "group":
        time.sleep(late)
    group = start_up.group(cfg.startup_timeout_s)
    if rank == 1 and mode == "barrier":
        time.sleep(late)
    start_up.barrier(group)
    print("ok", flush=True)
except PeerLost as err:
    print("PeerLost", err, flush=True)
"""


def _ranks(late: float, bound: int, mode: str) -> tuple[str, str, float]:
    """Both ranks' last lines, and how long rank 0 took (rank 1 is killed once rank 0 is done)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(port), str(r), str(late), str(bound), mode],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        # Each rank imports torch first (seconds on a loaded box, and not alike): with --dist-timeout-s 1 the
        # slower import alone failed the world group's join (2 of 4 cases on a 2-core box under load).
        if [p.stdout.readline() for p in procs] != ["imported\n"] * 2:  # one died importing: say why
            for p in procs:
                p.kill()
            raise AssertionError("a rank did not start: " + " | ".join(p.communicate()[1] for p in procs))
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        t = time.monotonic()
        out0, err0 = procs[0].communicate(timeout=120)
        took = time.monotonic() - t
        if late > bound:  # hung: it would sleep on
            procs[1].kill()
        out1, _ = procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "Traceback" not in err0, err0
    return out0.strip(), out1.strip(), took


def test_a_rank_loading_past_the_collective_timeout_still_catches_up():
    """Rank 1 reaches the start-up barrier 4 s after rank 0, with --dist-timeout-s 1: within
    --startup-timeout-s both go on (on gloo the barrier ran under --dist-timeout-s and failed)."""
    out0, out1, _ = _ranks(4.0, 60, "barrier")
    assert (out0, out1) == ("ok", "ok")


def test_a_peer_hung_at_the_barrier_ends_the_rank_within_the_start_up_bound():
    """Rank 1 stalls before the barrier (a hung read, a wedged device): rank 0 stops after
    --startup-timeout-s with one line naming it, not after torch's 30-minute default."""
    out0, _, _ = _ranks(120.0, 3, "barrier")  # with torch's 30 minutes, _ranks' 120 s wait fails it
    assert out0.startswith("PeerLost rank 0: a peer rank left during start-up or did not catch up within "
                           "--startup-timeout-s 3 s ("), out0


def test_a_peer_that_never_makes_the_start_up_group_is_one_line():
    """Rank 1 joined the world group but never reaches the start-up group: new_group's wait timed out with
    a traceback (after 30 minutes); now it is PeerLost, as the barriers' failures are."""
    out0, _, _ = _ranks(120.0, 3, "group")  # with torch's 30 minutes, _ranks' 120 s wait fails it
    assert out0.startswith("PeerLost rank 0: a peer rank left during start-up or did not catch up within "
                           "--startup-timeout-s 3 s ("), out0


def test_a_rank_refused_its_tcp_port_removes_its_socket_file(tmp_path):
    """Under torchrun (no launcher of ours to remove it): the unix socket was bound before the TCP port
    failed, and start-up had not yet recorded it as its own, so the file outlived the rank."""
    sock = tmp_path / "sock"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    with socket.socket() as s, socket.socket() as held:
        s.bind(("127.0.0.1", 0))
        held.bind(("127.0.0.1", 0))
        held.listen()
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(s.getsockname()[1]))
        p = subprocess.run([sys.executable, "-m", "dspark_sidecar", "serve", "--tp", "1", "--device", "cpu",
                            "--socket-dir", str(sock), "--tcp-base-port", str(held.getsockname()[1])],
                           env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 75 and "--tcp-base-port: rank 0 cannot listen on" in p.stderr, p.stderr
    assert not list(sock.glob("*.sock")), "a rank refused its TCP port left its socket file"


def test_serve_rank_bounds_the_start_up_group_by_startup_timeout_s(tmp_path, monkeypatch):
    """The tests above give StartUp.group their bound themselves: serve_rank passing another one (the world
    group's --dist-timeout-s, 60 s) failed a rank whose load ran a minute behind its peers', and a larger one
    held the group past the bound README gives --startup-timeout-s. Here up to the start-up group, stubbed."""
    from dspark_sidecar.server import app
    from dspark_sidecar.server.config import ServeConfig

    class Made(Exception):
        pass

    bounds = []

    def group(self, bound_s):
        bounds.append(bound_s)
        raise Made

    monkeypatch.setattr(app.StartUp, "group", group)
    monkeypatch.setattr(app, "join_group", lambda *a, **k: None)
    monkeypatch.setattr(app, "_start_grpc", lambda *a, **k: None)  # no listener in the test process
    monkeypatch.setattr(app.signal, "signal", lambda *a: None)  # nor the rank's signal handlers
    monkeypatch.setattr(app.faulthandler, "register", lambda *a, **k: None)
    monkeypatch.setattr(app.torch, "set_num_threads", lambda n: None)
    monkeypatch.delenv("DSPARK_LAUNCHER_PID", raising=False)
    cfg = ServeConfig(tp=1, device="cpu", socket_dir=tmp_path, dist_timeout_s=7, startup_timeout_s=42)
    try:
        app.serve_rank(cfg, 0, 1, 0)
    except Made:
        pass
    assert bounds == [42]
