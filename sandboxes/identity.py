"""The named unprivileged user sandboxed commands of the in-sandbox agent run as (``--run-as``), never
the worker's: ``SANDBOX_USER``, made at first use by a worker running as root (``useradd``, idempotent;
``.ci/system-deps`` makes it at set-up). A local sandbox runs as a uid of its own instead, one per running
sandbox (sandboxes/uidpool.py), and so does a Slurm job's agent as root. The worker keeps its own files
(the supervisors' logs and results, the descriptor): the sandbox's user can write its workspace, home and
tmp, and nothing else on the host.
"""

from __future__ import annotations

import functools
import os
import pwd
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

SANDBOX_USER = "rollout-sandbox"


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
