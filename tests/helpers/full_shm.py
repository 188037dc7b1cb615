"""Run a Python script in a mount namespace of its own whose /dev/shm is a full 64 KiB tmpfs (unshare -rm)."""

from __future__ import annotations

import errno
import shutil
import subprocess
import sys
import textwrap
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


def assert_refused_with_enospc(tmp_path: Path, setup: str, make: str) -> None:
    """Run `setup` then `make` (Python, one line each) with /dev/shm full: `make` must raise OSError ENOSPC and
    leave nothing in /dev/shm beside the filler, where a segment made without reserving its pages was a SIGBUS at
    its first store (the process killed without a line)."""
    probe = tmp_path / "enospc_probe.py"
    probe.write_text(textwrap.dedent(f"""
        import os
        {setup}
        try:
            {make}
        except OSError as e:
            print("refused", e.errno, sorted(os.listdir("/dev/shm")), sep="|")
        else:
            print("made")
    """))
    proc = run_on_full_dev_shm(probe)
    assert proc.returncode == 0, f"rc {proc.returncode} (-7 or 135: SIGBUS): {proc.stderr[-2000:]}"
    kind, err, left = proc.stdout.strip().splitlines()[-1].split("|")
    assert kind == "refused" and int(err) == errno.ENOSPC and left == "['fill']", proc.stdout
