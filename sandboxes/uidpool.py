"""One uid per running sandbox, so that two sandboxes running at once cannot signal or ptrace each other's
processes and own none of each other's files (the kernel's keyrings, which a uid's would share, are no
sandbox's at all: seccomp.py).

A sandbox leases its uid from a pool (``lease``): ``POOL_SIZE`` numbers from ``POOL_BASE`` (far above
any account or container range, below 2**31; a number with an account is skipped), with a gid of the same
number. No passwd entry is needed: the sandbox's view binds a passwd and group file of its own naming it
(``account_files``), so that programs that look their user up (git, ssh, Node's ``os.userInfo``) find
it. Each number is held by an exclusive ``flock`` on ``LEASE_DIR/<uid>`` for as long as its sandbox
lives: the kernel drops a lock with its holder, so a crashed worker's leases free themselves, and leases
taken at once (an agent's sandbox and its fresh verification sandbox) are always two. A number is taken
again only once no process of its last sandbox is left: the sandbox's supervisor server holds
``<uid>.busy`` shared until its PID namespace is empty (sandboxes/supervisor_server.py), and a lease
passes over a number whose ``.busy`` it cannot lock. Only root can switch a command to another uid.
Standard library only, python3 >= 3.8: the in-sandbox agent leases from its node's pool the same way.
"""

from __future__ import annotations

import fcntl
import os
import pwd

POOL_BASE = 2_000_000_000
POOL_SIZE = 65_536
LEASE_DIR = "/run/rollout-executor/uids"
USER_NAME = "rollout-sandbox"  # what the sandbox's own passwd file calls it


class Lease:
    """A uid (and a gid of the same number) held for one sandbox until ``release``."""

    def __init__(self, uid: int, gid: int, fd: int, busy_path: str) -> None:
        self.uid, self.gid = uid, gid
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


# Where this process's next lease looks first: past its last one (a next fit). A search from the pool's
# start tried (open, flock, close) every uid held, ~500 at 1,000 sandboxes in flight, for each lease;
# ahead of the cursor nearly all are free. The cursor goes back to the start past the first CURSOR_SPAN
# uids, so that the lock files stay as few (two per uid ever leased); a lease still looks round the whole
# pool when those are taken.
CURSOR_SPAN = 4096
_cursor = [POOL_BASE]


def lease(directory: str = LEASE_DIR) -> Lease:
    """A uid of the pool that no running sandbox holds and no process of a stopped one still runs as:
    the first from this process's cursor on, round the pool. Raises OSError when the pool is spent or
    the lock directory cannot be made."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    start = _cursor[0] - POOL_BASE
    for n in range(POOL_SIZE):
        uid = POOL_BASE + (start + n) % POOL_SIZE
        path = os.path.join(directory, str(uid))
        fd = _try_lock(path, fcntl.LOCK_EX)
        if fd is None:
            continue
        busy = _try_lock(path + ".busy", fcntl.LOCK_EX)  # free once no process of its last tenant is left
        if busy is None or _has_account(uid):
            os.close(fd)
            if busy is not None:
                os.close(busy)
            continue
        os.close(busy)
        _cursor[0] = uid + 1 if uid + 1 < POOL_BASE + CURSOR_SPAN else POOL_BASE
        return Lease(uid, uid, fd, path + ".busy")
    raise OSError(f"no free sandbox uid among {POOL_SIZE} from {POOL_BASE} ({directory})")


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def account_files(
    uid: int, gid: int, home: str, passwd: str = "/etc/passwd", group: str = "/etc/group"
) -> tuple[str, str]:
    """The host's passwd and group text with the sandbox's uid and gid named ``USER_NAME`` (an entry
    of that name already there is left out): programs that look their user up (git, ssh, Node's
    ``os.userInfo``) find it."""

    user = f"{USER_NAME}:x:{uid}:{gid}:rollout sandbox:{home}:/usr/sbin/nologin\n"
    return _others(passwd) + user, _others(group) + f"{USER_NAME}:x:{gid}:\n"


# The host file's other entries by path, with the stat they were read at: every sandbox's start copies
# them, and the file changes far more rarely (a read and a filter of each line, ~14 us here, against a
# stat, ~1 us).
_read_entries: dict[str, tuple[tuple[int, int, int, int, int], str]] = {}


def _others(path: str) -> str:
    """``path``'s entries but one named ``USER_NAME``, read again whenever the file is another or has
    changed since (its inode, size, modification or change time)."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    kept = _read_entries.get(path)
    if kept is not None and kept[0] == key:
        return kept[1]
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    text = "".join(line + "\n" for line in lines if not line.startswith(USER_NAME + ":"))
    _read_entries[path] = (key, text)
    return text
