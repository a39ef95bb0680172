"""The unprivileged identities sandboxed commands run as, never the worker's: one per running sandbox.

Two sandboxes running at once never share a uid, so they share no kernel user keyring (a token one
stores with ``add_key`` the other cannot read), cannot signal or ptrace each other's processes, and own
none of each other's files. A local sandbox leases its uid from a pool (``lease``): ``POOL_SIZE`` numbers
from ``POOL_BASE`` (far above any account or container range; no passwd entry needed: the sandbox's view
binds a passwd and group file of its own naming it), each held by an exclusive ``flock`` on a file under
``LEASE_DIR`` for as long as the sandbox lives. The kernel drops a lock with its holder, so a crashed
worker's leases free themselves; a uid is taken again only once no process of its last sandbox is left,
which that sandbox's supervisor server says by holding a shared lock on ``<uid>.busy`` until its PID
namespace is empty (sandboxes/supervisor_server.py). Only root can switch a command to another user.

The in-sandbox agent (Slurm, ECS) runs its commands as one named user (``--run-as``, ``SANDBOX_USER``,
which ``sandbox_identity`` makes at first use); on Slurm it leases a uid from the node's pool the same
way where the agent runs as root. The worker keeps its own files (the supervisors' logs and results, the
descriptor): a sandbox's uid can write its workspace, home and tmp, and nothing else on the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import pwd
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

SANDBOX_USER = "rollout-sandbox"
POOL_BASE = 2_000_000_000
POOL_SIZE = 65_536
LEASE_DIR = "/run/rollout-executor/uids"


class Identity(NamedTuple):
    """The sandbox user's ids."""

    uid: int
    gid: int


def _lookup() -> Identity | None:
    try:
        entry = pwd.getpwnam(SANDBOX_USER)
    except KeyError:
        return None
    return Identity(entry.pw_uid, entry.pw_gid)


@functools.cache
def sandbox_identity() -> Identity | str:
    """The sandbox user, made if missing; or why this host cannot have one (one line)."""
    if os.geteuid() != 0:
        return "commands run as the worker's own user (only root can switch them to an unprivileged one)"
    found = _lookup()
    if found is not None:
        return _checked(found)
    if shutil.which("useradd") is None:
        return f"no user {SANDBOX_USER!r} and no useradd to make it"
    argv = ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent"]
    argv += ["--shell", "/usr/sbin/nologin", SANDBOX_USER]
    try:
        made = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make user {SANDBOX_USER!r}: {exc}"
    found = _lookup()  # another process may have made it first: useradd then fails, the user is there
    if found is None:
        why = made.stderr.decode("utf-8", "replace").strip().replace("\n", " ")[:200]
        return f"cannot make user {SANDBOX_USER!r}: {why}"
    return _checked(found)


def _checked(found: Identity) -> Identity | str:
    if found.uid == 0 or found.gid == 0:
        return f"user {SANDBOX_USER!r} has uid or gid 0: refusing to run sandboxes as root"
    return found


def give(paths: list[Path], who: Identity) -> None:
    """Make ``paths`` (and everything under them) the sandbox user's; symlinks themselves, never their
    targets."""
    for path in paths:
        os.lchown(path, who.uid, who.gid)
        if path.is_symlink() or not path.is_dir():
            continue
        for top, dirs, files in os.walk(path):
            for name in dirs + files:
                os.lchown(os.path.join(top, name), who.uid, who.gid)


class Lease:
    """A uid (and a gid of the same number) held for one sandbox until ``release``."""

    def __init__(self, who: Identity, fd: int, busy_path: str) -> None:
        self.identity = who
        self.busy_path = busy_path  # the sandbox's supervisor server holds it while any process is left
        self._fd: int | None = fd

    def release(self) -> None:
        """Give the uid back (idempotent): call once the sandbox's processes are gone."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def pool_unavailable() -> str | None:
    """Why sandboxes here cannot each run as a uid of their own (one line), or None."""
    if os.geteuid() != 0:
        return "commands run as the worker's own user (only root can switch them to an unprivileged one)"
    return None


def _try_lock(path: str, operation: int) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def lease(directory: str = LEASE_DIR) -> Lease:
    """The lowest uid of the pool that no running sandbox holds and no process of a stopped one still
    runs as. Raises OSError when the pool is spent or the lock directory cannot be made."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for uid in range(POOL_BASE, POOL_BASE + POOL_SIZE):
        path = os.path.join(directory, str(uid))
        fd = _try_lock(path, fcntl.LOCK_EX)
        if fd is None:
            continue
        busy = _try_lock(path + ".busy", fcntl.LOCK_EX)  # free once the last tenant's server has ended
        if busy is None or _has_account(uid):
            os.close(fd)
            if busy is not None:
                os.close(busy)
            continue
        os.close(busy)
        return Lease(Identity(uid, uid), fd, path + ".busy")
    raise OSError(f"no free sandbox uid among {POOL_SIZE} from {POOL_BASE} ({directory})")


def _has_account(uid: int) -> bool:
    with contextlib.suppress(KeyError):
        pwd.getpwuid(uid)
        return True
    return False


def account_files(
    who: Identity, home: str, passwd: str = "/etc/passwd", group: str = "/etc/group"
) -> tuple[str, str]:
    """The host's passwd and group text with the sandbox's uid and gid named ``SANDBOX_USER`` (an entry
    of that name already there is left out): programs that look their user up (git, ssh, Node's
    ``os.userInfo``) find it."""

    def others(path: str) -> str:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            lines = []
        return "".join(line + "\n" for line in lines if not line.startswith(SANDBOX_USER + ":"))

    user = f"{SANDBOX_USER}:x:{who.uid}:{who.gid}:rollout sandbox:{home}:/usr/sbin/nologin\n"
    return others(passwd) + user, others(group) + f"{SANDBOX_USER}:x:{who.gid}:\n"
