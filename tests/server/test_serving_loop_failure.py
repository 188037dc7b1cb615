"""server/app.py's serving loop: a failure in a beat drains and tears the rank down (exit 1), never hangs it.

Before, an exception out of watch_peers, watch_steps or their health publish left the loop without the
teardown: the gRPC server was never stopped, and the interpreter's exit waited for good on the handler thread
of every open DraftSteps stream (an engine keeps one open), so the rank neither served nor exited: no exit
for its launcher or torchrun to see, health hung (no answer), the socket file already removed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark_sidecar.proto import SERVICE_NAME
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.server.healthcheck import check
from helpers.waiting import wait_until

# Rank 0 of TP 1 under torchrun's variables, its beat failing once SERVING: in watch_peers itself ("beat"), or
# in every health publish from then on ("publish"), the drain's own included; or ("drain") a SIGTERM stop whose
# drain publish alone fails.
RANK_WHOSE_BEAT_FAILS = """
import sys
from pathlib import Path
from dspark_sidecar.server import app
how, marker = sys.argv[-2], Path(sys.argv[-1])
real_watch, real_publish = app.watch_peers, app.HealthPublisher.__call__
def watch_peers(board, rank, life, publish, peers):
    if marker.exists() and how != "drain":  # the test holds a stream open: the next beat fails
        if how == "beat":
            raise OSError(24, "Too many open files")
        publish()
    return real_watch(board, rank, life, publish, peers)
def publish(self, state=None):
    if (how == "publish" and marker.exists()) or (how == "drain" and state == "DRAINING"):
        raise RuntimeError("publish failed")
    return real_publish(self, state)
app.watch_peers = watch_peers
app.HealthPublisher.__call__ = publish
from dspark_sidecar import cli
sys.exit(cli.main(sys.argv[1:-2]))
"""


@pytest.mark.parametrize("how", ["beat", "publish", "drain"])
def test_a_failed_beat_drains_the_rank_and_exits_1_with_a_stream_open(tmp_path, how):
    sock, marker = tmp_path / "sock", tmp_path / "fail"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    p = subprocess.Popen([sys.executable, "-c", RANK_WHOSE_BEAT_FAILS, "serve", "--tp", "1", "--device", "cpu",
                          "--socket-dir", str(sock), "--drain-s", "1", how, str(marker)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    target = f"unix:{sock / 'rank0.sock'}"
    release = threading.Event()
    ended: list[object] = []
    try:
        wait_until(lambda: check(target, 1.0) == "SERVING", 120, "rank 0 SERVING", watch=p, interval_s=0.1)
        channel = grpc.insecure_channel(target)

        def requests():  # an engine's idle stream: no step, held open
            release.wait()
            return
            yield

        call = pb_grpc.DrafterSidecarStub(channel).DraftSteps(requests())

        def read() -> None:
            try:
                ended.append(list(call))
            except grpc.RpcError as err:
                ended.append(err.code())

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        time.sleep(0.5)  # the stream reaches its handler thread before the beat fails
        # Health looked at on one channel connected before the failure, not on a fresh channel each time with 0.5 s
        # to connect and answer: on a loaded box every such look in the 1 s drain could run out, and the drain went
        # unseen. A call on the connected channel fails at once when the server has gone.
        looks = grpc.insecure_channel(target)
        health = health_pb2_grpc.HealthStub(looks)

        def look() -> str:
            try:
                resp = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30)
            except grpc.RpcError:
                return "UNREACHABLE"
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

        assert look() == "SERVING"
        if how == "drain":
            p.send_signal(signal.SIGTERM)
        else:
            marker.touch()
        seen = set()
        deadline = time.monotonic() + 45
        while p.poll() is None and time.monotonic() < deadline:
            seen.add(look())
            time.sleep(0.05)
        looks.close()
        assert p.poll() is not None, "the rank neither served nor exited after its beat failed"
        _, err = p.communicate(timeout=10)
        assert p.returncode == 1, err[-3000:]
        said = {"beat": "the serving loop failed; draining (exit 1)", "publish": "the serving loop failed",
                "drain": "publishing the drain failed; health set NOT_SERVING directly (exit 1)"}[how]
        assert f"rank 0: {said}" in err, err[-3000:]
        assert "rank 0: stopped" in err, err[-3000:]  # the teardown ran to its end
        assert "NOT_SERVING" in seen, seen  # drained: health left SERVING before the server stopped
        reader.join(10)
        assert ended, "the engine's stream was not ended"
        assert not list(sock.glob("*.sock")), "the rank left a socket file behind"
    finally:
        release.set()
        if p.returncode is None:  # a failed check must not leave the rank behind
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=10)


# Rank 0 of TP 1 as under torchrun (TORCHELASTIC_USE_AGENT_STORE), its agent watched by a stand-in that reports it
# gone once the test touches the marker; the rank hosts its store itself, as under our launcher (no agent here).
RANK_WHOSE_AGENT_GOES = """
import sys
from pathlib import Path
from dspark_sidecar.server import app
marker = Path(sys.argv[-1])
real_join = app.join_group
def join_group(cfg, backend, rank, world, agent_attempt=None):
    assert agent_attempt == 0  # the rank took itself for torchrun's
    return real_join(cfg, backend, rank, world, None)
class Agent:
    def __init__(self, pid):
        self.pid = pid
    def gone(self):
        return marker.exists()
app.join_group, app.ExitWith = join_group, Agent
from dspark_sidecar import cli
sys.exit(cli.main(sys.argv[1:-1]))
"""


def test_a_rank_whose_torchrun_agent_has_gone_drains_and_exits_1(tmp_path):
    """torchrun's agent killed outright leaves its ranks running (sessions of their own): each drains by itself, as
    the agent would have had it, and exits 1, not a clean stop's 0, for whatever supervises it."""
    sock, marker = tmp_path / "sock", tmp_path / "agent-gone"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    p = subprocess.Popen([sys.executable, "-c", RANK_WHOSE_AGENT_GOES, "serve", "--tp", "1", "--device", "cpu",
                          "--socket-dir", str(sock), "--drain-s", "0", str(marker)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    target = f"unix:{sock / 'rank0.sock'}"
    try:
        wait_until(lambda: check(target, 1.0) == "SERVING", 120, "rank 0 SERVING", watch=p, interval_s=0.1)
        marker.touch()
        _, err = p.communicate(timeout=60)  # a hang guard only
        assert p.returncode == 1, err[-3000:]
        assert "rank 0: torchrun's agent (pid" in err and "rank 0: stopped" in err, err[-3000:]
        assert not list(sock.glob("*.sock")), "the rank left a socket file behind"
    finally:
        if p.returncode is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate(timeout=10)


def test_a_drain_whose_publish_failed_still_says_not_serving_in_the_metrics():
    """draining_anyway set health NOT_SERVING and left the metrics' serving gauge at 1: a dashboard (or an alert
    on dspark_serving) read the draining rank as serving for the whole drain and teardown."""
    from types import SimpleNamespace

    from grpc_health.v1 import health, health_pb2

    from dspark_sidecar.server.health import HealthPublisher
    from dspark_sidecar.server.servicer import Lifecycle

    life = Lifecycle(state="SERVING")
    seen: list[bool] = []
    hs = health.HealthServicer()
    publish = HealthPublisher(life, SimpleNamespace(refusal=lambda: ""), SimpleNamespace(refusal=None), hs,
                              SimpleNamespace(set_serving=seen.append))
    publish("SERVING")
    assert seen == [True]
    publish.draining_anyway()
    assert seen[-1] is False and life.state == "DRAINING"
    assert hs.Check(health_pb2.HealthCheckRequest(service=""), None).status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_the_agent_watched_is_the_parent_the_rank_process_started_with(tmp_path, monkeypatch):
    """Under torchrun the rank watches its agent by pid. Read as os.getppid() in serve_rank, after the imports and
    check_checkpoint's full read, an agent killed meanwhile had the rank re-parented: it watched init (or a
    subreaper), alive for good, and served on as an orphan. The pid read at the process's start is the one watched."""
    from dspark_sidecar.server import app
    from dspark_sidecar.server.config import ServeConfig

    class Watched(Exception):
        pass

    pids = []

    def exit_with(pid):
        pids.append(pid)
        raise Watched  # start-up stops here: nothing else of the rank is needed

    monkeypatch.setattr(app, "ExitWith", exit_with)
    monkeypatch.setattr(app.signal, "signal", lambda *a: None)  # not the test process's handlers
    monkeypatch.setattr(app.faulthandler, "register", lambda *a, **k: None)
    monkeypatch.delenv("DSPARK_LAUNCHER_PID", raising=False)
    cfg = ServeConfig(tp=1, device="cpu", socket_dir=tmp_path)
    with pytest.raises(Watched):
        app.serve_rank(cfg, 0, 1, 0, agent_attempt=0, agent_pid=4242)
    with pytest.raises(Watched):
        app.serve_rank(cfg, 0, 1, 0, agent_attempt=0)  # no pid given: the parent now
    assert pids == [4242, os.getppid()]


def test_serve_under_torchrun_hands_its_rank_the_parent_read_at_import(tmp_path, monkeypatch):
    """cli reads the parent's pid first thing (PARENT_AT_START) and serve_rank watches that one, with the
    agent's restart count; a rank of our own launcher watches no agent."""
    from dspark_sidecar import cli
    from dspark_sidecar.server import app

    seen = []
    monkeypatch.setattr(app, "serve_rank", lambda cfg, *a, **k: seen.append(k) or 0)
    monkeypatch.setattr(cli, "PARENT_AT_START", 4242)
    monkeypatch.delenv("DSPARK_LAUNCHER_PID", raising=False)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
                 "TORCHELASTIC_RESTART_COUNT": "3"}.items():
        monkeypatch.setenv(k, v)
    argv = ["serve", "--tp", "1", "--device", "cpu", "--socket-dir", str(tmp_path / "s"), "--random-weights"]
    assert cli.main(argv) == 0
    assert seen == [{"agent_attempt": 3, "agent_pid": 4242}], seen
