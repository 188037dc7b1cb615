"""The doorbell's thread on CPU stand-ins: between steps it lets the pre-launch time a cooldown step's word."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

pytest.importorskip("triton")  # the doorbell imports the pre-launch, which imports its metadata program

from dspark_sidecar.proto import doorbell as bell  # noqa: E402
from dspark_sidecar.server.doorbell import Doorbell  # noqa: E402

CAPACITY = 4096


class _Page:
    """What the doorbell uses of its MappedMemory: the bytes, and close."""

    def __init__(self) -> None:
        self.storage = torch.zeros(bell.HEADER + 2 * CAPACITY, dtype=torch.uint8)

    def close(self) -> None:
        pass


class _Loop:
    """What the doorbell uses of its RankLoop when no step is rung."""

    graphs = None

    def on_quiesce(self, fn, old=None) -> None:
        pass

    @contextlib.contextmanager
    def exclusive(self, wait: bool = True, quiesce: bool = True):
        yield


class _Prelaunch:
    """Counts the idle loop's watch() calls (server/prelaunch.py times a cooldown step's word there)."""

    def __init__(self) -> None:
        self.watches, self.closed, self.seen = 0, False, threading.Event()

    def watch(self) -> None:
        self.watches += 1
        if self.watches >= 3:
            self.seen.set()

    def release(self, wait: bool = False) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_the_idle_doorbell_lets_the_prelaunch_watch_between_steps():
    db = Doorbell(_Page(), CAPACITY, _Loop(), torch.device("cpu"), b"")
    pl = db.prelaunch = _Prelaunch()  # on a GPU the doorbell builds it from the GPU word's ops
    db.start()
    try:
        assert pl.seen.wait(timeout=10), "the idle loop never called watch()"
    finally:
        db.stop()
    assert not db.is_alive() and pl.closed and db.prelaunch is None
    n = pl.watches
    time.sleep(0.05)
    assert pl.watches == n  # stopped: no more polling


def test_a_doorbell_too_small_for_an_error_answer_is_refused():
    """With a 64-byte area even the error answer to a ring cannot be written: the thread died and the
    rank went on reporting SERVING while every ring went unanswered. AttachDoorbell refuses it."""
    from dspark_sidecar.server.errors import SidecarError

    with pytest.raises(SidecarError, match="capacity_bytes: 64 is below the 4096 bytes"):
        Doorbell(_Page(), 64, _Loop(), torch.device("cpu"), b"")


class _FailingLoop(_Loop):
    """A loop whose every step raises, with an answer that never fits: the thread must outlive both."""

    def answer_now(self, req, hook=None):
        raise RuntimeError("x" * (2 * CAPACITY))


def test_the_doorbell_thread_outlives_a_failed_step_and_a_failed_error_answer(monkeypatch):
    db = Doorbell(_Page(), CAPACITY, _FailingLoop(), torch.device("cpu"), b"")
    published = []
    real = db._publish

    def publish(seq, resp):
        published.append(seq)
        if len(published) == 1:
            raise ValueError("the page refused the answer")  # the error answer fails once
        real(seq, resp)

    monkeypatch.setattr(db, "_publish", publish)
    db.start()
    try:
        for seq in (1, 2):  # two rings: the first answer is lost, the second one gets through
            db.page.write(db.page.req_area, b"", bell.REQ_LEN, bell.REQ_SEQ, seq)
            deadline = time.monotonic() + 10
            while seq not in published:
                assert time.monotonic() < deadline and db.is_alive()
                time.sleep(0.01)
        deadline = time.monotonic() + 10
        while db.page.word(bell.RESP_SEQ) != 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert db.is_alive()
    finally:
        db.stop()
