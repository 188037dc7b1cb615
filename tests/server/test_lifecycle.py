"""Health through a rank's life, drain on SIGTERM, a killed rank taking the group down, strict refusal."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dspark_sidecar.proto import SERVICE_NAME
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.proto import sidecar_pb2_grpc as pb_grpc
from dspark_sidecar.server.healthcheck import check
from helpers.peer_watch import watched_peer
from helpers.sidecar_proc import SidecarProcess, alive as _alive
from helpers.waiting import wait_until


def test_health_not_serving_then_serving_then_not_serving_on_drain(tmp_path, tiny_ckpt):
    sc = SidecarProcess(tmp_path, tp=2, checkpoint=tiny_ckpt, extra_args=["--drain-s", "2"])
    log = open(sc.log_path, "ab")
    sc.proc = subprocess.Popen(sc.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _serve_then_drain(sc)
    finally:
        if sc.proc.poll() is None:  # a failed check must not leave a sidecar behind
            os.killpg(sc.proc.pid, signal.SIGKILL)
            sc.proc.wait()
        log.close()


def _serve_then_drain(sc: SidecarProcess) -> None:
    seen: list[str] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        s = check(sc.socket(0), 1.0)
        if not seen or seen[-1] != s:
            seen.append(s)
        if s == "SERVING":
            break
        time.sleep(0.05)
    assert "NOT_SERVING" in seen and seen[-1] == "SERVING", seen
    assert seen.index("NOT_SERVING") < seen.index("SERVING")
    # Each rank publishes SERVING on its own after the last start-up barrier: rank 1 may still be in its
    # last collection (app.serve_rank's gc.collect) when rank 0 is SERVING, which failed the check below.
    while check(sc.socket(1), 1.0) != "SERVING" and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = sc.rank_pids()
    # SIGUSR1 (server/app.py): every thread's stack into the rank's log, and the rank goes on serving.
    before = sc.log_path.read_text(errors="replace")
    os.kill(pids[1], signal.SIGUSR1)
    t = time.monotonic()
    while "serve_rank" not in sc.log_path.read_text(errors="replace")[len(before):] and time.monotonic() - t < 10:
        time.sleep(0.05)
    dump = sc.log_path.read_text(errors="replace")[len(before):]
    assert "Thread 0x" in dump and "serve_rank" in dump, dump[-2000:]
    # A bound on a hang, not a timing: a first call on a fresh channel ran past 1 s on a loaded CI box.
    assert _alive(pids[1]) and check(sc.socket(1), 30.0) == "SERVING"
    # Rank 0's health looked at on one channel, connected before the stop, until its server has gone: not in a fixed
    # 1.5 s of fresh channels. SIGTERM reaches the rank through the launcher (on a loaded 2-core box that took
    # ~0.5 s once), and a late flip, or fresh connects slower than the window, read as no drain at all.
    # What matters is that health flips and never flips back while draining.
    drained = []
    with grpc.insecure_channel(sc.socket(0)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        def look() -> str:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=30)
            except grpc.RpcError as err:  # the server has gone (a call on a connected channel fails at once)
                return f"UNREACHABLE: {err.code().name}"
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

        assert look() == "SERVING"
        sc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30  # a bound on a hang: the group exits after its 2 s drain
        while not drained or not drained[-1].startswith("UNREACHABLE"):
            assert time.monotonic() < deadline, f"rank 0 still answers 30 s after SIGTERM: {drained[-5:]}"
            drained.append(look())
            time.sleep(0.05)
    assert "NOT_SERVING" in drained, drained
    assert "SERVING" not in drained[drained.index("NOT_SERVING"):], drained
    assert sc.proc.wait(timeout=30) == 0  # drained and exited cleanly
    assert not any(_alive(p) for p in pids)


def test_killed_rank_takes_group_down_and_clients_see_unavailable(tmp_path, tiny_ckpt):
    sc = SidecarProcess(tmp_path, tp=4, checkpoint=tiny_ckpt).start()
    try:
        pids = sc.rank_pids()
        sc.kill_rank(2)
        assert sc.proc.wait(timeout=30) == 1
        time.sleep(0.5)
        assert not any(_alive(p) for p in pids), "orphan rank processes left behind"
        assert "sidecar rank 2 exited with code -9; stopping the group" in sc.log_tail(80)
        with grpc.insecure_channel(sc.socket(0)) as ch:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.DrafterSidecarStub(ch).GetStatus(pb.GetStatusRequest(), timeout=3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        sc.stop()


def test_strict_refusal_is_not_serving_with_the_reason(tmp_path, tiny_ckpt):
    sc = SidecarProcess(tmp_path, tp=1, checkpoint=tiny_ckpt, extra_args=["--strict-refusal"])
    log = open(sc.log_path, "ab")
    sc.proc = subprocess.Popen(sc.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        seen: list[str] = []

        def loaded() -> pb.StatusReport | None:
            try:
                with grpc.insecure_channel(sc.socket(0)) as ch:
                    st = pb_grpc.DrafterSidecarStub(ch).GetStatus(pb.GetStatusRequest(), timeout=2)
            except grpc.RpcError as err:  # not listening yet
                seen.append(err.code().name)
                return None
            seen.append(st.state)
            return st if st.state != "LOADING" else None

        st = wait_until(loaded, 120, lambda: f"rank 0 past LOADING: {seen[-1:]}\n{sc.log_tail()}", watch=sc.proc,
                        interval_s=0.2)
        assert st.state == "REFUSED" and not st.serving, st
        assert st.fast_path_refusal == "not gfx950"
        assert check(sc.socket(0), 30.0) == "NOT_SERVING"  # a bound on a hang, not a timing (the 2 s default)
    finally:
        sc.stop()  # SIGTERM, then SIGKILL of the whole process group after a timeout
        log.close()


def test_a_binding_s_publish_caught_by_the_drain_cannot_leave_health_serving():
    """BindKV's gRPC thread publishes health (its binding may change the fast path) while the main
    thread starts the drain. A publish that had read SERVING and set health after the drain's
    NOT_SERVING left the rank SERVING for the whole drain and teardown (nothing publishes again).
    Here the binding's publish is held inside its health write while the drain starts: the drain
    must wait for it and have the last word."""
    import threading
    from types import SimpleNamespace

    from grpc_health.v1 import health_pb2

    from dspark_sidecar.server.health import HealthPublisher
    from dspark_sidecar.server.servicer import Lifecycle

    inside, release, sets = threading.Event(), threading.Event(), []

    class Health:
        def set(self, name, status):
            if threading.current_thread().name == "bindkv" and not release.is_set():
                inside.set()
                release.wait(5)
            sets.append(status)

    life = Lifecycle(state="SERVING")
    publish = HealthPublisher(life, SimpleNamespace(refusal=lambda: ""), SimpleNamespace(refusal=None), Health(),
                              SimpleNamespace(set_serving=lambda serving: None))
    binding = threading.Thread(target=publish, name="bindkv")
    binding.start()
    assert inside.wait(5)
    drain = threading.Thread(target=publish, args=("DRAINING",))
    drain.start()
    drain.join(0.2)  # the drain waits for the binding's publish (before the fix it ran through)
    release.set()
    binding.join(5)
    drain.join(5)
    assert life.state == "DRAINING" and sets[-1] == health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_silent_peer_sends_watch_subscribers_one_not_serving_not_one_every_beat():
    """While a peer is silent, watch_peers publishes every beat (0.5 s) so that GetStatus's reason counts
    the seconds. Each publish set health again, and grpc.health.v1's servicer sends every set to every
    Watch stream, changed or not: a subscriber (a Kubernetes-style watcher, the engine's probe) got a
    duplicate NOT_SERVING twice a second for as long as the peer stayed silent. Now: one per change."""
    import uuid
    from types import SimpleNamespace

    from grpc_health.v1 import health, health_pb2

    from dspark_sidecar.server.health import HealthPublisher, watch_peers
    from dspark_sidecar.server.rendezvous import Board, PeerProcesses
    from dspark_sidecar.server.servicer import Lifecycle

    hs = health.HealthServicer()
    life = Lifecycle(state="LOADING")
    publish = HealthPublisher(life, SimpleNamespace(refusal=lambda: ""), SimpleNamespace(refusal=None), hs,
                              SimpleNamespace(set_serving=lambda serving: None))
    publish("SERVING")
    got: list = []
    closing: list = []
    hs.Watch(health_pb2.HealthCheckRequest(service=""), SimpleNamespace(add_callback=closing.append), got.append)
    board = Board(f"dspark-test-{uuid.uuid4().hex[:8]}", 2, create=True)
    try:
        peers = PeerProcesses(board, 0)  # no pids on the board: only the beats speak
        board.beats[1] = time.monotonic_ns()
        watch_peers(board, 0, life, publish, peers)
        reasons = []
        for age_s in (10, 11, 12, 13):  # four beats of a silent peer
            board.beats[1] = time.monotonic_ns() - age_s * 10**9
            watch_peers(board, 0, life, publish, peers)
            reasons.append(life.reason)
        assert life.state == "PEER_SILENT"
        # The reason still counts the seconds (GetStatus reads it) ...
        assert [r.split("silent for ")[1].split(" s")[0] for r in reasons] == ["10.0", "11.0", "12.0", "13.0"], reasons
        board.beats[1] = time.monotonic_ns()  # the peer beats again
        watch_peers(board, 0, life, publish, peers)
        watch_peers(board, 0, life, publish, peers)
        assert life.state == "SERVING" and life.reason == ""
        # ... while the subscriber hears each change once.
        S, N = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        assert [r.status for r in got] == [S, N, S], got
        assert hs.Check(health_pb2.HealthCheckRequest(service=""), None).status == S
    finally:
        board.close()


def test_a_silent_peer_that_then_exits_is_not_logged_as_signalling_again(caplog):
    """A peer stopped (SIGSTOP, hung) for longer than the silence timeout, then killed: it moves from the
    silent peers to the exited ones. The log said "every peer rank signals again" at that moment, the
    line meant for a peer that came back, just after the error naming it exited."""
    import logging

    with watched_peer() as (life, _, board, peer, look):
        board.beats[1] = time.monotonic_ns() - 10 * 10**9  # silent for 10 s
        look()
        assert life.state == "PEER_SILENT" and "silent" in life.reason, life.reason
        peer.kill()
        peer.wait()
        with caplog.at_level(logging.INFO, logger="dspark_sidecar.server"):
            look()
        assert life.state == "PEER_SILENT" and "rank(s) 1 exited" in life.reason, life.reason
        lines = [r.getMessage() for r in caplog.records if r.name == "dspark_sidecar.server"]
        assert any("exited" in line for line in lines), lines
        assert not any("signals again" in line for line in lines), lines


# --strict-refusal and the binding: a servicer over fakes (no model, no rank loop) -----------------------

class _Fast:
    """server.fast_path.FlyDSLFastPath's verdicts as it gives them for a binding it has not built for."""

    def __init__(self, on_refusal=None) -> None:
        self.on_refusal = on_refusal  # called with the binding judged, before its verdict

    def refusal(self, kv):
        if kv is None:
            return None  # no start-up reason
        if self.on_refusal is not None:
            self.on_refusal(kv)
        return None if len(kv.layers) == 5 else f"{len(kv.layers)} KV layers bound, kernels need 5"

    def pending(self, kv):
        return None

    def unbound(self, retire=None):
        return None


class _Memory:
    """server.kv_binding.MemoryBindings' binding, as BindKV and UnbindKV change it."""

    def __init__(self, kv=None) -> None:
        self.kv = kv

    def unbind(self, binding_id, retire=lambda close: close()):
        kv, self.kv = self.kv, None
        retire(kv.close)


def _kv(binding_id, dp_size=1):
    import torch

    from dspark_sidecar.server.refusal import EngineFacts

    kv = None

    def close():
        kv.layers = []  # as KVBinding.close

    from types import SimpleNamespace

    kv = SimpleNamespace(binding_id=binding_id, generation=1, layers=[torch.zeros(1, dtype=torch.bfloat16)] * 5,
                         num_pages=4, page_size=16, engine=EngineFacts(4, dp_size, 1, "dspark", 7), close=close)
    return kv


def _strict_rank(host, kv=None, fast=None):
    """(servicer, its publisher, ctx, health servicer) of a strict rank, health published as app.py does."""
    import contextlib
    from types import SimpleNamespace

    import torch
    from grpc_health.v1 import health

    from dspark_sidecar.drafter.config import load_config
    from dspark_sidecar.server.health import HealthPublisher
    from dspark_sidecar.server.metrics import Metrics
    from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle

    ctx = SimpleNamespace(rank=0, fast=fast or _Fast(), cfg=load_config("tiny"), memory=_Memory(kv),
                          model=SimpleNamespace(dtype=torch.bfloat16), metrics=Metrics(0), refusal=None)
    loop = SimpleNamespace(exclusive=lambda wait=True, give_up=None: contextlib.nullcontext(), after_device=lambda fn: fn(),
                           graphs=None)
    life = Lifecycle(backend="flydsl", host=host, strict=True)
    svc = DrafterServicer(ctx, loop, life, pb.Limits(), pb.Parallel(), "mxfp8")
    hs = health.HealthServicer()
    publish = HealthPublisher(life, svc, ctx, hs, ctx.metrics)
    life.on_change.append(publish)
    return svc, publish, ctx, hs


def _health(hs):
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckResponse.ServingStatus.Name(
        hs.Check(health_pb2.HealthCheckRequest(service=""), None).status)


def test_a_strict_rank_on_the_fast_path_s_own_host_serves_before_any_bind():
    """On a gfx950 host with FlyDSL at TP 4 the seed's checks end, before any BindKV, on "no engine bound
    yet": the engine's checks wait for its facts. --strict-refusal took that for a refusal, so a strict rank
    on the very host the fast path is for came up REFUSED (NOT_SERVING): the engine reads REFUSED as
    refused for good (client/reasons.py sidecar_refusal) and never binds, and a native sidecar's startup
    probe never passes. Now it is SERVING until a binding is refused; a host that fails its own checks is
    still REFUSED from the start."""
    from dspark_sidecar.client.reasons import sidecar_refusal
    from dspark_sidecar.server.refusal import HostFacts

    svc, publish, ctx, hs = _strict_rank(HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4))
    publish("SERVING")
    st = svc.GetStatus(pb.GetStatusRequest(), None)
    assert (st.state, st.serving, _health(hs), ctx.refusal) == ("SERVING", True, "SERVING", None)
    assert st.fast_path_refusal.startswith("no engine bound yet")  # GetStatus still says what it waits for
    assert sidecar_refusal(st) is None
    svc2, publish2, ctx2, hs2 = _strict_rank(HostFacts(on_gfx950=True, flydsl_available=False, tp_size=4))
    publish2("SERVING")
    st2 = svc2.GetStatus(pb.GetStatusRequest(), None)
    assert (st2.state, _health(hs2), ctx2.refusal) == ("REFUSED", "NOT_SERVING", "FlyDSL not installed")
    assert sidecar_refusal(st2) == "sidecar refuses: FlyDSL not installed"


def test_an_unbind_publishes_health_again_so_a_binding_s_strict_refusal_does_not_outlive_it():
    """UnbindKV released the binding but, unlike BindKV, did not publish health: a strict rank refused for
    that binding (here the engine's DP > 1) stayed REFUSED with nothing bound, its steps refused, and the
    next engine to connect (configured right) read REFUSED as refused for good and never bound."""
    from types import SimpleNamespace

    from dspark_sidecar.client.reasons import sidecar_refusal
    from dspark_sidecar.server.refusal import HostFacts

    svc, publish, ctx, hs = _strict_rank(HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4),
                                         kv=_kv(7, dp_size=2))
    publish("SERVING")
    assert (svc.life.state, _health(hs), ctx.refusal) == ("REFUSED", "NOT_SERVING", "DP > 1")
    svc.UnbindKV(pb.UnbindKVRequest(binding_id=7), SimpleNamespace(peer=lambda: "unix:/run/dspark/rank0.sock"))
    st = svc.GetStatus(pb.GetStatusRequest(), None)
    assert (st.state, st.serving, _health(hs), ctx.refusal) == ("SERVING", True, "SERVING", None)
    assert not st.kv.bound and sidecar_refusal(st) is None


def test_a_publish_that_races_a_rebind_judges_the_binding_in_place_not_the_closed_one():
    """A publish on another thread (a compile that failed, a silent peer's beat) read the binding, and a
    BindKV then replaced and closed it (layers = []) before its fast-path verdict: the verdict was "0 KV
    layers bound", and a strict rank refused steps and went NOT_SERVING (UnbindKV alike, where nothing
    published again). Now a binding replaced while it was judged is judged again: the current one's."""
    from dspark_sidecar.server.refusal import HostFacts

    old, new = _kv(7), _kv(8)
    raced = []

    def rebind(kv):  # BindKV on another thread, between the read of the binding and its verdict
        if kv is old and not raced:
            raced.append(kv)
            ctx.memory.kv = new
            old.close()

    svc, publish, ctx, hs = _strict_rank(HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4), kv=old,
                                         fast=_Fast(on_refusal=rebind))
    publish("SERVING")
    assert raced == [old] and old.layers == []
    assert (svc.life.state, _health(hs), ctx.refusal) == ("SERVING", "SERVING", None)


def test_get_status_does_not_read_serving_while_a_strict_publish_asks_for_the_refusal():
    """publish("SERVING") set the state first and asked for the refusal after: a GetStatus on a gRPC thread
    in between read state SERVING, serving true, on a strict rank that was then REFUSED (an engine took it
    as ready and bound). The state is now set once, as worked out."""
    from types import SimpleNamespace

    from dspark_sidecar.server.health import HealthPublisher
    from dspark_sidecar.server.servicer import Lifecycle

    life = Lifecycle(state="LOADING", strict=True)
    seen = []

    def refusal():
        seen.append((life.state, life.serving))  # what a GetStatus would read at this moment
        return "not gfx950"

    from grpc_health.v1 import health

    publish = HealthPublisher(life, SimpleNamespace(refusal=refusal), SimpleNamespace(refusal=None),
                              health.HealthServicer(), SimpleNamespace(set_serving=lambda serving: None))
    publish("SERVING")
    assert seen == [("LOADING", False)]
    assert life.state == "REFUSED" and not life.serving


@pytest.mark.parametrize("off", ["fast path failed at start-up", "no fast path built"])
def test_a_strict_rank_whose_fast_path_is_off_for_good_is_refused_before_any_bind(off):
    """The seed's host checks passed, so before any BindKV they end on "no engine bound yet" - and that
    hid every host-side reason found after them: the FlyDSL path failed to start (peers or weights:
    FlyDSLFastPath.startup_reason) or was never built (BackendChoice.flydsl_refusal: a model the kernels
    are not for, a CPU rank, a portable --backend). A strict rank came up SERVING with GetStatus saying
    it waited for a binding, passed the startup probe, and refused the engine's binding once it came."""
    from dspark_sidecar.client.reasons import sidecar_refusal
    from dspark_sidecar.server.refusal import HostFacts

    why = "TP exchange needs 4 ranks, the group has 1" if off.startswith("fast") else "--backend triton selected"

    class Failed(_Fast):
        def refusal(self, kv):
            return why  # FlyDSLFastPath.refusal: the start-up reason, for any binding or none

    svc, publish, ctx, hs = _strict_rank(HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4),
                                         fast=Failed() if off.startswith("fast") else None)
    if not off.startswith("fast"):
        ctx.fast, svc.life.flydsl_off = None, why
    publish("SERVING")
    st = svc.GetStatus(pb.GetStatusRequest(), None)
    assert (st.state, st.serving, _health(hs), ctx.refusal) == ("REFUSED", False, "NOT_SERVING", why)
    assert st.fast_path_refusal == why
    assert sidecar_refusal(st) == f"sidecar refuses: {why}"


@pytest.mark.parametrize("after", ["rebound", "unbound"])
def test_a_bind_answers_the_verdict_on_the_binding_it_made_not_on_the_one_in_place_after_it(after):
    """BindKV judged the fast path after its section, on whatever binding was the rank's then: a BindKV of
    another engine (or a lease's release, an UnbindKV) landing right after this call's section made its answer
    carry binding 8's id with binding 9's "DP > 1" (or "no engine bound yet") and the fallback backend, and the
    engine logged its FlyDSL path as off for a binding that passed every check."""
    import contextlib
    from types import SimpleNamespace

    from dspark_sidecar.server.refusal import HostFacts

    mine, other = _kv(8), _kv(9, dp_size=2)
    svc, publish, ctx, hs = _strict_rank(HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4))
    svc.life.fallback = "triton"

    @contextlib.contextmanager
    def exclusive(wait=True, give_up=None):
        yield
        ctx.memory.kv = other if after == "rebound" else None  # the next section's change, on another thread

    def bind(request, retire=None):
        ctx.memory.kv = mine
        return mine

    svc.loop.exclusive, ctx.memory.bind = exclusive, bind
    peer = SimpleNamespace(peer=lambda: "unix:/run/dspark/rank0.sock", is_active=lambda: True,
                           time_remaining=lambda: None)
    resp = svc.BindKV(pb.BindKVRequest(), peer)
    assert (resp.binding_id, resp.generation, resp.fast_path_refusal, resp.backend) == (8, 1, "", "flydsl"), resp


def test_a_bind_publishes_health_so_a_strict_rank_refuses_the_binding_it_cannot_serve():
    """BindKV publishes health with the new binding's verdict: a strict rank bound by an engine at DP 2 is REFUSED
    (NOT_SERVING) at once, not SERVING until some other change publishes."""
    from types import SimpleNamespace

    from dspark_sidecar.server.refusal import HostFacts

    svc, publish, ctx, hs = _strict_rank(HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4))
    publish("SERVING")
    refused = _kv(8, dp_size=2)

    def bind(request, retire=None):
        ctx.memory.kv = refused
        return refused

    ctx.memory.bind = bind
    resp = svc.BindKV(pb.BindKVRequest(), SimpleNamespace(peer=lambda: "unix:/run/dspark/rank0.sock"))
    assert (resp.binding_id, resp.fast_path_refusal) == (8, "DP > 1")
    assert (svc.life.state, _health(hs), ctx.refusal) == ("REFUSED", "NOT_SERVING", "DP > 1")


def test_a_bind_the_fast_path_refuses_answers_the_fallback_backend_that_serves_its_steps():
    """Under --backend flydsl the steps of a binding the FlyDSL path refuses run on its fallback: BindKVResponse.backend
    names that one (the engine logs and reports it), and "flydsl" only for a binding the fast path serves."""
    from types import SimpleNamespace

    from dspark_sidecar.server.refusal import HostFacts

    svc, publish, ctx, hs = _strict_rank(HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4))
    svc.life.fallback = "triton"
    peer = SimpleNamespace(peer=lambda: "unix:/run/dspark/rank0.sock")
    for kv, why, backend in ((_kv(8, dp_size=2), "DP > 1", "triton"), (_kv(9), "", "flydsl")):
        def bind(request, retire=None, kv=kv):
            ctx.memory.kv = kv
            return kv

        ctx.memory.bind = bind
        resp = svc.BindKV(pb.BindKVRequest(), peer)
        assert (resp.binding_id, resp.fast_path_refusal, resp.backend) == (kv.binding_id, why, backend), resp


def test_an_unbind_of_another_binding_is_refused_before_the_rank_s_section():
    """UnbindKV of an id that is not the binding in place (a second UnbindKV, an engine's late release of a binding
    a re-bind replaced) is UNKNOWN_BINDING before the rank's section, whose quiesce would release the live
    engine's pre-launched step (at TP > 1 on this rank alone), and the binding in place stands."""
    import contextlib
    from types import SimpleNamespace

    from dspark_sidecar.server.errors import SidecarError
    from dspark_sidecar.server.refusal import HostFacts

    svc, publish, ctx, hs = _strict_rank(HostFacts(on_gfx950=True, flydsl_available=True, tp_size=4), kv=_kv(7))
    entered = []

    @contextlib.contextmanager
    def exclusive(wait=True, give_up=None):
        entered.append(wait)
        yield

    svc.loop.exclusive = exclusive
    peer = SimpleNamespace(peer=lambda: "unix:/run/dspark/rank0.sock", is_active=lambda: True,
                           time_remaining=lambda: None)
    with pytest.raises(SidecarError) as err:
        svc.UnbindKV(pb.UnbindKVRequest(binding_id=8), peer)
    assert (err.value.code, err.value.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "UNKNOWN_BINDING")
    assert entered == [] and ctx.memory.kv.binding_id == 7 and len(ctx.memory.kv.layers) == 5
