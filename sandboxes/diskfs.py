"""A local sandbox's own filesystem: one tmpfs of ``max_disk_mb`` under the directories its commands
write (work, home, tmp), so that the bound holds as writes happen: past it a write fails with ENOSPC
(a ``fallocate`` of more than is left fails whole), where a watcher (sandboxes/diskbound.py) can only
stop a command after it has written past the bound.

The tmpfs is mounted at ``<session>/.disk`` in the worker's mount namespace, and each writable directory
``<session>/<name>`` is a bind of ``.disk/<name>``: the paths stay what they were, the worker reads and
writes them as before, and each command's view (sandboxes/fsview.py, built from the host's mounts) binds
them in. A mount and a bind per directory: microseconds, where a filesystem image would need a mkfs.

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
from collections.abc import Callable, Sequence

DISK_DIR = ".disk"
_MS_NOSUID, _MS_NODEV, _MS_BIND = 2, 4, 4096
_MNT_DETACH = 2
_EINVAL, _ENOENT = 22, 2


@functools.cache  # a CDLL(None) costs ~50 us, two per sandbox
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
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


def mount(session_dir: str, dirs: Sequence[str], size_bytes: int) -> None:
    """Mount the session's tmpfs of ``size_bytes`` and bind ``dirs`` (existing, empty directories directly
    in ``session_dir``) from it. Raises OSError; whatever was mounted is then unmounted."""
    libc = _libc()
    disk = os.path.join(session_dir, DISK_DIR)
    os.mkdir(disk, 0o700)
    try:
        _mount(libc, "tmpfs", disk, "tmpfs", _MS_NOSUID | _MS_NODEV, f"size={size_bytes},mode=0700")
        for path in dirs:
            inside = os.path.join(disk, os.path.basename(path))
            os.mkdir(inside, 0o700)
            _mount(libc, inside, path, None, _MS_BIND, None)
    except OSError:
        unmount(session_dir, dirs)
        raise


def unmount(session_dir: str, dirs: Sequence[str], keep: Callable[[str, str], None] | None = None) -> None:
    """Detach the session's binds and its tmpfs (idempotent; lazily, so a process still holding a file
    open cannot keep the mount from going). ``keep(src, dst)``: called for each directory once its bind
    is gone and before the tmpfs goes, to copy what it holds onto the disk (a kept session). Blocking."""
    libc = _libc()
    disk = os.path.join(session_dir, DISK_DIR)
    for path in [*dirs, disk]:
        if libc.umount2(path.encode(), _MNT_DETACH):
            err = ctypes.get_errno()
            if err not in (_EINVAL, _ENOENT):  # not mounted, or not there: nothing to undo
                raise OSError(err, f"umount {path}: {os.strerror(err)}")
        elif keep is not None and path != disk:
            keep(os.path.join(disk, os.path.basename(path)), path)
    with contextlib.suppress(OSError):
        os.rmdir(disk)
