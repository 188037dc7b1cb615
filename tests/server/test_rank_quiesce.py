"""A quiesce hook (a doorbell's queued step being released, server/prelaunch.py) that raises.

Such a hook may have left its queued wait blocking the device's stream: the rank exits (3) as after a
failed launch, instead of the worker thread dying with the step it held never answered (and every
later gRPC step queued behind it for ever)."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import pytest
import torch

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop


@pytest.fixture
def exits(monkeypatch):
    """os._exit recorded; the calling thread ends there (SystemExit ends a thread silently)."""
    codes: list[int] = []
    called = threading.Event()

    def fake_exit(code):
        codes.append(code)
        called.set()
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    return SimpleNamespace(codes=codes, called=called)


@pytest.fixture
def loop():
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    ctx = RankContext(0, 1, SimpleNamespace(), model, None, None, Metrics(0), 8)
    loop = RankLoop(ctx, SimpleNamespace(agree=None), None)  # type: ignore[arg-type]
    yield loop
    loop.close()


def _failing(calls: list):
    def release(wait: bool) -> None:
        calls.append(wait)
        raise RuntimeError("cuStreamWriteValue64 failed")

    return release


# The fake exit ends the worker with SystemExit, which pytest reports as a thread's unhandled exception.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_raising_hook_before_a_grpc_step_exits_the_rank(loop, exits, caplog):
    calls: list = []
    loop.on_quiesce(_failing(calls))
    fut = loop.submit(pb.DraftStepRequest(step_id=1, num_requests=1))
    assert exits.called.wait(5), "the worker died with the step unanswered, and the rank lived on"
    assert exits.codes == [3] and calls == [False]
    assert "exiting" in caplog.text and "cuStreamWriteValue64 failed" in caplog.text
    assert not fut.done()  # never answered by this rank: the engines see it exit (UNAVAILABLE) and fall back


def test_a_raising_hook_before_a_binding_exits_the_rank(loop, exits):
    """The same hooks run before BindKV, UnbindKV and UnregisterBuffers (exclusive)."""
    calls: list = []
    loop.on_quiesce(_failing(calls))
    with pytest.raises(SystemExit):
        with loop.exclusive(wait=True):
            pytest.fail("ran on a device a failed release may have left blocked")
    assert exits.codes == [3] and calls == [True]
    with loop.exclusive(quiesce=False):  # the doorbell's own sections run no hooks: nothing raised
        pass
    assert exits.codes == [3]


def _servicer(loop):
    """A servicer over `loop` with a real MemoryBindings (host memory): UnregisterBuffers as the engine calls it."""
    from dspark_sidecar.server.kv_binding import MemoryBindings
    from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle

    loop.ctx.memory = MemoryBindings(SimpleNamespace(), 1, 0, torch.float32, torch.device("cpu"))
    return DrafterServicer(loop.ctx, loop, Lifecycle(), None, None, "")


ENGINE = SimpleNamespace(peer=lambda: "unix:/engine", is_active=lambda: True, time_remaining=lambda: None)


def test_an_unregisterbuffers_that_releases_nothing_runs_no_hook(loop):
    """The shim releases its owner token after a RegisterBuffers whose outcome it does not know (its call timed
    out): often nothing was registered under it. That call entered the rank's section all the same, whose hooks
    release the doorbell's pre-launched step, at TP > 1 on this rank alone (the peers' copies ran: SOME_COPIES).
    The token is retired all the same: a registration still under way under it is refused."""
    from dspark_sidecar.proto import memory

    calls: list = []
    loop.on_quiesce(calls.append)
    svc = _servicer(loop)
    svc.UnregisterBuffers(pb.UnregisterBuffersRequest(owner=77), ENGINE)
    assert calls == []
    seg = memory.shm_empty((4096,), torch.uint8)
    try:
        late = pb.RegisterBuffersRequest(owner=77, regions=[pb.BufferRegion(
            name="late", memory=memory.export_handle(seg.tensor), size_bytes=4096)])
        with pytest.raises(Exception, match="owner: 77 was released by UnregisterBuffers"):
            svc.RegisterBuffers(late, ENGINE)
        # One that holds a region releases it in the section, its hooks run.
        held = pb.RegisterBuffersRequest(owner=78, regions=list(late.regions))
        svc.RegisterBuffers(held, ENGINE)
        svc.UnregisterBuffers(pb.UnregisterBuffersRequest(owner=78), ENGINE)
        assert calls == [False] and svc.ctx.memory.region_count == 0
    finally:
        seg.close()
