"""Checks of the places `serve` listens on, made before any rank starts (cli.py) and again in each rank;
and, in the parent only, that the process `--exit-with-pid` names still runs (else the sidecar would
start only to stop again at once). The launcher's removal of a failed rank's socket file takes the rank's
claim too (remove_stale_socket).

Why in the parent: a rank that meets a busy port or an unusable socket folder fails after seconds of
start-up (the metrics port only after loading its shard), once per rank, and the launcher would
report the group's failure rather than the flag. Why again in the rank: under torchrun there is no
parent of ours, and a port can be taken between the parent's check and the rank's bind.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import struct
from pathlib import Path

from dspark_sidecar import layout
from dspark_sidecar.server import sockdir
from dspark_sidecar.server.config import AddressInUse, ServeConfig, ServeConfigError, bind_refusal
from dspark_sidecar.server.processes import ExitWith

PROBE_TIMEOUT_S = 1.0


def socket_answers(path: Path, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a process accepts connections on the unix socket at `path` (a live sidecar), as opposed
    to a socket file left by one that was killed (connection refused). Unknown answers count as live:
    replacing a socket that someone still serves on cuts that server off for good."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:  # EACCES (another user's socket), a timeout: someone may be serving there
            return True
        return True


def listener_pid(path: Path, timeout_s: float = PROBE_TIMEOUT_S) -> int | None:
    """The pid of the process listening on the unix socket at `path` (SO_PEERCRED, as of its listen(); 0 for
    one of another pid namespace, another container's); None where nobody answers now, or not in time."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
            return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        except OSError:
            return None


def _stale(path: Path) -> bool:
    """Whether a socket file nobody answers on is at `path`; refuses a live server's socket and a path
    that is not a socket (neither may be replaced)."""
    if not _socket_or_none(path):
        return False
    if socket_answers(path):
        raise AddressInUse(f"--socket-dir: a sidecar is already serving on {path}; stop it first or "
                               "choose another --socket-dir")
    return True


def _socket_or_none(path: Path) -> bool:
    """Whether a socket file is at `path` (False: nothing); refuses anything else, which a bind would replace."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise ServeConfigError(f"--socket-dir: {path} exists and is not a socket; remove it or choose another folder")
    return True


def _check_lease_path(cfg: ServeConfig, rank: int) -> None:
    """The rank's engine-lease socket path holds nothing or a socket. The lease socket is bound after the shard
    loads (server/lease.py), and it replaces a socket there (a killed run's; the gRPC socket's claim shows no
    live rank has it); anything else there is refused now, not removed then (a folder was a traceback then)."""
    _socket_or_none(layout.rank_lease_socket(cfg.socket_dir, rank))


# This process's claims (claim_socket), by socket path: each lock file's descriptor, open until the process ends.
_claims: dict[Path, int] = {}


def _hold_claim(path: Path) -> None:
    """Lock `path`'s lock file (DIR/rank{r}.sock.lock) for the rest of this process's life, or refuse: gRPC's
    bind unlinks whatever socket sits at the path, a live server's too, so two serves whose ranks both probed
    it before either had bound it both bound it, and the later cut the earlier off unseen. The kernel lets
    go of the lock when the process ends, kill -9 included; the file stays, harmless."""
    if path in _claims:  # claimed by this process already (tests, a rank that checks again)
        return
    fd = _open_lock(path)
    if not _lock(fd):
        os.close(fd)
        raise AddressInUse(f"--socket-dir: another sidecar is starting or serving on {path} (its rank holds "
                           f"{_lock_path(path)}); stop it first or choose another --socket-dir")
    _claims[path] = fd


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _open_lock(path: Path) -> int:
    """A descriptor of `path`'s lock file, made if missing; refused (ServeConfigError) if it cannot be used."""
    lock = _lock_path(path)
    # Never through a link, nor made readable by others: the folder's policy governs what is in it. O_NONBLOCK:
    # a FIFO at that name (the engine's group may create entries here, its wake FIFOs among them) blocked
    # the open until a writer came, a rank hung before it listened; it is refused below instead.
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as err:
        raise ServeConfigError(f"--socket-dir: cannot open the lock file {lock}: {err.strerror}; remove it "
                               "(as its owner or root)") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ServeConfigError(f"--socket-dir: the lock file {lock} is not a regular file; remove it (as its "
                               "owner or root)")
    return fd


def _lock(fd: int) -> bool:
    """Take the lock on a lock file's descriptor; False if another process (another open of it) holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def remove_stale_socket(path: Path, *beside: Path) -> None:
    """Remove the socket file at `path`, and each of `beside` (the rank's other sockets: its engine-lease socket),
    if nobody answers on it, holding the rank's claim on `path` meanwhile (the launcher, once its own ranks have
    gone). A claim another serve's rank holds leaves them: that rank may be between its bind and its listen, or
    have just put its socket where a stale one was, and a file that did not answer yet was removed, the rank
    serving on for no engine. An unusable lock file leaves them too."""
    paths = (path, *beside)
    if not any(p.is_socket() for p in paths):  # (no lock file made for a rank that failed before its claim)
        return
    try:
        fd = _open_lock(path)
    except ServeConfigError:
        return
    try:
        if _lock(fd):
            for p in paths:
                if p.is_socket() and not socket_answers(p):
                    p.unlink(missing_ok=True)
    finally:
        os.close(fd)


def claim_socket(cfg: ServeConfig, rank: int) -> None:
    """In the rank, just before it binds: the folder passes the parent's checks again (under torchrun
    this is the only check; elsewhere the folder may have changed since), the path is claimed against
    other serves' ranks (_hold_claim), then made free, removing a stale socket file (a restart after
    kill -9 must keep working) but never a live server's socket."""
    _usable_dir(cfg.socket_dir)
    path = cfg.socket_path(rank)
    _hold_claim(path)
    _check_lease_path(cfg, rank)
    if _stale(path):
        try:
            path.unlink(missing_ok=True)
        except PermissionError:  # another user's file in a sticky folder (a pod whose containers' uids differ)
            raise ServeConfigError(f"--socket-dir: cannot remove the stale socket {path} (owner uid "
                                   f"{path.lstat().st_uid}); remove it as that user or root") from None


def _usable_dir(d: Path) -> None:
    """The folder passes sockdir's policy and this user can create sockets in it. In the parent and again
    in the rank: under torchrun the rank's is the only check, and gRPC's failed bind names no reason (the
    rank read it as a socket taken since the checks: exit 75, which is restarted, for a folder it may not
    write, which no restart fixes)."""
    sockdir.prepare(d)
    if not os.access(d, os.W_OK | os.X_OK):
        raise ServeConfigError(f"--socket-dir: {d} is not writable by this user")


def check_socket_dir(cfg: ServeConfig) -> None:
    """The folder exists (made here if need be, mode 0770), nobody but this user, root and the folder's
    group can plant sockets in it (sockdir.py), and this user can create sockets in it; no rank's socket
    is served by a running sidecar. Stale socket files are left for the ranks to replace."""
    _usable_dir(cfg.socket_dir)
    for r in range(cfg.tp):
        _stale(cfg.socket_path(r))
        _check_lease_path(cfg, r)


def resolve(flag: str, host: str, port: int, who: str = "", passive: bool = True) -> list:
    """getaddrinfo's stream addresses of host:port (a bracketed IPv6 address unbracketed), or ServeConfigError naming
    `flag` for a name that does not resolve (check_port here, rank 0's store in process_group._listen)."""
    try:
        return socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                  flags=socket.AI_PASSIVE if passive else 0)
    except socket.gaierror as err:
        raise ServeConfigError(f"{flag}: {who}cannot resolve host {host!r}: {err.strerror}") from None
    except UnicodeError as err:  # an empty label (a typo's "..") or one past 63 characters: IDNA fails, no lookup
        raise ServeConfigError(f"{flag}: {who}cannot resolve host {host!r}: not a valid host name ({err})") from None


def check_port(flag: str, host: str, port: int, who: str = "") -> None:
    """Bind host:port as the server will (SO_REUSEADDR, as gRPC and prometheus' HTTP server set it,
    so a port in TIME_WAIT is not reported busy) and let it go again. `who` ("rank 2 ") leads the reason."""
    infos = resolve(flag, host, port, who)
    errors = []
    for family, kind, proto, _, addr in infos:
        try:
            s = socket.socket(family, kind, proto)
        except OSError as err:  # a family this kernel lacks (IPv6 off at boot: 'localhost' is ::1 first),
            errors.append(err)  # as rank 0's store skips it (process_group._listen)
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as err:
                if err.errno in (errno.EADDRINUSE, errno.EACCES):  # held now, or a privileged port
                    raise bind_refusal(err)(f"{flag}: {who}cannot listen on {host}:{port}: {err.strerror}; "
                                            "choose another port") from None
                errors.append(err)  # e.g. ::1 on a host without IPv6: the server binds the others
    if errors and len(errors) == len(infos):
        raise ServeConfigError(f"{flag}: {who}cannot listen on {host}:{port}: {bind_failure(errors)}")


def bind_failure(errors: list[OSError]) -> str:
    """Why no address of a host could be bound (the first error), with what to do when it is not one
    of this host's addresses."""
    if not errors:
        return "no address"
    hint = ("; it is not an address of this host (the ranks share one node: 127.0.0.1 will do)"
            if errors[0].errno == errno.EADDRNOTAVAIL else "")
    return f"{errors[0].strerror}{hint}"


def check_ports(cfg: ServeConfig) -> None:
    """Every TCP port the ranks will listen on is free: gRPC's HOST:PORT+r, metrics' HOST:PORT+r, and
    the rendezvous address rank 0 hosts the store on, and its port when one is given (0: the launcher picks)."""
    for flag, host, base in (("--tcp-base-port", cfg.tcp_host, cfg.tcp_base_port),
                             ("--metrics-port", cfg.metrics_host, cfg.metrics_port)):
        for r in range(cfg.tp) if base else ():
            check_port(flag, host, base + r)
    # Rank 0 hosts the group's store on the rendezvous address (process_group.rendezvous_store); port 0
    # (the launcher picks one) still checks that the address is this host's.
    check_port("--master-addr/--master-port", cfg.master_addr, cfg.master_port)


def check_exit_with(cfg: ServeConfig) -> None:
    """The process the launcher is to exit with still runs (a pid typed wrong, or a starter gone already)."""
    if cfg.exit_with_pid and ExitWith(cfg.exit_with_pid).gone():
        raise ServeConfigError(f"--exit-with-pid: process {cfg.exit_with_pid} is not running (the sidecar would "
                               "stop as soon as it started)")


def check_before_launch(cfg: ServeConfig) -> None:
    check_exit_with(cfg)
    check_socket_dir(cfg)
    check_ports(cfg)
