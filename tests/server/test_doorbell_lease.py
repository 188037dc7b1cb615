"""A doorbell attached under an engine lease stops when that lease ends, and only then (AttachDoorbellRequest.lease)."""

from __future__ import annotations

import contextlib
import socket
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
from helpers.waiting import wait_until  # noqa: E402

CAP = 4096
CTX = SimpleNamespace(peer=lambda: "unix:/tmp/engine.sock")


class _Loop:
    graphs = None

    def on_quiesce(self, fn, old=None):
        pass

    @contextlib.contextmanager
    def exclusive(self, wait=True, quiesce=True):
        yield

    def after_device(self, fn, wait=None):
        fn()

    def sweep_idle(self, poke=False):
        pass


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
    svc = DrafterServicer(ctx, _Loop(), Lifecycle(), None, None, "",  # type: ignore[arg-type]
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
    d.input_event = None  # nothing it queued waits on an engine: nothing to look at
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
