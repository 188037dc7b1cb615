"""RankLoop.after_device: work held until the device has passed a point, run before a later step or section."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import grpc
import pytest
import torch

from dspark_sidecar.proto import sidecar_pb2 as pb
from dspark_sidecar.server import rank as rank_mod
from dspark_sidecar.server.metrics import Metrics
from dspark_sidecar.server.rank import RankContext, RankLoop
from helpers.waiting import wait_until


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
def gpu(monkeypatch):
    """torch.cuda's events, device and streams as stand-ins; records which stream each release ran on."""
    _Event.made.clear()
    current = []
    monkeypatch.setattr(rank_mod.torch.cuda, "Event", _Event)
    monkeypatch.setattr(rank_mod.torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(rank_mod.torch.cuda, "set_device", lambda dev: None)
    monkeypatch.setattr(rank_mod.torch.cuda, "Stream", lambda device=None: "idle stream")

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        yield
        current.pop()

    monkeypatch.setattr(rank_mod.torch.cuda, "stream", stream)
    return current


def _loop(world: int) -> RankLoop:
    # A CUDA rank (deferred releases exist only with CUDA graphs); torch.cuda is stood in for by `gpu`.
    ctx = RankContext(0, world, SimpleNamespace(), SimpleNamespace(device=torch.device("cuda", 0)), None, None,
                      Metrics(0), 8)
    return RankLoop(ctx, None, SimpleNamespace(stream="graphs' stream"))  # type: ignore[arg-type]


@pytest.fixture
def loop(gpu):
    lp = _loop(2)
    yield lp
    lp.close()


def test_releases_run_on_an_idle_stream_of_their_own(loop, gpu):
    """torch synchronizes the current stream before it unmaps CUDA IPC memory; on the rank's stream
    that could wait, lock held, for a copy that waits on the engine."""
    on = []
    with loop.exclusive():
        loop.after_device(lambda: on.append(list(gpu)))
    _Event.made[0].done = True
    with loop.exclusive():
        pass
    assert on == [["idle stream"]]


def test_at_tp1_the_release_is_waited_for_in_the_call(gpu):
    lp = _loop(1)
    try:
        ran = []
        with lp.exclusive():
            lp.after_device(lambda: ran.append(1))
        assert ran == [1] and _Event.made[0].synced == 1
    finally:
        lp.close()


def test_a_wait_for_the_device_runs_the_registered_pokes_until_it_passes(gpu):
    """A released queued step's wait can be blocked again by the engine's late word (Prelaunch.repass):
    a host wait on the device must keep storing the release, not sit in synchronize()."""
    lp = _loop(1)
    pokes, ran = [], []

    def repass() -> None:  # the device gets past the step only once the release is stored again
        pokes.append(1)
        if len(pokes) == 3:
            _Event.made[-1].done = True

    try:
        lp.on_device_wait(repass)
        with lp.exclusive():
            lp.after_device(lambda: ran.append(1))
        assert ran == [1] and len(pokes) >= 3 and _Event.made[-1].synced == 0
        lp.on_device_wait(None, old=repass)
        before = len(pokes)
        with lp.exclusive():
            lp.after_device(lambda: ran.append(2))
        assert ran == [1, 2] and _Event.made[-1].synced == 1 and len(pokes) == before  # unhooked: synchronize
    finally:
        lp.close()


class _CpuGraphs:
    """StepGraphs on the CPU: says whether run() would capture, records each run."""

    stream = "graphs' stream"

    def __init__(self, calls: list, capture: bool) -> None:
        self.calls, self.capture = calls, capture

    def will_capture(self, embeds, R, kv, in_place=False):
        return self.capture

    def run(self, embeds, host, kv, in_place=False):
        self.calls.append("run")
        return embeds


def _cpu_loop(world: int, graphs: _CpuGraphs, answers: list) -> tuple[RankLoop, SimpleNamespace]:
    """A CPU rank with graphs and one poke that records itself and answers from `answers` (True when
    empty); and a one-request step for its _execute."""
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    lp = RankLoop(RankContext(0, world, SimpleNamespace(), model, None, None, Metrics(0), 8), None, graphs)  # type: ignore[arg-type]

    def repass() -> bool:
        graphs.calls.append("poke")
        return answers.pop(0) if answers else True

    lp.on_device_wait(repass)
    step = SimpleNamespace(inputs_embeds=torch.zeros(7, 4), input_ids=None, in_region=False, num_reqs=1,
                           host=None, kv=SimpleNamespace(layers=[]))
    return lp, step


def test_a_step_that_captures_a_graph_first_waits_for_released_work_and_one_that_replays_does_not(gpu):
    """A capture synchronizes the device inside torch, where no poke can re-store a release that an
    engine's late word undid: the step waits (poking) until nothing released still waits."""
    calls, answers = [], [False, False, True]
    graphs = _CpuGraphs(calls, capture=True)
    lp, step = _cpu_loop(1, graphs, answers)
    try:
        with lp.exclusive(quiesce=False):
            lp._execute(step)
        assert calls == ["poke", "poke", "poke", "run"]
        calls.clear()
        graphs.capture = False
        answers[:] = [False]
        with lp.exclusive(quiesce=False):
            lp._execute(step)
        assert calls == ["run"]  # a replay is ordered on the stream behind the released work: no host wait
    finally:
        lp.close()


def test_a_grpc_step_waits_for_released_work_poking_after_go_not_before(gpu):
    """Its inputs' copies, an inline answer's .cpu() and a capture wait on the device inside torch, where
    no poke runs: with a released step still waiting (an engine's late word may block it again, and the
    idle doorbell cannot poke while this step holds the lock), the rank would hang (helper 73). It waits
    after GO (in _execute), not before the rendezvous: at TP > 1 its released copy finishes only with the
    peers' copies, and a step no peer sent is aborted there instead, answered (helper 74)."""
    import concurrent.futures

    from dspark_sidecar.server.errors import SidecarError

    calls, answers = [], [False, False, True]
    lp, step = _cpu_loop(2, _CpuGraphs(calls, capture=False), answers)
    try:
        with lp.exclusive(quiesce=False):
            lp._execute(step, settle=True)  # a gRPC step after GO
        assert calls == ["poke", "poke", "poke", "run"]
        calls.clear()
        with lp.exclusive(quiesce=False):
            lp._execute(step)  # a doorbell step: ordered on the stream behind the released work instead
        assert calls == ["run"]
        # Before GO nothing waits: a step the rendezvous aborts (a peer's engine never sent it) is answered
        # at once, whatever the released copy, which only that peer's ring would finish, is doing.
        answers[:] = [False] * 10**6

        def aborted(*a, **k):
            raise SidecarError(grpc.StatusCode.ABORTED, "step 7 aborted: rank 1 missing", "", "ABORTED")

        lp._run = aborted
        try:
            exc = lp.submit(pb.DraftStepRequest(step_id=7)).exception(timeout=3.0)
        except concurrent.futures.TimeoutError:
            pytest.fail("the gRPC step was never answered: it waited for a copy only a peer's ring finishes")
        assert isinstance(exc, SidecarError) and exc.code == grpc.StatusCode.ABORTED
    finally:
        answers.clear()
        lp.close()


def test_a_settle_waits_until_every_poke_has_nothing_waiting(gpu):
    """Two pokes: a replaced doorbell's old pre-launch stays hooked until its own release has run
    (Doorbell._drop_prelaunch). The new one passing first must not end the wait for the old one's step."""
    lp = _loop(1)
    old = [False, False, True]
    try:
        lp.on_device_wait(lambda: True)
        lp.on_device_wait(lambda: old.pop(0) if old else True)
        with lp.exclusive(quiesce=False):
            lp._settle_released()
        assert old == []
    finally:
        lp.close()


def test_a_grpc_answer_s_device_wait_pokes_until_the_streams_pass(gpu, monkeypatch):
    """_device_idle (an answer naming an output region): with pokes registered, events on the step's and
    the graphs' streams, polled with the pokes, instead of torch.cuda.synchronize."""
    lp = _loop(1)
    pokes = []
    monkeypatch.setattr(rank_mod.torch.cuda, "current_stream", lambda dev: "worker's stream")
    monkeypatch.setattr(rank_mod.torch.cuda, "synchronize", lambda dev: pytest.fail("synchronize with pokes"))

    def repass() -> bool:
        pokes.append(1)
        if len(pokes) == 2:
            for e in _Event.made:
                e.done = True
        return True

    try:
        lp.on_device_wait(repass)
        with lp.exclusive(wait=False):
            lp._device_idle()
        streams = [e.recorded_on for e in _Event.made[-2:]]
        assert streams == ["worker's stream", "graphs' stream"] and len(pokes) >= 2
        assert all(e.synced == 0 for e in _Event.made)
    finally:
        lp.close()


def test_a_doorbell_step_first_runs_the_releases_the_device_has_passed(loop):
    """A doorbell step (answer_now) takes no exclusive section: its own look (_guarded) is what lets a busy
    doorbell's released memory go between its steps, not only when its idle loop comes round."""
    ran = []
    with loop.exclusive():
        loop.after_device(lambda: ran.append("release"))
    _Event.made[0].done = True
    loop._run = lambda req, *a, **k: ran.append("step") or pb.DraftStepResponse(step_id=req.step_id)
    assert loop.answer_now(pb.DraftStepRequest(step_id=1)).step_id == 1
    assert ran == ["release", "step"]


def test_the_idle_doorbell_pokes_only_when_asked(loop):
    pokes = []
    loop.on_device_wait(lambda: pokes.append(1))
    loop.sweep_idle()  # nothing deferred, nothing released: the idle poll costs nothing
    assert pokes == []
    loop.sweep_idle(poke=True)
    assert pokes == [1]


def test_the_idle_doorbell_sweeps_unless_a_step_holds_the_lock(loop):
    import threading

    ran = []
    with loop.exclusive():
        loop.after_device(lambda: ran.append(1))
    held, go = threading.Event(), threading.Event()

    def step() -> None:
        with loop.exclusive(quiesce=False):
            held.set()
            go.wait(5)

    t = threading.Thread(target=step)
    t.start()
    held.wait(5)
    _Event.made[0].done = True  # the device got there during the step
    loop.sweep_idle()  # another thread's step holds the lock: not now, and no wait
    assert ran == []
    go.set()
    t.join(5)
    loop.sweep_idle()
    assert ran == [1]


def test_shutdown_runs_what_the_device_has_passed(loop):
    ran = []
    with loop.exclusive():
        loop.after_device(lambda: ran.append(1))
    loop.drain()
    assert ran == []
    _Event.made[0].done = True  # as after the device is synchronized (app.py)
    loop.drain()
    assert ran == [1]


def test_a_release_deferred_at_tp_above_1_runs_once_the_device_gets_there_though_nothing_else_comes(loop):
    """A lease's end (its engine killed) or an UnbindKV at TP > 1 leaves the cache's unmapping to after_device, with
    no host wait. It ran only at a later step, exclusive section or idle doorbell's sweep: with the gRPC transport
    (the shim's default, no doorbell thread) and no engine left to call, the dead engine's cache stayed mapped, and
    under CUDA IPC allocated, until the next engine's BindKV, which comes after that engine's start-up memory check."""
    import threading

    unmapped = threading.Event()
    with loop.exclusive(wait=False):
        loop.after_device(unmapped.set)
    assert not unmapped.is_set()  # the device has not got there
    _Event.made[-1].done = True  # it gets there; nothing else happens on the rank
    assert unmapped.wait(5), "the release still waits for a step, a section or a doorbell"


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


def test_the_reaper_says_when_a_release_waits_on_the_device_for_long(loop, monkeypatch, caplog):
    """A release the device never gets to (a stuck device, a peer's copy that never runs) keeps its memory mapped,
    and under CUDA IPC allocated: said every WAIT_LOG_S, as _settle_released says its wait. The reaper was silent."""
    monkeypatch.setattr(rank_mod, "WAIT_LOG_S", 0.05)
    ran = []
    with caplog.at_level(logging.WARNING, logger="dspark_sidecar.server"):
        with loop.exclusive(wait=False):
            loop.after_device(lambda: ran.append(1))
        wait_until(lambda: "still wait on the device" in caplog.text, 5, "the reaper's line")
    assert ran == [] and "1 releases still wait" in caplog.text
    _Event.made[-1].done = True  # the device gets there: the release runs, the reaper ends
    wait_until(lambda: ran == [1], 5, "the release")


def test_the_reaper_says_it_once_each_wait_log_s_not_at_each_turn(loop, monkeypatch, caplog):
    """Its turns come every REAP_S (10 ms): a line per turn, or one at the first, would flood the log of a rank whose
    released memory waits on a peer for minutes. The clock here runs as the real one plus what the test adds."""
    import time as real_time

    ahead, turns = [0.0], [0]

    class _Time:
        def __getattr__(self, name):
            return getattr(real_time, name)

        def monotonic(self):
            return real_time.monotonic() + ahead[0]

        def sleep(self, s):
            turns[0] += 1
            real_time.sleep(s)

    monkeypatch.setattr(rank_mod, "time", _Time())

    def look_several_times():
        n = turns[0]
        wait_until(lambda: turns[0] > n + 5, 5, "the reaper's turns")

    ran = []
    with caplog.at_level(logging.WARNING, logger="dspark_sidecar.server"):
        with loop.exclusive(wait=False):
            loop.after_device(lambda: ran.append(1))
        look_several_times()
        assert "still wait on the device" not in caplog.text  # not WAIT_LOG_S yet
        ahead[0] += rank_mod.WAIT_LOG_S + 1
        wait_until(lambda: "still wait on the device" in caplog.text, 5, "the reaper's line")
        look_several_times()
    assert caplog.text.count("still wait on the device") == 1 and "after 11 s" in caplog.text
    _Event.made[-1].done = True
    wait_until(lambda: ran == [1], 5, "the release")


def test_close_ends_the_reaper_and_leaves_what_the_device_reaches_later_to_the_teardown_s_drain(loop, monkeypatch):
    """close() stops the reaper: the teardown drops the graphs and the process group next (server/teardown.py), and a
    release run meanwhile on a thread left behind would race them. What the device gets to after close() runs at the
    teardown's own drain (after its device sync), on the caller's thread."""
    import threading

    monkeypatch.setattr(rank_mod, "DRAIN_S", 0.1)
    ran = []
    with loop.exclusive(wait=False):
        loop.after_device(lambda: ran.append(threading.current_thread()))
    reaper = loop._reaper
    assert reaper is not None and reaper.is_alive()  # a release waits on the device: the reaper looks at it
    loop.close()  # the release still waits (the device has not got there): left to the teardown
    reaper.join(5)
    assert not reaper.is_alive(), "the reaper outlived close(), still sweeping while the teardown goes on"
    _Event.made[-1].done = True
    assert ran == []
    assert loop.drain() and ran == [threading.current_thread()]


def test_a_release_deferred_after_the_reaper_ended_gets_a_reaper_of_its_own(loop):
    """The reaper ends once nothing waits; a release deferred after that must start another, or it waited again for
    a step, a section or a doorbell that may never come (a killed engine's cache, released by its lease)."""
    import threading

    first, second = threading.Event(), threading.Event()
    with loop.exclusive(wait=False):
        loop.after_device(first.set)
    reaper = loop._reaper
    _Event.made[-1].done = True
    assert first.wait(5), "the first release never ran"
    reaper.join(5)
    assert not reaper.is_alive()  # nothing waits any more: it ended
    with loop.exclusive(wait=False):
        loop.after_device(second.set)
    _Event.made[-1].done = True  # the device gets there; nothing else comes to the rank
    assert second.wait(5), "the second release waits for a step, a section or a doorbell: no reaper took it"


def test_a_sweep_pokes_the_released_work_a_deferred_release_waits_behind(loop):
    """A deferred release waits for the device to pass a released queued step, whose wait an engine's late word can
    block again until the release is stored again (Prelaunch.repass): every sweep with releases waiting pokes first,
    the reaper's too, or such a release waited for good on a rank with no step or doorbell poll coming."""
    pokes, ran = [], []

    def repass() -> bool:  # the device gets past the released step once the release is stored again
        pokes.append(1)
        for e in _Event.made:
            e.done = True
        return True

    loop.on_device_wait(repass)
    with loop.exclusive(wait=False):
        loop.after_device(lambda: ran.append(1))
    wait_until(lambda: ran == [1], 5, lambda: f"the release behind the released step: ran {ran}, pokes {len(pokes)}")
    assert pokes


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_device_error_found_before_a_deferred_release_exits_the_rank(loop, monkeypatch, caplog):
    """An event query that raises is a failed device (a fault in a step or a queued copy): nothing queued can be
    trusted, as after a failed launch, so the rank exits (3) with one line; taken for "not yet", the release
    waited for good and the rank served on a broken device."""
    import os
    import threading

    codes, called = [], threading.Event()

    def fake_exit(code):
        codes.append(code)
        called.set()
        raise SystemExit(code)  # ends the calling thread (the reaper's silently)

    monkeypatch.setattr(os, "_exit", fake_exit)
    ran = []
    with loop.exclusive(wait=False):
        loop.after_device(lambda: ran.append(1))
    ev = _Event.made[-1]

    def broken() -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    ev.query = broken
    with caplog.at_level(logging.ERROR, logger="dspark_sidecar.server"), contextlib.suppress(SystemExit):
        loop.drain()
    assert called.wait(5), "a device error read as a release not yet reached"
    assert set(codes) == {3} and ran == [] and "the device failed before a deferred release" in caplog.text
    ev.query = lambda: True  # the fixture's close() drains it


@pytest.mark.parametrize("pokes", [False, True])
def test_a_device_error_met_waiting_for_a_release_at_tp1_exits_the_rank(gpu, monkeypatch, caplog, pokes):
    """At TP 1 after_device waits for the device in the call (a BindKV's, an UnbindKV's or an UnregisterBuffers'
    section). An asynchronous fault of an earlier doorbell step (which no host wait follows) surfaces there: the
    device is gone, as _passed says, and the rank exits (3) with one line, with pokes registered or not. Raised
    instead, the RPC was answered INTERNAL after its binding had already been replaced, the old cache's release
    was dropped, and the rank stayed SERVING on a broken device until a later step's launch failed."""
    import os

    codes = []

    def fake_exit(code):
        codes.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)

    class _Failed(_Event):
        """An event on a device that has failed: every look at it raises, as CUDA's sticky error does."""

        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        synchronize = query

    monkeypatch.setattr(rank_mod.torch.cuda, "Event", _Failed)
    lp = _loop(1)
    try:
        if pokes:
            lp.on_device_wait(lambda: True)
        with caplog.at_level(logging.ERROR, logger="dspark_sidecar.server"), pytest.raises(SystemExit):
            with lp.exclusive(wait=False):
                lp.after_device(lambda: pytest.fail("released on a failed device"))
        assert codes == [3] and "the device failed" in caplog.text
    finally:
        lp.close()
