"""wait_until: the suite's one bounded poll, on a state rather than a nap, failing with what it waited for."""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Callable, TypeVar

import pytest

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout_s: float, what: str | Callable[[], str], *,
               watch: subprocess.Popen | threading.Thread | None = None, interval_s: float = 0.01) -> T:
    """Call cond() every interval_s until it returns something truthy, and return that; cond() is called once
    more after the last sleep, so a state reached at the bound counts. Past timeout_s: pytest.fail("not within
    {timeout_s} s: {what}"). `what` may be a zero-argument callable, called only on a failure, so the message
    shows the state then. `watch`, a process or thread the state depends on, fails the wait at once when it
    has ended (a process: with its exit code, and its output where it was piped) instead of at the bound.
    Not for a spawned process's body: pytest.fail raises a BaseException, which torch's spawn does not hand back."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if watch is not None and (ended := _ended(watch)):
            pytest.fail(f"{_said(what)}: never, {ended}")
        if time.monotonic() >= deadline:
            pytest.fail(f"not within {timeout_s:g} s: {_said(what)}")
        time.sleep(interval_s)


def _said(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what


def _ended(watch: subprocess.Popen | threading.Thread) -> str:
    """How `watch` ended ("" while it runs)."""
    if isinstance(watch, threading.Thread):
        return "" if watch.is_alive() else f"thread {watch.name} ended"
    if watch.poll() is None:
        return ""
    if watch.stdout is None and watch.stderr is None:  # it wrote to a file or to the test's own output
        return f"the process exited with code {watch.returncode}"
    try:
        out, err = watch.communicate(timeout=5)
    except subprocess.TimeoutExpired:  # a process it left holds the pipe: its output has no end to read to
        return f"the process exited with code {watch.returncode} (its pipes held open by a process it left)"
    text = "".join(s.decode(errors="replace") if isinstance(s, bytes) else s for s in (out, err) if s)
    return f"the process exited with code {watch.returncode}" + (f":\n{text}" if text else "")
