"""Engine leases: a unix stream connection per engine process whose end tells the rank that the engine is gone.

A CUDA/HIP IPC mapping keeps the exporter's memory allocated after the exporter exits (run 299: 16 GiB still
held after the exporting process exited or was SIGKILLed, freed only when the importer closed its mapping). A
sidecar rank that kept a dead engine's KV cache bound therefore held most of the GPU's memory, and the engine,
restarted, failed its start-up memory check until the sidecar restarted too. gRPC tells a server nothing about
a client process's end; a socket does: the kernel closes an exiting process's descriptors, and the peer reads
end of file. So the engine takes a lease here before BindKV (StatusReport.lease_socket documents the protocol),
and the rank releases the binding made under the lease when its connection ends.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import selectors
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Callable

from dspark_sidecar.proto import LEASE_TOKEN_FORMAT, MAX_LEASES

log = logging.getLogger("dspark_sidecar.server")

TOKEN = struct.Struct(LEASE_TOKEN_FORMAT)  # the one message: the lease token
# After an accept failed for want of descriptors (EMFILE, ENFILE): how long the listener goes unwatched unless a
# lease's end frees one first. Watched on, it stayed readable (the connection waits in the backlog) and the
# thread spun, a warning per turn.
ACCEPT_RETRY_S = 1.0


class LeaseKeeper:
    """The listening socket at `path` and its open leases, served by one thread. `on_lost(token)` runs on a second
    thread, in the order the leases ended, after a lease's connection ended; `live(token)` is already False by
    then. On its own thread, because a release waits for the rank's loop (a step in progress, a doorbell's step
    for up to its stop bound): run by the serving thread, no lease was handed out meanwhile, and a restarted
    engine whose connect waited past its bind deadline bound without one (its binding then outlived it)."""

    def __init__(self, path: str | Path, on_lost: Callable[[int], None]) -> None:
        self.path = str(path)
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._live: set[int] = set()
        if os.path.lexists(self.path):  # a killed run's: the rank claimed its gRPC socket beside it first
            os.unlink(self.path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)  # its mode is the caller's to set, as the gRPC socket's (app._give_socket_mode)
        self._listener.listen(MAX_LEASES)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the thread out of select
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._stopping = False
        self._accept_paused = False  # the listener out of the selector (_accept's EMFILE) until _resume_accept
        self._resume_at = 0.0  # time.monotonic() by which a paused listener is watched again
        self._ended: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # leases ended, for _release; None: stop
        name = Path(self.path).name
        self._thread = threading.Thread(target=self._run, name=f"lease:{name}", daemon=True)
        self._releaser = threading.Thread(target=self._release, name=f"lease-release:{name}", daemon=True)
        self._thread.start()
        self._releaser.start()

    def live(self, token: int) -> bool:
        """Whether `token` names a lease of this keeper whose connection is still open."""
        with self._lock:
            return token in self._live

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._live)

    def _run(self) -> None:
        while not self._stopping:
            events = self._sel.select(max(0.0, self._resume_at - time.monotonic()) if self._accept_paused else None)
            # The pause's bound (descriptors freed elsewhere in the process count too), from the pause, not from the
            # last event: a lease's connection that writes wakes the selector again and again.
            if self._accept_paused and time.monotonic() >= self._resume_at:
                self._resume_accept()
            for key, _ in events:
                if key.fileobj is self._wake_r or self._stopping:
                    return
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj, key.data)

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):  # the client gave up between the event and the accept
            return
        except OSError as err:  # EMFILE and the like: the connection waits in the backlog; said, not spun on
            log.warning("lease socket %s: cannot accept a lease: %s (tried again once a lease ends, or in %.0f s)",
                        self.path, err, ACCEPT_RETRY_S)
            self._sel.unregister(self._listener)
            self._accept_paused = True
            self._resume_at = time.monotonic() + ACCEPT_RETRY_S
            return
        with self._lock:
            full = len(self._live) >= MAX_LEASES
            token = 0 if full else (secrets.randbits(63) or 1)
            if token:
                self._live.add(token)
        if full:
            log.warning("lease socket %s: %d leases open, the most a rank holds: a new one refused (closed before "
                        "its token)", self.path, MAX_LEASES)
            conn.close()
            return
        try:
            conn.sendall(TOKEN.pack(token))  # 8 bytes into an empty socket buffer: never blocks
        except OSError:  # the engine closed it already: a lease that never was
            conn.close()
            self._end(token)
            return
        conn.setblocking(False)
        self._sel.register(conn, selectors.EVENT_READ, token)

    def _read(self, conn: socket.socket, token: int) -> None:
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # ECONNRESET and the like: the connection is gone as surely as at end of file
            data = b""
        if data:  # the protocol has the engine write nothing: read and dropped, the lease stands
            return
        self._sel.unregister(conn)
        conn.close()
        self._end(token)
        self._resume_accept()  # a descriptor freed
        self._ended.put(token)

    def _release(self) -> None:
        """The releasing thread: on_lost for each lease ended, until close()."""
        while (token := self._ended.get()) is not None and not self._stopping:
            try:
                self._on_lost(token)
            except Exception:  # noqa: BLE001 - raised on, it would end this thread, and no later lease would be released
                log.exception("lease socket %s: releasing what lease %d held failed", self.path, token)

    def _resume_accept(self) -> None:
        if self._accept_paused:
            self._accept_paused = False
            self._sel.register(self._listener, selectors.EVENT_READ, None)

    def _end(self, token: int) -> None:
        with self._lock:
            self._live.discard(token)

    def close(self, wait_s: float | None = None) -> None:
        """Stop serving: the listener and every lease closed (the engines read end of file), the path removed.
        No on_lost for those, nor for leases ended but not yet released: the rank is shutting down, and its exit
        releases every mapping. wait_s: how long to wait for a release already running (None: until it ends);
        one still running past it (it waits on the rank's loop, which a step stuck at shutdown holds for good)
        is left to the process's end, which the teardown then brings. A second call does nothing."""
        with self._lock:
            if self._stopping:  # closed already (or closing on another thread): the path may be another rank's now
                return
            self._stopping = True
        self._wake_w.send(b"x")
        self._thread.join()  # it never waits on anything but its selector: back at once
        self._ended.put(None)
        self._releaser.join(wait_s)
        try:
            if os.path.lexists(self.path):
                os.unlink(self.path)
        except OSError as err:
            # The name replaced in the group-writable folder (a folder; another user's file in a sticky one), as
            # Waker.close leaves it. Raised, no lease ended (no engine read end of file) and the teardown failed.
            log.warning("lease socket %s not removed: %s", self.path, err)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()
        self._wake_w.close()
        if self._accept_paused:  # out of the selector's map
            self._listener.close()
        with self._lock:
            self._live.clear()
