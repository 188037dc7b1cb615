"""The shim's link (its connection, KV binding and data plane): one thread at a time, and close()'s hand-off to it.

maybe_forward's phases 2 and 3, connect() and close() each hold the link while they use it; close() may come
from any thread (an engine's atexit hook, a signal handler, its executor) while a step holds it. close() wakes
the transport a step waits on, then waits for the link up to CLOSE_WAIT_S; past that, or on the holding
thread itself (a signal handler runs on the main thread, maybe in the middle of its step), the thread inside
finishes the close as it leaves. Either way exactly one thread runs the release (`finish_close`), holding the
link: nothing is unmapped under a step.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger("dspark_sidecar.client")

# How long close() waits for a thread using the link to leave it. A step waiting for its answer is woken
# at once; what is left is a readiness check's own bounded calls (connect, bind, registration). Past
# this the thread inside finishes the close as it leaves.
CLOSE_WAIT_S = 5.0


class Link:
    """`with link as is_open:` holds the link for the block; is_open: whether close() has not been called
    (after it, only the bookkeeping of a deferred drop may use the link). Waits for another holder, which
    its own deadlines bound (a step's, a readiness check's calls, close()'s release).

    A plain class, not a generator-based contextmanager: maybe_forward enters the link twice a step, and on
    the step's host path the generator's machinery cost about twice the lock's work."""

    def __init__(self, finish_close: Callable[[], None], rank: int = 0) -> None:
        self._finish_close = finish_close  # close()'s release, run once, holding the link; never raises an Exception
        self.rank = rank
        # Taken as itself on the step's path (a Condition's own `with` and notify_all are Python code: ~1 us a
        # step of the shim's host time). Re-entrant: a signal handler's close() may run on a thread that holds it.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)  # guards the six below
        self.waiters = 0  # threads waiting on _cv for the link to be free (__enter__, close): notified only then
        self.inside = False  # a thread holds the link
        self.holder = 0  # which (threading.get_ident)
        self.closed = False  # close() was called: final
        self._close_left = False  # close() gave up waiting for the link: the thread inside finishes it
        self._waiter: Any = None  # the transport a step waits on now: close() interrupts it

    def __enter__(self) -> bool:
        with self._lock:
            if self.inside:
                self.waiters += 1  # under the lock, so the holder's _leave sees it and notifies
                try:
                    while self.inside:
                        self._cv.wait()
                finally:
                    self.waiters -= 1
            self.inside, self.holder = True, threading.get_ident()
            return not self.closed

    def __exit__(self, *exc: object) -> None:
        self._leave()

    def wait_on(self, transport: Any) -> bool:
        """A step is about to wait on `transport` (holding the link): False when close() came first, else close()
        from here on interrupts that wait. Either close() finds this waiter, or the step sees the close here."""
        with self._lock:
            if self.closed:
                return False
            self._waiter = transport
            return True

    def waited(self) -> None:
        """The step's wait is over (answered, timed out, interrupted): close() no longer interrupts it."""
        with self._lock:
            self._waiter = None

    def close(self) -> None:
        """Final and idempotent; from any thread, at any time. Wakes a waiting step, then takes the link (at most
        CLOSE_WAIT_S) and runs finish_close; past that, on the thread that holds the link, or interrupted while it
        waits (Ctrl-C), the holder runs it as it leaves."""
        with self._cv:
            if self.closed:
                return
            self.closed = True
            waiter = self._waiter
        if waiter is not None:
            waiter.interrupt()
        me = threading.get_ident()
        with self._cv:
            mine = self.inside and self.holder == me
            free = False
            if not mine:
                self.waiters += 1
                try:
                    free = self._cv.wait_for(lambda: not self.inside, CLOSE_WAIT_S)
                except BaseException:  # (Ctrl-C while it waits; the lock is held again): left, as past CLOSE_WAIT_S,
                    self._close_left = True  # to the holder as it leaves (or the next to take the link): closed,
                    raise  # no later close() would run the release
                finally:
                    self.waiters -= 1
            if mine or not free:
                self._close_left = True  # _leave, under this same lock, sees it
                if self.holder != me:
                    log.warning("sidecar rank %d: close() found the link still in use after %.0f s; the "
                                "thread using it releases it as it leaves", self.rank, CLOSE_WAIT_S)
                return
            self.inside, self.holder = True, me
        self._leave(closing=True)

    def _leave(self, closing: bool = False) -> None:
        """Give the link back. First finish close()'s release when this is close() itself (closing) or
        close() left it to the holder (_close_left: decided under the same lock as `inside`, so exactly
        one thread releases)."""
        while True:
            with self._lock:
                finish, self._close_left, closing = closing or self._close_left, False, False
                if not finish:
                    self.inside, self.holder = False, 0
                    if self.waiters:
                        self._cv.notify_all()
                    return
            try:
                self._finish_close()  # never raises an Exception; a KeyboardInterrupt or SystemExit it lets through
            except BaseException:
                with self._cv:  # (Ctrl-C in close()'s grace): the link is given back all the same, or every later
                    self.inside, self.holder = False, 0  # entry to it would wait for it for ever
                    self._cv.notify_all()
                raise
