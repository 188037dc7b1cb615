"""Engine ranks whose starter (a `demo`, a test run) is SIGKILLed end at once instead of drafting on, orphaned."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.waiting import wait_until

# The starter: TP-2 engine ranks, no sidecar, more rounds than any test waits for; rank 0 prints every round.
STARTER = """
import sys
from dspark_sidecar.client.harness import HarnessConfig, run_engine
from dspark_sidecar.client.workload import MixConfig
h = HarnessConfig(rounds=100_000, tp=2, required_tp=2, checkpoint=(sys.argv[1], sys.argv[2]), num_pages=64,
                  verify=False, progress_every=1,
                  mix=MixConfig(seed=0, max_active=1, short_prompt=(1, 20), mid_p=0.0, long_p=0.0, first_long=False))
run_engine(h, sys.argv[3], timeout_s=600)
"""
# A rank ends once its watch starts, after its imports: seconds, more on a loaded 2-core host. Unfixed, the
# ranks drafted on for their 100000 rounds.
GONE_WITHIN_S = 60.0


def _rank_pids(starter: int) -> list[int]:
    """The starter's spawned children (not its resource tracker)."""
    pids = []
    for child in Path(f"/proc/{starter}/task/{starter}/children").read_text().split():
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids.append(int(child))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("when", ["starting", "drafting"])
def test_a_sigkilled_starter_takes_its_engine_ranks_down(tiny_ckpt, tmp_path, when):
    """run_engine's finally kills the ranks when the starter unwinds (an error, Ctrl-C, SIGTERM), but a starter
    that is SIGKILLed runs no finally, and torch's parent-death SIGINT is set only once a rank has imported and
    unpickled its function: a `demo` killed in its ranks' first seconds left them drafting every round (locally,
    its sidecar gone) for as many rounds as it had asked, their KV cache's segments held in /dev/shm. Killed
    later, a rank blocked in a gloo collective never ran that SIGINT's KeyboardInterrupt, and its peer, interrupted
    between two, could leave it waiting there for gloo's timeout."""
    out = tmp_path / "starter.out"
    with open(out, "wb") as sink:
        starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tiny_ckpt[0]), str(tiny_ckpt[1]),
                                    str(tmp_path / "engine")], stdout=sink, stderr=subprocess.STDOUT)
    pidfds: dict[int, int] = {}

    def started() -> list[int]:
        ranks = _rank_pids(starter.pid)
        return ranks if len(ranks) >= 2 and (when != "drafting" or b"round 3/" in out.read_bytes()) else []

    try:
        ranks = wait_until(started, 300, lambda: f"two engine ranks {when}:\n{out.read_text()}", watch=starter,
                           interval_s=0.05)
        pidfds = {p: os.pidfd_open(p) for p in ranks}
        starter.kill()
        starter.wait()
        poller = select.poll()
        for fd in pidfds.values():
            poller.register(fd, select.POLLIN)
        left = set(pidfds.values())
        deadline = time.monotonic() + GONE_WITHIN_S
        while left and (wait_s := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(wait_s * 1e3):
                poller.unregister(fd)
                left.discard(fd)
        assert not left, (f"{GONE_WITHIN_S:.0f} s after their starter was SIGKILLed, engine ranks "
                          f"{[p for p, f in pidfds.items() if f in left]} still run:\n{out.read_text()[-2000:]}")
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        for fd in pidfds.values():  # the test failed: end exactly the processes it started
            if not select.select([fd], [], [], 0)[0]:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
