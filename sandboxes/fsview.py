"""What a sandboxed command sees of the filesystem: an allow-list. A fresh, empty root holds only the
system directories programs need to run (``SYSTEM``, read-only, with ``/etc``'s secrets hidden), a /proc
of the command's own PID namespace, a /dev of the basic devices, an empty /tmp, the session's own
directories, and the paths the caller binds in (the harness cache, the Python the worker runs, the
gateway's socket, what the run config's ``sandbox.mounts`` names). Every other host path is simply not
there, not merely hidden: other runs' rows and evidence, source trees, dataset directories.

A view is a list of steps, applied outermost path first (``plan`` orders them)::

    [LINK, path, target]   a symlink (``/bin -> usr/bin`` on a merged-/usr host)
    [PROC, path]           a fresh procfs: the command's PID namespace
    [DEV, path]            a small tmpfs with null, zero, full, random, urandom, tty, a private devpts
    [HIDE, path]           inside something bound in: /dev/null over a file (``/etc/shadow``); over a
                           directory an empty read-only tmpfs, made read-only once the mount points of
                           the steps inside it are made (the sandbox root under the cache), or where
                           it holds no step and the view is built over a base, the base's empty root
    [SCRATCH, path]        an empty writable tmpfs of SCRATCH_SIZE over path: /tmp, /dev/shm
    [RO, path(, source)]   a host path bound in read-only (at ``path``, from ``source`` if given)
    [RW, path]             a host path bound in writable: the session's work, home and tmp

Two ways to apply one. Root applies it in a fresh mount namespace with a few dozen system calls
(``apply``), once per sandbox, by its supervisor server, whose commands each join that namespace
(supervisor_server.py; bubblewrap and its two helper interpreters cost ~30 ms an exec): the binds
are cloned from the host's tree first, a new tmpfs goes on top of ``/``, the clones are moved into it,
and it becomes the root. Over a base (``make_base``: a namespace of one empty read-only tmpfs, which
every view of the fork server's is unshared from), by ``chroot`` into it, the base's tmpfs left beneath:
``pivot_root`` walks every thread on the host (~1 ms a session with a thousand sandboxes in flight), and
what it would detach holds nothing to reach. Over a copy of the host's tree, by ``pivot_root``, the
host's tree detached. A process that joins a view's namespace gets its topmost root, the view's.
Without root, bubblewrap does it (``bwrap_args``, sandboxes/isolation.py), which also starts from an
empty root.
Standard library only, python3 >= 3.8: the supervisor, run by path, and the in-sandbox agent import it.
"""

from __future__ import annotations

import ctypes
import os
import stat
import time

LINK, PROC, DEV, HIDE, SCRATCH, RO, RW = "link", "proc", "dev", "hide", "scratch", "ro", "rw"
SCRATCH_SIZE = "64m"
_ORDER = {LINK: 0, PROC: 0, DEV: 0, HIDE: 0, SCRATCH: 0, RO: 1, RW: 2}

# What every view holds of the host, read-only: the programs, their libraries and their configuration.
# A top-level symlink (merged /usr) is made as a link. /var, /opt, /srv, /home, /root, /run, /mnt, /media,
# /sys and anything else at the top are not there; a program installed elsewhere is bound in by name
# (``sandbox.mounts``, the harness cache).
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# What no command may read under /etc: password hashes, host keys, TLS private keys, Kerberos keytabs,
# Slurm's and munge's secrets, container registry credentials. Root-only files are unreadable by the
# sandbox user anyway; hidden here also for a sandbox that runs as the worker's own user (bubblewrap).
ETC_HIDDEN = (
    "/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/security/opasswd",
    "/etc/sudoers", "/etc/sudoers.d", "/etc/ssl/private", "/etc/pki/tls/private", "/etc/krb5.keytab",
    "/etc/munge", "/etc/slurm", "/etc/slurm-llnl", "/etc/containers/auth.json", "/etc/docker",
    "/etc/ecs", "/etc/rollout-executor",
)  # fmt: skip
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = (
    ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"), ("ptmx", "pts/ptmx"),
)  # fmt: skip

# The new mount API (Linux 5.2 to 5.12): these numbers are the same on x86_64 and arm64.
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 428, 429, 430, 431, 432
_SYS_MOUNT_SETATTR = 442
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_OPEN_TREE_CLONE = 1
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 1, 6
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV, _MOUNT_ATTR_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
_MNT_DETACH = 2
_EMPTY_READ_ONLY = _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | _MOUNT_ATTR_NOEXEC


def _depth(path: str) -> int:
    return path.rstrip("/").count("/")


def _under(path: str, tops: list[str]) -> bool:
    return any(path == top or path.startswith(top.rstrip("/") + "/") for top in tops)


def _holds_a_step(steps: list[list[str]], i: int) -> bool:
    """Whether another of the view's ``steps`` lies inside step ``i``'s path."""
    top = steps[i][1]
    return any(step[1] != top and _under(step[1], [top]) for step in steps)


def _resolved(path: str) -> str | None:
    """``path`` with every symlink in it resolved, or None where nothing is there: one walk by the kernel
    (open with O_PATH, read back through /proc), where ``os.path.realpath`` takes an lstat and a few
    lines of Python a component. A view resolves ~35 paths, twice a session."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc here
        real = os.path.realpath(path)
    finally:
        os.close(fd)
    # Not a path (a symlink to a process's pipe or socket through /proc): what a walk by hand makes of it.
    return real if real.startswith("/") else os.path.realpath(path)


def real_path(path: str) -> str:
    """``_resolved``, or for a path not there (yet) ``os.path.realpath``'s: as far as it resolves."""
    return _resolved(path) or os.path.realpath(path)


# How long ``plan`` reuses what it found of the host's own paths (the system directories, the read-only
# binds, /tmp's, the hidden paths'), in seconds. A view is the host as of its sandbox's start: one
# resolved a second ago is the view of a sandbox started a second earlier. A burst of starts (a worker's
# hundred sessions, each with its grading sandbox) then walks the same ~30 host paths once a second
# instead of twice a session (a plan took 95 us, 29 us now, in a loop: more in a burst, out of the caches).
# Only the host's paths: a session's own directories are named by the caller, and ``real_path``'s other
# callers are never served from here.
HOST_PATHS_TTL_S = 1.0
_MAX_HOST_PATHS = 32  # distinct (hidden, scratch, readonly) sets kept: a provider has one or two
TYPE_CHECKING = False  # no `typing` import here: the in-sandbox agent runs this on python3 >= 3.8
if TYPE_CHECKING:
    # The system directories' steps; the read-only, /tmp's and the hidden paths, resolved.
    _HostPart = tuple[tuple[tuple[str, ...], ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]
_host_paths: dict[tuple[tuple[str, ...], ...], tuple[float, _HostPart]] = {}


def _host_part(hidden: tuple[str, ...], scratch: tuple[str, ...], readonly: tuple[str, ...]) -> _HostPart:
    """The system directories' steps, the read-only paths and /tmp's resolved (those there), and the
    hidden paths resolved (those there): at most ``HOST_PATHS_TTL_S`` old."""
    key = (hidden, scratch, readonly)
    now = time.monotonic()
    kept = _host_paths.get(key)
    if kept is not None and 0 <= now - kept[0] < HOST_PATHS_TTL_S:
        return kept[1]
    system: list[tuple[str, ...]] = []
    for top in SYSTEM:
        if os.path.islink(top):
            system.append((LINK, top, os.readlink(top)))
        elif os.path.isdir(top):
            system.append((RO, top))
    own_hidden = [_resolved(p) for p in hidden]
    found = (
        tuple(system),
        tuple(real for p in readonly if (real := _resolved(p)) is not None),
        tuple(real_path(p) for p in scratch),
        tuple(real for real in own_hidden if real is not None)
        + tuple(real for p in ETC_HIDDEN if (real := _resolved(p)) is not None),
    )
    # A hidden path of the caller's not there yet (a directory of its own it is about to make) is looked
    # for again at the next view: once made, it is hidden from the next sandbox on.
    if None not in own_hidden:
        if len(_host_paths) >= _MAX_HOST_PATHS:
            _host_paths.clear()
        _host_paths[key] = (now, found)
    return found


def plan(
    hidden: list[str],
    scratch: list[str],
    readonly: list[str],
    writable: list[str],
    files: dict[str, str] | None = None,
    *,
    resolved: bool = False,
) -> list[list[str]]:
    """The steps of a view: ``SYSTEM``, /proc, /dev, ``scratch`` (/tmp, /dev/shm), ``readonly`` and
    ``writable`` bound in, ``files`` (target -> source: a file bound read-only at another path, the
    session's /etc/passwd) and, of ``hidden`` and ``ETC_HIDDEN``, what lies inside something bound in;
    outermost path first and, at one depth, hiding before binding. Read-only paths that do not exist on
    the host are left out; the writable ones are made before the view is applied. ``resolved``: the
    writable paths and the files' sources are real paths already (a provider's own, made under its
    resolved root), bound as given: most are not there yet, and ``os.path.realpath`` of a path not there
    takes an lstat a component, ~90 a sandbox. What the view holds of the host's own paths is looked up
    at most ``HOST_PATHS_TTL_S`` before."""
    system, readonly_real, scratch_real, hidden_real = _host_part(
        tuple(hidden), tuple(scratch), tuple(readonly)
    )
    steps: list[list[str]] = [[PROC, "/proc"], [DEV, "/dev"], *(list(step) for step in system)]
    visible: list[str] = ["/proc", "/dev", *(step[1] for step in system if step[0] == RO)]
    binds = [[RO, real] for real in readonly_real]
    own = (lambda p: p) if resolved else real_path
    binds += [[RW, own(p)] for p in writable]
    binds += [[RO, target, own(src)] for target, src in (files or {}).items()]
    binds = [b for b in binds if b[1] != "/"]
    visible += [b[1] for b in binds]
    steps += binds
    steps += [[SCRATCH, real] for real in scratch_real]
    for real in hidden_real:
        if _under(real, visible) and real not in visible:
            steps.append([HIDE, real])
    unique = {tuple(s): s for s in steps}
    return sorted(unique.values(), key=lambda s: (_depth(s[1]), _ORDER[s[0]], s[1]))


def bwrap_args(steps: list[list[str]]) -> list[str]:
    """The view as bubblewrap's options (bubblewrap starts from an empty root of its own)."""
    out: list[str] = []
    for step in steps:
        kind, path = step[0], step[1]
        if kind == LINK:
            out += ["--symlink", step[2], path]
        elif kind == PROC:
            out += ["--proc", path]
        elif kind == DEV:
            out += ["--dev", path]
        elif kind == HIDE and not os.path.isdir(path):
            out += ["--ro-bind", "/dev/null", path]
        elif kind in (HIDE, SCRATCH):
            perms = "1777" if kind == SCRATCH else "0755"
            out += ["--perms", perms, "--tmpfs", path]
            if kind == HIDE:
                out += ["--remount-ro", path]
        else:
            source = step[2] if len(step) > 2 else path
            out += ["--ro-bind" if kind == RO else "--bind", source, path]
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
    """The mount calls, through one libc loaded and its functions resolved once (``_CALLS``)."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.syscall.restype = ctypes.c_long
        self.libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
        self.libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        self.libc.chroot.argtypes = [ctypes.c_char_p]

    def mount(
        self, source: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes | None
    ) -> None:
        _check(self.libc.mount(source, target.encode(), fstype, flags, data), "mount", target)

    def clone(self, path: str) -> int:
        flags = _OPEN_TREE_CLONE | os.O_CLOEXEC
        return _check(self.libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, path.encode(), flags), "open_tree", path)

    def setattr(
        self, fd: int, path: str, flags: int, attr_set: int, attr_clr: int = 0, propagation: int = 0
    ) -> None:
        attr = _MountAttr(attr_set, attr_clr, propagation, 0)
        name = b"" if fd != _AT_FDCWD else path.encode()
        size = ctypes.sizeof(attr)
        result = self.libc.syscall(_SYS_MOUNT_SETATTR, fd, name, flags, ctypes.byref(attr), size)
        _check(result, "mount_setattr", path)

    def move(self, fd: int, target: str) -> None:
        result = self.libc.syscall(
            _SYS_MOVE_MOUNT, fd, b"", _AT_FDCWD, target.encode(), _MOVE_MOUNT_F_EMPTY_PATH
        )
        _check(result, "move_mount", target)

    def tmpfs(self, options: dict[str, str], attrs: int) -> int:
        """A new tmpfs, not yet attached anywhere: the descriptor of its mount."""
        return self.detached(b"tmpfs", options, attrs)

    def detached(self, fstype: bytes, options: dict[str, str], attrs: int) -> int:
        """A new filesystem of ``fstype``, not attached anywhere: the descriptor of its mount."""
        fs = _check(self.libc.syscall(_SYS_FSOPEN, fstype, 1), "fsopen", fstype.decode())  # FSOPEN_CLOEXEC
        try:
            for key, value in options.items():
                result = self.libc.syscall(
                    _SYS_FSCONFIG, fs, _FSCONFIG_SET_STRING, key.encode(), value.encode(), 0
                )
                _check(result, "fsconfig", key)
            _check(
                self.libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0),
                "fsconfig",
                "create",
            )
            return _check(
                self.libc.syscall(_SYS_FSMOUNT, fs, 1, attrs), "fsmount", fstype.decode()
            )  # FSMOUNT_CLOEXEC
        finally:
            os.close(fs)

    def chroot_here(self) -> None:
        """Make the current directory the root: the view's, stacked on a base's empty root."""
        _check(self.libc.chroot(b"."), "chroot", ".")
        os.chdir("/")

    def pivot_here(self) -> None:
        """Make the current directory (a mount) the root and detach the old root, which ``pivot_root(".",
        ".")`` stacks on top of it."""
        number = _SYS_PIVOT_ROOT.get(os.uname().machine)
        if number is None:
            raise OSError(f"pivot_root: no system call number known for {os.uname().machine}")
        _check(self.libc.syscall(number, b".", b"."), "pivot_root", ".")
        _check(self.libc.umount2(b".", _MNT_DETACH), "umount2", "the host's root")
        os.chdir("/")


# Made at import: the fork server's, which every supervisor server and command's init is forked from. Made
# in each of them, a libc loaded and its functions resolved cost ~0.13 ms and ~40 pages copied a time.
_CALLS = _Calls()


def _make_mount_point(path: str, directory: bool) -> None:
    """An empty directory (or file, for a file's bind) at ``path``, and its parents, in a tmpfs of ours."""
    if os.path.lexists(path):
        return
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if directory:
        os.mkdir(path, 0o755)
    else:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))


def _make_dev(calls: _Calls, here: str, devices: dict[str, int]) -> None:
    calls.mount(b"tmpfs", here, b"tmpfs", _MS_NOSUID | _MS_NOEXEC, b"mode=0755,size=64k")
    for name, fd in devices.items():
        _make_mount_point(f"{here}/{name}", directory=False)
        calls.setattr(fd, name, _AT_EMPTY_PATH, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NOEXEC)
        calls.move(fd, f"{here}/{name}")
        os.close(fd)
    for name, target in DEV_LINKS:
        os.symlink(target, f"{here}/{name}")
    os.mkdir(f"{here}/pts", 0o755)
    os.mkdir(f"{here}/shm", 0o1777)
    options = b"newinstance,ptmxmode=0666,mode=0620"
    calls.mount(b"devpts", f"{here}/pts", b"devpts", _MS_NOSUID | _MS_NOEXEC, options)


Sources = tuple[dict[int, int], dict[str, int]]  # the binds' clones by step, the devices' by name


def clone_sources(steps: list[list[str]]) -> Sources:
    """The view's host sources (its binds, the devices, /dev/null for hidden files), cloned as detached
    mounts, each made private so that nothing mounted on it later reaches the host's tree. Taken in the
    host's mount namespace, they let ``apply`` build the view in a namespace that holds none of the
    host's mounts (``make_base``): a new mount namespace copies every mount of the one it comes from
    (~1,400 on a busy host, ~5 ms of CPU to copy and tear down, more with every sandbox in flight)."""
    calls = _CALLS
    clones: dict[int, int] = {}
    devices: dict[str, int] = {}
    for i, step in enumerate(steps):
        kind, path = step[0], step[1]
        if kind in (RO, RW):
            clones[i] = calls.clone(step[2] if len(step) > 2 else path)
        elif kind == DEV:
            devices = {
                name: calls.clone(f"/dev/{name}") for name in DEVICES if os.path.exists(f"/dev/{name}")
            }
        elif kind == HIDE and not os.path.isdir(path):
            clones[i] = calls.clone("/dev/null")
    for fd in (*clones.values(), *devices.values()):
        calls.setattr(fd, "", _AT_EMPTY_PATH | _AT_RECURSIVE, 0, propagation=_MS_PRIVATE)
    return clones, devices


def detached_proc() -> int:
    """A procfs of this process's PID namespace, mounted nowhere: the descriptor of its mount, which
    another process of the namespace reads as its /proc (``/proc/self/fd/N``) from the host's mount
    namespace. Root only; raises OSError."""
    return _CALLS.detached(b"proc", {}, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | _MOUNT_ATTR_NOEXEC)


def clone_mount(fd: int) -> int:
    """A detached clone of the mount whose root ``fd`` is (a detached one too, as ``detached_proc``'s,
    where the kernel allows: 6.15 and later). Raises OSError."""
    flags = _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_EMPTY_PATH
    return _check(_CALLS.libc.syscall(_SYS_OPEN_TREE, fd, b"", flags), "open_tree", f"descriptor {fd}")


def make_base() -> None:
    """Turn this process's (fresh, unshared) mount namespace into one that holds a single empty tmpfs:
    a namespace to unshare a view's from, cheaply (see ``clone_sources``). Root only; raises OSError."""
    calls = _CALLS
    calls.mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)
    # Each view is stacked on this root (``apply``): a walk up out of a view's root comes back down into
    # it, and a process joining the view's namespace gets the view as its root. Were anything to reach
    # this one, it would find it empty and could leave nothing in it for another sandbox; every view shows
    # it at its hidden directories that hold no other step (``apply``).
    root = calls.tmpfs({"mode": "0755", "size": "4k"}, _EMPTY_READ_ONLY)
    calls.move(root, "/")
    os.fchdir(root)
    os.close(root)
    calls.pivot_here()


def apply(steps: list[list[str]], sources: Sources | None = None, proc: int | None = None) -> None:
    """Turn this process's (fresh, unshared) mount namespace into the view. ``sources``: the view's
    clones, taken by ``clone_sources`` in the host's namespace before this one was unshared from a base
    (``make_base``); without them they are cloned here, from this namespace's copy of the host's tree.
    ``proc``: a detached procfs mount (``clone_mount``) that becomes the view's /proc; without it a procfs
    of this process's PID namespace is mounted. Over a base (``sources`` given), the view becomes this
    process's root by ``chroot``, stacked on the base's: a process that joins the namespace (``setns``)
    gets the topmost mount on its root as its root, the view's. Root only; raises OSError."""
    calls = _CALLS
    os.umask(0o022)
    calls.mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)  # nothing of ours may reach the host
    # Clones first, while every source is in sight: the binds, the devices, /dev/null for hidden files.
    clones, devices = clone_sources(steps) if sources is None else (dict(sources[0]), sources[1])
    if sources is not None:  # over a base: "/" is its empty read-only root until the view's goes on top
        for i, step in enumerate(steps):
            if step[0] == HIDE and i not in clones and not _holds_a_step(steps, i):
                clones[i] = calls.clone("/")
                calls.setattr(clones[i], "", _AT_EMPTY_PATH, _EMPTY_READ_ONLY, propagation=_MS_PRIVATE)
    root = calls.tmpfs({"mode": "0755", "size": "1m"}, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV)
    calls.move(root, "/")  # on top of the host's root; built below through relative paths
    os.fchdir(root)
    read_only = [root]
    for i, step in enumerate(steps):
        kind, here = step[0], "." + step[1]
        if kind == LINK:
            os.makedirs(os.path.dirname(here), mode=0o755, exist_ok=True)
            os.symlink(step[2], here)
        elif kind == PROC:
            _make_mount_point(here, directory=True)
            if proc is not None:
                calls.move(proc, here)  # the caller closes its descriptor
            else:
                calls.mount(b"proc", here, b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
        elif kind == DEV:
            _make_mount_point(here, directory=True)
            _make_dev(calls, here, devices)
            read_only.append(os.open(here, os.O_PATH | os.O_CLOEXEC))
        elif kind == SCRATCH or (kind == HIDE and i not in clones):
            if kind == SCRATCH:
                _make_mount_point(here, directory=True)
            elif not os.path.isdir(here):  # hidden already by a step above it
                continue
            options = f"mode=1777,size={SCRATCH_SIZE}" if kind == SCRATCH else "mode=0755,size=1m"
            calls.mount(b"tmpfs", here, b"tmpfs", _MS_NOSUID | _MS_NODEV, options.encode())
            if kind == HIDE:  # read-only once the binds' mount points are made in it
                read_only.append(os.open(here, os.O_PATH | os.O_CLOEXEC))
        else:
            fd = clones.pop(i)
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            if kind == HIDE and is_dir and not os.path.isdir(here):  # hidden already by a step above it
                os.close(fd)
                continue
            attrs = _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV
            if kind == RO or kind == HIDE:
                attrs |= _MOUNT_ATTR_RDONLY
            calls.setattr(fd, here, _AT_EMPTY_PATH | _AT_RECURSIVE, attrs)
            _make_mount_point(here, is_dir)  # no /proc in a base's root
            calls.move(fd, here)
            os.close(fd)
    for fd in read_only:
        calls.setattr(fd, "", _AT_EMPTY_PATH, _MOUNT_ATTR_RDONLY)
        os.close(fd)
    if sources is not None:
        calls.chroot_here()
    else:
        calls.pivot_here()


def _probe() -> int:
    """Exit 0 if this process can make a view: a mount namespace, and the mount API ``apply`` uses."""
    calls = _CALLS
    _check(calls.libc.unshare(0x00020000), "unshare", "CLONE_NEWNS")  # CLONE_NEWNS
    apply(plan([], ["/tmp"], [], []))
    return 0 if os.path.isdir("/usr") and not os.path.exists("/root") else 1


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["probe"]:
        print("usage: fsview.py probe", file=sys.stderr)
        sys.exit(2)
    sys.exit(_probe())
