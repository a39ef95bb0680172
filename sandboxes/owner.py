"""Who started a remote sandbox, in a form a reaper on the same host can check for liveness.

A remote sandbox (Slurm job, ECS task) outlives the worker that started it unless someone ends it; its
owner is written into the job's comment or the task's tags, and a reaper ends the sandboxes whose owner
process is gone. Only a reaper on the owner's host and boot can tell; elsewhere the TTL is the backstop.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from sandboxes import proctree


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    info = proctree.read_proc(pid)
    return info.start_ticks if info is not None and info.alive else None


@dataclass(frozen=True)
class Owner:
    host: str
    boot: str  # the first 8 characters of the boot id: enough to tell a reboot
    pid: int
    ticks: int  # the process's start time in clock ticks: a recycled pid has another

    @classmethod
    def current(cls) -> Owner:
        pid = os.getpid()
        return cls(socket.gethostname(), boot_id()[:8], pid, start_ticks(pid) or 0)

    def encode(self) -> dict[str, str]:
        return {"host": self.host, "boot": self.boot, "pid": str(self.pid), "ticks": str(self.ticks)}

    @classmethod
    def decode(cls, data: dict[str, str]) -> Owner | None:
        try:
            return cls(data["host"], data["boot"], int(data["pid"]), int(data["ticks"]))
        except (KeyError, ValueError):
            return None

    def known_dead(self) -> bool:
        """True only when this host can see the owner is gone; another host's owner is never 'dead'."""
        if self.host != socket.gethostname():
            return False
        if self.boot != boot_id()[:8]:
            return True
        return start_ticks(self.pid) != self.ticks
