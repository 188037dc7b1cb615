"""client/link.py: one holder at a time, and close()'s release run exactly once, holding the link, by whoever can."""

from __future__ import annotations

import signal
import threading

import pytest

from dspark_sidecar.client import link
from dspark_sidecar.client.link import Link
from helpers.waiting import wait_until


class _Release:
    def __init__(self) -> None:
        self.runs: list[tuple[int, bool]] = []  # (thread, whether that thread held the link then)
        self.link: Link | None = None

    def __call__(self) -> None:
        assert self.link is not None
        self.runs.append((threading.get_ident(), self.link.inside and self.link.holder == threading.get_ident()))


def _link() -> tuple[Link, _Release]:
    release = _Release()
    release.link = Link(release)
    return release.link, release


def _held(lk: Link) -> tuple[threading.Thread, threading.Event]:
    """A thread holding `lk` (a step, say) until the event returned is set."""
    entered, leave = threading.Event(), threading.Event()

    def step() -> None:
        with lk:
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=step)
    t.start()
    assert entered.wait(10)
    return t, leave


def test_a_free_link_is_released_by_close_itself_once():
    lk, release = _link()
    lk.close()
    lk.close()
    assert release.runs == [(threading.get_ident(), True)] and lk.closed and not lk.inside
    with lk as is_open:  # the bookkeeping of a deferred drop may still take it
        assert not is_open


def test_close_from_the_holding_thread_returns_at_once_and_the_holder_releases_as_it_leaves(monkeypatch):
    """A signal handler's close() on the thread in the middle of its step: waiting for the link would be waiting for
    itself (CLOSE_WAIT_S, an hour here)."""
    monkeypatch.setattr(link, "CLOSE_WAIT_S", 3600.0)
    lk, release = _link()
    with lk as is_open:
        assert is_open
        lk.close()
        assert release.runs == []
    assert release.runs == [(threading.get_ident(), True)] and not lk.inside


def test_close_waits_for_another_holder_then_releases_on_its_own_thread():
    lk, release = _link()
    t, leave = _held(lk)
    closer = threading.Thread(target=lk.close)
    closer.start()
    wait_until(lambda: lk.waiters == 1, 5, "close() to wait for the link")
    leave.set()
    closer.join(10)
    t.join(10)
    assert release.runs == [(closer.ident, True)] and not lk.inside


def test_a_holder_past_close_wait_s_finishes_the_close_as_it_leaves(monkeypatch):
    monkeypatch.setattr(link, "CLOSE_WAIT_S", 0.05)
    lk, release = _link()
    t, leave = _held(lk)
    lk.close()  # gives up after CLOSE_WAIT_S: the link is still held
    assert release.runs == [] and lk.closed
    leave.set()
    t.join(10)
    assert release.runs == [(t.ident, True)] and not lk.inside


def test_close_interrupts_the_transport_a_step_waits_on_and_a_later_wait_is_refused():
    lk, release = _link()
    interrupted = []
    transport = type("T", (), {"interrupt": lambda self: interrupted.append(self)})()
    with lk:
        assert lk.wait_on(transport)
        lk.close()  # the holder's own thread: returns at once, after the interrupt
        assert interrupted == [transport]
        lk.waited()
    assert not lk.wait_on(transport) and len(release.runs) == 1


def test_a_close_interrupted_while_it_waits_for_the_link_leaves_the_release_to_the_holder(monkeypatch):
    """Ctrl-C while close() waits for a step's link (an engine's shutdown on its main thread): the interrupt goes up,
    and the release is the holder's as it leaves. Before, close() had marked the shim closed and left nothing to do
    it: the holder gave the link back unreleased, and every later close() returned at once (closed), so the binding,
    the channel and the data plane's shared memory stayed until the process exited."""
    monkeypatch.setattr(link, "CLOSE_WAIT_S", 3600.0)
    lk, release = _link()
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    main = threading.get_ident()
    t, leave = _held(lk)
    ctrl_c = threading.Thread(target=lambda: (wait_until(lambda: lk.waiters == 1, 5, "close() to wait for the link"),
                                              signal.pthread_kill(main, signal.SIGUSR1)))
    old = signal.signal(signal.SIGUSR1, interrupt)
    try:
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            lk.close()
    finally:
        signal.signal(signal.SIGUSR1, old)
        ctrl_c.join(10)
    assert lk.closed and lk.waiters == 0 and release.runs == []
    leave.set()
    t.join(10)
    assert release.runs == [(t.ident, True)] and not lk.inside
    lk.close()  # final: nothing more
    assert len(release.runs) == 1


class _CountingCondition(threading.Condition):
    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.waits = 0  # wait() calls begun

    def wait(self, timeout=None):
        self.waits += 1
        return super().wait(timeout)


def test_of_two_threads_woken_when_the_link_is_given_back_one_takes_it_and_the_other_waits_again():
    """The holder's leave wakes every waiter (notify_all): each must find the link free before it takes it, or two
    threads used the connection, the binding and the data plane at once (a connect() beside a step)."""
    lk, _ = _link()
    lk._cv = cv = _CountingCondition(lk._lock)
    inside, most = [0], [0]

    def waiter() -> None:
        with lk:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            # Both woke; the other one either waits again (its third wait) or came in beside this one. The second
            # one in finds the first gone.
            wait_until(lambda: cv.waits == 3 or inside[0] == 2 or most[0] == 2 or not lk.waiters, 5, "the other")
            inside[0] -= 1

    t, leave = _held(lk)
    ws = [threading.Thread(target=waiter) for _ in range(2)]
    for w in ws:
        w.start()
    wait_until(lambda: cv.waits == 2, 5, "both to wait for the link")
    leave.set()
    for th in (t, *ws):
        th.join(10)
    assert most[0] == 1 and cv.waits == 3 and not lk.inside and lk.waiters == 0


def test_a_wait_that_is_over_is_not_interrupted_by_a_later_close():
    lk, release = _link()
    interrupted = []
    transport = type("T", (), {"interrupt": lambda self: interrupted.append(self)})()
    with lk:
        assert lk.wait_on(transport)
        lk.waited()
    lk.close()
    assert interrupted == [] and len(release.runs) == 1
