"""This process's TCP sockets, read from Linux's /proc (elsewhere: none) -- what trainguard.liveness.world.World tells its
groups' connections by, to shut them when a rank died (gloo cannot abort a collective)."""
from __future__ import annotations

import os


def fds() -> dict[str, int]:
    """This process's sockets: inode -> file descriptor (Linux: /proc; elsewhere none)."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[link[8:-1]] = int(fd)
    return out


def _address(text: str) -> str:
    """/proc/net/tcp{,6}'s hex address as an IP (an IPv4-mapped IPv6 one as IPv4)."""
    import ipaddress

    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    ip = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return str(ip.ipv4_mapped or ip)


def tcp_sockets() -> dict[str, tuple[str, int, str, int, str]]:
    """This process's TCP sockets: inode -> (local address, local port, remote address, remote port -- 0: listening
    --, state). Linux (/proc); elsewhere none."""
    inodes = set(fds())
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            col = row.split()  # sl, local, remote, state, queues, timer, retransmits, uid, timeout, inode
            if len(col) > 9 and col[9] in inodes:
                (la, lp), (ra, rp) = col[1].rsplit(":", 1), col[2].rsplit(":", 1)
                found[col[9]] = (_address(la), int(lp, 16), _address(ra), int(rp, 16), col[3])
    return found
