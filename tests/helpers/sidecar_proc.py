"""The tests' handle on a real `dspark-sidecar serve`: client.launcher.SidecarLauncher rooted in a tmp dir."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from dspark_sidecar.client.launcher import SidecarLauncher
from dspark_sidecar.server.healthcheck import check
from helpers.waiting import wait_until


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()[:1] != "Z"


HEALTH_LOOK_S = 30.0


class SidecarProcess(SidecarLauncher):
    """`with SidecarProcess(tmp_path, tp=4) as sc:` -> sc.socket(r) is rank r's "unix:..." target."""

    def __init__(self, tmp_dir: Path, tp: int = 4, dtype: str = "fp32", checkpoint: tuple[Path, Path] | None = None,
                 extra_args: list[str] | None = None, ready_timeout_s: float = 120.0) -> None:
        self.dir = Path(tmp_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        super().__init__(self.dir / "sock", tp=tp, dtype=dtype, checkpoint=checkpoint, extra_args=extra_args,
                         log_path=self.dir / "sidecar.log", ready_timeout_s=ready_timeout_s)

    def socket(self, rank: int) -> str:
        return self.endpoint(rank)

    def health(self) -> list[str]:
        """Each rank's health status name ("SERVING", "NOT_SERVING", "UNREACHABLE: ..."). Each look's deadline bounds a
        hang, not a timing: at 1 s a loaded CI box's first call on a fresh channel ran out (commit 2df49eb), and a
        test that asserts SERVING once read UNREACHABLE. A rank that is gone answers at once (no socket, refused)."""
        return [check(self.socket(r), HEALTH_LOOK_S) for r in range(self.tp)]

    def wait_health(self, want: str, timeout_s: float) -> None:
        wait_until(lambda: all(s == want for s in self.health()), timeout_s,
                   lambda: f"sidecar {want}: {self.health()}\n{self.log_tail()}", watch=self.proc, interval_s=0.2)


def free_port_block(n: int, start: int = 20000, end: int = 60000) -> int:
    """A base port p such that p .. p+n-1 are free on loopback now (rank r serves on p + r)."""
    for base in range(start + (hash(time.time()) % 1000) * 16, end, 16):
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of loopback ports")
