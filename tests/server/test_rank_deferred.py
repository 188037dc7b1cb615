"""RankLoop.after_device: work held until the device has passed a point, run before a later step or section."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.server import rank as rank_mod
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop


class _Event:
    """A CUDA event stand-in: done when the test says the device got there."""

    made: list["_Event"] = []

    def __init__(self) -> None:
        self.done, self.recorded_on, self.synced = False, None, 0
        _Event.made.append(self)

    def record(self, stream) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synced += 1
        self.done = True


@pytest.fixture
def loop(monkeypatch):
    _Event.made.clear()
    monkeypatch.setattr(rank_mod.torch.cuda, "Event", _Event)
    monkeypatch.setattr(rank_mod.torch.cuda, "device", lambda dev: contextlib.nullcontext())
    ctx = RankContext(0, 2, SimpleNamespace(), SimpleNamespace(device=torch.device("cpu")), None, None, Metrics(0), 8)
    lp = RankLoop(ctx, None, SimpleNamespace(stream="graphs' stream"))  # type: ignore[arg-type]
    yield lp
    lp.close()


def test_released_memory_waits_for_the_device_not_for_the_host(loop):
    """At TP > 1 UnregisterBuffers cannot wait on the host: the released pre-launched copy finishes only
    when the peers' copies run, after their engines ring, and they wait for this engine rank."""
    ran = []
    with loop.exclusive(wait=False):
        loop.after_device(lambda: ran.append("first"))
        loop.after_device(lambda: ran.append("second"))
    first, second = _Event.made
    assert ran == [] and first.recorded_on == "graphs' stream" and first.synced == 0
    with loop.exclusive():
        pass
    assert ran == []  # the device has not got there
    second.done = True
    with loop.exclusive():
        pass
    assert ran == []  # in order: the first is not done yet
    first.done = True
    with loop.exclusive():
        pass
    assert ran == ["first", "second"]
    with loop.exclusive():  # each once
        loop.after_device(lambda: ran.append("waited"), wait=True)  # TP 1: waited for, and run at once
    assert ran == ["first", "second", "waited"] and _Event.made[-1].synced == 1


def test_a_failing_release_is_logged_and_the_rest_still_run(loop, caplog):
    ran = []

    def broken() -> None:
        raise RuntimeError("unregister failed")

    with loop.exclusive():
        loop.after_device(broken)
        loop.after_device(lambda: ran.append("next"))
    for ev in _Event.made:
        ev.done = True
    with caplog.at_level(logging.ERROR, logger="dspark_sidecar.server"), loop.exclusive():
        pass
    assert ran == ["next"] and "deferred release failed" in caplog.text


def test_without_graphs_nothing_is_queued_ahead_so_nothing_waits():
    ctx = RankContext(0, 1, SimpleNamespace(), SimpleNamespace(device=torch.device("cpu")), None, None, Metrics(0), 8)
    lp = RankLoop(ctx, None, None)  # type: ignore[arg-type]
    try:
        ran = []
        with lp.exclusive():
            lp.after_device(lambda: ran.append(1))
        assert ran == [1]
    finally:
        lp.close()
