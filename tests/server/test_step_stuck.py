"""A draft step stuck past STEP_STUCK_S takes the rank out of SERVING (state STEP_STUCK, with why) until it ends."""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
from grpc_health.v1 import health, health_pb2

from dspark_sidecar.client.reasons import sidecar_refusal
from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server import health as rank_health
from dspark_sidecar.server.health import HealthPublisher, watch_steps
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop
from dspark_sidecar.server.servicer import Lifecycle
from helpers.rank_fakes import hold_steps
from helpers.waiting import wait_until

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def rank(monkeypatch):
    """A SERVING CPU rank's loop, lifecycle and health, whose step 7 runs until the test lets it end."""
    # 1 s: the first beat, just after the step started, must see it not yet stuck, on a loaded 2-core CI box too.
    monkeypatch.setattr(rank_health, "STEP_STUCK_S", 1.0)
    ctx = RankContext(0, 1, SimpleNamespace(), SimpleNamespace(device=torch.device("cpu")), None, None, Metrics(0), 8)
    loop = RankLoop(ctx, SimpleNamespace(deadline_ms=200), None)  # type: ignore[arg-type]  (--rendezvous-ms's default)
    started, release = hold_steps(loop)
    life = Lifecycle(state="SERVING")
    hs = health.HealthServicer()
    publish = HealthPublisher(life, SimpleNamespace(refusal=lambda: ""), SimpleNamespace(refusal=None), hs,
                              SimpleNamespace(set_serving=lambda serving: None))
    publish("SERVING")
    r = SimpleNamespace(loop=loop, life=life, publish=publish, started=started, release=release,
                        health=lambda: hs.Check(health_pb2.HealthCheckRequest(service=""), None).status,
                        watch=lambda: watch_steps(loop, 0, life, publish))
    yield r
    release.set()
    loop.close()


def _stuck(r) -> None:
    """Beat (as the rank's main thread does) until the running step counts as stuck."""
    deadline = time.monotonic() + 10
    while r.life.state != "STEP_STUCK":
        assert time.monotonic() < deadline, r.life.snapshot()
        r.watch()
        time.sleep(0.05)


def test_a_step_running_past_the_bound_is_not_serving_with_why_until_it_ends(rank, caplog):
    caplog.set_level(logging.INFO, "dspark_sidecar.server")
    fut = rank.loop.submit(pb.DraftStepRequest(step_id=7))
    assert rank.started.wait(5)
    rank.watch()  # just started: a step's own milliseconds are not stuck
    assert rank.life.snapshot() == ("SERVING", "") and rank.health() == SERVING
    _stuck(rank)
    state, reason = rank.life.snapshot()
    assert "draft step 7 has run for" in reason and "stuck on the device or in a collective" in reason, reason
    assert rank.health() == NOT_SERVING and not rank.life.serving
    assert any("draft step 7 has run for" in m for m in caplog.messages)  # the operator's log says so once
    rank.release.set()
    assert fut.result(5).step_id == 7
    rank.watch()
    assert rank.life.snapshot() == ("SERVING", "") and rank.health() == SERVING
    assert any("stuck draft step 7 has ended" in m for m in caplog.messages)


def test_the_reason_s_seconds_grow_while_the_step_stays_stuck(rank):
    rank.loop.submit(pb.DraftStepRequest(step_id=7))
    _stuck(rank)
    first = float(rank.life.reason.split("has run for ")[1].split(" s")[0])
    time.sleep(0.5)
    rank.watch()
    # Each figure is rounded to 0.1 s: 0.5 s later reads at least 0.4 s more.
    assert float(rank.life.reason.split("has run for ")[1].split(" s")[0]) >= first + 0.35, rank.life.reason


def test_a_peer_out_is_said_before_a_stuck_step(rank):
    """A step stuck in a collective is most often stuck on a gone peer: PEER_SILENT names the cause."""
    rank.loop.submit(pb.DraftStepRequest(step_id=7))
    _stuck(rank)
    rank.life.exited_peers = {1: 4242}
    rank.publish()
    state, reason = rank.life.snapshot()
    assert state == "PEER_SILENT" and "peer rank(s) 1 exited" in reason, (state, reason)
    rank.life.exited_peers = {}
    rank.watch()
    assert rank.life.state == "STEP_STUCK"


def test_a_drain_is_not_undone_by_a_stuck_step(rank):
    rank.loop.submit(pb.DraftStepRequest(step_id=7))
    _stuck(rank)
    rank.publish("DRAINING")
    rank.watch()
    assert rank.life.state == "DRAINING" and rank.health() == NOT_SERVING


def test_the_engine_reads_a_stuck_step_as_passing_not_as_a_refusal_for_good():
    """On NVIDIA fast_path_refusal is never empty ("not gfx950"): STEP_STUCK must not read as strict mode,
    which turns the engine's sidecar path off for good."""
    status = pb.StatusReport(serving=False, state="STEP_STUCK", fast_path_refusal="not gfx950")
    assert sidecar_refusal(status) is None
    assert sidecar_refusal(pb.StatusReport(serving=False, state="REFUSED", fast_path_refusal="not gfx950"))


class _GateLock:
    """Lifecycle.lock that holds its taker at the door until the test opens it (a GetStatus holding it)."""

    def __init__(self) -> None:
        self._lock, self.waiting, self.open = threading.Lock(), threading.Event(), threading.Event()

    def __enter__(self):
        self.waiting.set()
        assert self.open.wait(10)
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


def test_a_stuck_step_that_ends_while_a_binding_publishes_does_not_fail_that_publish():
    """A BindKV's publish (a gRPC thread) reads the stuck step, then waits for the lifecycle's lock (held by a
    GetStatus); meanwhile the beat (the main thread, not under the publisher's lock) sees the step end and clears
    it. The publish must go on with what it read, not fail on the cleared value."""
    life = Lifecycle(state="STEP_STUCK", stuck_step=(7, 16.0))
    gate = life.lock = _GateLock()  # type: ignore[assignment]
    hs = health.HealthServicer()
    publish = HealthPublisher(life, SimpleNamespace(refusal=lambda: ""), SimpleNamespace(refusal=None), hs,
                              SimpleNamespace(set_serving=lambda serving: None))
    errors: list[BaseException] = []

    def bind_publish():
        try:
            publish()
        except BaseException as exc:  # noqa: BLE001  (the test reports it)
            errors.append(exc)

    t = threading.Thread(target=bind_publish)
    t.start()
    assert gate.waiting.wait(10)
    life.stuck_step = None  # watch_steps: the step has ended
    gate.open.set()
    t.join(10)
    assert not t.is_alive() and not errors, errors
    assert life.state == "STEP_STUCK" and "draft step 7 has run for 16.0 s" in life.reason, life.snapshot()


def test_a_step_waiting_out_a_long_rendezvous_deadline_is_not_stuck(rank):
    """--rendezvous-ms goes up to 60 s: a step may wait that long for a peer's copy (an engine rank whose stream broke
    after the pre-flight), and is then answered ABORTED. Waiting out the configured deadline is not stuck."""
    rank.loop.rendezvous.deadline_ms = 60_000
    rank.loop.submit(pb.DraftStepRequest(step_id=7))
    assert rank.started.wait(5)
    wait_until(lambda: rank.loop.stuck_step(rank_health.STEP_STUCK_S), 10, "the step has run past STEP_STUCK_S")
    rank.watch()
    assert rank.life.snapshot() == ("SERVING", "") and rank.health() == SERVING


class _Gone(Exception):
    """A waiting section's client is gone (the servicer's give_up raises a SidecarError)."""


def test_a_section_that_gives_up_behind_a_stuck_step_takes_nothing_and_leaves_nothing_to_the_collector(rank):
    """RankLoop.exclusive(give_up=...): the wait for the lock a stuck step holds ends when give_up raises, before
    the section's quiesce, sweep or body ran, with the lock still the step's. The error is freed by reference
    counting: a frame of the wait holding it (a cycle through its traceback) would leave it to the collector."""
    quiesced, entered, turns = [], [], []
    rank.loop.on_quiesce(quiesced.append)
    fut = rank.loop.submit(pb.DraftStepRequest(step_id=7))
    assert rank.started.wait(5)
    quiesced.clear()  # the step's own section

    def give_up() -> float:
        turns.append(1)
        if len(turns) == 3:
            raise _Gone()
        return 0.01

    gc.disable()
    try:
        try:
            with rank.loop.exclusive(wait=False, give_up=give_up):
                entered.append(1)
        except _Gone as exc:
            gone = weakref.ref(exc)
        assert gone() is None, "the given-up wait's error outlived its handler: a reference cycle"
    finally:
        gc.enable()
    assert len(turns) == 3 and not entered and not quiesced
    assert not fut.done()
    rank.release.set()
    assert fut.result(5).step_id == 7
    # The lock was never taken by the section that gave up: free now, the next one takes it without asking.
    with rank.loop.exclusive(wait=False, give_up=give_up):
        entered.append(1)
    assert entered == [1] and len(turns) == 3 and quiesced == [False]
