"""tests/conftest.py's os._exit guard: a stray os._exit in the pytest process fails the session (status 70)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_STRAY = '''
import os, threading, time

def test_leaves_a_timer_behind():
    threading.Timer(0.2, lambda: os._exit(0)).start()  # as teardown's watchdog once outlived its test

def test_runs_while_it_fires():
    time.sleep(60)  # ended in here by the timer's os._exit (at 2 s, a timer late on a loaded box came after)

def test_never_reached():
    pass
'''


def test_an_os_exit_0_in_the_pytest_process_ends_the_session_with_status_70(tmp_path):
    """Before, a production timer that outlived its test (teardown's watchdog, os._exit(0) 75 s later) ended CI's
    pytest at 91% with status 0 and no summary: read as a suite that passed."""
    (tmp_path / "test_stray.py").write_text(_STRAY)
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    # `-p conftest`: this suite's conftest as a plugin, as pytest loads it for every file under tests/.
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                          str(tmp_path / "test_stray.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 70, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    said = out.stdout + out.stderr
    assert "os._exit(0) called in the pytest process itself" in said and "test_stray.py" in said, said[-2000:]
    assert "passed" not in said


def test_a_forked_child_exits_with_its_own_code():
    """Outside the session's own process (a fork: multiprocessing's children end with os._exit) the code stands."""
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7
