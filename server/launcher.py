"""The built-in launcher: spawns the TP rank processes, watches them, and takes the group down together."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection

from dspark_sidecar import layout
from dspark_sidecar.server.config import AddressInUse, ServeConfig, ServeConfigError
from dspark_sidecar.server.preflight import remove_stale_socket
from dspark_sidecar.server.processes import ExitWith

log = logging.getLogger("dspark_sidecar.launcher")
# A serving rank that has not exited this long after its --drain-s is killed: its teardown ends itself
# within 30 s (teardown.TEARDOWN_LIMIT_S + rank.STOP_STEPS_S + teardown.SERVER_GRACE_S), so only a wedged one is.
DRAIN_GRACE_S = 60.0
# A rank still starting ends at once on SIGTERM (startup.StartUp) unless it is blocked in native code
# (torch's rendezvous connect retries for --dist-timeout-s, a read of a hung filesystem) where no
# Python signal handler runs: past this it is killed, and a stop requested by the user still exits 0.
STARTUP_STOP_S = 3.0
EXIT_USAGE = ServeConfigError.exit_status  # cli.main: a flag, value, config or checkpoint that cannot be used, in one line
EXIT_TEMPFAIL = AddressInUse.exit_status  # cli.main: the same for a port or socket another process holds now
_REFUSALS = (EXIT_USAGE, EXIT_TEMPFAIL)
# How a rank still starting ends on a stop: its handler's exit 0, or the signal's default action before its
# handlers are set (-SIGTERM from the launcher, -SIGINT from a Ctrl-C to the whole foreground group).
_STARTUP_STOPPED = (0, -signal.SIGTERM, -signal.SIGINT)
# How a rank ends once a peer has left during start-up: by itself at once, one line (PeerLost, cli.cmd_serve).
EXIT_PEER_LOST = 1


def free_port(avoid: Collection[int] = ()) -> int:
    """A TCP port free on 127.0.0.1 now and none of `avoid`: the ranks' own gRPC and metrics ports. Those
    are free until the ranks bind them, so the kernel may hand one out (when they lie in its ephemeral
    range); the rendezvous and that rank's listener then met on it, and whichever bound second refused
    to start, blaming a port the user never chose or "another process" (ServeConfig refuses the same
    overlap for a --master-port given)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def launch(cfg: ServeConfig, rank_argv: list[str], on_ready=None, poll_s: float = 0.2) -> int:
    """Run `python -m dspark_sidecar <rank_argv>` once per rank, torchrun-style env; block until done.

    A rank that exits while the group is serving takes the group down: one log line naming it,
    SIGTERM to the rest, SIGKILL after a grace period, exit code 1. SIGTERM/SIGINT to the
    launcher drains every rank and returns 0 when all exited cleanly (else 1, with a line naming the ranks
    that did not); before the group serves (on_ready has not reported it yet) it stops them within
    STARTUP_STOP_S and returns 0. A rank that refuses to start (exit EXIT_USAGE or EXIT_TEMPFAIL, its one
    line said) stops the group with that code.
    With cfg.exit_with_pid, the process of that pid going (its starter SIGKILLed) stops the group as
    SIGTERM does, with one log line: the ranks die with this launcher (PR_SET_PDEATHSIG), but nothing
    else would end the launcher.
    """
    watched = ExitWith(cfg.exit_with_pid) if cfg.exit_with_pid else None  # gone already: preflight refused it
    own = {base + r for base in (cfg.tcp_base_port, cfg.metrics_port) if base for r in range(cfg.tp)}
    port = cfg.master_port or free_port(avoid=own)
    env = dict(os.environ, WORLD_SIZE=str(cfg.tp), MASTER_ADDR=cfg.master_addr, MASTER_PORT=str(port),
               DSPARK_LAUNCHER_PID=str(os.getpid()))
    procs: list[subprocess.Popen] = []
    stopping = False
    stop_deadline = float("inf")
    serving_grace = cfg.drain_s + DRAIN_GRACE_S  # a serving rank's stop: its drain, then its teardown
    ready_sent = on_ready is None  # without a probe, assume serving: the long drain grace applies

    def stop() -> None:
        nonlocal stopping, stop_deadline
        # The first stop sets the kill's deadline; a second SIGTERM or Ctrl-C (a user who thinks the
        # stop is stuck, a supervisor repeating its signal) must not push it back, else wedged ranks
        # were killed only once the signals stopped coming, or never.
        if not stopping:
            stop_deadline = time.monotonic() + (serving_grace if ready_sent else STARTUP_STOP_S)
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    # The handlers and the spawning inside the try whose finally terminates the ranks: a Popen that raises
    # for rank k (EAGAIN, ENOMEM) left ranks 0..k-1 running, and a stop during the spawning killed this
    # launcher by the signal's default action. A rank not spawned yet when a stop comes is not spawned.
    old = {}
    try:
        old = {s: signal.signal(s, lambda _signum, _frame: stop()) for s in (signal.SIGTERM, signal.SIGINT)}
        for r in range(cfg.tp):
            if stopping:
                break
            procs.append(subprocess.Popen([sys.executable, "-m", "dspark_sidecar", *rank_argv],
                                          env=dict(env, RANK=str(r), LOCAL_RANK=str(r))))
            if stopping:  # the stop came inside Popen, before this rank was in `procs` for stop() to signal
                procs[-1].send_signal(signal.SIGTERM)
        while True:
            codes = [p.poll() for p in procs]
            if stopping and all(c is not None for c in codes):
                # A rank still importing (before serve_rank sets its handlers) ends by the stop's own signal:
                # -SIGTERM from here, or -SIGINT from a Ctrl-C to the whole foreground group. That is the
                # start-up stop asked for, exit 0 as documented, not a failed rank.
                stopped = _STARTUP_STOPPED if not ready_sent else (0,)
                return _stop_result(codes, stopped)
            if stopping and not ready_sent and time.monotonic() > stop_deadline:
                log.warning("rank(s) %s still starting %.0f s after the stop request (blocked in the rendezvous "
                            "or a read); killing them", [r for r, c in enumerate(codes) if c is None], STARTUP_STOP_S)
                _terminate(procs, grace_s=0.0)
                # The kill is the stop asked for; a rank that had already exited otherwise (a traceback, exit 1)
                # failed all the same, as when every rank exits by itself (above): 0 here hid it.
                return _stop_result(codes, _STARTUP_STOPPED)
            if stopping and time.monotonic() > stop_deadline:
                # Named, as the start-up stop's kill names them: the wedged rank(s), and (_stop_result) any that
                # failed in its drain meanwhile; "ranks still running" alone said neither which nor how.
                log.error("rank(s) %s still running %.0f s after SIGTERM; killing them",
                          [r for r, c in enumerate(codes) if c is None], serving_grace)
                _terminate(procs, grace_s=0.0)
                _stop_result(codes, (0,))
                return 1
            dead = [(r, c) for r, c in enumerate(codes) if c is not None]
            if dead and not stopping:
                # The rank that failed, not a peer it took down: a peer of a rank gone during start-up exits 1 by
                # itself at once (PeerLost), so where a slow probe or poll found several gone, the lowest was often
                # such a peer and the failed rank (killed by a signal, -9 from the OOM killer, it says nothing
                # itself) went unnamed. A refusal first (its code is the group's), then any exit but PeerLost's.
                r, c = min(dead, key=lambda rc: (rc[1] not in _REFUSALS, rc[1] == EXIT_PEER_LOST))
                if c in _REFUSALS and not ready_sent:
                    # The rank refused something at start-up (a port or socket taken since the parent's
                    # check) and said so in its own line: no second line here, and its exit code is the
                    # group's, as the same refusal in the parent gives.
                    log.info("sidecar rank %d refused to start; stopping the group (%d ranks)", r, cfg.tp)
                    _terminate(procs, grace_s=STARTUP_STOP_S)
                    return c
                log.error("sidecar rank %d exited with code %s; stopping the group (%d ranks)", r, c, cfg.tp)
                _terminate(procs, grace_s=10.0 if ready_sent else STARTUP_STOP_S)
                return 1
            if watched is not None and not stopping and watched.gone():
                log.warning("the process this sidecar exits with (--exit-with-pid %d) has gone; stopping the "
                            "ranks", watched.pid)
                stop()
            if on_ready is not None and not ready_sent and not stopping:
                ready_sent = on_ready()
                if ready_sent and stopping:
                    # The signal came during the probe, which then found every rank serving: they
                    # drain (drain_s, the teardown), so the serving grace applies, not the start-up
                    # bound set by stop() (that would kill them mid-drain and exit 1).
                    stop_deadline = time.monotonic() + serving_grace
            time.sleep(poll_s)
    finally:
        # The handlers go back last: put back first, a stop during the rest (a repeated SIGTERM or Ctrl-C reaching a
        # caller's defaults) killed this launcher inside _terminate's grace or between a killed rank's socket files.
        try:
            _terminate(procs)
            _remove_stale_sockets(cfg, procs)
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def _stop_result(codes: list[int | None], stopped: Collection[int]) -> int:
    """The launcher's exit code for a stop the ranks have ended (None: killed by the stop): 0 when each ended as
    the stop asks, else 1 with one line naming the ranks that did not (killed by a signal, -9 from the OOM
    killer, a rank prints nothing of its own: exit 1 alone said no rank failed, nor which)."""
    failed = [(r, c) for r, c in enumerate(codes) if c is not None and c not in stopped]
    if failed:
        log.error("%s during the stop", "; ".join(f"sidecar rank {r} exited with code {c}" for r, c in failed))
    return 1 if failed else 0


def _remove_stale_sockets(cfg: ServeConfig, procs: list[subprocess.Popen]) -> None:
    """A rank that failed or was killed (os._exit(3), SIGKILL) leaves its socket files, the gRPC one and the
    engine-lease one; remove them unless something answers on them or another serve's rank has claimed the
    rank's name (never a live server's: preflight.remove_stale_socket), so the folder shows no sidecar that is
    not there. One that cannot be removed (another user's in a sticky folder: EPERM) is left with a line: this
    runs in launch's finally, where an OSError replaced the group's exit code (a refusal's 2) with a traceback."""
    for r, p in enumerate(procs):
        if p.returncode != 0:
            try:
                remove_stale_socket(cfg.socket_path(r), layout.rank_lease_socket(cfg.socket_dir, r))
            except OSError as err:
                log.warning("cannot remove rank %d's stale socket %s: %s; remove it as its owner or root", r,
                            err.filename or cfg.socket_path(r), err.strerror or err)


def _terminate(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
