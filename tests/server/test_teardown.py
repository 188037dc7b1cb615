"""server/app.py teardown: a drained rank's end, in order; one whose step is stuck ends the streams and exits 1."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from dspark_sidecar.server import app


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

    monkeypatch.setattr(app.os, "_exit", fake_exit)
    monkeypatch.setattr(app, "dist", SimpleNamespace(get_backend=lambda: "gloo",
                                                     destroy_process_group=rec("destroy group")))
    # The watchdog: a daemon timer whose os._exit(0) would end the whole test session once its limit had passed
    # (teardown leaves it running, to bound the interpreter's own exit too). Recorded, never started.
    monkeypatch.setattr(app.threading, "Timer", _Watchdog)
    stopped = SimpleNamespace(wait=rec("streams ended"))
    r = SimpleNamespace(
        calls=calls, steps_stop=True,
        servicer=SimpleNamespace(close_doorbell=rec("doorbell"),
                                 close_leases=lambda wait_s=None: calls.append(f"leases (wait {wait_s})")),
        server=SimpleNamespace(stop=lambda grace: (calls.append("server stop"), stopped)[1]),
        graphs=SimpleNamespace(close=rec("graphs")),
        fast=SimpleNamespace(close=rec("fast path")),
        rendezvous=SimpleNamespace(close=rec("rendezvous", True)),
        board=SimpleNamespace(close=rec("board"), unlink=rec("board unlink")),
    )
    r.loop = SimpleNamespace(stop_steps=lambda: (calls.append("steps"), r.steps_stop)[1], close=rec("loop"),
                             drain=rec("drain"))
    r.run = lambda: app.teardown(0, r.servicer, r.loop, r.server, r.graphs, r.fast, r.rendezvous, r.board)
    return r


def test_a_clean_teardown_ends_the_streams_only_once_no_step_runs_then_frees_the_device(rig, caplog):
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.server"):
        rig.run()
    assert rig.calls == ["doorbell", "steps", "server stop", "streams ended", "leases (wait None)", "loop", "graphs", "drain", "fast path",
                         "rendezvous", "board", "destroy group"]
    assert "rank 0: stopped" in caplog.text
    dog = _Watchdog.made[-1]
    # Started first, bounding the whole teardown and the exit after it: past its limit the process just ends.
    assert dog.started and dog.daemon and dog.interval == app.TEARDOWN_LIMIT_S + app.STOP_STEPS_S + app.SERVER_GRACE_S


def test_a_step_stuck_at_shutdown_ends_the_streams_then_the_process_with_status_1(rig, caplog):
    """Before, the teardown went on to graphs.close() and the fast path's close, which synchronize the device
    the stuck step holds, and the group's destroy: the watchdog ended the rank 30 s later with status 0."""
    rig.steps_stop = False
    with caplog.at_level(logging.INFO, logger="dspark_sidecar.server"), pytest.raises(Exited):
        rig.run()
    # The leases closed without waiting: a lease's release may wait for the loop the stuck step holds.
    assert rig.calls == ["doorbell", "steps", "server stop", "streams ended", "leases (wait 0.0)",
                         f"exit {app.STUCK_EXIT}"]
    assert app.STUCK_EXIT != 0
    assert "a step still runs" in caplog.text and "status 1" in caplog.text
    assert "rank 0: stopped" not in caplog.text


@pytest.mark.parametrize("status", [0, 1])
def test_a_teardown_past_its_limit_ends_the_process_with_the_rank_s_status(rig, status):
    """A rank that failed (its serving loop, or torchrun's agent gone) exits 1; a teardown that then hung (a
    wedged NCCL destroy) was ended by the watchdog with status 0, a clean stop to its supervisor."""
    app.teardown(0, rig.servicer, rig.loop, rig.server, rig.graphs, rig.fast, rig.rendezvous, rig.board, status=status)
    with pytest.raises(Exited):
        _Watchdog.made[-1].function()
    assert rig.calls[-1] == f"exit {status}"
