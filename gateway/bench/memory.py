"""A benchmarked server's peak memory, read from Linux's /proc (no dependency, no torch).

The server is found by its URL, when the URL's host is this machine (local_port): the process
that listens on its port, found through /proc/net/tcp and the socket inodes among each
process's open files. Its peak RSS is the sum
of VmHWM (the high-water mark of the resident set, since the process started) over it and
every process below it: Switchyard's gateway, engine process and grammar workers, vLLM's API
server and engine core, llama-server's one process. The sum is an upper bound of the tree's
peak (each process peaks at its own time), and shared pages count once per process.

Where the server is not found (another machine, another user's process, not Linux) the
figure is None, and the tables show "-"."""
from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from switchyard.core.memory import status_kib

PROC = "/proc"
_LISTEN = "0A"  # the TCP state column of /proc/net/tcp for LISTEN


def listening_inodes(port: int, proc: str = PROC) -> set[str]:
    """Inodes of the sockets listening on `port` (IPv4 and IPv6, any address)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc, "net", table)) as lines:
                next(lines, None)  # the header
                for line in lines:
                    fields = line.split()
                    if len(fields) > 9 and fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except OSError:
            continue
    return inodes


def _pids(proc: str) -> list[int]:
    try:
        return [int(name) for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return []


def socket_owners(inodes: set[str], proc: str = PROC) -> set[int]:
    """The processes with one of these sockets open (those whose files can be read)."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    owners = set()
    for pid in _pids(proc):
        folder = os.path.join(proc, str(pid), "fd")
        try:
            if any(os.readlink(os.path.join(folder, fd)) in wanted for fd in os.listdir(folder)):
                owners.add(pid)
        except OSError:  # gone, or not ours to read
            continue
    return owners


def parent_of(pid: int, proc: str = PROC) -> int | None:
    try:
        with open(os.path.join(proc, str(pid), "stat")) as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ')'
    except (OSError, ValueError, IndexError):
        return None


def process_tree(root: int, proc: str = PROC) -> list[int]:
    """`root` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid in _pids(proc):
        parent = parent_of(pid, proc)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def peak_rss_kib(pid: int, proc: str = PROC) -> int | None:
    """VmHWM of one process, in KiB; None when it is gone or unreadable."""
    return status_kib("VmHWM", pid, proc)


def tree_peak_rss_bytes(pids: Iterable[int], proc: str = PROC) -> int | None:
    """The sum of VmHWM over these processes, in bytes; None when none could be read."""
    peaks = [kib for kib in (peak_rss_kib(pid, proc) for pid in pids) if kib is not None]
    return sum(peaks) * 1024 if peaks else None


def local_port(url: str) -> int | None:
    """The URL's port when its host is this machine (an address a socket here can bind), else None."""
    parts = urlsplit(url)
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, None, proto=socket.IPPROTO_TCP)}
    except (ValueError, OSError):
        return None
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((address, 0))
            except OSError:
                continue
            return port
    return None


class ServerMemory:
    """The peak RSS of the server behind one URL, found once (`find`) and read after each run."""

    def __init__(self, root: int | None, proc: str = PROC):
        self.root = root  # the topmost process listening on the URL's port; None: not found
        self._proc = proc

    @classmethod
    def find(cls, url: str, proc: str = PROC) -> "ServerMemory":
        port = local_port(url)
        owners = socket_owners(listening_inodes(port, proc), proc) if port is not None else set()
        # a forking server's workers share the socket: the root is the owner whose parent is not one
        roots = sorted(pid for pid in owners if parent_of(pid, proc) not in owners)
        return cls(roots[0] if roots else None, proc)

    def peak_rss_bytes(self) -> int | None:
        if self.root is None:
            return None
        return tree_peak_rss_bytes(process_tree(self.root, self._proc), self._proc)
