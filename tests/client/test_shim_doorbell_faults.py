"""The shim's doorbell transport when its answer or its liveness stream goes wrong, and an unsettled step's
link when the shim turns off: the engine's stream stays ordered and nothing is kept until exit."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest
import torch

from dspark_sidecar.client.config import EngineConfig
from dspark_sidecar.client.forward_context import set_forward_context
from dspark_sidecar.client.shim import BAD_ANSWER, DEADLINE, STREAM, UNSETTLED, DrafterShim
from dspark_sidecar.drafter.parallel import ParallelContext
from dspark_sidecar.proto import codec
from dspark_sidecar.proto import doorbell as bell
from dspark_sidecar.proto import sidecar_pb2 as pb
from helpers.engine_fakes import (
    DoorbellNeverAnswered, FakeModel, FakeServer, PreflightHook, recording_shm, shm_kv_cache, short_socket_dir,
    step_inputs,
)
from helpers.waiting import wait_until


def _shim(endpoint: str, par, **cfg) -> DrafterShim:
    kv = shm_kv_cache()
    shim = DrafterShim(EngineConfig(tp_size=4, endpoint=endpoint, transport="doorbell", **cfg), FakeModel(),
                       lambda: [s.tensor for s in kv], par)
    shim._test_kv = kv  # kept alive with the shim
    return shim


@contextlib.contextmanager
def _never_answered(**cfg):
    """A shim on the doorbell of a fake sidecar that never answers a ring (tests play its part)."""
    server = FakeServer(DoorbellNeverAnswered(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    shim = _shim(server.endpoint, ParallelContext(0, 1), **cfg)
    try:
        yield server, shim
    finally:
        shim.close()
        server.stop()


def _when_rung(channel, then) -> None:
    """Play the sidecar on another thread: once the ring lands, call then()."""
    def run() -> None:
        deadline = time.monotonic() + 5
        while (channel._seq == 0 or channel.page.word(bell.REQ_SEQ) != channel._seq) and time.monotonic() < deadline:
            time.sleep(0.001)
        then()

    threading.Thread(target=run, daemon=True).start()


def _answer_with(channel, payload: bytes) -> None:
    """Once the ring lands, publish `payload` as the answer."""
    _when_rung(channel, lambda: channel.page.write(channel.page.resp_area, payload, bell.RESP_LEN, bell.RESP_SEQ,
                                                   channel._seq))


def test_an_undecodable_answer_still_orders_the_engine_stream_and_drops_the_link():
    """An answer means the sidecar launched the step, whose kernels may still read the input rows and
    write K/V. Bytes that do not decode must not skip ordering the engine's stream after those writes
    (before, the decode raised first), and the link is dropped as a broken stream."""
    with _never_answered(step_deadline_s=1.0, late_grace_s=0.2) as (server, shim):
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.connect() is None and shim.doorbell is not None
            channel = shim.doorbell.bell
            ordered = []
            channel._after_outputs = lambda: ordered.append(channel._seq)
            shim.fault_hook = lambda _sid: _answer_with(channel, b"\xff\xff\xff\xff")
            assert shim.maybe_forward(ids, pos) is None
        assert ordered == [1] and shim._unsettled is None
        assert shim.stats.fallbacks[STREAM] == 1 and shim.doorbell is None  # dropped, re-attached at the next step
        assert server.sidecar.calls["UnregisterBuffers"] == 1


def _close_unanswered(channel) -> None:
    """A sidecar whose doorbell was replaced once the ring lands: it closes the page, no answer."""
    _when_rung(channel, lambda: channel.page.words.__setitem__(bell.CLOSED, 1))


def test_a_doorbell_the_sidecar_closes_under_a_step_ends_the_step_settled_and_is_attached_again():
    """Another client's AttachDoorbell replaces this engine's doorbell on the rank. Before, the sidecar
    stopped the old one silently: the engine's ring was never answered, the step stayed unsettled for
    as long as the sidecar lived (liveness still up), and every later step fell back."""
    with _never_answered(step_deadline_s=5.0, late_grace_s=0.2) as (server, shim):
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.connect() is None and shim.doorbell is not None
            channel = shim.doorbell.bell
            shim.fault_hook = lambda _sid: _close_unanswered(channel)
            assert shim.maybe_forward(ids, pos) is None
            # Told, not timed out: the fallback is the closed stream's, none the step deadline's.
            assert shim._unsettled is None and shim.stats.fallbacks[STREAM] == 1 and shim.doorbell is None
            assert dict(shim.stats.fallbacks) == {STREAM: 1}, dict(shim.stats.fallbacks)
            shim.fault_hook = None
            assert shim.connect() is None and shim.doorbell is not None and shim.doorbell.bell is not channel
        assert server.sidecar.calls["AttachDoorbell"] == 2


def test_a_doorbell_the_sidecar_closed_between_steps_is_attached_again_before_the_next():
    with _never_answered(step_deadline_s=1.0, late_grace_s=0.2) as (server, shim):
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.connect() is None and shim.doorbell is not None
            old = shim.doorbell
            old.bell.page.words[bell.CLOSED] = 1  # the sidecar attached another client's doorbell meanwhile
            assert shim.connect() is None and shim.doorbell is not None and shim.doorbell is not old
        assert server.sidecar.calls["AttachDoorbell"] == 2 and server.sidecar.calls["UnregisterBuffers"] == 1


class _EndsLivenessInPreflight(PreflightHook):
    """Ends the doorbell's liveness stream while this rank waits in the pre-flight: as when the sidecar
    rank restarts while a peer is still binding."""

    def at_preflight(self) -> None:
        live = self.shim.doorbell.liveness
        live._call.cancel()
        wait_until(lambda: not live.alive, 5, "the cancelled liveness stream ended")


def test_a_liveness_stream_that_ends_between_steps_drops_and_reattaches_the_data_plane():
    """The step then goes over the gRPC stream, which ended with the liveness stream (one stream per link):
    a broken stream, the link dropped. Before the fix connection.stream() replaced the ended stream quietly,
    and the dead data plane was kept for good: its page and regions never released, never attached again,
    every later step on the gRPC stream."""
    server = FakeServer(DoorbellNeverAnswered(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    agree = _EndsLivenessInPreflight()
    shim = _shim(server.endpoint, agree)
    agree.shim = shim
    try:
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.connect() is None and shim.doorbell is not None
            dead = shim.doorbell
            agree.armed = True
            assert shim.maybe_forward(ids, pos) is None and shim.stats.fallbacks[STREAM] == 1
            for _ in range(3):
                shim.maybe_forward(ids, pos)
        calls = server.sidecar.calls
        assert calls["UnregisterBuffers"] == 1, "the dead data plane's regions were never released"
        assert calls["AttachDoorbell"] == 2 and shim.doorbell is not None and shim.doorbell is not dead
    finally:
        shim.close()
        server.stop()


class _PeerRefusesWhenAsked:
    world_size = 2

    def __init__(self) -> None:
        self.refuse = False

    def all_min(self, values: torch.Tensor) -> torch.Tensor:
        values = values.clone()
        if self.refuse and values.numel() == 5:
            values[1] = -1  # a peer engine rank's sidecar refuses for good
        return values


@contextlib.contextmanager
def _turning_off_with_a_step_unsettled():
    """(server, shim, ids, pos), inside the step's forward context: one step sent on the doorbell and never
    answered (unsettled past its late grace), and the ranks' next agreement turns every one off."""
    server = FakeServer(DoorbellNeverAnswered(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    agree = _PeerRefusesWhenAsked()
    shim = _shim(server.endpoint, agree, step_deadline_s=0.2, late_grace_s=0.2)
    try:
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is None and shim._unsettled is not None
            agree.refuse = True
            yield server, shim, ids, pos
    finally:
        shim._unsettled = None
        shim.close()
        server.stop()


def test_a_shim_turned_off_with_a_step_unsettled_releases_its_link_once_the_step_settles():
    """The drop asked for while the step was unsettled used to wait for a _prepare that an off shim
    never runs again: the page, the three regions and the channel stayed until the process exited."""
    with _turning_off_with_a_step_unsettled() as (server, shim, ids, pos):
        assert shim.maybe_forward(ids, pos) is None and not shim.enabled  # every rank turns off
        channel = shim.doorbell.bell
        assert shim.maybe_forward(ids, pos) is None
        assert server.sidecar.calls["UnregisterBuffers"] == 0  # unsettled: the link is kept
        channel.page.words[bell.RESP_SEQ] = channel._seq  # the late answer lands: the step settles
        assert shim.maybe_forward(ids, pos) is None
        # Before the helper's close: the drop, not the close, released the link.
        assert server.sidecar.calls["UnregisterBuffers"] == 1 and not shim.connection.is_open
        assert shim.doorbell is None


def test_a_shim_turned_off_with_a_step_unsettled_touches_no_data_plane_inside_cuda_graph_capture():
    """An off shim settles a deferred drop at the top of maybe_forward, ahead of the seed's checks: inside
    CUDA graph capture that looked at the step (its settled() orders the engine's stream after the
    sidecar's "outputs written" event) and closed the data plane (events recorded and queried on the
    capturing stream), work that invalidates the engine's capture. It waits for a call outside capture."""
    with _turning_off_with_a_step_unsettled() as (server, shim, ids, pos):
        assert shim.maybe_forward(ids, pos) is None and not shim.enabled
        transport = shim._unsettled[0]
        looks = []
        settled = transport.settled
        transport.settled = lambda step_id: looks.append(step_id) or settled(step_id)
        channel = shim.doorbell.bell
        channel.page.words[bell.RESP_SEQ] = channel._seq  # the late answer lands: the step settles
        shim.is_capturing = lambda: True
        assert shim.maybe_forward(ids, pos) is None
        assert looks == [] and shim._unsettled is not None and shim.doorbell is not None
        assert server.sidecar.calls["UnregisterBuffers"] == 0
        shim.is_capturing = lambda: False
        assert shim.maybe_forward(ids, pos) is None  # out of capture: the drop is made
        assert looks and shim._unsettled is None and shim.doorbell is None and not shim.connection.is_open
        assert server.sidecar.calls["UnregisterBuffers"] == 1


def test_a_doorbell_whose_page_fails_to_close_still_releases_the_step_buffers():
    """DoorbellTransport.close closed the doorbell, then the buffers: a doorbell close that raised (a
    driver error unregistering the page's GPU word, which _drop_link catches and logs) skipped the
    buffers, so their three regions stayed registered on the live sidecar (under CUDA IPC about 5.5 MB
    of the engine's memory at 32 requests) and their shared memory stayed mapped, once per drop."""
    server = FakeServer(DoorbellNeverAnswered(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    shim = _shim(server.endpoint, ParallelContext(0, 1))
    try:
        with recording_shm() as shm:
            assert shim.connect() is None and shim.doorbell is not None
        assert shm.created, "no segment recorded: the data plane's were not seen"
        transport = shim.doorbell
        stock_close = transport.bell.close

        def failing_close() -> None:
            stock_close()
            raise RuntimeError("CUDA error: invalid argument (unregistering the doorbell page)")

        transport.bell.close = failing_close
        shim._drop_link()  # as after a broken stream; must not raise
        assert shim.doorbell is None and not shim.connection.is_open
        assert "shim error in closing the data plane: RuntimeError" in shim._logged
        assert server.sidecar.calls["UnregisterBuffers"] == 1, "the step buffers were never released"
        assert transport.buffers.embeds is None and shm.left() == set()
    finally:
        shim.close()
        server.stop()


class _UnansweredBell:
    """A doorbell never answered: each wait sleeps its timeout and finds nothing (records the timeouts)."""

    def __init__(self, answer=None) -> None:
        self.timeouts: list[float] = []
        self.answer = answer

    def wait(self, step_id: int, timeout_s: float):
        self.timeouts.append(timeout_s)
        if self.answer is not None:
            return self.answer
        time.sleep(timeout_s)
        return None


def test_a_doorbell_wait_after_interrupt_gives_up_at_once_and_still_returns_an_answer_in_hand():
    """DoorbellTransport.interrupt: "every later wait gives up at once". A later wait polled the page for
    POLL_S first (50 ms more of a closing shim's late-grace wait); it now looks once, without waiting,
    and still returns an answer already there, as StepStream.wait does."""
    import types

    from dspark_sidecar.client import doorbell_transport as dt
    from dspark_sidecar.client.connection import StepInterrupted
    from dspark_sidecar.proto import sidecar_pb2 as pb

    t = object.__new__(dt.DoorbellTransport)
    t.bell, t.liveness, t.interrupted = _UnansweredBell(), types.SimpleNamespace(alive=True, end=None), False
    t.interrupt()
    with pytest.raises(StepInterrupted):
        t.wait(7, 2.0)
    assert t.bell.timeouts == [0.0], f"polled {t.bell.timeouts} after interrupt(), not once at once"

    answer = pb.DraftStepResponse(step_id=7)
    t.bell = _UnansweredBell(answer)
    assert t.wait(7, 2.0) is answer and t.bell.timeouts == [0.0]


def test_a_liveness_stream_that_ended_before_the_readiness_check_is_attached_again_before_the_step():
    """The readiness check's own look at the ended stream. The test above ends it inside the pre-flight,
    where the step's broken gRPC stream drops the link anyway: deleting the check passed it. Ended while
    no step runs, the link is dropped and the data plane attached again before the step, which then goes
    out on the new doorbell, not as a broken stream."""
    server = FakeServer(DoorbellNeverAnswered(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    shim = _shim(server.endpoint, ParallelContext(0, 1), step_deadline_s=0.2, late_grace_s=0.2)
    try:
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.connect() is None and shim.doorbell is not None
            dead = shim.doorbell
            dead.liveness._call.cancel()
            wait_until(lambda: not dead.liveness.alive, 5, "the cancelled liveness stream ended")
            assert shim.maybe_forward(ids, pos) is None  # the fake never answers a ring
        assert STREAM not in shim.stats.fallbacks, dict(shim.stats.fallbacks)
        calls = server.sidecar.calls
        assert calls["UnregisterBuffers"] == 1 and calls["AttachDoorbell"] == 2
        assert shim.doorbell is not None and shim.doorbell is not dead
    finally:
        shim._unsettled = None
        shim.close()
        server.stop()


def _good_answer(transport, step_id: int, rows: int) -> bytes:
    """A well-formed answer naming `step_id`, its hidden states in the output region (whatever is there)."""
    b = transport.buffers
    ref = codec.region_tensor_ref(b.dtype, (rows, b.embeds.shape[1]), b.hidden_id, 0)
    return pb.DraftStepResponse(step_id=step_id, hidden_states=ref).SerializeToString()


def test_an_answer_naming_another_step_is_no_result_and_counts_against_the_breaker():
    """The output region then holds what the previous step (or nothing) left there: handed back, the engine
    got a wrong tensor."""
    with _never_answered(step_deadline_s=2.0, late_grace_s=0.2) as (server, shim):
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.connect() is None and shim.doorbell is not None
            t = shim.doorbell
            shim.fault_hook = lambda sid: _answer_with(t.bell, _good_answer(t, sid + 1, pos.numel()))
            assert shim.maybe_forward(ids, pos) is None
        assert dict(shim.stats.fallbacks) == {BAD_ANSWER: 1} and shim.breaker.failures == 1


def test_a_liveness_stream_that_ends_during_the_wait_ends_the_step_at_once():
    """A sidecar rank that dies never answers the ring: its liveness stream, not the step deadline, says so
    (a broken stream, counted; the link dropped and nothing left unsettled, since a dead process writes nothing)."""
    with _never_answered(step_deadline_s=3.0, late_grace_s=0.2) as (server, shim):
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.connect() is None and shim.doorbell is not None
            t = shim.doorbell
            shim.fault_hook = lambda _sid: _when_rung(t.bell, t.liveness._call.cancel)
            t0 = time.monotonic()
            assert shim.maybe_forward(ids, pos) is None
            took = time.monotonic() - t0
        assert dict(shim.stats.fallbacks) == {STREAM: 1}, dict(shim.stats.fallbacks)
        assert took < 2.0, f"waited {took:.2f} s for a dead sidecar's answer"
        assert shim._unsettled is None and shim.doorbell is None and shim.breaker.failures == 1


def test_a_late_answer_in_the_grace_settles_the_step_and_is_still_no_result():
    """Past the step deadline the engine has given up on the step: an answer in late_grace_s only settles it
    (nothing kept unsettled), and the step is a counted deadline fallback, never the late tensor."""
    with _never_answered(step_deadline_s=0.2, late_grace_s=2.0) as (server, shim):
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.connect() is None and shim.doorbell is not None
            t = shim.doorbell

            def late(sid: int) -> None:
                payload = _good_answer(t, sid, pos.numel())
                _when_rung(t.bell, lambda: (time.sleep(0.6), t.bell.page.write(
                    t.bell.page.resp_area, payload, bell.RESP_LEN, bell.RESP_SEQ, t.bell._seq)))

            shim.fault_hook = late
            t0 = time.monotonic()
            assert shim.maybe_forward(ids, pos) is None
            took = time.monotonic() - t0
        assert dict(shim.stats.fallbacks) == {DEADLINE: 1}, dict(shim.stats.fallbacks)
        assert shim._unsettled is None, "an answer inside the grace left the step unsettled"
        assert took < 1.8 and shim.breaker.failures == 1


@pytest.mark.parametrize("how", ["liveness ends", "sidecar closes the page"])
def test_an_unsettled_step_settles_when_the_sidecar_goes_or_closes_the_doorbell(how):
    """After either, nothing of the step runs on the sidecar any more. Read as still unsettled, every later
    step fell back (UNSETTLED) and the link was never dropped, for as long as the sidecar lived."""
    with _never_answered(step_deadline_s=0.2, late_grace_s=0.2) as (server, shim):
        ids, pos, meta = step_inputs(2)
        with set_forward_context(meta):
            assert shim.maybe_forward(ids, pos) is None and shim._unsettled is not None
            assert shim.breaker.failures == 1  # the deadline counts
            old = shim.doorbell
            if how == "liveness ends":
                old.liveness._call.cancel()
                wait_until(lambda: not old.liveness.alive, 5, "the cancelled liveness stream ended")
            else:
                old.bell.page.words[bell.CLOSED] = 1
            shim.maybe_forward(ids, pos)  # the new doorbell never answers either
        assert UNSETTLED not in shim.stats.fallbacks, dict(shim.stats.fallbacks)
        assert shim.doorbell is not None and shim.doorbell is not old
        assert server.sidecar.calls["AttachDoorbell"] == 2 and server.sidecar.calls["UnregisterBuffers"] == 1
        shim._unsettled = None  # the second step's


def test_a_doorbell_wait_never_polls_past_its_deadline():
    """DoorbellTransport.wait's polls add up to its timeout at most (each at most POLL_S), and it returns then."""
    import types

    from dspark_sidecar.client import doorbell_transport as dt

    t = object.__new__(dt.DoorbellTransport)
    t.bell, t.liveness, t.interrupted = _UnansweredBell(), types.SimpleNamespace(alive=True, end=None), False
    t0 = time.monotonic()
    assert t.wait(7, 0.12) is None
    assert time.monotonic() - t0 < 1.0  # loose: the polls' sum below is the exact check
    assert sum(t.bell.timeouts) <= 0.12 + 1e-6 and max(t.bell.timeouts) <= dt.POLL_S, t.bell.timeouts


class _RefusesBuffers(DoorbellNeverAnswered):
    def RegisterBuffers(self, request, context):
        self.calls["RegisterBuffers"] += 1
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "no data plane here")


def test_step_buffers_refused_after_the_doorbell_attached_leave_no_page_behind():
    server = FakeServer(_RefusesBuffers(max_reqs=4), short_socket_dir() / "rank0.sock").start()
    shim = _shim(server.endpoint, ParallelContext(0, 1))
    try:
        with recording_shm() as shm:
            assert shim.connect() is None and shim.doorbell is None  # the gRPC stream instead
        assert server.sidecar.calls["AttachDoorbell"] == 1 and server.sidecar.calls["RegisterBuffers"] == 1
        assert shm.created and shm.left() == set(), f"left in /dev/shm: {sorted(shm.left())}"
    finally:
        shim.close()
        server.stop()
