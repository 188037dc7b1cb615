"""server/processes.py ExitWith, with real processes: the process `serve --exit-with-pid` names is gone once
it has exited (a zombie too) or once its pid names a process that started after serve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from dspark_sidecar.server.processes import ExitWith

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
