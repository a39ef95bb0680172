"""A local sandbox's own filesystem: one tmpfs of ``max_disk_mb`` holding the directories its commands
write (work, home, tmp, the baseline's git directory), so that the bound holds as writes happen: past it
a write fails with ENOSPC (a ``fallocate`` of more than is left fails whole), where a watcher
(sandboxes/diskbound.py) can only stop a command after it has written past the bound.

The tmpfs is mounted at ``<session>/disk`` in the worker's mount namespace and the writable directories
are made in it (``<session>/disk/work`` ...), as are the passwd and group files of the sandbox's user: one
mount and one unmount a sandbox, and nothing of them allocated on the host's disk, where each inode made
and freed under a run's churn costs the kernel a search (an ext4 without a journal skips every inode freed
in the last minutes, one lookup each). Each command's view (sandboxes/fsview.py) binds the directories
in; the tmpfs's root is in no view. A mount: microseconds, where a filesystem image would need a mkfs.

The session directory itself is a tmpfs too where its sandbox is not kept (``mount_session``): its logs,
its supervisors' results and its descriptor, a dozen inodes a sandbox that the host's disk would make and
free (measured: ~3 ms of a worker's CPU a session on such an ext4, tests/bench/bench_worker_cpu.py). No
size of its own: what is written there is bounded by the output caps. What a sandbox's server writes
there (its commands' output) counts toward the sandbox's memory cap, as its page cache did on the disk.

A session directory's tmpfs is mounted on a directory of the disk, and that directory is what a sandbox
would still make and free on the disk: an emptied one is kept for a later session (``MountPoints``), so
that a run's sessions make and free no inode of the disk (each made on such an ext4 searches past every
one freed in the last minute, the run's evidence files among them).

Its pages are memory: what the sandbox's commands write counts toward the sandbox's memory cap
(sandboxes/pidlimit.py), so the tighter of the two bounds holds; what the worker copies in counts toward
the worker's. They are freed at ``unmount`` (the sandbox's stop); a kept session directory (``sandbox.keep``)
gets their files copied onto the disk first. Needs root (``mount``); without it the
watcher keeps the bound. Standard library only.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import secrets
from collections.abc import Callable

DISK_DIR = "disk"
# An older version's layout: the tmpfs at <session>/.disk, bound at each of these (a reaper still undoes it).
_LEGACY_DISK_DIR = ".disk"
_LEGACY_BINDS = ("work", "home", "tmp", "baseline.git")
_KEPT_SUFFIX = ".kept"
_MS_NOSUID, _MS_NODEV = 2, 4
_MNT_DETACH = 2
_EINVAL, _ENOENT, _ENOSYS = 22, 2, 38
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1
# An emptied session mount point kept for a later session (``MountPoints``), named
# ``<random>.<owner>.spare`` in its run's directory: a reaper removes a dead owner's (local_reap.py).
SPARE_SUFFIX = ".spare"
# Spares a provider keeps at most: as many as its sandboxes at once, each an empty directory.
MAX_SPARES = 4096


@functools.cache  # a CDLL(None) costs ~50 us, two per sandbox
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    if hasattr(libc, "renameat2"):  # glibc 2.28 and later; without it no mount point is kept (MountPoints)
        path = ctypes.c_char_p
        libc.renameat2.argtypes = [ctypes.c_int, path, ctypes.c_int, path, ctypes.c_uint]
    return libc


def _mount(
    libc: ctypes.CDLL, source: str, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    if libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    ):
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def unavailable() -> str | None:
    """Why a sandbox here cannot have a filesystem of its own (one line), or None."""
    return None if os.geteuid() == 0 else "a filesystem of the sandbox's own needs root (mount)"


def mount(session_dir: str, size_bytes: int) -> str:
    """Mount the session's tmpfs of ``size_bytes`` at ``<session_dir>/disk`` and return that path, where
    the caller then makes the writable directories. Raises OSError; nothing is then left mounted."""
    disk = os.path.join(session_dir, DISK_DIR)
    os.mkdir(disk, 0o700)
    try:
        _mount(_libc(), "tmpfs", disk, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size_bytes},mode=0700")
    except OSError:
        os.rmdir(disk)
        raise
    return disk


def mount_session(session_dir: str) -> None:
    """Mount a tmpfs on the session's directory, just made and empty, where its logs, results and
    descriptor then go; ``unmount(..., session=True)`` takes it and the directory away. Raises OSError."""
    flags = _MS_NOSUID | _MS_NODEV
    _mount(_libc(), "tmpfs", session_dir, "tmpfs", flags, "mode=0700")


class MountPoints:
    """The directories a provider's session directories' tmpfs are mounted on (``mount_session``), each
    kept once its tmpfs is detached and renamed into a later session's place rather than freed and made
    again: a rename makes and frees no inode. Thread-safe (each step is one list operation); blocking."""

    def __init__(self) -> None:
        self._spares: list[str] = []

    def make(self, session_dir: str) -> None:
        """Make the session's directory (mode 0700), empty: a spare renamed into place where one is kept.
        Raises OSError as ``os.mkdir`` does (FileExistsError where the directory is there already)."""
        while True:
            try:
                spare = self._spares.pop()
            except IndexError:
                break
            try:
                if _empty(spare):
                    _rename_noreplace(spare, session_dir)
                    return
            except FileExistsError:
                self._spares.append(spare)
                raise
            except OSError:  # gone, or a filesystem without the rename's flag: made below
                pass
            with contextlib.suppress(OSError):
                os.rmdir(spare)
        os.mkdir(session_dir, 0o700)

    def keep(self, session_dir: str, owner_name: str) -> bool:
        """Keep ``session_dir``, its tmpfs detached and so an empty directory again, for a later session;
        False where it is not kept (the caller removes it)."""
        if len(self._spares) >= MAX_SPARES:
            return False
        name = f"{secrets.token_hex(8)}.{owner_name}{SPARE_SUFFIX}"
        spare = os.path.join(os.path.dirname(session_dir), name)
        try:
            _rename_noreplace(session_dir, spare)
        except OSError:
            return False
        self._spares.append(spare)
        return True

    def close(self) -> None:
        """Remove every spare (the provider's last step)."""
        spares, self._spares = self._spares, []
        for spare in spares:
            with contextlib.suppress(OSError):
                os.rmdir(spare)


def _empty(directory: str) -> bool:
    with os.scandir(directory) as entries:
        return next(entries, None) is None


def _rename_noreplace(src: str, dst: str) -> None:
    rename = getattr(_libc(), "renameat2", None)
    if rename is None:
        raise OSError(_ENOSYS, "no renameat2 in this C library", dst)
    if rename(_AT_FDCWD, src.encode(), _AT_FDCWD, dst.encode(), _RENAME_NOREPLACE):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), dst)


def unmount(
    session_dir: str,
    keep: Callable[[str, str], None] | None = None,
    *,
    session: bool = False,
    spare: Callable[[str], bool] | None = None,
) -> None:
    """Detach the session's tmpfs (idempotent; lazily, so a process still holding a file open cannot keep
    the mount from going), and an older version's binds of it. ``keep(src, dst)``: copies what the tmpfs
    holds into a directory on the disk before it goes (a kept session), which then takes its place, so the
    kept files are where the sandbox had them. ``session``: the session directory's own tmpfs goes too
    (``mount_session``), every file in it, and the directory, unless ``spare(session_dir)`` takes the
    emptied directory for a later session (``MountPoints.keep``). Blocking."""
    disk = os.path.join(session_dir, DISK_DIR)
    kept = None
    if keep is not None and os.path.ismount(disk):
        kept = disk + _KEPT_SUFFIX
        os.mkdir(kept, 0o700)
        keep(disk, kept)
    legacy = os.path.join(session_dir, _LEGACY_DISK_DIR)
    if os.path.isdir(legacy):  # only a reaper meets one: no stop pays for these look-ups
        for path in [*(os.path.join(session_dir, name) for name in _LEGACY_BINDS), legacy]:
            _detach(path)
        with contextlib.suppress(OSError):
            os.rmdir(legacy)
    # A lazy unmount takes every mount below too: the disk goes with the session's tmpfs, in one call
    # (each takes ~0.1 ms of the kernel's CPU).
    if session and kept is None and _detach(session_dir):
        if spare is None or not spare(session_dir):
            with contextlib.suppress(OSError):  # else left for a reaper
                os.rmdir(session_dir)
        return
    _detach(disk)
    with contextlib.suppress(OSError):
        os.rmdir(disk)
    if kept is not None:
        with contextlib.suppress(OSError):  # else the kept files stay in disk.kept
            os.rename(kept, disk)
    if session:
        _detach(session_dir)
        with contextlib.suppress(OSError):  # else left for a reaper
            os.rmdir(session_dir)


def _detach(path: str) -> bool:
    """Whether a mount was there to detach."""
    if _libc().umount2(path.encode(), _MNT_DETACH):
        err = ctypes.get_errno()
        if err not in (_EINVAL, _ENOENT):  # not mounted, or not there: nothing to undo
            raise OSError(err, f"umount {path}: {os.strerror(err)}")
        return False
    return True
