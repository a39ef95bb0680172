"""The native init (native_init.c): a command's init as a small compiled program the server starts with
posix_spawn, where spawn.py's init is a fork of the server's interpreter.

A forked init costs the machine ~1-1.5 ms before its exec: the fork, the pages the interpreter writes on
its way there (~250 of them, each copied) and every page the server writes while they share them.
posix_spawn copies none: the server waits (vfork) until the program runs, and the program's steps are ~90
system calls, 64 of them each signal's default (a further command of a sandbox: 3.25-3.5 ms of its
processes' CPU with the forked init, 1.6-1.7 ms with this, docs/performance.md). It is used for the
commands a server supervises itself (folded.py) whose view the server built (spawn._init's ``view_fds``),
whose network is the sandbox's and whose process and memory caps the server's own cgroups already are; any
other command, or a machine where the program was not built, gets spawn.py's init, which stays the
reference for what an init does. Its view mode (``start_view``) builds a sandbox's filesystem view for
the server, as fsview.apply would in the server's interpreter, where each line of Python run in a freshly
forked server copies pages (~125 for a view); fsview stays the reference for what a view is.

The program is built by ``build`` (the worker, before its fork server starts; `make demo` and `make test`
first) into the checkout's ``build/`` directory, named by its source's checksum so that a changed source is
never run as an older build. It runs as root before the command's privileges are dropped, so it is used
only where no one but us could have written it: ``PROGRAM`` is None unless the file (by its real path) and
every directory above it belong to root (or us) and are writable by no one else; and it runs with an
empty environment, the command's passed as arguments.

Standard library only, like the server that imports it.
"""

from __future__ import annotations

import binascii
import fcntl
import itertools
import os
import stat
import sys

if __package__:
    from sandboxes import fsview, pidlimit, seccomp, spawn, supervisor
else:  # imported by the server run by path, with its directory on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fsview
    import pidlimit
    import seccomp
    import spawn
    import supervisor

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(_HERE, "native_init.c")
MNT_FD, IPC_FD = 3, 4  # where the program finds the view's namespaces (native_init.c)
BASE_FD, PROC_FD = 3, 4  # where its view mode finds the base mount namespace and the view's /proc
BUILD_TIMEOUT_S = 60.0
_COMPILERS = ("cc", "gcc")
# Without a C library first (x86-64: native_init.c's system calls of its own), whose start-up costs a
# static glibc program ~0.6 ms of CPU a command here; else against the static glibc. Never dynamically
# linked: its loader would run as root under an environment it reads (LD_PRELOAD and the like).
_BUILDS = (
    "-O2 -static -nostdlib -ffreestanding -fno-builtin -fno-stack-protector -fno-pie -no-pie "
    "-fno-asynchronous-unwind-tables -DROLLOUT_NOLIBC".split(),
    "-O2 -static".split(),
)


def expected_path() -> str | None:
    """Where the build of this source is, built or not; None without the source."""
    try:
        with open(SOURCE, "rb") as source:
            # A checksum names the version; who could have written the file is _ours's to say. Not
            # hashlib: its OpenSSL would be ~3.6 MB more of the fork server's, for each fork to map.
            digest = binascii.crc32(source.read())
    except OSError:
        return None
    return os.path.join(os.path.dirname(_HERE), "build", f"rollout-init-{digest:08x}")


def _ours(path: str) -> bool:
    """Whether ``path`` and every directory above it belong to root or us and are writable by no one
    else (a sticky directory's entries are their owners' alone)."""
    me = os.geteuid()
    at = path
    while True:
        try:
            info = os.lstat(at)
        except OSError:
            return False
        if info.st_uid not in (0, me) or stat.S_ISLNK(info.st_mode):
            return False
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (at != path and info.st_mode & stat.S_ISVTX):
            return False
        if at == "/":
            return True
        at = os.path.dirname(at)


def _usable(path: str | None) -> str | None:
    """The real path of the build at ``path`` (a checkout under a symlinked directory is run by the path
    the link names), if it is ours (``_ours``) and runnable."""
    if path is None:
        return None
    real = os.path.realpath(path)
    try:
        runnable = stat.S_ISREG(os.stat(real).st_mode) and os.access(real, os.X_OK)
    except OSError:
        return None
    return real if runnable and _ours(real) else None


# Found once, at import (the fork server's, which every server is forked from).
PROGRAM = _usable(expected_path())


def fits(p: dict[str, Any]) -> bool:
    """Whether the command of ``p`` (its supervisor parameters) can be started by the native init: the
    server built its view, it has no network of its own, and its caps' cgroups are ours already (a child
    is born in its parent's)."""
    view_fds = p.get("view_fds") if p.get("view") else None
    if PROGRAM is None or not view_fds or p.get("network_forward") or not p.get("argv"):
        return False
    if {int(view_fds[0]), int(view_fds[1])} & {MNT_FD, IPC_FD}:
        return False  # a descriptor the program's own would overwrite before it is moved
    for procs, controller in (("cgroup_procs", pidlimit.PIDS), ("memory_procs", pidlimit.MEMORY)):
        if p.get(procs) and not pidlimit.member(p[procs], controller):
            return False
    return True


def start(p: dict[str, Any], env: dict[str, str] | None, stdin_fd: int, out_w: int, err_w: int) -> int:
    """Start the command of ``p`` (``fits``) under the native init, in a session of its own; its pid
    (the command's, once the init has exec'd it). Raises the OSError of a failed spawn."""
    assert PROGRAM is not None
    user = p.get("user")
    candidates = spawn._candidates(p["argv"], env)
    command_env = os.environ if env is None else env
    args = [
        PROGRAM,
        str(supervisor.nofile_limit(p)),
        str(int(p.get("memory_limit_bytes") or 0)),
        str(int(p.get("file_size_limit_bytes") or 0)),
        "1" if p.get("memory_procs") else "0",
        str(int(user[0])) if user else "-1",
        str(int(user[1])) if user else "-1",
        seccomp.FILTER_HEX or "-",
        str(p["cwd"]),
        str(len(candidates)),
        *candidates,
        str(len(command_env)),
        *(f"{name}={value}" for name, value in command_env.items()),
        *p["argv"],
    ]
    mnt, ipc = (int(fd) for fd in p["view_fds"])
    return os.posix_spawn(
        PROGRAM,
        args,
        {},  # the command's comes as arguments: native_init.c
        file_actions=[
            (os.POSIX_SPAWN_DUP2, stdin_fd, 0),
            (os.POSIX_SPAWN_DUP2, out_w, 1),
            (os.POSIX_SPAWN_DUP2, err_w, 2),
            (os.POSIX_SPAWN_DUP2, mnt, MNT_FD),
            (os.POSIX_SPAWN_DUP2, ipc, IPC_FD),
        ],
        setsid=True,
        setsigmask=(),
        setsigdef=(*spawn._RESTORED_SIGNALS, *spawn.STOP_SIGNALS),
    )


def start_view(steps: list[list[str]], base_mounts: int, proc: int, ready_w: int, hold_r: int) -> int:
    """Start the program's view mode (native_init.c), which builds the view ``steps`` (sandboxes/fsview.py)
    in a mount and IPC namespace it unshares from ``base_mounts``, with the detached procfs ``proc`` as
    its /proc, writes "1" on ``ready_w`` and waits for ``hold_r``'s end; its pid. Raises the OSError of a
    failed spawn."""
    assert PROGRAM is not None
    args = [PROGRAM, "view", fsview.SCRATCH_SIZE, str(len(fsview.DEVICES)), *fsview.DEVICES]
    args += [str(len(fsview.DEV_LINKS)), *(part for link in fsview.DEV_LINKS for part in link)]
    args += [part for step in steps for part in (step[0], step[1], step[2] if len(step) > 2 else "")]
    # Each descriptor is moved into place in turn: first all out of the way of the places they go to.
    sources = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (hold_r, ready_w, base_mounts, proc)]
    try:
        return os.posix_spawn(
            PROGRAM,
            args,
            {},
            file_actions=[
                (os.POSIX_SPAWN_DUP2, fd, place)
                for fd, place in zip(sources, (0, 1, BASE_FD, PROC_FD), strict=True)
            ],
            setsigmask=(),
        )
    finally:
        for fd in sources:
            os.close(fd)


def build() -> str | None:
    """Build the program if this source has no build yet; its path, or None where no compiler (or no
    static C library) builds it: spawn.py's init is then used. Safe to run in several processes at once:
    each builds into a file of its own and renames it into place."""
    path = expected_path()
    if path is None:
        return None
    if (usable := _usable(path)) is not None:
        return usable
    import subprocess  # here, not at the server's start (supervisor.py)

    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    try:
        for compiler, flags in itertools.product(_COMPILERS, _BUILDS):
            try:
                done = subprocess.run(
                    [compiler, *flags, "-o", partial, SOURCE],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=BUILD_TIMEOUT_S,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired):
                continue  # no such compiler, or one that hangs: the next
            if done.returncode == 0:
                os.chmod(partial, 0o755)
                os.replace(partial, path)
                return _usable(path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return None


if __name__ == "__main__":  # `make demo`, `make test`: built once, before the first sandbox
    built = build()
    print(f"native init: {built or 'not built (no C compiler): each command gets a forked init'}")
