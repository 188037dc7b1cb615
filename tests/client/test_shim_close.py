"""DrafterShim.close() from another thread while maybe_forward is inside a step (an engine shutting down from an
atexit hook, a signal handler's thread or its executor's shutdown), on both transports.

What must hold: maybe_forward returns the step's hidden states or None, within its bounds, without raising
or logging a shim error; close() returns within its bounds; nothing is unmapped under the step (the
doorbell's page and regions are shared memory: a view read after the munmap is a SIGSEGV); nothing is
re-opened after close() (no binding, no /dev/shm segment, no channel); close() is idempotent and every
later maybe_forward is a clean None that makes no remote call.

The doorbell scenarios run in a child process: before the fix one of them killed the process (SIGSEGV),
which would have taken the whole test session with it. Every wait here is bounded.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch

from dspark_sidecar.client import link
from dspark_sidecar.client import shim as S
from dspark_sidecar.client.config import EngineConfig
from dspark_sidecar.client.forward_context import set_forward_context
from dspark_sidecar.client.shim import DrafterShim
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.proto import memory
from dspark_sidecar.proto import doorbell as bell
from helpers.engine_fakes import (
    DoorbellNeverAnswered, FakeModel, FakeServer, FakeSidecar, PreflightHook, RecordingSharedMemory, shm_kv_cache,
    short_socket_dir, step_inputs,
)
from helpers.waiting import wait_until

_HERE = Path(__file__).resolve()


def _fuzz():
    """tests/client/test_answer_fuzz.py, for its FuzzSidecar (a fake whose doorbell really answers) and rig."""
    mod = sys.modules.get("answer_fuzz")
    if mod is None:
        spec = importlib.util.spec_from_file_location("answer_fuzz", _HERE.parent / "test_answer_fuzz.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["answer_fuzz"] = mod
        spec.loader.exec_module(mod)
    return mod


# close() lets the woken step settle within late_grace_s. The close-during-a-step scenario holds the fake's answer
# until the step was woken, so a passing run waits none of these out: each is a hang guard.
DEADLINE_S, GRACE_S = 3.0, 8.0
JOIN_S = DEADLINE_S + GRACE_S + 3.0  # a thread still alive after this is a hang


class Rig:
    """One engine rank (a 2-rank agreement whose peer always agrees) against a FuzzSidecar rank."""

    def __init__(self, transport: str, agree=None) -> None:
        fz = _fuzz()
        self.fz = fz
        self.transport = transport
        self.shm = RecordingSharedMemory()
        memory.shared_memory = self.shm  # undone by stop()
        self.fake = fz.FuzzSidecar(dataplane=transport == "doorbell", max_reqs=4)
        self.server = FakeServer(self.fake, short_socket_dir() / "rank0.sock").start()
        self.kv = shm_kv_cache()
        self.kv_names = {s.segment.name.lstrip("/") for s in self.kv}
        self.model = FakeModel()
        cfg = EngineConfig(tp_size=4, endpoint=self.server.endpoint, transport=transport, step_deadline_s=DEADLINE_S,
                           late_grace_s=GRACE_S, connect_deadline_s=1.0, bind_deadline_s=1.0)
        self.shim = DrafterShim(cfg, self.model, lambda: [s.tensor for s in self.kv], agree or fz.EchoPeer())

    def step(self, k: int):
        """maybe_forward of step k on this thread; the result checked against step k's own answer."""
        ids, pos, meta = self.fz.inputs(k)
        with set_forward_context(meta):
            out = self.shim.maybe_forward(ids, pos)
        if out is not None:
            want = self.fz.expected(self.model, k)
            assert out.dtype == want.dtype and torch.equal(out, want), f"step {k}: a wrong tensor"
        return out

    def new_segments(self) -> set[str]:
        """Segments this process created (other than the KV cache) still in /dev/shm."""
        if self.transport == "doorbell":
            assert self.shm.created - self.kv_names, "no segment recorded: the data plane's were not seen"
        return (self.shm.created - self.kv_names) & set(os.listdir("/dev/shm"))

    def shim_errors(self) -> dict:
        return {k: v for k, v in self.shim.stats.fallbacks.items() if k.startswith("shim error")}

    def stop(self) -> None:
        memory.shared_memory = shared_memory
        self.fake.stop_bells()
        self.server.stop()
        for s in self.kv:
            s.close()


class Bounded:
    """Run fn on a daemon thread; join() fails the test if it is still running after `limit` seconds."""

    def __init__(self, fn, name: str) -> None:
        self.out = self.exc = None
        self.t0 = self.t1 = 0.0

        def run() -> None:
            self.t0 = time.monotonic()
            try:
                self.out = fn()
            except BaseException as e:  # noqa: BLE001  (reported by join)
                self.exc = e
            self.t1 = time.monotonic()

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def join(self, limit: float, what: str):
        self.thread.join(limit)
        assert not self.thread.is_alive(), f"{what}: still running after {limit} s (hang)"
        if self.exc is not None:
            raise AssertionError(f"{what} raised {type(self.exc).__name__}: {self.exc}") from self.exc
        return self.out

    @property
    def secs(self) -> float:
        return self.t1 - self.t0


def _assert_closed_cleanly(rig: Rig) -> None:
    """After close(): no link left, nothing in /dev/shm, and later steps are None without a remote call."""
    shim = rig.shim
    assert not shim.connection.is_open, "close() left the channel open"
    assert shim.doorbell is None, "close() left the data plane attached"
    assert not rig.new_segments(), f"shared memory left after close(): {sorted(rig.new_segments())}"
    calls = rig.fake.remote_calls()
    for k in (50, 51):
        assert rig.step(k) is None, f"step {k} after close() forwarded: the shim re-opened its link"
    assert rig.fake.remote_calls() == calls, (
        f"maybe_forward after close() called the sidecar: {dict(rig.fake.calls)}")
    assert not shim.connection.is_open and shim.doorbell is None and not rig.new_segments()
    assert shim.stats.fallbacks[S.CLOSED] >= 2
    shim.close()  # idempotent: no remote call, no error
    assert rig.fake.remote_calls() == calls
    assert not rig.shim_errors(), rig.shim_errors()


# ------------------------------------------------------------------------------------------------
# Scenarios (each also runs alone in a child: see _in_child)
# ------------------------------------------------------------------------------------------------

def scenario_close_then_step(transport: str) -> None:
    """close() between steps: final and idempotent; before, the next maybe_forward re-connected, re-bound
    and (doorbell) mapped a new page and three regions that nothing released."""
    rig = Rig(transport)
    try:
        first = rig.step(1)
        assert first is not None and rig.step(2) is not None
        # Step 1's tensor is the engine's own: the next step's answer (in the doorbell's output region) leaves it be.
        assert torch.equal(first, rig.fz.expected(rig.model, 1)), "step 2's answer overwrote step 1's hidden states"
        assert (rig.shim.doorbell is not None) == (transport == "doorbell")
        rig.shim.close()
        assert rig.fake.calls["UnbindKV"] == 1
        _assert_closed_cleanly(rig)
    finally:
        rig.stop()


def scenario_close_during_a_step(transport: str) -> None:
    """close() on another thread while maybe_forward waits for its step's answer. Before, on the doorbell
    the waiting thread read the page close() had just unmapped (a TypeError logged as a shim error, or a
    SIGSEGV when the munmap landed between two reads).

    The fake holds step 2's answer until the test lets it land, after the step returned: a step that ends
    meanwhile was woken by close() (left to wait, it would end at its deadline, as DEADLINE, counted against
    the breaker), and a close() that released the link before the answer landed released it under a step
    the sidecar still ran. Nothing here is timed: the wake was bounded at 1 s of wall clock after close()
    began (against an answer due 1.5 s after the step arrived), which a loaded box that leaves the woken
    thread unscheduled for a second fails with nothing wrong in the shim."""
    rig = Rig(transport)
    fz = rig.fz
    answer = threading.Event()  # set by the test: the fake's answer to step 2 lands

    def held(req, resp, prev):
        answer.wait(60)  # a hang guard only
        return [(0.0, resp)]

    try:
        assert rig.step(1) is not None
        rig.fake.step_mut = fz.StepMut(resp=held)
        step = Bounded(lambda: rig.step(2), "step-2")
        # Step 2's own arrival, not `busy`: the gRPC fake's flag could still be set from step 1's answer (cleared only
        # when gRPC resumed its generator), and close() then ran before step 2 was sent (CI, sessions 48 and 50).
        wait_until(lambda: 2 in rig.fake.received, 5.0, lambda: f"the fake received step 2 (got {rig.fake.received})")
        # The step woken by close() may still run on the sidecar: the release waits for it to settle (in the grace).
        release, settled_at_release, released_early = rig.shim._release, [], []

        def recording_release() -> None:
            settled_at_release.append((rig.shim.doorbell or rig.shim.connection._stream).settled(2))
            released_early.append(not answer.is_set())
            release()

        rig.shim._release = recording_release
        closing = Bounded(rig.shim.close, "close")
        out = step.join(JOIN_S, "maybe_forward, which close() should have woken")  # the answer is held
        assert out is None, "step 2 returned hidden states its sidecar had not answered"
        assert S.DEADLINE not in rig.shim.stats.fallbacks and rig.shim.stats.fallbacks[S.CLOSED] == 1, (
            f"close() did not wake the step waiting for its answer: {dict(rig.shim.stats.fallbacks)}")
        # Waited for, not raced: close() either holds the link now, giving the woken step its grace (its answer is
        # held), or has released it. A close() that took the woken step for settled released at once, most often
        # before this line ran, but not always (a loaded host), and the answer then landed before its release.
        wait_until(lambda: released_early or (rig.shim._hold.inside and rig.shim._hold.holder == closing.thread.ident), 5.0,
                   "close() took the link")
        assert not released_early, "close() released the link while the sidecar still ran step 2 (its answer held)"
        answer.set()
        closing.join(GRACE_S + 4.0, "close()")
        assert settled_at_release == [True] and released_early == [False], (
            f"close() released the link under a step the sidecar still ran (settled: {settled_at_release})")
        assert rig.shim.breaker.failures == 0, "a close() was counted against the sidecar"
        assert not rig.shim_errors(), rig.shim_errors()
        assert not rig.fake.thread_errors, rig.fake.thread_errors
        _assert_closed_cleanly(rig)
    finally:
        answer.set()
        rig.stop()


def scenario_close_while_the_answer_is_read(transport: str) -> None:
    """close() while maybe_forward holds the doorbell's answer and is about to copy the hidden states out of
    the output region. Before, close() unmapped the region under it: the copy was a SIGSEGV."""
    assert transport == "doorbell"
    rig = Rig(transport)
    try:
        assert rig.step(1) is not None
        transport_ = rig.shim.doorbell
        check = transport_.check_answer
        inside, closing = threading.Event(), threading.Event()
        released_under_the_step: list[bool] = []

        def slow_check(*a, **kw):
            inside.set()
            assert closing.wait(5)
            # close() runs meanwhile: before the fix it released the regions here. Until close() either waits
            # for the link or has released them (bounded). A SIGSEGV alone cannot tell: the regions' mappings
            # now go with their last view (memory.shm_empty), so a release under the step no longer crashes.
            shim, until = rig.shim, time.monotonic() + 5
            while not shim._hold.waiters and transport_.buffers.hidden is not None and time.monotonic() < until:
                time.sleep(0.005)
            released_under_the_step.append(shim.doorbell is None or transport_.buffers.hidden is None)
            return check(*a, **kw)

        transport_.check_answer = slow_check
        step = Bounded(lambda: rig.step(2), "step-2")
        assert inside.wait(5), "step 2 was never answered"
        closing.set()
        rig.shim.close()
        out = step.join(JOIN_S, "maybe_forward")
        assert out is not None, "the answer in hand was dropped (it was complete and checked)"
        assert released_under_the_step == [False], "close() released the data plane while the step copied out of it"
        assert not rig.shim_errors(), rig.shim_errors()
        _assert_closed_cleanly(rig)
    finally:
        rig.stop()


class _ClosesInPreflight(PreflightHook):
    """Another thread closes the shim in the pre-flight: this rank has prepared its link and waits for its
    peer when the engine shuts down."""

    def at_preflight(self) -> None:
        Bounded(self.shim.close, "close").join(10, "close() during the pre-flight")


def scenario_close_during_the_preflight(transport: str) -> None:
    """Before, the step went on with the binding close() had dropped: an AssertionError logged as a shim
    error (with its trace) and counted against the breaker."""
    agree = _ClosesInPreflight()
    rig = Rig(transport, agree)
    agree.shim = rig.shim
    try:
        assert rig.step(1) is not None
        agree.armed = True
        assert rig.step(2) is None
        assert not agree.armed
        assert not rig.shim_errors(), rig.shim_errors()
        assert rig.shim.breaker.failures == 0, "a close() was counted against the sidecar"
        _assert_closed_cleanly(rig)
    finally:
        rig.stop()


SCENARIOS = {f.__name__: f for f in (scenario_close_then_step, scenario_close_during_a_step,
                                     scenario_close_while_the_answer_is_read, scenario_close_during_the_preflight)}

_CHILD = """
import sys, importlib.util
sys.path.insert(0, {tests!r})
spec = importlib.util.spec_from_file_location("shim_close", {path!r})
mod = importlib.util.module_from_spec(spec); sys.modules["shim_close"] = mod; spec.loader.exec_module(mod)
mod.SCENARIOS[{name!r}]({transport!r})
print("SCENARIO PASSED", flush=True)
"""


def _in_child(name: str, transport: str) -> None:
    """Run one scenario in a fresh interpreter: a SIGSEGV there fails this test instead of ending the session."""
    tests = str(_HERE.parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([tests, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(tests=tests, path=str(_HERE), name=name,
                                                               transport=transport)],
                          env=env, capture_output=True, text=True, timeout=90, start_new_session=True)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0 and "SCENARIO PASSED" in proc.stdout, (
        f"{name}[{transport}]: child exit {proc.returncode}"
        f"{' (SIGSEGV)' if proc.returncode == -11 else ' (SIGBUS)' if proc.returncode == -7 else ''}:\n{tail}")


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("transport", ["grpc", "doorbell"])
def test_close_between_steps_is_final_and_idempotent(transport):
    scenario_close_then_step(transport)


@pytest.mark.parametrize("transport", ["grpc", "doorbell"])
def test_close_during_a_step_wakes_it_and_unmaps_nothing_under_it(transport):
    _in_child("scenario_close_during_a_step", transport)


def test_close_while_the_doorbell_answer_is_copied_out_waits_for_the_copy():
    _in_child("scenario_close_while_the_answer_is_read", "doorbell")


@pytest.mark.parametrize("transport", ["grpc", "doorbell"])
def test_close_during_the_preflight_ends_the_step_cleanly(transport):
    _in_child("scenario_close_during_the_preflight", transport)


@pytest.mark.parametrize("transport", ["grpc", "doorbell"])
def test_close_with_a_step_unsettled_past_its_grace_keeps_the_link_until_it_settles(transport):
    """A step past its deadline and grace when close() comes: close() gives it late_grace_s more, then keeps
    its link (the sidecar may still write that step's K/V, and only the link tells when it is done).
    A later maybe_forward (None, no new link) drops it once the step settles. The answer is held until the
    test lets it land (after close() returned), so a close() that waited for the step to settle would still
    wait at the hang guard."""
    fake = (DoorbellNeverAnswered if transport == "doorbell" else FakeSidecar)(max_reqs=4)
    server = FakeServer(fake, short_socket_dir() / "rank0.sock").start()
    kv = shm_kv_cache()
    shim = DrafterShim(EngineConfig(tp_size=4, endpoint=server.endpoint, transport=transport, step_deadline_s=0.2,
                                    late_grace_s=0.2), FakeModel(), lambda: [s.tensor for s in kv],
                       ParallelContext(0, 1))
    answer = threading.Event()  # grpc: the fake answers step 1 only once set (the doorbell's never answers)
    try:
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            if transport == "grpc":
                fake.step_holds[1] = answer  # past deadline + grace, and past close()'s grace too
            assert shim.maybe_forward(ids, pos) is None and shim._unsettled is not None
            opens = shim.connection.opens
            closing = threading.Thread(target=shim.close, daemon=True)
            closing.start()
            closing.join(30)  # a hang guard only
            assert not closing.is_alive(), "close() waited past late_grace_s for the step to settle"
            assert fake.calls["UnbindKV"] == 1
            assert shim.connection.is_open and shim._unsettled is not None, "the unsettled step's link was dropped"
            assert shim.maybe_forward(ids, pos) is None and shim.connection.is_open  # still unsettled
            if transport == "doorbell":
                channel = shim.doorbell.bell
                assert channel.page.words is not None
                channel.page.words[bell.RESP_SEQ] = channel._seq  # the late answer lands
            answer.set()  # grpc: the late answer lands
            deadline = time.monotonic() + 10
            while shim.connection.is_open:
                assert time.monotonic() < deadline, "the settled step's link was never dropped"
                assert shim.maybe_forward(ids, pos) is None
                time.sleep(0.05)
            calls = fake.remote_calls()
            for _ in range(3):
                assert shim.maybe_forward(ids, pos) is None
        assert shim._unsettled is None and shim.doorbell is None and shim.connection.opens == opens
        assert fake.remote_calls() == calls and shim.stats.fallbacks[S.CLOSED] >= 3
        if transport == "doorbell":
            assert fake.calls["UnregisterBuffers"] == 1
        assert not [k for k in shim.stats.fallbacks if k.startswith("shim error")], dict(shim.stats.fallbacks)
    finally:
        answer.set()
        server.stop()
        for s in kv:
            s.close()


@pytest.mark.parametrize("transport", ["grpc", "doorbell"])
def test_close_on_the_thread_inside_the_step_is_finished_as_the_step_leaves(transport, monkeypatch):
    """close() on the very thread that holds the link (a Python signal handler runs on the main thread, maybe
    in the middle of its step; here: the fault hook, just before the step is sent). It cannot wait for the
    link (it would wait for itself, CLOSE_WAIT_S): it returns at once, and the step, woken, finishes the
    close as it leaves the link. CLOSE_WAIT_S is an hour here: a close() that waited for its own link would
    still wait at the step's hang guard."""
    monkeypatch.setattr(link, "CLOSE_WAIT_S", 3600.0)
    rig = Rig(transport)
    try:
        assert rig.step(1) is not None
        returned: list[bool] = []

        def close_here(_step_id: int) -> None:
            rig.shim.close()
            returned.append(True)

        rig.shim.fault_hook = close_here
        step = Bounded(lambda: rig.step(2), "step-2")
        step.join(JOIN_S, "maybe_forward")  # None, or the answer if it came before the wake (checked in rig.step)
        assert returned, "close() on the link's own thread did not return"
        # The step was woken, not left to its deadline (it would count DEADLINE), and finished the close.
        assert S.DEADLINE not in rig.shim.stats.fallbacks, dict(rig.shim.stats.fallbacks)
        assert rig.fake.calls["UnbindKV"] == 1
        _assert_closed_cleanly(rig)
    finally:
        rig.stop()


def test_a_close_interrupted_in_its_release_still_gives_the_link_back():
    """close() on the main thread at shutdown can be interrupted in its release (Ctrl-C while it gives an
    unsettled step its grace: KeyboardInterrupt out of time.sleep). The link was then never given back: every
    later entry to it (another thread's maybe_forward or connect(), the engine's step thread) waited for it
    without a deadline, for ever. The interrupt still goes up; the link is free."""
    rig = Rig("grpc")
    try:
        assert rig.step(1) is not None

        def interrupted() -> None:
            raise KeyboardInterrupt

        rig.shim._release = interrupted
        with pytest.raises(KeyboardInterrupt):
            rig.shim.close()
        assert Bounded(rig.shim.connect, "connect").join(5.0, "connect() after the interrupted close") == S.CLOSED
        assert Bounded(lambda: rig.step(2), "step-2").join(5.0, "maybe_forward after the interrupted close") is None
    finally:
        rig.stop()


def test_close_on_the_step_thread_before_the_step_is_sent_sends_nothing():
    """close() on the link's own thread (a signal handler) after the step entered the link, before it is sent:
    no waiter to wake yet, so the step itself must see the close and send nothing (else it ran on a closing
    shim, and handed the engine its tensor)."""
    rig = Rig("grpc")
    try:
        assert rig.step(1) is not None
        request = rig.shim._request

        def closing_request(*a, **kw):
            rig.shim.close()
            return request(*a, **kw)

        rig.shim._request = closing_request
        sent = len(rig.fake.requests)
        assert Bounded(lambda: rig.step(2), "step-2").join(JOIN_S, "maybe_forward") is None
        assert len(rig.fake.requests) == sent, "the step was sent after close()"
        assert S.CLOSED in rig.shim.stats.fallbacks and S.DEADLINE not in rig.shim.stats.fallbacks
        _assert_closed_cleanly(rig)
    finally:
        rig.stop()


def test_a_connect_that_waited_for_the_link_while_the_ranks_turned_off_does_nothing():
    """connect() reads `enabled` before it waits for the link; a step's turn-off (its _disable, holding the
    link) releases the binding meanwhile. connect() must look again once it has the link, or it re-opens and
    re-binds a shim that is off, and nothing releases that before close()."""
    rig = Rig("grpc")
    try:
        assert rig.step(1) is not None
        binds = rig.fake.calls["BindKV"]
        with rig.shim._link():
            connecting = Bounded(rig.shim.connect, "connect")
            wait_until(lambda: rig.shim._hold.waiters, 5, "connect() waits for the link", interval_s=0.005)
            assert rig.shim._hold.waiters == 1, "connect() never waited for the link"
            rig.shim._disable("a peer engine rank's sidecar refuses")  # as a step's turn-off does, in the link
        assert connecting.join(5.0, "connect()") == "off: a peer engine rank's sidecar refuses"
        assert rig.fake.calls["BindKV"] == binds and not rig.shim.connection.is_open
    finally:
        rig.shim.close()
        rig.stop()


def test_a_close_that_finds_the_link_held_past_its_wait_leaves_the_release_to_the_holder(monkeypatch):
    """close() waits CLOSE_WAIT_S for a thread using the link (a readiness check's bounded calls, on another
    thread); past that it returns and the thread inside releases as it leaves: nothing is released under it."""
    monkeypatch.setattr(link, "CLOSE_WAIT_S", 0.05)
    rig = Rig("grpc")
    try:
        assert rig.step(1) is not None
        inside, leave = threading.Event(), threading.Event()

        def hold() -> bool:
            with rig.shim._link():
                inside.set()
                assert leave.wait(10)
                return rig.shim.connection.is_open and rig.fake.calls["UnbindKV"] == 0

        holder = Bounded(hold, "the link's holder")
        assert inside.wait(5)
        rig.shim.close()  # gives up waiting for the link after CLOSE_WAIT_S
        assert rig.fake.calls["UnbindKV"] == 0 and rig.shim.connection.is_open, "close() released under the holder"
        leave.set()
        assert holder.join(5, "the link's holder") is True, "the link was released while its holder used it"
        assert rig.fake.calls["UnbindKV"] == 1  # released by the holder as it left
        _assert_closed_cleanly(rig)
    finally:
        rig.stop()
