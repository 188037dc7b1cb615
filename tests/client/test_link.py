"""client/link.py: one holder at a time, and close()'s release run exactly once, holding the link, by whoever can."""

from __future__ import annotations

import threading

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
    entered, leave = threading.Event(), threading.Event()

    def step() -> None:
        with lk:
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=step)
    t.start()
    assert entered.wait(10)
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
    entered, leave = threading.Event(), threading.Event()

    def step() -> None:
        with lk:
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=step)
    t.start()
    assert entered.wait(10)
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
