"""helpers.waiting.wait_until, the suite's bounded poll: its value, its bound, its message, a dead watch."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from helpers.waiting import wait_until


def test_returns_the_first_truthy_value_of_the_condition():
    seen = iter([None, 0, "", ["state"]])
    assert wait_until(lambda: next(seen), 5, "a state") == ["state"]


def test_past_the_bound_it_fails_with_what_it_waited_for():
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"^not within 0.2 s: the marker$"):
        wait_until(lambda: False, 0.2, "the marker")
    assert 0.2 <= time.monotonic() - t0 < 2


def test_a_state_reached_at_the_bound_still_counts():
    calls = []

    def cond() -> bool:
        calls.append(time.monotonic())
        return len(calls) == 2  # the call after the only sleep, which outlasts the bound

    assert wait_until(cond, 0.05, "the second look", interval_s=0.2) is True


def test_a_callable_message_is_evaluated_on_a_failure_only():
    said: list[int] = []

    def what() -> str:
        said.append(1)
        return f"the count at {len(said)}"

    assert wait_until(lambda: True, 1, what) is True
    assert said == []
    with pytest.raises(pytest.fail.Exception, match=r"not within 0.05 s: the count at 1$"):
        wait_until(lambda: False, 0.05, what)
    assert said == [1]


def test_a_watched_process_that_exited_fails_at_once_with_its_code_and_output():
    p = subprocess.Popen([sys.executable, "-c", "import sys; print('loading failed'); sys.exit(3)"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    p.wait(timeout=30)
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        wait_until(lambda: False, 60, "rank 0's socket", watch=p)
    assert time.monotonic() - t0 < 10  # not the 60 s bound
    msg = str(failed.value)
    assert msg.startswith("rank 0's socket: never, the process exited with code 3") and "loading failed" in msg, msg


def test_a_watched_process_writing_to_a_file_fails_at_once_with_its_code(tmp_path):
    with open(tmp_path / "log", "w") as log:
        p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(5)"], stdout=log, stderr=log)
    p.wait(timeout=30)
    with pytest.raises(pytest.fail.Exception, match=r"^the marker: never, the process exited with code 5$"):
        wait_until(lambda: False, 60, "the marker", watch=p)


def test_a_watched_thread_that_ended_fails_at_once():
    t = threading.Thread(target=lambda: None, name="doorbell")
    t.start()
    t.join()
    with pytest.raises(pytest.fail.Exception, match=r"^ring 1 published: never, thread doorbell ended$"):
        wait_until(lambda: False, 60, "ring 1 published", watch=t)


def test_a_state_reached_before_the_watch_ended_counts():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    assert wait_until(lambda: "done", 1, "the state", watch=p) == "done"
