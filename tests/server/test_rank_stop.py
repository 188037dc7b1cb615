"""RankLoop.stop_steps: at shutdown no step is left running, and every later one is refused at once."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.errors import SidecarError
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop
from helpers.rank_fakes import RefusingRendezvous
from helpers.waiting import wait_until


@pytest.fixture
def held():
    """A CPU rank loop whose step 1 runs until the test lets it finish; other steps take the real path."""
    ctx = RankContext(0, 2, SimpleNamespace(), SimpleNamespace(device=torch.device("cpu")), None, None, Metrics(0), 8)
    rdv = RefusingRendezvous()
    loop = RankLoop(ctx, rdv, None)  # type: ignore[arg-type]
    started, release, finished = threading.Event(), threading.Event(), threading.Event()
    real_run = loop._run

    def run(req, *args, **kwargs):
        if req.step_id == 1:
            started.set()
            try:
                # Held past every hang guard of these tests: a stop that waits for it shows as still waiting.
                assert release.wait(120)
            finally:
                finished.set()
            return pb.DraftStepResponse(step_id=1)
        return real_run(req, *args, **kwargs)

    loop._run = run  # type: ignore[method-assign]
    yield SimpleNamespace(loop=loop, rdv=rdv, started=started, release=release, finished=finished)
    release.set()
    loop.close()


def _refused(fut) -> SidecarError:
    err = fut.exception(timeout=5)
    assert isinstance(err, SidecarError), err
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.reason == "SHUTTING_DOWN"
    return err


def test_the_shutdown_waits_for_the_running_step_and_refuses_the_rest(held):
    running = held.loop.submit(pb.DraftStepRequest(step_id=1))
    assert held.started.wait(5)
    queued = held.loop.submit(pb.DraftStepRequest(step_id=2))  # accepted, not yet started
    result: list[bool] = []
    stopper = threading.Thread(target=lambda: result.append(held.loop.stop_steps(timeout_s=10)))
    stopper.start()
    wait_until(lambda: held.loop._stopping, 5, "stop_steps began", interval_s=0.005)
    late = held.loop.submit(pb.DraftStepRequest(step_id=3))
    # Refused at once, though a step still runs: nothing queued behind the worker's end is left unanswered.
    assert "shutting down" in _refused(late).message
    time.sleep(0.2)
    assert stopper.is_alive() and not running.done(), "stop_steps returned while a step was running"
    held.release.set()
    stopper.join(5)
    assert result == [True]
    assert running.result(timeout=1).step_id == 1
    _refused(queued)
    # The queued step's copy was posted as refused, so the peers abort at once instead of at the deadline.
    assert [(p.step_id, p.valid) for p in held.rdv.posts] == [(2, False)]


def test_a_doorbell_step_after_the_shutdown_is_answered_refused(held):
    assert held.loop.stop_steps(timeout_s=5)
    resp = held.loop.answer_now(pb.DraftStepRequest(step_id=4))
    assert resp.step_id == 4 and resp.error.reason == "SHUTTING_DOWN"
    assert resp.error.code == grpc.StatusCode.UNAVAILABLE.value[0]


def test_a_step_that_outlives_the_bound_is_reported(held):
    held.loop.submit(pb.DraftStepRequest(step_id=1))
    assert held.started.wait(5)
    result: list[bool] = []
    stopper = threading.Thread(target=lambda: result.append(held.loop.stop_steps(timeout_s=0.3)), daemon=True)
    stopper.start()
    stopper.join(30)  # a hang guard only: the step is held for the fixture's 120 s
    # It gave up on the step at its bound, not waited it out: the step is still held.
    assert result == [False] and not held.finished.is_set(), (result, "stop_steps waited for the running step")


def test_close_with_a_step_that_outlives_the_bound_returns_without_it(held, monkeypatch):
    """close() warns that it closes without a step still running (a peer gone); it must then not wait for
    that step's lock for ever in its drain (the shutdown's watchdog ended the process instead)."""
    from dspark_sidecar.server import rank as rank_mod

    monkeypatch.setattr(rank_mod, "DRAIN_S", 0.3)
    real_stop = held.loop.stop_steps
    monkeypatch.setattr(held.loop, "stop_steps", lambda timeout_s=0.3: real_stop(timeout_s))
    held.loop.submit(pb.DraftStepRequest(step_id=1))
    assert held.started.wait(5)
    closer = threading.Thread(target=held.loop.close, daemon=True)
    closer.start()
    closer.join(30)  # a hang guard only: the step is held for the fixture's 120 s
    stuck = closer.is_alive()
    held.release.set()
    closer.join(5)
    assert not stuck, "close() waited for the step it said it closes without"


@pytest.mark.parametrize("path", ["grpc", "doorbell"])
def test_the_teardown_waits_one_bound_for_a_stuck_step_not_one_per_stop(held, monkeypatch, path):
    """app.py's teardown calls stop_steps, then close(), which stops the steps again: with a step stuck
    (a peer gone) the second call waited out a second STOP_STEPS_S, and the teardown's watchdog fired."""
    from dspark_sidecar.server import rank as rank_mod

    monkeypatch.setattr(rank_mod, "DRAIN_S", 0.2)
    bound = 2.0
    # close()'s own call to stop_steps asks for an hour (STOP_STEPS_S is its default): if it waited its own
    # bound again, close() would still wait at the hang guard below, with the step still held.
    real_stop = held.loop.stop_steps
    monkeypatch.setattr(held.loop, "stop_steps", lambda timeout_s=3600.0: real_stop(timeout_s))
    if path == "grpc":  # on the worker
        held.loop.submit(pb.DraftStepRequest(step_id=1))
    else:  # on the doorbell's thread, holding the rank's lock
        threading.Thread(target=held.loop.answer_now, args=(pb.DraftStepRequest(step_id=1),), daemon=True).start()
    assert held.started.wait(5)
    t0 = time.monotonic()
    assert held.loop.stop_steps(timeout_s=bound) is False  # app.py's call
    t1 = time.monotonic()
    closer = threading.Thread(target=held.loop.close, daemon=True)  # then app.py's loop.close()
    closer.start()
    closer.join(30)  # a hang guard only: well short of the held step's 120 s (the fixture's)
    stuck = closer.is_alive()
    step_ended = held.finished.is_set()
    held.release.set()
    closer.join(5)
    assert not stuck, "close() waited a second bound for the step the shutdown already gave up on"
    assert not step_ended  # close() returned while the step still ran: it did not wait for it
    assert t1 - t0 >= bound * 0.9  # the first call did wait its bound


def test_close_alone_stops_the_steps(held):
    """close() without the teardown's stop_steps first (it calls it itself): no worker is left to take a step."""
    held.loop.close()
    assert not held.loop._worker.is_alive(), "close() left the worker taking steps"
    _refused(held.loop.submit(pb.DraftStepRequest(step_id=2)))


def test_a_drain_whose_bound_has_passed_returns_at_once(held):
    """close() passes drain the time left to its deadline, which may have passed by the call (its sleep):
    a negative bound means no wait, not a ValueError out of the teardown."""
    assert held.loop.drain(-0.5) is True  # the lock is free: the sweep ran
    held.loop.submit(pb.DraftStepRequest(step_id=1))
    assert held.started.wait(5)
    t0 = time.monotonic()
    assert held.loop.drain(-0.5) is False  # a step holds the lock
    assert time.monotonic() - t0 < 1
