"""A cap on how many processes (and threads) one sandbox may have: a pids cgroup of its own.

A fork bomb in one sandbox must not take the pids of the host, nor those of the other sandboxes; all of
them run as one sandbox user, so a per-user limit (RLIMIT_NPROC) would let one sandbox starve the rest.
Each sandbox gets ``<pids hierarchy>/rollout-executor/<marker>`` with ``pids.max`` set, and each of its
commands' inits moves itself there before starting the command (sandboxes/supervisor.py). Needs root and
a pids controller (cgroup v1's ``pids`` hierarchy, or v2 with ``pids`` enabled at the root); without
them a sandbox has no such cap, which ``unavailable`` says.
"""

from __future__ import annotations

import errno
import functools
import os
import time
from pathlib import Path

DEFAULT_LIMIT = 2048
_V1 = Path("/sys/fs/cgroup/pids")
_V2 = Path("/sys/fs/cgroup")
_OURS = "rollout-executor"


@functools.cache
def _parent() -> Path | str:
    """Our directory in the pids hierarchy, made if missing; or why there is none (one line)."""
    if os.geteuid() != 0:
        return "a sandbox's process cap needs root"
    if (_V1 / "pids.max").exists() or (_V1 / "cgroup.procs").exists():
        root = _V1
    elif "pids" in _read(_V2 / "cgroup.controllers").split():
        root = _V2
        if "pids" not in _read(_V2 / "cgroup.subtree_control").split():
            try:
                (_V2 / "cgroup.subtree_control").write_text("+pids")
            except OSError as exc:
                return f"cannot enable the pids controller: {exc}"
    else:
        return "no pids cgroup controller on this host"
    parent = root / _OURS
    try:
        parent.mkdir(exist_ok=True)
    except OSError as exc:
        return f"cannot make {parent}: {exc}"
    return parent


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def unavailable() -> str | None:
    """Why sandboxes get no process cap here, or None."""
    parent = _parent()
    return parent if isinstance(parent, str) else None


def make(name: str, limit: int = DEFAULT_LIMIT) -> str | None:
    """A cgroup capped at ``limit`` tasks for one sandbox; the path of its ``cgroup.procs`` (which a
    command's init writes itself into), or None where there is none."""
    parent = _parent()
    if isinstance(parent, str):
        return None
    group = parent / name
    try:
        group.mkdir()
        (group / "pids.max").write_text(str(limit))
    except OSError:
        remove(str(group / "cgroup.procs"))
        return None
    return str(group / "cgroup.procs")


def remove(procs_path: str | None, wait_s: float = 0.0) -> bool:
    """Remove a sandbox's cgroup once its processes are gone. The kernel refuses while any is left, and
    a process killed a moment ago may still count: ``wait_s`` bounds retrying (blocking). True once gone."""
    if not procs_path:
        return True
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(os.path.dirname(procs_path))
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                return False
        time.sleep(0.01)
