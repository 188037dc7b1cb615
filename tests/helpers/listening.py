"""The TCP sockets a process listens on, read from /proc (Linux): [(address, port)]."""

from __future__ import annotations

import ipaddress
import os
import socket


def _addr(hex_addr: str) -> tuple[str, int]:
    """/proc/net/tcp{,6}'s "0100007F:1F90" (host byte order per 32-bit word) -> ("127.0.0.1", 8080)."""
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # Each 32-bit word is printed as the host-order integer: undo it word by word.
    words = b"".join(int.from_bytes(raw[i:i + 4], "big").to_bytes(4, "little") for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # gRPC's dual-stack sockets
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def listening_tcp(pid: int) -> list[tuple[str, int]]:
    """Every TCP socket `pid` holds in the LISTEN state, IPv4 and IPv6."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed between listdir and readlink
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
        except FileNotFoundError:  # a kernel without IPv6
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # st 0A: TCP_LISTEN
                found.append(_addr(f[1]))
    return found


def is_loopback(addr: str) -> bool:
    """127/8 and ::1 (listening_tcp reports IPv4-mapped addresses as IPv4)."""
    return ipaddress.ip_address(addr).is_loopback



def has_ipv6_loopback() -> bool:
    """Whether this host can bind ::1 (containers often have IPv6 off)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False
