"""Which addresses a process listens on, read from /proc/net/tcp{,6} and its socket inodes: the AFD tests' check
that a server binds where it was told (loopback) and nowhere else, and that nothing listens after a join."""

import os


def _listening_sockets(pid: str = "self") -> list[tuple[str, int]]:
    """Every (local address in /proc's hex, port) process ``pid`` listens on over TCP (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            words = line.split()
            local, state, inode = words[1], words[3], words[9]
            if state == "0A" and inode in inodes:
                found.append((local.rsplit(":", 1)[0], int(local.rsplit(":", 1)[1], 16)))
    return found


def _listening(port: int, pid: str = "self") -> list[str]:
    """The local addresses process ``pid`` listens on at ``port``."""
    return [address for address, p in _listening_sockets(pid) if p == port]


def _listening_any(pid: str) -> list[str]:
    """Every local address process ``pid`` listens on (TCP, IPv4 and IPv6)."""
    return [address for address, _ in _listening_sockets(pid)]
