"""What a sandboxed command sees of the filesystem: the host read-only, its private places hidden, and only
the session's own directories (and the read-only harness cache) bound back.

A view is a list of steps, applied outermost path first (``plan`` orders them)::

    [HIDE, path]     an empty read-only tmpfs over path: homes, /root, the run directory, the sandbox root
    [SCRATCH, path]  an empty writable tmpfs of SCRATCH_SIZE over path: /tmp, /dev/shm
    [RO, path]       path bound back read-only: the harness cache, the Python the worker runs, the socket
    [RW, path]       path bound back writable: the session's work, home and tmp

Two ways to apply one. Root applies it per command in a fresh mount namespace with a handful of system
calls (``apply``: microseconds, where bubblewrap and its two helper interpreters cost ~30 ms an exec);
without root, bubblewrap does it (``bwrap_args``, sandboxes/isolation.py). Standard library only: the
supervisor, run by path, imports it.
"""

from __future__ import annotations

import ctypes
import os

HIDE, SCRATCH, RO, RW = "hide", "scratch", "ro", "rw"
SCRATCH_SIZE = "64m"
_ORDER = {HIDE: 0, SCRATCH: 0, RO: 1, RW: 2}

# The new mount API (Linux 5.12): these numbers are the same on x86_64 and arm64.
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_OPEN_TREE_CLONE = 1
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_MS_NOSUID, _MS_NODEV = 2, 4
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000


def plan(hidden: list[str], scratch: list[str], readonly: list[str], writable: list[str]) -> list[list[str]]:
    """The steps of a view, outermost path first and, at one depth, hiding before binding. Paths to hide
    or bind read-only that do not exist on the host are left out; the writable ones are made before the
    view is applied."""
    steps = [
        [kind, os.path.realpath(p)] for kind, paths in ((HIDE, hidden), (SCRATCH, scratch)) for p in paths
    ]
    steps += [[kind, os.path.realpath(p)] for kind, paths in ((RO, readonly), (RW, writable)) for p in paths]
    unique = {tuple(s): s for s in steps if (s[0] == RW or os.path.lexists(s[1])) and s[1] != "/"}
    return sorted(unique.values(), key=lambda s: (s[1].count("/"), _ORDER[s[0]], s[1]))


def bwrap_args(steps: list[list[str]]) -> list[str]:
    """The view as bubblewrap's options, after ``--ro-bind / /``."""
    out: list[str] = []
    for kind, path in steps:
        if kind in (HIDE, SCRATCH):
            perms = "1777" if kind == SCRATCH else "0755"
            out += ["--perms", perms, "--tmpfs", path]
        else:
            out += ["--ro-bind" if kind == RO else "--bind", path, path]
    return out


# ---------------------------------------------------------------------------------------------------------
# As root, in the command's init, after it has unshared a mount namespace


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str, path: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} {path}: {os.strerror(err)}")
    return result


class _Calls:
    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long
        self.libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]

    def mount(
        self, source: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes | None
    ) -> None:
        _check(self.libc.mount(source, target.encode(), fstype, flags, data), "mount", target)

    def clone(self, path: str) -> int:
        flags = _OPEN_TREE_CLONE | os.O_CLOEXEC
        return _check(self.libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, path.encode(), flags), "open_tree", path)

    def setattr(self, fd: int, path: str, flags: int, attr_set: int, attr_clr: int = 0) -> None:
        attr = _MountAttr(attr_set, attr_clr, 0, 0)
        name = b"" if fd != _AT_FDCWD else path.encode()
        size = ctypes.sizeof(attr)
        result = self.libc.syscall(_SYS_MOUNT_SETATTR, fd, name, flags, ctypes.byref(attr), size)
        _check(result, "mount_setattr", path)

    def move(self, fd: int, target: str) -> None:
        result = self.libc.syscall(
            _SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH
        )
        _check(result, "move_mount", target)


def _make_mount_point(path: str, like: int) -> None:
    """An empty directory (or file, for a file's bind) at ``path``, and its parents, in a tmpfs of ours."""
    if os.path.lexists(path):
        return
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if os.path.isdir(f"/proc/self/fd/{like}"):
        os.mkdir(path, 0o755)
    else:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))


def apply(steps: list[list[str]]) -> None:
    """Turn this process's (fresh, unshared) mount namespace into the view. Root only; raises OSError."""
    calls = _Calls()
    os.umask(0o022)
    calls.mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)  # nothing of ours may reach the host
    # Clones first, while every source is still in sight and writable; the host goes read-only after.
    clones = {path: calls.clone(path) for kind, path in steps if kind in (RO, RW)}
    calls.setattr(_AT_FDCWD, "/", _AT_RECURSIVE, _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID)
    hidden: list[str] = []
    for kind, path in steps:
        if kind in (HIDE, SCRATCH):
            if not os.path.isdir(path):  # hidden already by a step above it
                continue
            options = f"mode=1777,size={SCRATCH_SIZE}" if kind == SCRATCH else "mode=0755,size=1m"
            calls.mount(b"tmpfs", path, b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode())
            if kind == HIDE:
                hidden.append(path)
            continue
        fd = clones.pop(path)
        readonly = _MOUNT_ATTR_RDONLY if kind == RO else 0
        calls.setattr(
            fd, path, _AT_EMPTY_PATH | _AT_RECURSIVE, readonly | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV
        )
        _make_mount_point(path, fd)
        calls.move(fd, path)
        os.close(fd)
    for path in hidden:  # read-only once the binds' mount points are made in them
        calls.setattr(_AT_FDCWD, path, 0, _MOUNT_ATTR_RDONLY)


def _probe() -> int:
    """Exit 0 if this process can make a view: a mount namespace, and the mount API ``apply`` uses."""
    calls = _Calls()
    _check(calls.libc.unshare(0x00020000), "unshare", "CLONE_NEWNS")  # CLONE_NEWNS
    apply([[HIDE, "/mnt"]] if os.path.isdir("/mnt") else [])
    return 0


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["probe"]:
        print("usage: fsview.py probe", file=sys.stderr)
        sys.exit(2)
    sys.exit(_probe())
