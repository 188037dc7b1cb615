"""server/teardown.py: a drained rank's end, in order; one whose step is stuck ends the streams and exits 1."""

from __future__ import annotations

import contextlib
import logging
import threading
from types import SimpleNamespace

import pytest

from dspark_sidecar.server import teardown
from dspark_sidecar.server.rank import STOP_STEPS_S
from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle
from helpers.waiting import wait_until


class Exited(Exception):
    """os._exit, made catchable: the test process must outlive the rank's teardown."""


class _Watchdog:
    """threading.Timer's stand-in: records its limit and whether it was started as a daemon."""

    made: list["_Watchdog"] = []

    def __init__(self, interval, function) -> None:
        self.interval, self.function, self.daemon, self.started = interval, function, False, False
        _Watchdog.made.append(self)

    def start(self) -> None:
        self.started = True

    def cancel(self) -> None:
        pass


@pytest.fixture
def rig(monkeypatch):
    """Fakes of everything teardown touches, each recording its call in `calls`, in order."""
    calls: list[str] = []

    def rec(name, result=None):
        return lambda *a, **kw: (calls.append(name), result)[1]

    def fake_exit(code):
        calls.append(f"exit {code}")
        raise Exited(code)

    monkeypatch.setattr(teardown.os, "_exit", fake_exit)
    monkeypatch.setattr(teardown, "dist", SimpleNamespace(get_backend=lambda: "gloo",
                                                     destroy_process_group=rec("destroy group")))
    # The watchdog: a daemon timer whose os._exit(0) would end the whole test session once its limit had passed
    # (teardown leaves it running, to bound the interpreter's own exit too). Recorded, never started.
    monkeypatch.setattr(teardown.threading, "Timer", _Watchdog)
    stopped = SimpleNamespace(wait=rec("streams ended"))
    r = SimpleNamespace(
        calls=calls, steps_stop=True,
        servicer=SimpleNamespace(close_doorbell=rec("doorbell", True),
                                 close_leases=lambda wait_s=None: calls.append(f"leases (wait {wait_s})")),
        server=SimpleNamespace(stop=lambda grace: (calls.append("server stop"), stopped)[1]),
        graphs=SimpleNamespace(close=rec("graphs")),
        fast=SimpleNamespace(close=rec("fast path")),
        rendezvous=SimpleNamespace(close=rec("rendezvous", True)),
        board=SimpleNamespace(close=rec("board"), unlink=rec("board unlink")),
    )
    r.loop = SimpleNamespace(stop_steps=lambda: (calls.append("steps"), r.steps_stop)[1], close=rec("loop"),
                             drain=rec("drain"))
    r.run = lambda: teardown.teardown(0, r.servicer, r.loop, r.server, r.graphs, r.fast, r.rendezvous, r.board)
    return r


def test_a_clean_teardown_ends_the_streams_only_once_no_step_runs_then_frees_the_device(rig, caplog):
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.server"):
        rig.run()
    assert rig.calls == ["doorbell", "steps", "server stop", "streams ended", "leases (wait None)", "loop", "graphs", "drain", "fast path",
                         "rendezvous", "board", "destroy group"]
    assert "rank 0: stopped" in caplog.text
    dog = _Watchdog.made[-1]
    # Started first, bounding the whole teardown and the exit after it: past its limit the process just ends.
    assert dog.started and dog.daemon and dog.interval == teardown.TEARDOWN_LIMIT_S + STOP_STEPS_S + teardown.SERVER_GRACE_S


def test_a_step_stuck_at_shutdown_ends_the_streams_then_the_process_with_status_1(rig, caplog):
    """Before, the teardown went on to graphs.close() and the fast path's close, which synchronize the device
    the stuck step holds, and the group's destroy: the watchdog ended the rank 30 s later with status 0."""
    rig.steps_stop = False
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.server"), pytest.raises(Exited):
        rig.run()
    # The leases closed without waiting: a lease's release may wait for the loop the stuck step holds.
    assert rig.calls == ["doorbell", "steps", "server stop", "streams ended", "leases (wait 0.0)",
                         f"exit {teardown.STUCK_EXIT}"]
    assert teardown.STUCK_EXIT != 0
    assert "a step still runs" in caplog.text and "status 1" in caplog.text
    assert "rank 0: stopped" not in caplog.text


@pytest.mark.parametrize("status", [0, 1])
def test_a_teardown_past_its_limit_ends_the_process_with_the_rank_s_status(rig, status):
    """A rank that failed (its serving loop, or torchrun's agent gone) exits 1; a teardown that then hung (a
    wedged NCCL destroy) was ended by the watchdog with status 0, a clean stop to its supervisor."""
    teardown.teardown(0, rig.servicer, rig.loop, rig.server, rig.graphs, rig.fast, rig.rendezvous, rig.board, status=status)
    with pytest.raises(Exited):
        _Watchdog.made[-1].function()
    assert rig.calls[-1] == f"exit {status}"


def test_a_teardown_that_raises_leaves_the_watchdog_exiting_1_not_the_clean_stop_s_0(rig):
    """An exception inside the teardown (graphs.close on a device that failed) went up through serve_rank, and the
    interpreter's exit could then wait for good on the gRPC server it never stopped: the watchdog ended that with
    the drained rank's status, 0, a clean stop to its supervisor, where the rank had failed."""
    def broken():
        rig.calls.append("graphs")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    rig.graphs.close = broken
    with pytest.raises(RuntimeError, match="illegal memory access"):
        rig.run()
    with pytest.raises(Exited):
        _Watchdog.made[-1].function()
    assert rig.calls[-1] == "exit 1"


class _StuckLoop:
    """The rank loop with a step stuck in it (a collective with a wedged peer): the rank's lock is held until
    `step_ends` is set, so an exclusive section waits behind it, and stop_steps gives up."""

    def __init__(self, calls: list[str]) -> None:
        self.calls, self.step_ends, self.graphs = calls, threading.Event(), None

    @contextlib.contextmanager
    def exclusive(self, wait=True, quiesce=True, give_up=None):
        self.step_ends.wait()
        yield

    def stop_steps(self):
        self.calls.append("steps")
        return self.step_ends.is_set()

    def close(self):
        self.calls.append("loop")

    def drain(self):
        self.calls.append("drain")


def test_a_stuck_step_at_shutdown_exits_1_though_a_lease_s_release_holds_the_attach_lock_behind_it(rig, caplog,
                                                                                                    monkeypatch):
    """An engine that ends (Kubernetes stops it before the sidecar) while a step is stuck: its lease's release takes
    the attach lock, then waits for the rank's lock behind the step, with no bound. The teardown's first stage,
    close_doorbell, waited for the attach lock for as long: the rank never reached the stuck step's exit 1, and the
    watchdog ended it 30 s into the teardown with status 0, a clean stop to its supervisor."""
    monkeypatch.setattr(teardown, "DOORBELL_LOCK_S", 0.2)  # stands for its 5 s
    loop = _StuckLoop(rig.calls)
    svc = DrafterServicer(SimpleNamespace(rank=0, fast=None,  # type: ignore[arg-type]
                                          # (retire_if_idle: False, the lease holds regions)
                                          memory=SimpleNamespace(unregister=lambda *a: [], region_count=0,
                                                                 retire_if_idle=lambda *a: False)),
                          loop, Lifecycle(), None, None, "")
    releasing = threading.Thread(target=svc._release_regions, args=([],), kwargs={"lease": 7}, daemon=True)
    releasing.start()  # the gone engine's lease: its regions released under the attach lock, behind the step
    wait_until(svc._attach_lock.locked, 10, "the lease's release takes the attach lock", interval_s=0.005)
    ended: list[object] = []

    def run() -> None:
        try:
            teardown.teardown(0, svc, loop, rig.server, rig.graphs, rig.fast, rig.rendezvous, rig.board)
        except Exited as err:
            ended.append(err.args[0])

    t = threading.Thread(target=run, daemon=True)
    try:
        with caplog.at_level(logging.INFO, logger="dspark_sidecar.server"):
            t.start()
            t.join(10)
            assert not t.is_alive(), f"the teardown waited for the attach lock behind the stuck step: {rig.calls}"
        assert ended == [teardown.STUCK_EXIT], (ended, rig.calls)
        assert rig.calls == ["steps", "server stop", "streams ended", f"exit {teardown.STUCK_EXIT}"], rig.calls
        assert "a step still runs" in caplog.text
    finally:
        loop.step_ends.set()  # the step ends: the release, then a teardown still waiting, go on
        releasing.join(10)
        t.join(10)


def test_a_teardown_that_could_not_take_the_attach_lock_stops_the_doorbells_once_the_steps_have_ended(rig,
                                                                                                     monkeypatch):
    """The attach lock held past the bound by a wait that the step's end lets go: the doorbells are stopped, under
    the lock, once stop_steps finds no step running, and still before the streams end."""
    monkeypatch.setattr(teardown, "DOORBELL_LOCK_S", 0.2)
    lock = threading.Lock()
    lock.acquire()  # held by a release waiting behind the step
    closes: list[float | None] = []

    def close_doorbell(wait_s=None):
        closes.append(wait_s)
        if not lock.acquire(timeout=10 if wait_s is None else wait_s):  # (10 s: a hang guard only)
            return False
        lock.release()
        rig.calls.append("doorbell")
        return True

    def stop_steps():
        rig.calls.append("steps")
        lock.release()  # the step ends: the release that held the attach lock finishes
        return True

    rig.servicer.close_doorbell = close_doorbell
    rig.loop.stop_steps = stop_steps
    rig.run()
    assert closes == [teardown.DOORBELL_LOCK_S, None]
    assert rig.calls[:4] == ["steps", "doorbell", "server stop", "streams ended"], rig.calls
    assert rig.calls[-1] == "destroy group"


def test_a_board_a_step_still_reads_is_unlinked_not_unmapped(rig):
    """Rendezvous.close says a step still waits for its verdict (a --rendezvous-ms past the teardown's bound):
    unmapped under that thread, the board was a segfault at a clean stop; its name goes, its mapping with the exit."""
    rig.rendezvous.close = lambda: (rig.calls.append("rendezvous"), False)[1]
    rig.run()
    assert rig.calls[-3:] == ["rendezvous", "board unlink", "destroy group"], rig.calls


def test_close_doorbell_says_whether_it_took_the_attach_lock_within_its_bound():
    """The teardown's second close_doorbell (above) runs only where the first said it could not take the lock."""
    svc = DrafterServicer(SimpleNamespace(rank=0, fast=None), None, Lifecycle(), None, None, "")  # type: ignore[arg-type]
    svc._attach_lock.acquire()  # a release waiting behind a stuck step
    try:
        assert svc.close_doorbell(0.05) is False
        assert not svc._doorbells_closed  # nothing done without the lock
    finally:
        svc._attach_lock.release()
    assert svc.close_doorbell(0.05) is True and svc._doorbells_closed
    assert not svc._attach_lock.locked()


def test_in_flight_calls_get_the_server_s_grace_and_a_stuck_rank_flushes_its_log_before_it_ends(rig, monkeypatch):
    """The gRPC server's stop gives calls in flight (a GetStatus, a step's answer on its way) SERVER_GRACE_S to
    finish, not none; and the stuck step's exit, os._exit, skips logging's own flush at exit: the handlers are
    flushed first, or a buffered handler lost the line saying why the rank exits 1."""
    graces: list[float] = []
    stopped = rig.server.stop(0)  # (the rig's: records "server stop")
    rig.calls.clear()
    rig.server.stop = lambda grace: (graces.append(grace), rig.calls.append("server stop"), stopped)[2]
    monkeypatch.setattr(teardown.logging, "shutdown", lambda: rig.calls.append("log flushed"))
    rig.steps_stop = False
    with pytest.raises(Exited):
        rig.run()
    assert graces == [teardown.SERVER_GRACE_S] and teardown.SERVER_GRACE_S > 0
    assert rig.calls[-2:] == ["log flushed", f"exit {teardown.STUCK_EXIT}"], rig.calls


def test_the_watchdog_s_line_names_the_stage_the_teardown_is_stuck_in(rig, caplog):
    """Past its limit the watchdog ends the process with one line naming what the teardown was doing: here a wait
    for the steps in flight that outlived it, not the doorbell's stop before it."""
    def limit_passes():
        rig.calls.append("steps")
        _Watchdog.made[-1].function()  # the limit passes while the steps are waited for

    rig.loop.stop_steps = limit_passes
    with caplog.at_level(logging.WARNING, logger="dspark_sidecar.server"), pytest.raises(Exited):
        rig.run()
    assert rig.calls == ["doorbell", "steps", "exit 0"], rig.calls
    assert "rank 0: teardown exceeded 30 s in the steps in flight; exiting" in caplog.text, caplog.text


def test_the_watchdog_s_line_names_the_leases_close_not_the_server_s_stop(rig, caplog):
    """close_leases waits for a lease's release already running (LeaseKeeper.close, no bound outside a stuck step),
    which may wait on the device: past the limit there, the line blamed the gRPC server's stop, which had ended."""
    def limit_passes(wait_s=None):
        rig.calls.append("leases")
        _Watchdog.made[-1].function()  # the limit passes while a release is waited for

    rig.servicer.close_leases = limit_passes
    with caplog.at_level(logging.WARNING, logger="dspark_sidecar.server"), pytest.raises(Exited):
        rig.run()
    assert rig.calls[-2:] == ["leases", "exit 0"], rig.calls
    assert "teardown exceeded 30 s in the engines' leases; exiting" in caplog.text, caplog.text


def test_the_watchdog_past_a_finished_teardown_does_not_blame_its_last_stage(rig, caplog):
    """The watchdog stays running past the teardown, to bound the interpreter's exit too (a thread that holds it):
    firing then, its line named the process group's destroy, which had ended ("rank 0: stopped" logged above it)."""
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.server"):
        rig.run()
        with pytest.raises(Exited):
            _Watchdog.made[-1].function()
    line = [r.getMessage() for r in caplog.records if "teardown exceeded" in r.getMessage()]
    assert line == ["rank 0: teardown exceeded 30 s in the process's exit, after the teardown; exiting"], line
