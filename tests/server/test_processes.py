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
from helpers.waiting import wait_until

# A watcher started after the watched process (as serve is after its starter): for each line on stdin,
# whether the process argv[1] names is gone.
WATCHER = """
import sys
from dspark_sidecar.server.processes import ExitWith
w = ExitWith(int(sys.argv[1]))
for _ in sys.stdin:
    print(w.gone(), flush=True)
"""
# The same watcher exec'd by a shell right after it started the watched process in the background (argv[1]: $!):
# first says the pid, and whether that process started after the one the watcher runs in.
EXEC_WATCHER = """
import os, sys
from dspark_sidecar.server.processes import ExitWith, process_start
pid = int(sys.argv[1])
w = ExitWith(pid)
print(pid, process_start(pid) > process_start(os.getpid()), flush=True)
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


def test_a_job_started_in_the_background_before_serve_was_exec_d_is_the_one_named():
    """`engine & exec dspark-sidecar serve --exit-with-pid $!` (a container's entrypoint, a unit's script): serve runs
    in the shell's process, with the shell's start time, older than its background job's. Read as a process that
    took the pid after serve started, the running engine was gone at once: serve refused to start beside it ("process
    N is not running", exit 2). It is serve's own child (the shell's job), which no later process can be."""
    shell = subprocess.Popen(["sh", "-c", 'sleep 0.05; sleep 60 & exec "$0" -c "$1" $!', sys.executable, EXEC_WATCHER],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pid = 0
    try:
        def gone() -> str:
            shell.stdin.write("?\n")
            shell.stdin.flush()
            return shell.stdout.readline().strip()

        named, later = shell.stdout.readline().split()
        pid = int(named)
        assert later == "True"  # started 50 ms after the shell: a later clock tick than the watcher's own start
        assert gone() == "False"
        os.kill(pid, signal.SIGKILL)  # exited, and left a zombie: the watcher does not reap its child
        wait_until(lambda: gone() == "True", 10, "the killed job read as gone")
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)  # a zombie until the watcher ends
        shell.stdin.close()
        shell.wait()


def test_a_process_started_after_this_one_is_not_the_one_named():
    """Its pid was on the command line, so the named process predates serve: a later start time means the pid
    was already reused, and the one named had gone. The later process is not this one's child (a shell that
    started it has exited): serve's own child is the one a shell started before it exec'd serve (below)."""
    later = int(subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True,
                               check=True).stdout)
    try:
        assert process_start(later) > process_start(os.getpid()) and processes.parent_pid(later) != os.getpid()
        assert ExitWith(later).gone()
        assert not ExitWith(os.getppid()).gone()  # the process that started this one: running, and earlier
    finally:
        os.kill(later, signal.SIGKILL)


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


def test_a_dead_process_still_in_proc_is_exited(monkeypatch):
    """State X (dead: its last moment in /proc, past the zombie's) is an exit as Z is; kill(pid, 0) may still find
    the pid then."""
    parent = os.getppid()
    w = ExitWith(parent)
    real = processes._stat
    monkeypatch.setattr(processes, "_stat", lambda pid: ("X", w.start) if pid == parent else real(pid))
    assert w.gone() and exited(parent, w.start) and exited(parent)


def test_a_stat_line_cut_short_is_read_as_not_known_not_raised(monkeypatch):
    """A /proc/<pid>/stat with fewer fields than proc(5) lists (a kernel or a filesystem in /proc's place that
    writes fewer): the start time is not known, and the process kill(pid, 0) finds runs. An IndexError out of it
    ended the launcher's poll or the rank's beat, as an unreadable file would have."""
    parent = os.getppid()
    monkeypatch.setattr(processes.Path, "read_bytes", lambda path: b"4242 (python3) S 1 4242 4242 0")
    assert process_start(parent) == 0
    assert not exited(parent) and not exited(parent, 12345)
    assert not ExitWith(parent).gone()
