"""A TP-2 sidecar whose rank 1 is stopped (SIGSTOP): rank 0 leaves SERVING and says why, then comes back.

A stopped peer never posts its copies, so every step on rank 0 would wait out the rendezvous
deadline and abort: rank 0 cannot draft, and health must say so (grpc.health.v1 SERVING only when
the rank can really draft), with GetStatus naming the silent peer (server/health.py watch_peers).
"""

from __future__ import annotations

import os
import re
import signal
import urllib.request

import grpc
import torch

from dspark_sidecar.drafter import scenario
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.server.health import PEER_SILENT_S
from dspark_sidecar.server.healthcheck import check
from helpers.engine_sim import PAGE, EngineSim
from helpers.sidecar_proc import SidecarProcess, free_port_block
from helpers.waiting import wait_until

TP = 2
LENS = [5, 40, 200, 33]
PAGES = sum(scenario.pages_needed(c + 7, PAGE) for c in LENS) + 8


def _status(sc: SidecarProcess, rank: int) -> pb.StatusReport:
    with grpc.insecure_channel(sc.socket(rank)) as ch:
        return pb_grpc.DrafterSidecarStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)


def _gauge(port: int) -> str:
    """Rank 0's Prometheus dspark_serving sample ("1.0" / "0.0")."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return re.search(r'^dspark_serving\{rank="0"\} (\S+)$', text, re.M).group(1)


def _faces(sc: SidecarProcess, port: int) -> tuple[str, str, str]:
    """Rank 0's health, as both health services and the gauge say it."""
    return check(sc.socket(0), 2.0), check(sc.socket(0), 2.0, service=""), _gauge(port)


def _silent_s(reason: str) -> float:
    return float(re.search(r"silent for ([0-9.]+) s", reason).group(1))


def test_a_stopped_peer_takes_rank_0_out_of_serving_until_it_is_back(tmp_path, tiny_ckpt, tiny_cfg, tiny_embed):
    port = free_port_block(TP)
    sc = SidecarProcess(tmp_path, tp=TP, checkpoint=tiny_ckpt,
                        extra_args=["--rendezvous-ms", "200", "--metrics-port", str(port)])
    sc.start()
    eng = EngineSim(tiny_cfg, [sc.socket(r) for r in range(TP)], PAGES, torch.float32)
    stopped = sc.rank_pids()[1]
    try:
        eng.bind()
        step = scenario.random_step(tiny_cfg, LENS, PAGE, PAGES, tiny_embed, seed=5)
        assert all(not isinstance(o, grpc.RpcError) for o in eng.step_all(1, step))
        assert _status(sc, 0).state == "SERVING" and _gauge(port) == "1.0"
        os.kill(stopped, signal.SIGSTOP)
        st = wait_until(lambda: (s := _status(sc, 0)).state == "PEER_SILENT" and s, PEER_SILENT_S + 10,
                        "rank 0 reports PEER_SILENT", interval_s=0.1)
        # Not before the peer could have beaten: the silence rank 0 reports is PEER_SILENT_S at least. Timed from the
        # SIGSTOP it was not: the peer's last beat came up to its beat's period before the stop, and a late beat (a
        # loaded box) made that longer than the 0.5 s allowed.
        assert not st.serving and "rank(s) 1 silent" in st.state_reason, st.state_reason
        assert _silent_s(st.state_reason) >= PEER_SILENT_S, st.state_reason
        # Every face of health says so: both health services (a Kubernetes gRPC probe asks for ""), the gauge.
        # They are set by the same publish as the state, just after it (health.HealthPublisher): waited for.
        wait_until(lambda: _faces(sc, port) == ("NOT_SERVING", "NOT_SERVING", "0.0"), 5,
                   lambda: f"health and the gauge follow: {_faces(sc, port)}", interval_s=0.1)
        # The reason is kept current while the peer stays silent (its seconds grow, beat by beat).
        first = _silent_s(st.state_reason)
        wait_until(lambda: _silent_s(_status(sc, 0).state_reason) >= first + 0.9, 5,
                   lambda: f"the silent seconds grow from {first}: {_status(sc, 0).state_reason}", interval_s=0.1)
        os.kill(stopped, signal.SIGCONT)
        stopped = 0
        wait_until(lambda: _status(sc, 0).state == "SERVING", 10, "rank 0 SERVING again once its peer beats",
                   interval_s=0.1)
        assert _status(sc, 0).state_reason == ""
        wait_until(lambda: _faces(sc, port) == ("SERVING", "SERVING", "1.0"), 5,
                   lambda: f"health and the gauge follow: {_faces(sc, port)}", interval_s=0.1)
        out = eng.step_all(2, step)
        assert all(not isinstance(o, grpc.RpcError) for o in out), out
    finally:
        if stopped:
            os.kill(stopped, signal.SIGCONT)
        eng.close()
        if sc.proc.poll() is None:
            os.killpg(sc.proc.pid, signal.SIGKILL)
            sc.proc.wait()
