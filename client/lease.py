"""The engine rank's lease on its sidecar rank: a unix connection that ends with this process (server/lease.py).

The sidecar releases the KV binding made under the lease once the connection ends, so a cache the engine can no
longer release itself (the process exited or was killed) does not stay mapped, and allocated, by the sidecar.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
import time
import weakref

from dspark_sidecar.layout import SUN_PATH_MAX
from dspark_sidecar.proto import LEASE_TOKEN_FORMAT, MAX_LEASES

TOKEN = struct.Struct(LEASE_TOKEN_FORMAT)
CONNECT_RETRY_S = 0.01  # between connects to a lease socket whose backlog is full (_connect_by)

log = logging.getLogger("dspark_sidecar.client")


class EngineLease:
    """One lease at a time, taken from the sidecar's lease socket when a BindKV needs one (`token`)."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._path = ""
        self._token = 0
        self._taking: socket.socket | None = None  # the socket of a take under way: a fork's child closes it too
        _ALL.add(self)

    def token(self, path: str, deadline_s: float) -> int:
        """The token of a live lease from `path` (StatusReport.lease_socket), taken now if the one held is from
        another path or has ended (the sidecar restarted or closed it); 0 where `path` is empty (a sidecar
        without leases) or none could be taken, which is said: the binding then outlives this process."""
        if not path:
            self.close()
            return 0
        if self._sock is not None and path == self._path and self._open():
            return self._token
        self.close()
        # Made and recorded under _FORK_LOCK, which a fork waits for: socket() lets other threads run, and a fork by
        # one of them between it and this record left the child a copy no hook knew of (the lease outlived the engine).
        with _FORK_LOCK:
            sock = self._taking = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # One deadline for the whole take, not each socket call's: a peer sending the token a byte at a time,
        # each within the timeout, held the bind up to 9x its deadline (connect's wait, then each of 8 recvs).
        end = time.monotonic() + deadline_s
        try:
            sock.settimeout(deadline_s)
            _connect(sock, path, end)
            token = TOKEN.unpack(_read_exactly(sock, TOKEN.size, end))[0]
            if token:  # the protocol's tokens are never 0; a peer sending one is no sidecar's lease socket
                self._sock, self._path, self._token = sock, path, token
        except (OSError, EOFError) as err:  # no socket there, refused, full (closed before the token), too slow
            sock.close()
            log.warning("no lease from the sidecar's %s (%s): this binding will outlive this process if it dies "
                        "(the sidecar keeps its KV cache mapped until a re-bind or its own exit)", path, err)
            return 0
        finally:
            self._taking = None  # once the socket is the lease's (or given up): a fork meanwhile finds it as either
        if not token:
            sock.close()
            log.warning("the sidecar's %s sent lease token 0: not a lease; binding without one", path)
            return 0
        return token

    @property
    def held(self) -> int:
        """The token of the lease held now (0: none), not checked nor taken again: for what is registered
        right after the bind that took it (StepBuffers)."""
        return self._token

    def _open(self) -> bool:
        """Whether the lease's connection is still open: the sidecar writes nothing after the token, so a
        readable socket means end of file (its end closed it)."""
        poller = select.poll()  # not select(): an engine's descriptor numbers may pass 1023
        poller.register(self._sock, select.POLLIN)
        return not poller.poll(0)

    def close(self) -> None:
        """End the lease: the sidecar releases a binding still held under it."""
        if self._sock is not None:
            self._sock.close()
        self._sock, self._path, self._token = None, "", 0


def lease_path(endpoint: str, lease_socket: str) -> str:
    """Where this process reaches the lease socket a sidecar rank's status names: beside the rank's gRPC socket as
    this process reaches that (the protocol puts it there; a link to it resolved), where such a socket exists; else
    the status's path.
    The status's path is the server's own view: an engine container that mounts the socket folder at another
    path found nothing there, took no lease, and its bindings outlived it. "" stays "" (no leases)."""
    if not lease_socket or not endpoint.startswith("unix:"):  # a TCP endpoint: no folder of ours to look in
        return lease_socket
    # The folder of the socket the endpoint leads to, not of a link to it: the one the sidecar checked and serves
    # from. Beside a link (in /tmp, say), whoever put a socket of that name there held this engine's lease.
    sock = os.path.realpath(endpoint[len("unix:"):])  # unix:///abs too (its extra slashes collapse)
    beside = os.path.join(os.path.dirname(sock), os.path.basename(lease_socket))
    return beside if os.path.exists(beside) else lease_socket


def _connect(sock: socket.socket, path: str, end: float) -> None:
    """connect() to the unix socket at `path`, of any length, by time.monotonic() `end`. lease_path resolves links,
    so the path it gives may pass sun_path's 108 bytes where the one serve bound (and the engine reaches the gRPC
    socket by) fit: a socket folder reached through a short link to a deep one, a relative endpoint under a deep
    working folder. Refused "AF_UNIX path too long", the engine bound without a lease. Such a path is reached
    through its folder's descriptor (/proc/self/fd/N/NAME, short), which names that very folder: no lookup by
    another path."""
    if len(os.fsencode(path)) <= SUN_PATH_MAX:
        _connect_by(sock, path, end)
        return
    folder, name = os.path.split(path)
    fd = os.open(folder or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _connect_by(sock, f"/proc/self/fd/{fd}/{name}", end)
    finally:
        os.close(fd)


def _connect_by(sock: socket.socket, address: str, end: float) -> None:
    """sock.connect(address), room in a full backlog waited for until `end`: a unix connect() with a timeout fails
    at once (EAGAIN) there, where a blocking one waits, and a keeper whose accepts wait (EMFILE, a burst of
    connects) gave the engine no lease at once, well inside its deadline."""
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError("the lease socket's backlog stayed full within the deadline") from None
            time.sleep(min(CONNECT_RETRY_S, left))


def _forget_in_child() -> None:
    """A forked child's copies of the leases' descriptors closed (the parent's stay open): a lease ends only
    when its last descriptor does, so a child the engine forked (a worker pool, a helper) that kept it kept the
    engine's binding at the sidecar after the engine ended. A lease the child needs, it takes itself. A take under
    way in another thread of the parent (connected, its token not read yet) too: that socket becomes the lease there."""
    try:
        for lease in list(_ALL):
            for sock in (lease._sock, lease._taking):
                if sock is not None:
                    sock.close()
            lease._sock, lease._path, lease._token, lease._taking = None, "", 0, None
    finally:
        _FORK_LOCK.release()  # taken for the fork (before=) by the thread that is this child's only one


_ALL: weakref.WeakSet[EngineLease] = weakref.WeakSet()
# Held by a take from socket() to its record (_taking), and by a fork: one waits for the other. Re-entrant: a fork
# from inside the take's own hold (a signal handler's) goes on, as before, rather than wait on itself for good.
_FORK_LOCK = threading.RLock()
os.register_at_fork(before=_FORK_LOCK.acquire, after_in_parent=_FORK_LOCK.release, after_in_child=_forget_in_child)


def _read_exactly(sock: socket.socket, n: int, end: float) -> bytes:
    """n bytes from `sock` by time.monotonic() `end` (TimeoutError past it), EOFError where it closes first."""
    data = b""
    while len(data) < n:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(data)} of the token's {n} bytes within the deadline")
        sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            # Before any byte, the sidecar's own refusal: said, or the engine's log named no cause to act on.
            raise EOFError(f"the connection closed after {len(data)} of the token's {n} bytes" + (
                "" if data else f", as the sidecar closes one when the rank already holds the most leases a sidecar "
                f"rank holds ({MAX_LEASES}: engines, or other processes connected to its lease socket) or when it "
                "shuts down"))
        data += chunk
    return data
