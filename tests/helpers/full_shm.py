"""Run a Python script in a mount namespace of its own whose /dev/shm is a full 64 KiB tmpfs (unshare -rm)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# A tmpfs of 16 pages, filled by one file ("fill"): a new segment is still created there (ftruncate reserves
# nothing), and only its first store finds no page. No other process sees this /dev/shm.
_FILL = ('mount -t tmpfs -o size=64k tmpfs /dev/shm && (dd if=/dev/zero of=/dev/shm/fill bs=4k count=64 '
         '2>/dev/null || test -s /dev/shm/fill) && exec "$0" "$@"')


def run_on_full_dev_shm(script: Path, *args: str) -> subprocess.CompletedProcess:
    """`python script args...` with /dev/shm full; skips where user namespaces are not available."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("needs user namespaces (unshare -rm) for a /dev/shm of its own")
    return subprocess.run(["unshare", "-rm", "bash", "-c", _FILL, sys.executable, str(script), *args],
                          capture_output=True, text=True, timeout=120)
