"""deploy/gpu-check.sh with stand-ins for the GPU tools: the MPS daemon it starts does not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

from deploy.deploy_files import DEPLOY
from helpers.waiting import wait_until

SCRIPT = DEPLOY / "gpu-check.sh"
# nvidia-cuda-mps-control: `-d` starts "the daemon" (a state file) unless one runs; on stdin,
# get_server_list answers only while it runs, and quit stops it.
MPS_CONTROL = """#!/bin/sh
state="$STUB_DIR/mps-running"
if [ "$1" = "-d" ]; then
  [ -e "$state" ] && { echo "An instance of this daemon is already running" >&2; exit 1; }
  touch "$state"; exit 0
fi
read -r cmd
case $cmd in
  get_server_list) [ -e "$state" ] ;;
  quit) rm -f "$state" ;;
esac
"""
# python3: every step prints a line and succeeds at once (the bench's output is filtered through grep,
# which fails on none), except pytest while STALL is set, which waits to be killed, or fails while
# FAIL_TESTS is set, and pip, which is the
# real one (the carried wheels of .whl/ are installed for real).
PYTHON = f"""#!/bin/sh
[ "$1 $2" = "-m pip" ] && exec {sys.executable} "$@"
case " $* " in
  *" pytest "*) if [ -n "$STALL" ]; then touch "$STUB_DIR/stalled"; exec sleep 60; fi
               if [ -n "$FAIL_TESTS" ]; then echo "1 failed"; exit 1; fi ;;
esac
echo "stand-in python3 $*"
"""


def _run_script(tmp_path: Path, stall: bool, fail_tests: bool = False) -> subprocess.Popen:
    """Start a copy of the script whose scratch paths (/tmp/...) lie under tmp_path, with the stand-ins
    first on PATH, in a session of its own (as `timeout` and a terminal signal it: the whole group)."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    for name, text in (("nvidia-cuda-mps-control", MPS_CONTROL), ("python3", PYTHON), ("nvidia-smi", "#!/bin/sh\n")):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    script = tmp_path / "gpu-check.sh"
    script.write_text(SCRIPT.read_text().replace("/tmp/", f"{scratch}/"))
    checkout = tmp_path / "checkout"
    checkout.mkdir(exist_ok=True)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_DIR": str(tmp_path), "OUT": str(tmp_path / "out")}
    if stall:
        env["STALL"] = "1"
    if fail_tests:
        env["FAIL_TESTS"] = "1"
    return subprocess.Popen(["bash", str(script)], cwd=checkout, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def test_a_killed_run_quits_the_mps_daemon_it_started(tmp_path):
    """`nvidia-cuda-mps-control -d` detaches the daemon, and the script sent `quit` only on its last line:
    a run ended by `timeout` (BENCHMARKS.md runs it under `timeout 560`) or Ctrl-C left the daemon and its
    MPS server running on the GPUs. The script quits it from an EXIT trap, which bash runs on SIGTERM."""
    proc = _run_script(tmp_path, stall=True)
    try:
        wait_until((tmp_path / "stalled").exists, 30, "the script reached the tests", watch=proc, interval_s=0.1)
        assert (tmp_path / "mps-running").exists()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not (tmp_path / "mps-running").exists(), "the MPS daemon outlived the killed run"


def test_a_daemon_already_answering_is_reported_and_left_running(tmp_path):
    """With a daemon already answering on the pipe directory (a killed run's), `-d` refused to start
    another and the logs said "MPS daemon: 0", while every CUDA process of the run was that daemon's
    client: benchmark figures under MPS labelled as without it. It is reported as MPS, and not quit by a
    run that did not start it."""
    (tmp_path / "mps-running").touch()
    proc = _run_script(tmp_path, stall=False)
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "out" / "env.log").read_text().splitlines()[0] == "MPS daemon: 1"
    assert (tmp_path / "mps-running").exists()


def test_a_run_that_ends_quits_the_daemon_it_started(tmp_path):
    """The ordinary run: the daemon it started answers during the run and is gone after it."""
    proc = _run_script(tmp_path, stall=False)
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "out" / "env.log").read_text().splitlines()[0] == "MPS daemon: 1"
    assert not (tmp_path / "mps-running").exists()


def test_a_failed_step_fails_the_run_after_the_rest_has_run(tmp_path):
    """Each step's output goes through `tee` (and the bench's through grep): without pipefail, or without the
    step's `|| rc=1`, the pipe's status is tee's, and a run whose GPU tests failed exited 0, read as passed.
    The steps after it still run (their logs are the run's record)."""
    proc = _run_script(tmp_path, stall=False, fail_tests=True)
    assert proc.wait(timeout=60) == 1
    assert "1 failed" in (tmp_path / "out" / "gpu-tests.log").read_text()
    assert "bench_host" in (tmp_path / "out" / "bench-host.log").read_text()


def _wheel(folder: Path, version: int) -> None:
    """A pure-Python wheel of the module `carried` at `version`, as the runs carry in .whl/."""
    import base64
    import hashlib

    files = {"carried.py": f"VERSION = {version}\n",
             f"carried-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: carried\nVersion: {version}\n",
             f"carried-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                     "Tag: py3-none-any\n"}
    record = f"carried-{version}.dist-info/RECORD"
    lines = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
             f"{len(text.encode())}" for name, text in files.items()]
    with zipfile.ZipFile(folder / f"carried-{version}-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(record, "\n".join([*lines, f"{record},,"]) + "\n")


def test_a_second_run_imports_the_wheels_it_carries_not_an_earlier_runs(tmp_path):
    """The carried wheels were installed with `pip install --target /tmp/dspark-site`, which skips (with a
    warning) every package already in the folder: on a warm machine a run carrying a newer wheel than the
    run before it imported the earlier run's package, with both versions' metadata beside it."""
    carried = tmp_path / "checkout" / ".whl"
    carried.mkdir(parents=True)
    for version in (1, 2):
        for old in carried.iterdir():
            old.unlink()
        _wheel(carried, version)
        assert _run_script(tmp_path, stall=False).wait(timeout=120) == 0
    site = tmp_path / "scratch" / "dspark-site"
    assert (site / "carried.py").read_text() == "VERSION = 2\n"
    assert sorted(p.name for p in site.glob("*.dist-info")) == ["carried-2.dist-info"]
