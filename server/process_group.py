"""Joins a rank's torch.distributed group with every socket it opens bound to the rendezvous address.

Why not `init_process_group(init_method="tcp://ADDR:PORT")`: torch's TCPStore then listens on the
wildcard address (`[::]:PORT`, every interface of the node) whatever ADDR says, for as long as the
group lives, and anyone who reaches the port can read and write the store's keys (the ranks'
collective bootstrap). Rank 0 binds the listening socket itself, on ADDR only, and hands it to the
store (`master_listen_fd`). Gloo and NCCL open listening sockets of their own, on the interface
named by GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME or else the one the host name resolves to (on a
real node, its network address): with a loopback ADDR (the default; the sidecar's ranks share one
node) both are pointed at the loopback interface unless the operator set them.

Under torchrun the store is the agent's (TORCHELASTIC_USE_AGENT_STORE, read in cli.py with the
restart count): torchrun bound it, and every rank, rank 0 included, joins as a client.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import socket
from collections.abc import MutableMapping

import torch.distributed as dist

from dspark_sidecar.server.config import ServeConfig, ServeConfigError, bind_refusal, is_loopback
from dspark_sidecar.server.preflight import bind_failure, check_port, resolve

log = logging.getLogger("dspark_sidecar.server")
COLLECTIVE_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def loopback_interface() -> str | None:
    """The name of this host's loopback interface ("lo" on Linux), None if it has none by that name."""
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names else None


def keep_collectives_local(master_addr: str, environ: MutableMapping[str, str]) -> dict[str, str]:
    """With a loopback rendezvous address, default gloo's and NCCL's socket interface to loopback in
    `environ` (the rank's own, before the group starts: both libraries read it when they create their
    devices). Values the operator set are left alone. Returns what it set."""
    lo = loopback_interface() if is_loopback(master_addr) else None
    if lo is None:
        return {}
    set_now = {k: lo for k in COLLECTIVE_IFNAMES if not environ.get(k)}
    environ.update(set_now)
    return set_now


def _listen(addr: str, port: int) -> socket.socket:
    """A TCP socket listening on addr:port only (SO_REUSEADDR, as torch's own store sets it): on the
    first of the name's addresses that can be bound ('localhost' is often ::1 first, which a host
    without IPv6 cannot bind; the store's clients try every address, as preflight.check_port does)."""
    infos = resolve("--master-addr", addr, port, passive=False)
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        try:
            s = socket.socket(family, kind, proto)
        except OSError as err:  # a family this kernel lacks
            errors.append(err)
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(sockaddr)
            s.listen(128)
            return s
        except OSError as err:
            s.close()
            if err.errno in (errno.EADDRINUSE, errno.EACCES):  # held now (exit 75), or a privileged port
                raise bind_refusal(err)(f"--master-port: rank 0 cannot listen on {addr}:{port} for the ranks' "
                                        f"rendezvous: {err.strerror}; choose another port") from None
            errors.append(err)
    raise ServeConfigError(f"--master-addr: rank 0 cannot listen on {addr}:{port} for the ranks' rendezvous: "
                           f"{bind_failure(errors)}")


def rendezvous_store(addr: str, port: int, rank: int, world: int, timeout: datetime.timedelta,
                     agent_attempt: int | None = None) -> dist.Store:
    """The group's key-value store: hosted by rank 0 on addr:port only, or, under torchrun, its agent's
    (`agent_attempt`: torchrun's restart count, None without an agent)."""
    # An IPv6 literal may come bracketed ("[::1]", as in torch's tcp:// URL); torch's store resolves
    # the bare address only (with the brackets its connect waits out the timeout).
    host = addr.strip("[]")
    if agent_attempt is not None:
        # torchrun's agent keeps its store across restarts of the ranks (--max-restarts): each attempt's
        # keys get a prefix of their own, or a restarted group reads the dead one's (gloo's addresses
        # among them). torch's own rendezvous used this prefix in the releases that had it (2.4 does).
        return dist.PrefixStore(f"/worker/attempt_{agent_attempt}",
                                dist.TCPStore(host, port, world, is_master=False, timeout=timeout))
    if rank != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    listener = _listen(addr, port)
    fd = listener.fileno()
    ident = _identity(fd)
    try:
        store = _store_on(fd, host, port, world, timeout)
    except BaseException:
        # The store's server takes the descriptor when it starts and closes it if a later step fails
        # (its own client's connect): closed again here, the number may be another thread's by then
        # (the rank's gRPC server runs). Closed here only if it is still our socket.
        if _identity(fd) == ident:
            listener.close()
        else:
            listener.detach()
        raise
    listener.detach()  # the store's server owns the descriptor now (it closes it when the store goes)
    return store


def _is_this_hosts(addr: str) -> bool:
    """Whether `addr` names an address of this host: one of its addresses can be bound (on any free port)."""
    try:
        check_port("--master-addr", addr, 0)
    except ServeConfigError:  # not resolved, or no address of it this host's
        return False
    return True


def _store_on(fd: int, host: str, port: int, world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """torch's store, serving on the listening socket `fd`. The libuv store, torch's default since 2.4,
    refused a listening socket until pytorch#150215 (2025): NotImplementedError, raised before the
    socket is taken. There the older store, which takes one, serves."""
    kw = dict(is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd)
    try:
        return dist.TCPStore(host, port, world, **kw)
    except NotImplementedError:
        return dist.TCPStore(host, port, world, use_libuv=False, **kw)


def _identity(fd: int) -> tuple[int, int] | None:
    """What `fd` is open on (device, inode), None if it is closed."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class PeerLost(RuntimeError):
    """A peer rank ended during start-up; this rank stops too (cli.py: one line, exit 1)."""

    @classmethod
    def of(cls, rank: int, err: BaseException, what: str = "left during start-up") -> PeerLost:
        """The one line for this rank, with the first line of the error that showed it (its type if it has none)."""
        first = next(iter(str(err).splitlines()), "") or type(err).__name__
        return cls(f"rank {rank}: a peer rank {what} ({first[:160]}); the peer's own line says why")


def check_gloo_interfaces(environ: MutableMapping[str, str]) -> None:
    """GLOO_SOCKET_IFNAME (gloo's comma-separated interface names) names interfaces of this host. Else gloo's
    device fails in this rank alone, on a GPU rank first in the start-up group (startup.StartUp.group), where a
    failure reads as a peer lost: every rank blamed a peer that printed nothing. ServeConfigError (exit 2)."""
    value = environ.get("GLOO_SOCKET_IFNAME", "")
    if not value:
        return
    have = sorted(name for _, name in socket.if_nameindex())
    missing = [name for name in value.split(",") if name not in have]
    if missing:
        raise ServeConfigError(f"GLOO_SOCKET_IFNAME={value}: this host has no network interface "
                               f"{', '.join(repr(n) if not n else n for n in missing)} (it has {', '.join(have)})")


def join_group(cfg: ServeConfig, backend: str, rank: int, world: int, agent_attempt: int | None = None) -> None:
    """init_process_group over `rendezvous_store`; a rendezvous that cannot be reached is one line
    (ServeConfigError, exit 2), and so is a peer lost while joining (PeerLost, exit 1), rank 0 not hosting
    the store in time on an address of this host's among them."""
    set_now = keep_collectives_local(cfg.master_addr, os.environ)
    check_gloo_interfaces(os.environ)  # after the default: "lo" where that is what gloo gets
    if set_now:
        log.info("rank %d: collectives listen on loopback only (%s)", rank,
                 ", ".join(f"{k}={v}" for k, v in sorted(set_now.items())))
    timeout = datetime.timedelta(seconds=cfg.dist_timeout_s)
    try:
        store = rendezvous_store(cfg.master_addr, cfg.master_port, rank, world, timeout, agent_attempt)
    except dist.DistNetworkError as err:  # an address that is not reachable, a store that never came up
        if rank != 0 and agent_attempt is None and _is_this_hosts(cfg.master_addr):
            # Rank 0, on this node as every rank, hosts the store on this address (or refuses it itself, exit 2):
            # nobody there within the timeout is rank 0 dead or behind this rank, not the flags. As
            # ServeConfigError (exit 2) the launcher stopped the group as refusing its configuration, with the
            # exit code systemd's RestartPreventExitStatus=2 never restarts, while rank 0 was only slower.
            raise PeerLost.of(rank, err, f"(rank 0) did not host the rendezvous at {cfg.master_addr}:"
                                         f"{cfg.master_port} within --dist-timeout-s {cfg.dist_timeout_s} s") from None
        raise ServeConfigError(f"--master-addr/--master-port: rank {rank} cannot join the rendezvous at "
                               f"{cfg.master_addr}:{cfg.master_port}: {str(err).splitlines()[0]}") from None
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    except (dist.DistNetworkError, dist.DistStoreError) as err:
        # The store was reached: a connection lost now is its host's end (rank 0, or torchrun's agent), and
        # a wait timeout a peer that never joined. Neither is the flags' fault: as ServeConfigError (exit 2)
        # the launcher reported the group's failure as this rank's refusal of its configuration, with that
        # exit code (which systemd's RestartPreventExitStatus=2 never restarts).
        raise PeerLost.of(rank, err, "left during start-up or did not join the group within --dist-timeout-s "
                                     f"{cfg.dist_timeout_s} s") from None
