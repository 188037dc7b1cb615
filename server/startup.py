"""A sidecar rank's start-up: its collectives bounded and a lost peer told in one line, and a stop before serving."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import select
import signal
import threading
from pathlib import Path
from typing import Callable, Iterator

import torch.distributed as dist

from dspark_sidecar.server.process_group import PeerLost
from dspark_sidecar.server.rank import RankContext
from dspark_sidecar.server.warmup import warm_up
from dspark_sidecar.server.rendezvous import Board

log = logging.getLogger("dspark_sidecar.server")


class SignalStop:
    """The rank's stop: set by its SIGTERM/SIGINT handler, waited for by the serving loop's beat, both on the main
    thread (a handler runs there, between two lines of whatever it was doing). A threading.Event deadlocked: a
    signal landing while the wait held the event's lock (not re-entrant) had set() wait for it for good. Here set()
    takes no lock: a flag, and a byte down a pipe that wakes the wait's select (it may have started already)."""

    def __init__(self) -> None:
        self._flag = False
        self._wake, self._ring = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def set(self) -> None:
        self._flag = True
        with contextlib.suppress(BlockingIOError):  # the pipe full of earlier signals' bytes: the wait wakes anyway
            os.write(self._ring, b"\0")

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float) -> bool:
        """Whether the stop is set, waiting up to `timeout` s for it."""
        if not self._flag:
            select.select([self._wake], [], [], timeout)
        return self._flag


class StartUp:
    """SIGTERM/SIGINT while the rank is still starting (loading, the rendezvous, the warm-up) ends it
    at once: the serving loop that reads `stop` is not reached yet, and a load can take minutes. What
    start-up made that outlives the process (its socket file, rank 0's board) is removed first; the
    process ends with os._exit so no half-made collective or CUDA state has to be torn down (inside
    `unwinding`, where a write has its own cleanup to run, it raises SystemExit(0) instead)."""

    def __init__(self, rank: int, stop: SignalStop | threading.Event | None = None) -> None:
        self.rank, self.stop = rank, stop if stop is not None else SignalStop()
        self.active = True  # until the rank accepts draft calls; from then on a signal drains
        self.socket: Path | None = None
        self.lease: Path | None = None  # the engine-lease socket, bound with the servicer (before the warm-up)
        self.board: Board | None = None
        self.bound_s: int | None = None  # --startup-timeout-s, once `group` made the start-up group
        self.unwind = False  # inside `unwinding`: a signal raises SystemExit(0) instead of ending the process
        self._unwinding = False  # that SystemExit was raised: the process is on its way out

    def group(self, bound_s: int):
        """The gloo group of the start-up collectives below, on every backend, waiting up to `bound_s`
        (--startup-timeout-s) for the slowest rank. Without a timeout new_group gave torch's default (30
        minutes) whatever --dist-timeout-s said, so on NCCL a peer hung while loading held the others that
        long; the world group's --dist-timeout-s (on gloo) failed a rank whose load ran a minute behind.
        Collective: a peer that never comes is PeerLost, as in barrier, not new_group's traceback."""
        self.bound_s = bound_s
        return self._collective(lambda: dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=bound_s)))

    def on_signal(self, signum, _frame) -> None:
        self.stop.set()
        if not self.active or self._unwinding:  # (a second signal must not cut the unwinding's cleanup short)
            return
        # The handler runs between two bytecodes of the main thread, which may be inside a write to the same
        # stderr: the line's write then raises RuntimeError ("reentrant call", logging's own report of it
        # again), which left this handler before the release and the exit. The line may go; the stop may not.
        with contextlib.suppress(RuntimeError):
            log.info("rank %d: %s during start-up; stopping (exit 0)", self.rank, signal.Signals(signum).name)
        if self.unwind:
            self._unwinding = True
            raise SystemExit(0)  # serve_rank releases the rest on its way out
        self.release()
        os._exit(0)

    @contextlib.contextmanager
    def unwinding(self) -> Iterator[None]:
        """Inside, a stop raises SystemExit(0) where the main thread is, as Ctrl-C's KeyboardInterrupt
        would, so that the work's own cleanup runs: os._exit skipped it, and rank 0 stopped while writing
        the embedded synthetic checkpoint (under torchrun) left its partial folder, gigabytes for a full
        preset, beside the cache, one more at each stop."""
        self.unwind = True
        try:
            yield
        finally:
            self.unwind = False

    def release(self) -> None:
        """Remove what start-up made that would outlive the process: rank 0's board, the socket files (the
        gRPC one and the engine-lease one)."""
        if self.board is not None:
            self.board.unlink()
        for path in (self.socket, self.lease):
            if path is not None:
                path.unlink(missing_ok=True)

    def barrier(self, group) -> None:
        """dist.barrier among the starting ranks. A peer that failed to start has printed its own line
        and exited, which reaches the others here as a gloo error: they say so in one line (PeerLost)
        rather than with a traceback that reads as a second, unrelated failure."""
        self._collective(lambda: dist.barrier(group=group))

    def share(self, value, group):
        """Rank 0's `value` on every starting rank (a broadcast; a peer lost is PeerLost, as in barrier)."""
        box = [value]
        self._collective(lambda: dist.broadcast_object_list(box, src=0, group=group))
        return box[0]

    def gather(self, value, world: int, group) -> list:
        """Every starting rank's `value`, in rank order (an all-gather; a peer lost is PeerLost, as in barrier)."""
        out = [None] * world
        self._collective(lambda: dist.all_gather_object(out, value, group=group))
        return out

    def warm_up(self, ctx: RankContext, **kw) -> float:
        """warmup.warm_up(ctx, **kw), whose steps exchange partial sums with the peers (the world group): a peer
        lost in one of those collectives is PeerLost, as in barrier, not gloo's traceback from inside a step. A
        failure of this rank's own compute (out of memory, a kernel error) is raised as it is: taken for a
        peer lost, its one line would send the reader to a peer that printed nothing."""
        try:
            return warm_up(ctx, **kw)
        except (RuntimeError, dist.DistError) as err:
            if not _raised_by_collective(err):
                raise
            self.release()
            raise PeerLost.of(self.rank, err, "left during the warm-up step") from None

    def _collective(self, run: Callable[[], object]):
        try:
            return run()
        except (RuntimeError, dist.DistError) as err:
            self.release()
            what = "left during start-up"
            if self.bound_s is not None:  # or is alive but hung: the wait timed out
                what += f" or did not catch up within --startup-timeout-s {self.bound_s} s"
            raise PeerLost.of(self.rank, err, what) from None


_DIST_DIR = os.path.dirname(dist.__file__) + os.sep


def _raised_by_collective(err: BaseException) -> bool:
    """Whether `err` came out of a torch.distributed call (gloo's error for a peer gone mid-collective
    is a plain RuntimeError, like any other): its innermost frame is torch.distributed's."""
    if isinstance(err, dist.DistError):
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_DIST_DIR)
