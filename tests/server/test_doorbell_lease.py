"""A doorbell attached under an engine lease stops when that lease ends, and only then (AttachDoorbellRequest.lease)."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import grpc
import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.proto import doorbell as bell  # noqa: E402
from dspark_sidecar.proto import memory  # noqa: E402
from dspark_sidecar.proto import sidecar_pb2 as pb  # noqa: E402
from dspark_sidecar.server import servicer as servicer_mod  # noqa: E402
from dspark_sidecar.server.errors import SidecarError  # noqa: E402
from dspark_sidecar.server.kv_binding import MemoryBindings  # noqa: E402
from dspark_sidecar.server.lease import TOKEN  # noqa: E402
from dspark_sidecar.server.servicer import DrafterServicer, Lifecycle  # noqa: E402
from helpers.engine_fakes import short_socket_dir  # noqa: E402
from helpers.rank_fakes import IdleLoop  # noqa: E402
from helpers.waiting import wait_until  # noqa: E402

CAP = 4096
CTX = SimpleNamespace(peer=lambda: "unix:/tmp/engine.sock", is_active=lambda: True, time_remaining=lambda: None)


@pytest.fixture
def exits(monkeypatch):
    """The rank's os._exit codes, recorded instead (the servicer goes on past one, which the real exit ends)."""
    codes: list[int] = []
    monkeypatch.setattr(servicer_mod.os, "_exit", codes.append)
    return codes


@pytest.fixture
def rank(exits):
    """A CPU rank's servicer with a lease socket, and the pages attached to it (closed after the test)."""
    ctx = SimpleNamespace(rank=0, fast=None, memory=MemoryBindings(None, 1, 0, torch.float32, torch.device("cpu")),
                          model=SimpleNamespace(device=torch.device("cpu")), cfg=SimpleNamespace(sliding_window=64),
                          metrics=SimpleNamespace(bound=lambda: None))
    svc = DrafterServicer(ctx, IdleLoop(), Lifecycle(), None, None, "",  # type: ignore[arg-type]
                          run_dir=short_socket_dir())
    svc.pages = []
    yield svc
    svc.close_doorbell()
    svc.close_leases()
    for p in svc.pages:
        p.close()


def _lease(svc) -> tuple[socket.socket, int]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(svc.leases.path)
    data = b""
    while len(data) < TOKEN.size:
        data += s.recv(TOKEN.size - len(data))
    return s, TOKEN.unpack(data)[0]


def _attach(svc, lease: int = 0):
    """Attach a fresh page under `lease`; the page's words (word [6]: the sidecar stopped serving it)."""
    page = memory.shm_empty((bell.HEADER + 2 * CAP,), torch.uint8)
    svc.pages.append(page)
    svc.AttachDoorbell(pb.AttachDoorbellRequest(page=memory.export_handle(page.tensor), capacity_bytes=CAP,
                                                lease=lease), CTX)
    return bell.Page(page.tensor.numpy(), CAP)


def _stopped(svc, words) -> bool:
    return svc.doorbell is None and bool(words.word(bell.CLOSED))


def test_the_doorbell_stops_when_the_lease_it_was_attached_under_ends(rank, exits):
    """Before: doorbells carried no lease, so a gone engine's doorbell kept polling its page (a thread, the page,
    its FIFO and events) until the next AttachDoorbell."""
    conn, token = _lease(rank)
    words = _attach(rank, token)
    d = rank.doorbell
    assert d is not None and d.is_alive() and not words.word(bell.CLOSED)
    conn.close()  # the engine ends (its process's descriptors closed by the kernel)
    wait_until(lambda: _stopped(rank, words), 10, "the doorbell to stop")
    wait_until(lambda: not d.is_alive(), 10, "its thread to end")
    assert exits == []  # the device got past its steps (none wait on an engine's event on a CPU rank)


def test_another_lease_s_end_or_none_leaves_the_doorbell_serving(rank):
    a, ta = _lease(rank)
    b, tb = _lease(rank)
    words = _attach(rank, tb)
    d = rank.doorbell
    a.close()  # another engine's lease (an old one, or a client that only connected)
    wait_until(lambda: not rank.leases.live(ta), 5, "lease a to end")
    rank.lease_lost(ta)  # as the keeper's thread does (again: idempotent)
    assert rank.doorbell is d and d.is_alive() and not words.word(bell.CLOSED)
    unleased = _attach(rank)  # the engine re-attaches without a lease: b's end has nothing of it to stop
    d2 = rank.doorbell
    wait_until(lambda: words.word(bell.CLOSED), 10, "the replaced doorbell to close its page")
    b.close()
    wait_until(lambda: not rank.leases.live(tb), 5, "lease b to end")
    rank.lease_lost(tb)
    assert rank.doorbell is d2 and d2.is_alive() and not unleased.word(bell.CLOSED)


def test_doorbells_replaced_or_stopped_and_ended_are_not_kept(rank):
    """Kept among the retiring only while still inside a step: each attach (an engine's reconnect) otherwise kept
    one more ended doorbell, with its events, for the process's life."""
    for _ in range(3):
        _attach(rank)
    conn, token = _lease(rank)
    _attach(rank, token)
    conn.close()
    wait_until(lambda: rank.doorbell is None, 10, "the doorbell to stop")
    with rank._attach_lock:  # the stop's _retire done
        assert rank._retiring == []


def test_a_doorbell_under_a_lease_already_ended_is_refused_and_the_attached_one_stands(rank):
    words = _attach(rank)
    d = rank.doorbell
    conn, token = _lease(rank)
    conn.close()
    wait_until(lambda: not rank.leases.live(token), 5, "the lease to end")
    with pytest.raises(SidecarError) as err:
        _attach(rank, token)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "LEASE_LOST"
    assert rank.doorbell is d and d.is_alive() and not words.word(bell.CLOSED)


def test_a_lease_that_ends_while_its_doorbell_attaches_stops_it(rank, monkeypatch):
    """The lease is live at AttachDoorbell's check, and its end's release runs while the attach still holds the
    attach lock: that release must find the doorbell once published, or it served a gone engine's page on."""
    conn, token = _lease(rank)
    real = servicer_mod.Doorbell

    def doorbell_while_the_engine_dies(*args, **kwargs):
        conn.close()
        # The keeper has marked it gone and its release is waiting for the attach lock.
        wait_until(lambda: not rank.leases.live(token), 5, "the keeper to see the lease end")
        return real(*args, **kwargs)

    monkeypatch.setattr(servicer_mod, "Doorbell", doorbell_while_the_engine_dies)
    words = _attach(rank, token)
    wait_until(lambda: _stopped(rank, words), 10, "the doorbell attached meanwhile to stop")


@pytest.mark.parametrize("device", ["stuck", "lost"])
def test_a_rank_whose_device_cannot_get_past_a_gone_engine_s_steps_exits_for_a_restart(rank, exits, monkeypatch,
                                                                                       caplog, device):
    """Run 301 (an H100): a stream waiting on a killed engine's event that its GPU had not yet recorded never goes
    on (without MPS), and under MPS the engine's end with GPU work in flight leaves this process's context with a
    sticky error. Either way nothing the rank queues runs again: it must not serve on as if it could."""
    def gets_past(self, within_s):
        if device == "lost":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return False

    monkeypatch.setattr(servicer_mod.Doorbell, "device_gets_past", gets_past)
    conn, token = _lease(rank)
    words = _attach(rank, token)
    with caplog.at_level("ERROR", logger="dspark_sidecar.server"):
        conn.close()
        wait_until(lambda: exits, 10, "the rank to exit")
    assert exits == [3] and _stopped(rank, words)
    assert ("has not got past the gone engine" if device == "stuck" else "the device failed after") in caplog.text


class _Mark:
    """torch.cuda.Event on a stream: passed after `after` queries (None: never)."""

    after: int | None = 0
    made: list["_Mark"] = []

    def __init__(self) -> None:
        self.queries, self.on = 0, None
        _Mark.made.append(self)

    def record(self, stream) -> None:
        self.on = stream

    def query(self) -> bool:
        self.queries += 1
        return _Mark.after is not None and self.queries > _Mark.after


@pytest.mark.parametrize("after, expected", [(3, True), (None, False)])
def test_the_device_check_polls_a_mark_on_the_doorbell_s_stream_within_its_bound(monkeypatch, after, expected):
    from dspark_sidecar.server import doorbell as doorbell_mod

    _Mark.after, _Mark.made = after, []
    monkeypatch.setattr(doorbell_mod.torch.cuda, "Event", _Mark)
    d = doorbell_mod.Doorbell.__new__(doorbell_mod.Doorbell)
    d.input_event, d._stream = object(), "the doorbell's stream"
    assert d.device_gets_past(0.2) is expected
    assert [m.on for m in _Mark.made] == ["the doorbell's stream"] and _Mark.made[0].queries > (after or 1)
    assert _Mark.made[0].queries <= 0.2 / 1e-3 + 2  # polled with a nap: a bare spin held a core and the GIL for 30 s
    d.input_event = None  # nothing it queued waits on an engine: nothing to look at
    assert d.device_gets_past(0.2) and len(_Mark.made) == 1
    d.input_event, d._stream = object(), None  # stopped before its thread served: it queued nothing on any stream
    assert d.device_gets_past(0.2) and len(_Mark.made) == 1


def test_a_lease_without_a_doorbell_still_has_its_rank_exit_when_the_device_is_lost(rank, exits, monkeypatch, caplog):
    """Under MPS an engine that ends with GPU work in flight leaves the other clients' contexts with a sticky error
    (run 301) whatever they held of it: an engine on the gRPC transport too. Its lease's release hit the error
    unmapping the cache, logged it as a failed release, and the rank served on (health SERVING) with a lost context."""
    def lost(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(servicer_mod, "_device_answers", lost)
    conn, _ = _lease(rank)
    with caplog.at_level("ERROR", logger="dspark_sidecar.server"):
        conn.close()
        wait_until(lambda: exits, 10, "the rank to exit")
    assert exits == [3] and "the device failed after" in caplog.text


def test_the_device_check_runs_on_the_stopped_doorbell_with_its_bound_and_holds_up_no_attach(rank, exits,
                                                                                             monkeypatch):
    """The check looks once the gone engine's doorbell has ended (its queued step released and its page closed:
    looked at before, a pre-launched step still waiting on the dead engine's GPU word would read as stuck), for
    GONE_ENGINE_DEVICE_S, and outside the attach lock: a restarted engine's AttachDoorbell is not held up for the
    check's bound."""
    seen, entered, go_on = [], threading.Event(), threading.Event()
    pages = []

    def gets_past(self, within_s):
        seen.append((self.is_alive(), bool(pages[0].word(bell.CLOSED)), within_s))
        entered.set()
        go_on.wait(10)
        return True

    monkeypatch.setattr(servicer_mod.Doorbell, "device_gets_past", gets_past)
    conn, token = _lease(rank)
    pages.append(_attach(rank, token))
    conn.close()
    try:
        assert entered.wait(10), "the lease's end never checked the device"
        assert seen == [(False, True, servicer_mod.GONE_ENGINE_DEVICE_S)]
        conn2, token2 = _lease(rank)  # the engine, restarted, attaches again while the check still polls
        attach = threading.Thread(target=_attach, args=(rank, token2))
        attach.start()
        attach.join(5)
        assert not attach.is_alive(), "AttachDoorbell waited on the gone engine's device check"
    finally:
        go_on.set()
    d2 = rank.doorbell
    wait_until(lambda: not rank.leases.live(token) and d2.is_alive(), 5, "the new doorbell to serve on")
    assert exits == [] and rank.doorbell is d2 and len(seen) == 1
    conn2.close()


def test_a_gpu_doorbell_s_thread_names_its_stream_for_the_check(monkeypatch):
    """The check marks the stream each step's wait on the input event went to: the doorbell thread's, looked up as
    its loop starts. Left unset, the check would read "nothing queued" on every GPU rank and never look."""
    from dspark_sidecar.server import doorbell as doorbell_mod

    cuda = doorbell_mod.torch.cuda
    current = []
    monkeypatch.setattr(cuda, "set_device", current.append)
    monkeypatch.setattr(cuda, "current_stream", lambda device: ("the stream of", current[-1], device))
    d = doorbell_mod.Doorbell.__new__(doorbell_mod.Doorbell)
    d.device, d._stream, d._halt = torch.device("cuda", 1), None, threading.Event()
    d._halt.set()  # stopped before its first ring: the loop sets up, then ends
    t = threading.Thread(target=d._ring_loop)  # on a thread of its own: it lowers that thread's timer slack
    t.start()
    t.join(10)
    dev = torch.device("cuda", 1)
    assert not t.is_alive() and d._stream == ("the stream of", dev, dev)


def test_the_check_is_not_held_up_for_good_by_a_release_waiting_in_the_attach_lock(rank, exits, monkeypatch):
    """At TP 1 a release of regions waits on the device inside the attach lock (review 285): with the device
    waiting on the gone engine's unrecorded event it never lets go, and the lease's release waited on that lock for
    good, the rank serving on. Past the bound, the doorbell is judged as it stands."""
    monkeypatch.setattr(servicer_mod, "GONE_ENGINE_DEVICE_S", 0.2)
    monkeypatch.setattr(servicer_mod.Doorbell, "device_gets_past", lambda self, within_s: False)
    conn, token = _lease(rank)
    _attach(rank, token)
    with rank._attach_lock:  # the stuck release's hold
        conn.close()
        wait_until(lambda: exits, 10, "the rank to exit though the attach lock stays held")
    assert exits[0] == 3


def test_a_lease_whose_doorbell_waits_on_no_engine_event_still_has_the_device_asked(rank, exits, monkeypatch, caplog):
    """A doorbell attached without an input event (an engine whose host writes the inputs), or stopped before its
    thread served (no stream yet), queued nothing that waits on its engine, so its own check passes at once. The
    device must still be asked, as for a lease without a doorbell: under MPS the engine's end leaves this context
    with a sticky error whatever it held of the engine's, and the rank served on with a lost context."""
    def lost(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(servicer_mod, "_device_answers", lost)
    conn, token = _lease(rank)
    words = _attach(rank, token)  # a CPU rank's doorbell: no input event
    with caplog.at_level("ERROR", logger="dspark_sidecar.server"):
        conn.close()
        wait_until(lambda: exits, 10, "the rank to exit")
    assert exits == [3] and _stopped(rank, words) and "the device failed after" in caplog.text


@pytest.mark.parametrize("ended", [False, True])
def test_a_gone_engine_s_doorbell_replaced_before_its_lease_s_release_is_still_judged(rank, exits, monkeypatch,
                                                                                       ended):
    """Another engine's AttachDoorbell (the gone one's restart) can retire the gone engine's doorbell before that
    engine's lease's release runs (the releases run one at a time, and this one waits for the attach lock the
    attach holds). The release then found no doorbell of its lease and asked the device only whether it answers,
    not whether it gets past the steps that doorbell queued: a doorbell still inside its end (at TP 1 its release
    waits on a device stuck on the gone engine's event, for good) was never judged, and the rank, the new doorbell
    following the stuck one and never serving, stayed up for good. One that has ended is not judged: the live
    engine's doorbell serves after it, and may have queued a step behind which a mark would wait."""
    from dspark_sidecar.server import doorbell as doorbell_mod

    monkeypatch.setattr(doorbell_mod, "STOP_S", 0.1)  # the stuck doorbell's stop gives up at once
    judged = []

    def gets_past(self, within_s):
        judged.append(self)
        return False  # the device waits on the gone engine's event

    monkeypatch.setattr(servicer_mod.Doorbell, "device_gets_past", gets_past)
    rank.leases._on_lost = lambda token: None  # the releases by hand, in the order the race gives them
    conn_a, ta = _lease(rank)
    _attach(rank, ta)
    gone, unstuck = rank.doorbell, threading.Event()
    real_release = gone._release
    gone._release = lambda: (unstuck.wait(10), real_release())  # its end waits on the stuck device
    conn_a.close()
    wait_until(lambda: not rank.leases.live(ta), 5, "lease a to end")
    conn_b, tb = _lease(rank)
    _attach(rank, tb)  # the restarted engine's attach takes the lock first
    new = rank.doorbell
    try:
        assert gone.is_alive() and new is not gone and gone in rank._retiring
        if ended:  # after the attach's retire: still among the retiring
            unstuck.set()
            wait_until(lambda: not gone.is_alive(), 5, "the gone engine's doorbell to end")
        rank.lease_lost(ta)  # the gone engine's release, after the attach
        assert (judged, exits) == (([], []) if ended else ([gone], [3]))
        assert rank.doorbell is new and new.is_alive()  # the live engine's doorbell stands
    finally:
        unstuck.set()
    wait_until(lambda: not gone.is_alive(), 5, "the gone engine's doorbell to end")
    conn_b.close()


def test_a_lease_that_ends_just_after_attachdoorbell_checked_it_still_stops_the_doorbell(rank, monkeypatch):
    """The lease is checked under the attach lock, which the lease's release takes to stop its doorbell: checked
    outside it, a lease that ended between the check and the publishing had its release find no doorbell and
    return, and the doorbell then published served a gone engine's page for good."""
    conn, token = _lease(rank)
    released = threading.Event()
    on_lost = rank.leases._on_lost
    rank.leases._on_lost = lambda t: (on_lost(t), released.set())
    real_live = rank._lease_live

    def live_then_the_engine_dies(t):
        live = real_live(t)
        conn.close()
        wait_until(lambda: not real_live(t), 5, "the keeper to see the lease end")
        released.wait(0.3)  # the release may not run to its end now (it waits for the attach lock)
        return live

    rank._lease_live = live_then_the_engine_dies
    words = _attach(rank, token)
    wait_until(lambda: _stopped(rank, words), 10, "the doorbell attached meanwhile to stop")


def test_the_device_is_asked_with_a_mark_on_an_idle_stream_of_its_own_never_waited_for(monkeypatch):
    """_device_answers: a lost context raises from the query; a busy device (the mark not yet passed) answers."""
    import contextlib

    cuda = servicer_mod.torch.cuda
    streams = []
    monkeypatch.setattr(cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cuda, "Stream", lambda device: streams.append(device) or f"a new stream on {device}")
    monkeypatch.setattr(cuda, "Event", _Mark)
    gpu = torch.device("cuda", 1)
    _Mark.after, _Mark.made = None, []  # never passes: busy, not lost
    assert servicer_mod._device_answers(gpu) is True
    assert streams == [gpu] and [(m.on, m.queries) for m in _Mark.made] == [(f"a new stream on {gpu}", 1)]

    class Lost(_Mark):
        def query(self) -> bool:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(cuda, "Event", Lost)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        servicer_mod._device_answers(gpu)
    assert servicer_mod._device_answers(torch.device("cpu")) is True  # a CPU rank has no context to lose
