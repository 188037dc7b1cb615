"""A process that started a sidecar through SidecarLauncher and is then SIGKILLed (a killed `demo`, a
test run stopped with kill -9) takes the sidecar down with it: the serve launcher and its ranks end
within a bound instead of serving, and holding their sockets, for ever. Real processes throughout."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from helpers.engine_fakes import short_socket_dir

# The parent: starts a TP-2 tiny sidecar on the CPU, prints the serve launcher's and the ranks' pids
# once every rank serves, then waits on its stdin (which the test never closes) until it is killed.
PARENT = """
import sys
from dspark_sidecar.client.launcher import SidecarLauncher
sc = SidecarLauncher(sys.argv[1], tp=2, preset="tiny", extra_args=["--device", "cpu"], log_path=sys.argv[2],
                     ready_timeout_s=120).start()
print(sc.proc.pid, *sc.rank_pids(), flush=True)
sys.stdin.read()
"""
GONE_WITHIN_S = 15.0


def _still_running(pidfds: dict[int, int], timeout_s: float) -> list[int]:
    """The pids (of `pidfds`: pid -> pidfd) whose process has not exited within timeout_s. A pidfd is
    readable once its process has exited (a zombie included), so this waits on events, not a sleep."""
    poller = select.poll()
    for fd in pidfds.values():
        poller.register(fd, select.POLLIN)
    left = dict(pidfds)
    deadline = time.monotonic() + timeout_s
    while left and (wait_s := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(wait_s * 1e3):
            poller.unregister(fd)
            left = {p: f for p, f in left.items() if f != fd}
    return sorted(left)


def test_a_sigkilled_parent_takes_its_sidecar_launcher_and_ranks_down(tmp_path):
    sock, log = short_socket_dir(), tmp_path / "sidecar.log"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(sock), str(log)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    pidfds: dict[int, int] = {}
    try:
        line = parent.stdout.readline()  # once the sidecar serves; "" if the parent failed
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3, f"the parent did not report a serving TP-2 sidecar ({line!r}):\n{log.read_text()}"
        pidfds = {p: os.pidfd_open(p) for p in pids}
        parent.kill()
        parent.wait()
        left = _still_running(pidfds, GONE_WITHIN_S)
        assert not left, (f"{GONE_WITHIN_S:.0f} s after its parent was SIGKILLed the sidecar still runs: pids {left} "
                          f"(launcher {pids[0]}, ranks {pids[1:]})\n{log.read_text()}")
        assert "--exit-with-pid" in log.read_text(), "no line saying why the sidecar stopped"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for fd in pidfds.values():  # a leak (the test failed): end exactly the processes it started
            if not select.select([fd], [], [], 0)[0]:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
