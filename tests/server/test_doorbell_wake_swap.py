"""A doorbell whose wake FIFO path was replaced still releases its queued GPU wait and its page.

The FIFO lives in the socket folder (mode 0770: the engine's group may write it). Replaced by a
directory (a buggy engine-side process, a cleanup script), Waker.close's unlink raised IsADirectoryError
and Doorbell._release stopped before the pre-launch was dropped and the page closed: the queued GPU
wait was never released by this doorbell, and on_close (MemoryBindings.release_page) never ran.
Found by helper 72's review."""
from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.proto import doorbell as bell  # noqa: E402
from dspark_sidecar.server.doorbell import Doorbell  # noqa: E402

CAP = 4096


class _Page:
    def __init__(self):
        self.storage = torch.zeros(bell.HEADER + 2 * CAP, dtype=torch.uint8)
        self.closed = False

    def close(self):
        self.closed = True


class _Loop:
    graphs = None

    def on_quiesce(self, fn, old=None):
        pass

    @contextlib.contextmanager
    def exclusive(self, wait=True, quiesce=True):
        yield

    def after_device(self, fn, wait=None):
        fn()

    def sweep_idle(self):
        pass


class _Prelaunch:
    def __init__(self):
        self.released = self.finished = False

    def watch(self):
        pass

    def release(self, wait=False):
        pass

    def detach(self):
        self.released = True  # detach releases the queued step (forget_regions -> release)

        def finish():
            self.finished = True
        return finish


def test_a_swapped_wake_fifo_still_releases_the_queued_step_and_the_page(tmp_path):
    closed = []
    page = _Page()
    db = Doorbell(page, CAP, _Loop(), torch.device("cpu"), b"", wake_path=str(tmp_path / "rank0.wake1"),
                  on_close=lambda: closed.append(True))
    pl = db.prelaunch = _Prelaunch()
    db.start()
    time.sleep(0.1)
    os.unlink(db.waker.path)
    os.mkdir(db.waker.path)  # the folder is group-writable: the path now names a directory
    db.stop()
    assert not db.is_alive()
    assert pl.released, "the queued step's wait was never released (GPU stream stays blocked)"
    assert page.closed and closed, "the page was never closed / release_page never ran"
