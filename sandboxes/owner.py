"""Who owns a sandbox, in a form a reaper can check for liveness: two forms, one per kind of sandbox.

A local sandbox, and a worker's laid-out workspaces, belong to a process on this machine. The process
makes an owner record under the sandbox root, ``<root>/owners/<name>``, and holds an ``flock`` on it until
it dies; the kernel lets go of the lock then, whatever killed it. A reaper takes that lock, shared and
without waiting, to learn whether the owner lives: the proof crosses PID namespaces (a run in a container,
a second job on a node), where a pid read in the reaper's own /proc names nobody, or somebody else.

A remote sandbox (Slurm job, ECS task) outlives the worker that started it unless someone ends it; its
owner (host, boot, pid, and the name of its record under the worker's sandbox root) is written into the
job's comment or the task's tags, and a reaper ends the sandboxes whose owner is gone. Only a reaper on the
owner's kernel can prove that, by the record's lock; elsewhere the TTL is the backstop.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sandboxes import proctree

log = logging.getLogger(__name__)

OWNERS_DIR = "owners"
_NAME_RE = re.compile(r"[0-9a-f]{16}")
_RECORD_BYTES = 4096


@functools.cache
def boot_id() -> str:
    """This boot's id, read once per process (which no boot outlives): every sandbox records it."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    info = proctree.read_proc(pid)
    return info.start_ticks if info is not None and info.alive else None


_own_ticks: dict[int, int | None] = {}


def own_start_ticks() -> int | None:
    """This process's start time, read once per process (a forked child reads its own): every sandbox
    records its owner's, and /proc/PID/stat of a worker with dozens of threads was ~5% of its CPU."""
    pid = os.getpid()
    if pid not in _own_ticks:
        _own_ticks[pid] = start_ticks(pid)
    return _own_ticks[pid]


@dataclass(frozen=True)
class Owner:
    host: str
    boot: str  # the first 8 characters of the boot id: enough to tell a reboot
    pid: int
    ticks: int  # the process's start time in clock ticks: a recycled pid has another
    # The name of the owner's record under the sandbox root (``hold``); "" from versions before records.
    record: str = ""

    @classmethod
    def current(cls, record: str = "") -> Owner:
        pid = os.getpid()
        return cls(socket.gethostname(), boot_id()[:8], pid, own_start_ticks() or 0, record)

    def encode(self) -> dict[str, str]:
        fields = {"host": self.host, "boot": self.boot, "pid": str(self.pid), "ticks": str(self.ticks)}
        return fields | ({"record": self.record} if self.record else {})

    @classmethod
    def decode(cls, data: dict[str, str]) -> Owner | None:
        try:
            record = data.get("record", "")
            record = record if is_owner_name(record) else ""  # a torn or foreign name: as if none
            return cls(data["host"], data["boot"], int(data["pid"]), int(data["ticks"]), record)
        except (KeyError, ValueError, TypeError, AttributeError):
            return None

    def known_dead(self, root: Path) -> bool:
        """Whether this machine can prove a remote sandbox's owner gone: the owner ran on this host before
        its last boot, or on this very kernel with its record under ``root`` (the worker's sandbox root)
        there and its lock free. Never from a pid: this reaper may see another PID namespace than the
        owner did (a run in a container, a second job on a node), where the pid names nobody, or somebody
        else. So an older version's owner, with no record named, is left to the TTL, as is another
        machine's: a shared filesystem's locks may be kept per client."""
        verdict = _kernel_verdict(self.host, self.boot)
        if verdict is not None or not self.record:
            return bool(verdict)
        return known_dead(root, self.record, missing_is_dead=False)


def _kernel_verdict(host: str, boot: str) -> bool | None:
    """What an owner's host and boot prove alone: None when it ran on this very kernel (its lock tells);
    True when it ran on this host before its last boot; else False, another machine's owner being never
    dead here (a shared filesystem may keep locks per client, or none across clients)."""
    if boot == boot_id()[:8]:
        return None
    return host == socket.gethostname()


# ---------------------------------------------------------------------------------------------------------
# Owner records: the local form

# The root's real path -> (this process's record name there, the open record that holds the lock).
_held: dict[str, tuple[str, int]] = {}
_held_lock = threading.Lock()


def hold(root: Path) -> str:
    """This process's name as the owner of what it makes under ``root``; idempotent.

    The first call makes the record and locks it for the rest of the process's life. A record removed
    from under us (the root deleted) is made again, under a new name."""
    key = os.path.realpath(root)
    with _held_lock:
        held = _held.get(key)
        if held is not None:
            if os.fstat(held[1]).st_nlink:
                return held[0]
            os.close(held[1])
        name, fd = _make_record(Path(key) / OWNERS_DIR)
        _held[key] = (name, fd)
        return name


def _make_record(owners: Path) -> tuple[str, int]:
    owners.mkdir(parents=True, exist_ok=True)
    name = secrets.token_hex(8)
    staging = owners / f"{name}.new"
    # O_CLOEXEC: a program this process starts (a sandbox's supervisor server, whose tree may outlive us)
    # must not hold the lock, or a dead owner would pass for alive and what it left could not be reaped.
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError as exc:  # a filesystem without locks (NFS without a lock manager)
            log.warning(
                "owner record %s cannot be locked (%s): what this process owns there is left to its TTL",
                staging,
                exc,
            )
            locked = False
        os.write(
            fd, json.dumps({**Owner.current().encode(), "locked": locked, "created_at": time.time()}).encode()
        )
        # Published only now: no reaper can find a live owner's record before it is locked (or says it
        # could not be).
        os.rename(staging, owners / name)
    except BaseException:
        os.close(fd)
        staging.unlink(missing_ok=True)
        raise
    return name, fd


def _forget_after_fork() -> None:
    """A forked child shares its parent's open records: closing them here lets the parent's death show,
    and the child makes records of its own if it owns anything."""
    global _held_lock
    _held_lock = threading.Lock()  # another thread may have held it at the fork
    for _name, fd in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def is_owner_name(name: str) -> bool:
    return _NAME_RE.fullmatch(name) is not None


def known_dead(root: Path, name: str, *, missing_is_dead: bool = True) -> bool:
    """Whether the owner ``name`` of things under ``root`` is gone, as far as this machine can prove: its
    record is gone (one is removed only once its owner is dead), its lock is free, or it was made on this
    host before its last boot. Another machine's owner, or a record we cannot read, is never dead here.

    ``missing_is_dead=False``: for what lives elsewhere (a remote sandbox) and only names its owner's
    record, whose absence proves nothing: at ``root`` the reaper may see another filesystem than the owner
    did (a container's own), or the root was deleted under a live owner, who made its record again under
    a new name. Such a sandbox is left to its TTL once its owner's record is forgotten."""
    if not is_owner_name(name) or any(name == held for held, _fd in _held.values()):
        # Our own: where flock is emulated by POSIX locks (NFS), a probe of it from this process would
        # succeed, and closing the probe would drop the owner's lock.
        return False
    try:
        fd = os.open(Path(root) / OWNERS_DIR / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return missing_is_dead
    except OSError:
        return False
    try:
        try:
            record = json.loads(os.read(fd, _RECORD_BYTES))
            owner = Owner.decode(record)
        except (OSError, ValueError, TypeError):
            return False
        if owner is None:
            return False
        verdict = _kernel_verdict(owner.host, owner.boot)
        if verdict is not None:
            return verdict
        if record.get("locked") is not True:
            return False  # its owner could not lock it: no lock of ours can prove it dead
        try:
            # Shared: two reapers probing at once must not take each other for the owner.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # EWOULDBLOCK: the owner holds it
            return False
        return True
    finally:
        os.close(fd)  # and with it the probe's lock


def reap_dead_dirs(root: Path, kind: str) -> list[str]:
    """Remove ``<root>/<run>/<kind>/<owner>``, the directories that owners keep per run under ``root``
    (named after their records there), of every owner known dead; returns them relative to ``root``."""
    root = Path(root)
    removed = []
    for path in sorted(root.glob(f"*/{kind}/*")):
        if known_dead(root, path.name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path.relative_to(root)))
    return removed


def forget_dead(root: Path) -> list[str]:
    """Remove the records of owners known dead; from then on, what they owned is known dead by the
    record's absence. Returns the names removed; idempotent."""
    owners = Path(root) / OWNERS_DIR
    try:
        names = sorted(os.listdir(owners))
    except OSError:
        return []
    removed = []
    for name in names:
        if is_owner_name(name) and known_dead(root, name):
            with contextlib.suppress(FileNotFoundError):
                (owners / name).unlink()
                removed.append(name)
    return removed
