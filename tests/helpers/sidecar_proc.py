"""Start a real `dspark-sidecar serve` (launcher + rank processes) for tests, wait for SERVING, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from dspark_sidecar.server.healthcheck import check


class SidecarProcess:
    """`with SidecarProcess(tmp_path, tp=4) as sc:` -> sc.socket(r) is rank r's "unix:..." target."""

    def __init__(self, tmp_dir: Path, tp: int = 4, dtype: str = "fp32", checkpoint: tuple[Path, Path] | None = None,
                 extra_args: list[str] | None = None, ready_timeout_s: float = 120.0) -> None:
        self.dir = Path(tmp_dir)
        self.socket_dir = self.dir / "sock"
        self.tp, self.dtype, self.checkpoint = tp, dtype, checkpoint
        self.extra = list(extra_args or [])
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "sidecar.log"

    def argv(self) -> list[str]:
        a = [sys.executable, "-m", "dspark_sidecar", "serve", "--tp", str(self.tp), "--socket-dir",
             str(self.socket_dir), "--dtype", self.dtype, *self.extra]
        if self.checkpoint is not None:
            a += ["--checkpoint", str(self.checkpoint[0]), "--target-checkpoint", str(self.checkpoint[1])]
        return a

    def socket(self, rank: int) -> str:
        return f"unix:{self.socket_dir / f'rank{rank}.sock'}"

    def start(self) -> SidecarProcess:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        self.proc = subprocess.Popen(self.argv(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.wait_health("SERVING", self.ready_timeout_s)
        return self

    def health(self) -> list[str]:
        return [check(self.socket(r), 1.0) for r in range(self.tp)]

    def wait_health(self, want: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(s == want for s in self.health()):
                return
            if self.proc is not None and self.proc.poll() is not None and want == "SERVING":
                break
            time.sleep(0.2)
        raise TimeoutError(f"sidecar not {want} within {timeout_s} s: {self.health()}\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def rank_pids(self) -> list[int]:
        """PIDs of the rank processes (children of the launcher), in rank order."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        pids = [int(p) for p in out]
        ranked = []
        for p in pids:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            r = next(int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK="))
            ranked.append((r, p))
        return [p for _, p in sorted(ranked)]

    def kill_rank(self, rank: int) -> None:
        os.kill(self.rank_pids()[rank], signal.SIGKILL)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def restart(self) -> SidecarProcess:
        self.stop()
        return self.start()

    def __enter__(self) -> SidecarProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
