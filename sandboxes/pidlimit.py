"""A cap on how many processes (and threads) one sandbox may have: a pids cgroup of its own.

A fork bomb in one sandbox must not take the pids of the host, nor those of the other sandboxes; all of
them run as one sandbox user, so a per-user limit (RLIMIT_NPROC) would let one sandbox starve the rest.
Each sandbox gets ``<pids hierarchy>/rollout-executor/<marker>`` with ``pids.max`` set, and its supervisor
server moves there once (``adopt``; a spare server, before the sandbox it will serve starts), so that
every command's init is born there; an init that is not (the server could not be moved, or a sweep
removed the group) moves itself there before starting the command (``join``, sandboxes/supervisor.py).
A move costs the kernel an RCU grace period, ~10 ms with cgroup v1; a birth in the group costs nothing.
Needs root and a pids controller (cgroup v1's ``pids`` hierarchy, or v2 with ``pids`` enabled at the
root); without them a sandbox has no such cap, which ``unavailable`` says.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time

# Standard library, and os.path rather than pathlib: each command's init imports this (by path).
DEFAULT_LIMIT = 2048
_V1 = "/sys/fs/cgroup/pids"
_V2 = "/sys/fs/cgroup"
_OURS = "rollout-executor"
_found: list[str] = []  # our directory, once made


def _parent() -> str | None:
    """Our directory in the pids hierarchy, made if missing (None where there is none)."""
    if not _found:
        _why_not()
    return _found[0] if _found else None


def _why_not() -> str | None:
    """Why there is no directory of ours in the pids hierarchy (one line); None once it is made."""
    if os.geteuid() != 0:
        return "a sandbox's process cap needs root"
    if os.path.exists(os.path.join(_V1, "cgroup.procs")):
        root = _V1
    elif "pids" in _read(os.path.join(_V2, "cgroup.controllers")).split():
        root = _V2
        if "pids" not in _read(os.path.join(_V2, "cgroup.subtree_control")).split():
            try:
                with open(os.path.join(_V2, "cgroup.subtree_control"), "w") as control:
                    control.write("+pids")
            except OSError as exc:
                return f"cannot enable the pids controller: {exc}"
    else:
        return "no pids cgroup controller on this host"
    parent = os.path.join(root, _OURS)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        return f"cannot make {parent}: {exc}"
    _found.append(parent)
    return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def unavailable() -> str | None:
    """Why sandboxes get no process cap here, or None."""
    return None if _found else _why_not()


def make(name: str, limit: int = DEFAULT_LIMIT) -> str | None:
    """A cgroup capped at ``limit`` tasks for one sandbox; the path of its ``cgroup.procs`` (which a
    command's init writes itself into), or None where there is none."""
    parent = _parent()
    if parent is None:
        return None
    group = os.path.join(parent, name)
    try:
        os.mkdir(group)
        with open(os.path.join(group, "pids.max"), "w") as cap:
            cap.write(str(limit))
    except OSError:
        remove(os.path.join(group, "cgroup.procs"))
        return None
    return os.path.join(group, "cgroup.procs")


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


def sweep() -> None:
    """Remove the empty cgroups under ours: those of sandboxes whose owners died, and of live sandboxes
    whose server could not be moved in, between commands (each command's init makes its sandbox's
    again: ``join``)."""
    parent = _parent()
    if parent is None:
        return
    for name in os.listdir(parent):
        group = os.path.join(parent, name)
        if os.path.isdir(group) and _read(os.path.join(group, "pids.current")).strip() == "0":
            try:
                os.rmdir(group)
            except OSError:
                pass


def adopt(procs_path: str, pid: int) -> None:
    """Move process ``pid`` (a sandbox's supervisor server) into the cgroup whose ``cgroup.procs`` is
    ``procs_path``: what it starts from then on is born there. Where it cannot be moved, each command's
    init joins the group itself (``join``)."""
    with contextlib.suppress(OSError), open(procs_path, "w") as procs:
        procs.write(str(pid))


def member(procs_path: str) -> bool:
    """Whether the calling process is in the cgroup whose ``cgroup.procs`` is ``procs_path`` already."""
    group = os.path.dirname(procs_path)
    for root, controllers in ((_V1, "pids"), (_V2, "")):
        if group.startswith(root + "/"):
            wanted = group[len(root) :]
            for line in _read("/proc/self/cgroup").splitlines():
                _id, listed, path = line.split(":", 2)
                if path == wanted and (controllers in listed.split(",") if controllers else not listed):
                    return True
            return False
    return False


def join(procs_path: str, limit: int) -> None:
    """Move the calling process into the cgroup whose ``cgroup.procs`` is ``procs_path``, making it (capped
    at ``limit``) if a sweep removed it. Raises OSError if that cannot be done."""
    for _ in range(3):  # a sweep may remove a group between its making and our joining it
        group = os.path.dirname(procs_path)
        os.makedirs(group, exist_ok=True)
        try:
            with open(os.path.join(group, "pids.max"), "w") as cap:
                cap.write(str(limit))
            with open(procs_path, "w") as procs:
                procs.write("0")
            return
        except FileNotFoundError:
            continue
    raise OSError(f"cannot join the process cap's cgroup {procs_path}")
