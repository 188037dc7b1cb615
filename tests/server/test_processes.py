"""server/processes.py ExitWith, with real processes: the process `serve --exit-with-pid` names is gone once
it has exited (a zombie too) or once its pid names a process that started after serve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from dspark_sidecar.server import processes
from dspark_sidecar.server.processes import ExitWith, exited, process_start

# A watcher started after the watched process (as serve is after its starter): for each line on stdin,
# whether the process argv[1] names is gone.
WATCHER = """
import sys
from dspark_sidecar.server.processes import ExitWith
w = ExitWith(int(sys.argv[1]))
for _ in sys.stdin:
    print(w.gone(), flush=True)
"""


def test_the_watched_process_is_gone_once_it_exits_even_unreaped():
    watched = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    watcher = subprocess.Popen([sys.executable, "-c", WATCHER, str(watched.pid)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        def gone() -> str:
            watcher.stdin.write("?\n")
            watcher.stdin.flush()
            return watcher.stdout.readline().strip()

        assert gone() == "False"
        watched.send_signal(signal.SIGKILL)
        os.waitid(os.P_PID, watched.pid, os.WEXITED | os.WNOWAIT)  # exited, left a zombie (not reaped)
        assert gone() == "True"
    finally:
        watcher.stdin.close()
        watcher.wait()
        watched.kill()
        watched.wait()


def test_a_process_started_after_this_one_is_not_the_one_named():
    """Its pid was on the command line, so the named process predates serve: a later start time means the pid
    was already reused, and the one named had gone."""
    later = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert ExitWith(later.pid).gone()
        assert not ExitWith(os.getppid()).gone()  # the process that started this one: running, and earlier
    finally:
        later.kill()
        later.wait()


def test_the_watched_pid_taken_by_another_process_is_gone(monkeypatch):
    """The process exited and its pid was taken again between two looks (the agent watch beats every half
    second): kill(pid, 0) finds the newcomer, only the start time tells. Missed, the sidecar served on as an
    orphan of a process that no longer ran."""
    parent = os.getppid()  # started before this process, as the one serve watches is
    w = ExitWith(parent)
    assert w.start and not w.gone()
    real = processes._stat
    monkeypatch.setattr(processes, "_stat", lambda pid: ("S", w.start + 1) if pid == parent else real(pid))
    assert w.gone()


def test_a_process_whose_name_holds_a_parenthesis_is_read_right():
    """/proc/<pid>/stat puts the name in parentheses and does not escape it: read up to its first ')', a name
    such as "w) Z 1 2 3" (prctl, setproctitle) read the running process as a zombie, so as gone."""
    renamed = subprocess.Popen([sys.executable, "-c", "open('/proc/self/comm', 'w').write('w) Z 1 2 3'); "
                                "print(flush=True); import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        renamed.stdout.readline()  # renamed
        assert Path(f"/proc/{renamed.pid}/comm").read_text().strip() == "w) Z 1 2 3"
        start = process_start(renamed.pid)
        assert start >= process_start(os.getpid()) and not exited(renamed.pid, start)
    finally:
        renamed.kill()
        renamed.wait()


def test_a_process_started_in_the_same_clock_tick_as_this_one_is_the_one_named(monkeypatch):
    """Start times count clock ticks (10 ms): `engine & serve --exit-with-pid $!` forks both within one. That
    process is not a later one that took the pid; read as gone, serve refused to start beside it."""
    parent = os.getppid()
    real = processes._stat
    tick = real(os.getpid())[1]
    monkeypatch.setattr(processes, "_stat",
                        lambda pid: ("S", tick) if pid in (parent, os.getpid()) else real(pid))
    assert not ExitWith(parent).gone()


def test_a_process_that_exited_and_was_reaped_is_gone():
    """No such process any more (the usual end: its parent reaped it): kill(pid, 0) says so at once."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start(done.pid)
    done.wait()
    assert exited(done.pid, start) and exited(done.pid)


def test_a_running_process_whose_start_time_is_not_known_is_not_gone():
    """start 0 (not known: /proc unreadable when it was taken, a peer's board slot not written yet) compares
    with nothing: read as another start time, every live peer and watched process was gone."""
    assert not exited(os.getpid(), 0) and not exited(os.getppid(), 0)


def test_pid_0_is_not_known_yet_so_not_gone():
    """A peer's board slot before it wrote its pid: kill(0, 0) would ask about this process group instead."""
    assert not exited(0) and not exited(0, 123)


def test_another_user_s_process_under_the_pid_is_judged_by_its_start_time(monkeypatch):
    """kill(pid, 0) is EPERM for another user's process: it exists, but may be one that took the pid."""
    parent = os.getppid()
    w = ExitWith(parent)

    def eperm(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(processes.os, "kill", eperm)
    assert not w.gone()
    real = processes._stat
    monkeypatch.setattr(processes, "_stat", lambda pid: ("S", w.start + 1) if pid == parent else real(pid))
    assert w.gone()


def test_a_process_whose_stat_cannot_be_read_is_judged_by_the_signal_alone(monkeypatch):
    """/proc mounted hidepid (another user's process), or no /proc at all: the stat file does not read. The start
    time is then not known (0), and a process kill(pid, 0) finds runs: an error out of the watch ended the
    launcher's poll or the rank's beat, and a live process read as gone stopped the sidecar."""
    parent = os.getppid()

    def unreadable(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(processes.Path, "read_bytes", unreadable)
    assert process_start(parent) == 0
    assert not exited(parent) and not exited(parent, 12345)
    assert not ExitWith(parent).gone()


def test_the_named_process_is_not_read_as_reused_when_this_one_s_start_is_not_known(monkeypatch):
    """0 is "not known", not a start before every other: compared as a time, the process serve was told to exit
    with read as one that took the pid after serve started, and serve stopped at once."""
    parent, me = os.getppid(), os.getpid()
    real = processes._stat
    monkeypatch.setattr(processes, "_stat", lambda pid: None if pid == me else real(pid))
    w = ExitWith(parent)
    assert w.start > 0 and not w.gone()
