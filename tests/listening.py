"""Which addresses a process listens on, read from /proc/net/tcp{,6} and its socket inodes: the AFD tests' check
that a server binds where it was told (loopback) and nowhere else."""

import os


def _listening(port: int, pid: str = "self") -> list[str]:
    """The local addresses this process listens on at ``port`` (from /proc/net/tcp{,6} and its socket inodes)."""
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
            if state == "0A" and inode in inodes and int(local.rsplit(":", 1)[1], 16) == port:
                found.append(local.rsplit(":", 1)[0])
    return found


def _listening_any(pid: str) -> list[str]:
    """Every local address process ``pid`` listens on (TCP, IPv4 and IPv6)."""
    inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
              if os.path.islink(f"/proc/{pid}/fd/{fd}") and os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            words = line.split()
            if words[3] == "0A" and words[9] in inodes:
                found.append(words[1].rsplit(":", 1)[0])
    return found
