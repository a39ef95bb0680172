"""Ports for the servers a test starts by number (Ray's nodes, moto, the scripted model's CLI).

A port the kernel picked for a bind to port 0 is free when picked, but the server binds it only later;
meanwhile another bind to port 0 (a Ray worker's, a driver's) may be given it too. These are picked
below the kernel's ephemeral range instead, where no bind to port 0 and no outgoing connection lands,
each checked free and never handed out twice by this process."""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000  # above Ray's default worker ports (10002-19999), which its nodes bind on their own
TRIES = 1000
_given: set[int] = set()


def _ephemeral_lowest() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_picked(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def free_ports(n: int, *, consecutive: bool = False) -> list[int]:
    """``n`` free ports (``consecutive``: a run of them, as Ray's worker port range), none given before
    by this process. Where the ephemeral range leaves no room below it, the kernel's picks instead."""
    top = _ephemeral_lowest()
    if top - LOWEST < 4 * n:
        return _kernel_picked(n)
    ports: list[int] = []
    for _ in range(TRIES):
        if consecutive:
            start = random.randrange(LOWEST, top - n)
            candidates = list(range(start, start + n))
            if _given.isdisjoint(candidates) and all(map(_bindable, candidates)):
                ports = candidates
        else:
            port = random.randrange(LOWEST, top)
            if port not in _given and port not in ports and _bindable(port):
                ports.append(port)
        if len(ports) == n:
            _given.update(ports)
            return ports
    raise RuntimeError(f"no {n} free ports between {LOWEST} and {top} in {TRIES} tries")


def free_port() -> int:
    return free_ports(1)[0]
