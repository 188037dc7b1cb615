"""tests/conftest.py's ordering: tests marked ends_mps_clients run after every other test of the session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_FILE = '''
import pytest

ran = []

@pytest.mark.ends_mps_clients
def test_kills_an_engine_mid_step():
    ran.append("ender")

def test_a_cuda_test():
    ran.append("a")

def test_another_cuda_test():
    ran.append("b")
    print("ORDER", ran)
'''


def test_a_test_that_ends_the_mps_clients_runs_after_the_others(tmp_path):
    """Defined first in its file, it must still run last: under MPS its killed engine's GPU work in flight
    leaves the pytest process's context with a sticky error, and every CUDA test after it failed (run 305)."""
    (tmp_path / "test_order.py").write_text(_FILE)
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]))
    # `-p conftest`: this suite's conftest as a plugin, as pytest loads it for every file under tests/; the
    # marker registered on the command line, as pyproject.toml registers it for the suite.
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "conftest",
                          "-o", "markers=ends_mps_clients: test", "--strict-markers", str(tmp_path / "test_order.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-2000:])
    assert "ORDER ['a', 'b']" in out.stdout, out.stdout[-2000:]
    assert "3 passed" in out.stdout
