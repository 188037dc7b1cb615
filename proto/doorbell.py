"""The doorbell page both ends share (layout of sidecar.proto's AttachDoorbellRequest) and how they wait on it."""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import platform
import select
import stat
import sys
import threading
import time

import numpy as np

log = logging.getLogger("dspark_sidecar.doorbell")

HEADER = 64  # bytes: 8 uint64 words, 7 used
MIN_CAPACITY = 4096  # bytes per direction: room for any error answer (its message and the step's timings)
REQ_SEQ, REQ_LEN, RESP_SEQ, RESP_LEN, ASLEEP, GPU_WORD, CLOSED = range(7)
WORDS = 7
GPU_WORD_OFFSET = 8 * GPU_WORD
SKIP_KEY = 0xFFFFFFFF  # a launch key no engine sends: the sidecar's own store releases a wait for nothing


# The doorbell page, the sidecar ranks' rendezvous board and the engine ranks' agreement page each
# write a message with plain stores and then its sequence number, and trust a reader that sees the
# number to see the message. That holds where stores become visible in the order written (x86-64),
# not on weakly ordered hosts (arm64, POWER), where Python has no fence to put between the two: a
# reader there could act on the previous step's words. Those hosts keep the gRPC stream, gloo, and
# a TP-1 sidecar (stores_in_order's callers).
IN_ORDER_MACHINES = ("x86_64", "amd64")


def stores_in_order(machine: str | None = None) -> bool:
    """Whether this host (or `machine`, as platform.machine() names it) shows other processes its
    stores in program order, which the shared-memory protocols here rely on."""
    return (platform.machine() if machine is None else machine).lower() in IN_ORDER_MACHINES


def gpu_word(seq: int, launch_key: int) -> int:
    """Word [5]'s value for step `seq` (sidecar.proto AttachDoorbellResponse.gpu_word)."""
    return (seq & 0xFFFFFFFF) << 32 | (launch_key & 0xFFFFFFFF)

# Waiting: short naps while the other end is active, longer sleeps once it has been quiet. Linux
# rounds every sleep up by the thread's timer slack (50 us by default), which made a "20 us" poll
# cost ~75 us of latency per hop; waiting threads lower their own slack to 1 us (per thread, see
# below). No busy spin, not even sleep(0): a spinning thread keeps taking the GIL back from the
# other threads of its process (measured: 3 such threads halve a fourth thread's throughput;
# 10 us naps cost it nothing), and on a CPU deployment it takes the core from the peer it waits for.
NAP_S = 10e-6  # ~15 us per poll with 1 us slack: a GPU step's host path is a few hundred us
CPU_NAP_S = 250e-6  # a CPU step computes for milliseconds, and polling threads would take its cores
WARM_S = 0.2  # after this long without activity, poll every SLEEP_S instead
SLEEP_S = 1e-3
# With a wake FIFO, an idle doorbell stops spinning after DOZE_S and blocks on the FIFO, each wait ending
# after MISSED_WAKE_S at most: the bound on the one race the flag protocol leaves (see Waker.sleep), and so
# ~500 wake-ups a second while idle (about 2.5% of a core), not a spin.
DOZE_S = 5e-3
MISSED_WAKE_S = 2e-3


def nap_for(device_type: str) -> float:
    """The poll interval while steps flow, for ranks computing on `device_type` ("cuda" or "cpu")."""
    return NAP_S if device_type == "cuda" else CPU_NAP_S


_PR_SET_TIMERSLACK = 29
_slack = threading.local()


@functools.cache
def _libc() -> ctypes.CDLL:
    """One handle for the process: each CDLL builds a reference cycle (its function-pointer type), which
    a new one per doorbell thread left to the cyclic collector (run 270's probe)."""
    return ctypes.CDLL(None, use_errno=True)


def lower_timer_slack() -> None:
    """Make this thread's short sleeps short (prctl PR_SET_TIMERSLACK = 1 us); Linux only, once per thread.

    Never raises: the slack only tightens the polls' naps. A prctl refused (a sandbox's seccomp filter, gVisor)
    raised OSError at the first poll of each thread, which ended the rendezvous coordinator's thread without a word
    (every step then waited its deadline and more before the ranks exited) and a doorbell's. Said once per process;
    the thread polls on with the kernel's default slack (50 us), its naps that much longer."""
    if getattr(_slack, "done", False) or not sys.platform.startswith("linux"):
        return
    _slack.done = True
    if _libc().prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0) != 0:
        _slack_refused(ctypes.get_errno())


_slack_said = threading.Lock()
_slack_errnos: set[int] = set()


def _slack_refused(err: int) -> None:
    """Say a refused prctl once per errno per process. Not functools.cache: two threads missing the cache at
    once both ran the body (CI saw the warning twice), so the check and the note share a lock."""
    with _slack_said:
        if err in _slack_errnos:
            return
        _slack_errnos.add(err)
    log.warning("prctl(PR_SET_TIMERSLACK) refused (%s): the doorbell's and the rendezvous' polls keep the default "
                "timer slack (about 50 us longer naps)", os.strerror(err))


def pause(idle_s: float, nap_s: float = NAP_S) -> None:
    """One poll's sleep: a nap while the other end acted within WARM_S, else SLEEP_S."""
    time.sleep(nap_s if idle_s < WARM_S else SLEEP_S)


def wait_until(ready, deadline: float, active_since: float, nap_s: float = NAP_S) -> bool:
    """Poll `ready()` until it is true (True) or perf_counter() passes `deadline` (False).

    active_since: when this end last saw the other end act; it sets how hot the poll starts.
    nap_s: the interval while active (`nap_for` the device).
    """
    lower_timer_slack()
    while not ready():
        now = time.perf_counter()
        if now > deadline:
            return False
        pause(now - active_since, nap_s)
    return True


class Page:
    """Typed views of a doorbell page: the header's WORDS words and the request / response areas."""

    def __init__(self, buf: np.ndarray, capacity: int) -> None:
        if buf.nbytes < HEADER + 2 * capacity:
            raise ValueError(f"page of {buf.nbytes} bytes cannot hold 2 x {capacity} + {HEADER}")
        self.capacity = capacity
        self.words = np.ndarray((WORDS,), dtype=np.uint64, buffer=buf[: 8 * WORDS])
        self.req_area = buf[HEADER : HEADER + capacity]
        self.resp_area = buf[HEADER + capacity : HEADER + 2 * capacity]
        # The areas as memoryviews: a slice assignment of bytes into one is a plain copy (~0.1 us), where numpy's
        # from a bytes object took ~1 us, before every ring (the engine) and every answer (the sidecar).
        # Released by close(), with the areas: a write after it raises (TypeError) instead of landing in a
        # mapping its owner is about to close.
        self._req_view: memoryview | None = memoryview(self.req_area)
        self._resp_view: memoryview | None = memoryview(self.resp_area)

    def word(self, i: int) -> int:
        return int(self.words[i])

    def write(self, area: np.ndarray, data: bytes, len_word: int, seq_word: int, seq: int) -> None:
        """Bytes, then their length, then the sequence number: the reader trusts nothing before the sequence."""
        n = len(data)
        if n > self.capacity:
            raise ValueError(f"message of {n} bytes exceeds the doorbell's {self.capacity}-byte area")
        if type(data) is bytes and area is self.req_area:
            self._req_view[:n] = data  # type: ignore[index]
        elif type(data) is bytes and area is self.resp_area:
            self._resp_view[:n] = data  # type: ignore[index]
        else:
            area[:n] = np.frombuffer(data, dtype=np.uint8)
        self.words[len_word] = n
        self.words[seq_word] = seq

    def read(self, area: np.ndarray, len_word: int) -> bytes:
        n = int(self.words[len_word])
        if n > self.capacity:
            raise ValueError(f"message length {n} exceeds the doorbell's {self.capacity}-byte area")
        return area[:n].tobytes()

    def close(self) -> None:
        for view in (self._req_view, self._resp_view):
            if view is not None:
                view.release()
        self._req_view = self._resp_view = None
        self.words = self.req_area = self.resp_area = None  # type: ignore[assignment]


class Waker:
    """The sidecar's end of the wake FIFO: an idle doorbell thread blocks here instead of polling."""

    def __init__(self, path: str) -> None:
        # Absolute (not normalized: "link/.." goes through the link, as the kernel reads it): the name is handed to
        # the engine (AttachDoorbellResponse.wake_fifo), which works from a directory of its own. `serve
        # --socket-dir socks` gave it "socks/rank0.wake1", which it could not open: it kept no ringer, and each
        # step rung after an idle spell waited out the sleeping doorbell's MISSED_WAKE_S poll.
        if not os.path.isabs(path):  # (getcwd only then: it fails once the directory is removed)
            path = os.path.join(os.getcwd(), path)
        try:
            os.mkfifo(path, 0o660)
        except FileExistsError:
            # Left by a rank of this socket folder that crashed (the numbers restart with the
            # process): a FIFO nobody else can be using, so it is replaced. Anything else is kept.
            if not stat.S_ISFIFO(os.lstat(path).st_mode):
                raise
            os.unlink(path)
            os.mkfifo(path, 0o660)
        try:
            self.path = path
            # The read end, plus a write end of our own: with no writer a FIFO reads as EOF, which
            # poll() reports as readable forever. The folder is group-writable, so the name may have
            # been swapped since mkfifo: never through a symbolic link, and only the FIFO itself (before,
            # the fchmod below made the target of a link swapped in, any file this user owns, 0660).
            self._r = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            first = os.fstat(self._r)
            if not stat.S_ISFIFO(first.st_mode):
                raise OSError(errno.EINVAL, f"{path} is no longer the FIFO just made")
            self._w = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            if not os.path.samestat(first, os.fstat(self._w)):
                raise OSError(errno.EINVAL, f"{path} is no longer the FIFO just made")
            # 0660 whatever the umask (mkfifo's mode is narrowed by it): the engine, of the socket
            # folder's group, must open it for writing. Through the descriptor: the FIFO just made.
            os.fchmod(self._r, 0o660)
        except OSError:
            for fd in (getattr(self, "_r", None), getattr(self, "_w", None)):
                if fd is not None:
                    os.close(fd)
            os.unlink(path)
            raise
        # poll, not select: select refuses a descriptor past 1023 (ValueError), which a rank reaches with
        # NCCL, gRPC and CUDA's descriptors under a raised limit (the systemd unit's LimitNOFILE=65536);
        # the doorbell thread then died at its first idle nap, at every attach (helper 79).
        self._poll = select.poll()
        self._poll.register(self._r, select.POLLIN)

    def sleep(self, page: Page, rung, timeout_s: float) -> None:
        """Block until a wake byte, `rung()` or the timeout (at most MISSED_WAKE_S).

        The flag is set before rung() is read again, and the engine reads the flag after its
        sequence store, so one of the two sees the other, unless both stores are still in their
        CPUs' store buffers: that (rare) missed wake costs at most MISSED_WAKE_S.
        """
        page.words[ASLEEP] = 1
        try:
            if not rung():
                # ms; never negative: poll() waits for ever on one (a caller's deadline already past)
                self._poll.poll(max(0.0, min(timeout_s, MISSED_WAKE_S)) * 1e3)
                self._drain()
        finally:
            page.words[ASLEEP] = 0

    def _drain(self) -> None:
        while True:
            try:
                if not os.read(self._r, 4096):
                    return
            except BlockingIOError:
                return

    def close(self) -> None:
        # Once, as Ringer.close: a second os.close of the numbers closed whatever the process opened under them since.
        fds, self._r, self._w = (self._r, self._w), -1, -1
        if fds[0] < 0:
            return
        for fd in fds:
            os.close(fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:  # already removed (e.g. the socket folder was cleaned up)
            return
        except OSError as e:  # the path replaced (a directory: the folder is group-writable); ours is closed
            log.warning("doorbell: wake FIFO %s not removed: %s", self.path, e)


class Ringer:
    """The engine's end of the wake FIFO: one byte after a ring, only while the sidecar sleeps."""

    def __init__(self, path: str) -> None:
        # Checked before the open (no device is ever opened) and on the descriptor after it: the name is in
        # a group-writable folder, and one swapped for a link between the two had every wake byte written
        # into whatever file of this user the link named.
        if not stat.S_ISFIFO(os.lstat(path).st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a FIFO")
        self._w = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        if not stat.S_ISFIFO(os.fstat(self._w).st_mode):
            os.close(self._w)
            raise OSError(errno.EINVAL, f"{path} is not a FIFO")

    def wake_if_asleep(self, page: Page) -> bool:
        """After the sequence store: wake a sleeping sidecar. True when a byte was written."""
        if not page.words[ASLEEP]:
            return False
        try:
            os.write(self._w, b"\x01")
        except BlockingIOError:  # the pipe is full of wake bytes: the sidecar is being woken already
            return False
        except BrokenPipeError:  # no reader left: the sidecar process is gone. The step is rung all the same,
            return False  # and the engine's wait learns that from the liveness stream, as for any dead sidecar
        return True

    def close(self) -> None:
        # Once: a second os.close of the number closed whatever file the process had opened under it since.
        w, self._w = self._w, -1
        if w >= 0:
            os.close(w)
