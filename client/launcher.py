"""Starts a TP-N `dspark-sidecar serve` as a subprocess, waits until every rank's health says SERVING, stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dspark_sidecar import layout
from dspark_sidecar.client.config import rank_endpoint
from dspark_sidecar.client.connection import SidecarConnection
from dspark_sidecar.proto import sidecar_pb2 as pb


def sidecar_env(environ: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """The environment for a sidecar this process starts with its configuration in argv: the starter's, less
    what would configure it behind argv's back.

    RANK/WORLD_SIZE of an enclosing launcher would make the sidecar think it runs under torchrun; so would
    torchrun's TORCHELASTIC_USE_AGENT_STORE (its workers carry it): the sidecar's own ranks then joined an
    agent's store as clients, rank 0 included, on a port nobody listens on, and never came up. And a serve
    flag's DSPARK_<FLAG> (an operator's shell, a deployment's .env) is the default of every flag argv leaves
    out: DSPARK_STRICT_REFUSAL, DSPARK_WEIGHTS or DSPARK_BACKEND made the demo's or the bench's sidecar
    another than the one they compare with. DSPARK_LOG_LEVEL and the other names serve does not take stay."""
    from dspark_sidecar.cli import env_name
    from dspark_sidecar.server.config import ServeConfig

    flags = {env_name(name) for name in ServeConfig.__dataclass_fields__}
    return {k: v for k, v in environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("TORCHELASTIC_") and k not in flags}


class SidecarLauncher:
    """`with SidecarLauncher(socket_dir, ...) as sc:` -> a serving sidecar; its output goes to `log_path`.

    The sidecar runs in a session of its own (a Ctrl-C to the starter's terminal does not reach it; stop()
    stops it), so a starter that is SIGKILLed would leave it serving for ever: with exit_with_starter it
    is told this process's pid (`serve --exit-with-pid`) and stops by itself once the starter has gone.
    Not PR_SET_PDEATHSIG in a preexec_fn: that signal comes when the *thread* that started the sidecar
    ends (a helper thread's start would stop it early), and preexec_fn is unsafe in a process with threads.
    """

    def __init__(self, socket_dir: str | Path, tp: int = 4, preset: str = "tiny", dtype: str = "fp32",
                 max_reqs: int | None = None, checkpoint: tuple[str, str] | None = None,
                 extra_args: list[str] | None = None, log_path: str | Path | None = None,
                 ready_timeout_s: float = 180.0, exit_with_starter: bool = True) -> None:
        self.socket_dir, self.tp = Path(socket_dir), tp
        self.argv = [sys.executable, "-m", "dspark_sidecar", "serve", "--tp", str(tp), "--socket-dir",
                     str(self.socket_dir), "--preset", preset, "--dtype", dtype]
        if max_reqs is not None:
            self.argv += ["--max-reqs", str(max_reqs)]
        if checkpoint is not None:
            self.argv += ["--checkpoint", str(checkpoint[0]), "--target-checkpoint", str(checkpoint[1])]
        self.argv += list(extra_args or [])
        self.log_path = Path(log_path) if log_path else self.socket_dir / "sidecar.log"
        self.ready_timeout_s = ready_timeout_s
        self.exit_with_starter = exit_with_starter
        self.proc: subprocess.Popen | None = None
        self._log_from = 0  # where this start's lines begin in log_path (log_tail)

    def endpoint(self, rank: int) -> str:
        return rank_endpoint(self.socket_dir, rank)

    def healthy(self, deadline_s: float = 1.0) -> list[bool]:
        return [SidecarConnection(self.endpoint(r)).probe_health(deadline_s) for r in range(self.tp)]

    def make_socket_dir(self) -> None:
        """The folder for the sockets (and, by default, the log), made and checked as serve makes and
        checks one (0770, parents not writable by others, whatever the umask). A plain mkdir under umask
        000 gave 0777, which serve then refused after this had already started it."""
        from dspark_sidecar.server import sockdir

        sockdir.prepare(self.socket_dir)

    def start(self) -> SidecarLauncher:
        from dspark_sidecar.server.config import ServeConfigError
        from dspark_sidecar.server.preflight import socket_answers

        # serve's own refusal of the folder's socket paths (over sun_path, URI syntax), here: the probe below
        # cannot connect to a path too long for a unix socket, and counts that as a sidecar answering there.
        problem = layout.socket_dir_problem(self.socket_dir, self.tp)
        if problem:
            raise ServeConfigError(f"--socket-dir: {problem}")
        self.make_socket_dir()
        # A sidecar already answering in the folder: the new one refuses its sockets (exit 75) a few seconds
        # later, but the old one's health passed the wait below at once, and start() returned that sidecar
        # (its preset, dtype, checkpoint; stop() not stopping it) as the one it started.
        taken = [r for r in range(self.tp) if socket_answers(layout.rank_socket(self.socket_dir, r))]
        if taken:
            raise RuntimeError(f"a sidecar already answers on {self.socket_dir} (ranks {taken}): stop it first, "
                               "or start this one in another folder")
        env = sidecar_env()
        # The pid of the process that starts it, now: the object may have been made in another one.
        argv = self.argv + (["--exit-with-pid", str(os.getpid())] if self.exit_with_starter else [])
        with open(self.log_path, "ab") as log:
            self._log_from = log.tell()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        # Until start() returns, no `with` calls stop(), and the sidecar's own session keeps the starter's
        # Ctrl-C from it: whatever ends the wait other than SERVING (a timeout, a Ctrl-C) stops it here.
        try:
            self._wait_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_serving(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while not all(self.healthy()):
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()  # first, so that the tail below holds its stop's lines too
                raise TimeoutError(f"sidecar not SERVING within {self.ready_timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.2)
        if self.proc.poll() is not None:  # served by someone else's sidecar, started since the check above
            raise RuntimeError(f"sidecar exited with {self.proc.returncode}:\n{self.log_tail()}")
        # ... or started since, with this serve still importing: it refuses the folder only seconds later (exit 75).
        others = [r for r in range(self.tp) if not self._own_rank(r)]
        if others:
            raise RuntimeError(f"another sidecar serves on {self.socket_dir} (ranks {others}), started as this one "
                               "was: stop it first, or start this one in another folder")

    def _own_rank(self, rank: int) -> bool:
        """Whether rank's socket is listened on by this launcher's sidecar: by a process in the session its serve
        leads (its ranks are serve's children). A socket nobody answers on now, or whose process has exited since,
        tells nothing of another sidecar: not held against it."""
        from dspark_sidecar.server.preflight import listener_pid

        assert self.proc is not None
        pid = listener_pid(layout.rank_socket(self.socket_dir, rank))
        if pid is None:
            return True
        try:
            # pid 0: a process of another pid namespace (another container's sidecar); session 0: one whose
            # session leader is outside ours (a container's `exec`). Never ours: serve leads its own session.
            return pid > 0 and os.getsid(pid) == self.proc.pid > 0
        except ProcessLookupError:  # exited since it answered
            return True

    @property
    def exited(self) -> bool:
        """Whether the sidecar this launcher started has ended (by itself, or stopped)."""
        return self.proc is not None and self.proc.poll() is not None

    def status(self, rank: int = 0) -> pb.StatusReport:
        conn = SidecarConnection(self.endpoint(rank))
        try:
            return conn.open(5.0)
        finally:
            conn.close()

    def rank_pids(self) -> list[int]:
        """PIDs of the rank processes (the launcher's children carrying RANK), in rank order."""
        assert self.proc is not None
        ranked = []
        for child in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split():
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                ranked.append((rank, int(child)))
        return [pid for _, pid in sorted(ranked)]

    def kill_rank(self, rank: int) -> None:
        """SIGKILL one rank process (a crash); the sidecar's other ranks then go down too."""
        os.kill(self.rank_pids()[rank], signal.SIGKILL)

    def log_tail(self, n: int = 30) -> str:
        """The last n lines this start's sidecar wrote. The log is appended to (a folder used again): its whole
        tail quoted an earlier start's traceback as the cause of a sidecar that died without a word (SIGKILL)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_from)
                return "\n".join(log.read().decode(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (drain and exit), SIGKILL to the whole process group if it lingers."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> SidecarLauncher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
