"""Whether a process on this node still runs, by pid and start time (/proc/<pid>/stat).

Why a module of its own: the rendezvous watches its peer ranks' processes with it, and the serve launcher
the process it was told to exit with (--exit-with-pid); a pid alone can name another process once the
first has gone, its start time with it names one process.
"""

from __future__ import annotations

import os
from pathlib import Path


def _fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat from field 3 (state) on; None where that cannot be read (no /proc: not
    Linux; the process just went; a /proc mounted hidepid)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return text[text.rfind(b")") + 1 :].split()  # after the command name, which may hold spaces and ')'


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of process `pid`, from /proc/<pid>/stat; None where
    that cannot be read."""
    fields = _fields(pid)
    try:
        return fields[0].decode(), int(fields[19])  # fields 3 (state) and 22 (starttime) of proc(5)
    except (TypeError, IndexError, ValueError, UnicodeDecodeError):  # TypeError: None, not read
        return None


def parent_pid(pid: int) -> int:
    """Process `pid`'s parent's pid (field 4 of proc(5)); 0 where not known."""
    fields = _fields(pid)
    try:
        return int(fields[1])
    except (TypeError, IndexError, ValueError):  # TypeError: None, not read
        return 0


def process_start(pid: int) -> int:
    """Process `pid`'s start time (clock ticks since boot); 0 where not known. With its pid it names one
    process: a pid reused after the process exited comes with another start time."""
    stat = _stat(pid)
    return stat[1] if stat is not None else 0


def exited(pid: int, start: int = 0) -> bool:
    """Whether process `pid` (on this node: a peer rank, the process `serve --exit-with-pid` names),
    started at `start` (process_start; 0: not known), has exited: no such process; a zombie (exited, its
    parent has not reaped it yet: kill(pid, 0) still succeeds on it, and torchrun's agent reaps only every
    --monitor-interval); or another process that now has the pid (another start time). pid 0: not known
    yet, so not."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, another user's: a reused pid if its start time differs (below)
        pass
    stat = _stat(pid)
    if stat is None:  # only the signal's answer: it exists
        return False
    state, started = stat
    return state in ("Z", "X") or 0 < start != started


class ExitWith:
    """The process `serve --exit-with-pid` names (whose end ends the sidecar), by its pid and start time.

    The pid was on serve's command line, so its process started no later than serve itself: a later
    start time already at the first look is a process that took the pid after the named one had gone,
    and counts as gone too (as does another start time at a later look: exited). Except serve's own child:
    `engine & exec serve --exit-with-pid $!` runs serve in the shell's process, whose start time (the
    shell's) is older than its background job's. Serve starts no process before it looks, so a child of its
    own is one the shell started, not one that took the pid since."""

    def __init__(self, pid: int) -> None:
        self.pid, self.start = pid, process_start(pid)
        mine = process_start(os.getpid())
        self._reused = 0 < mine < self.start and parent_pid(pid) != os.getpid()

    def gone(self) -> bool:
        return self._reused or exited(self.pid, self.start)
