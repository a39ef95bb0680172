"""A sandbox's cgroups: a cap on its processes and threads (``pids``) and on its memory (``memory``).

A fork bomb in one sandbox must not take the pids of the host, nor those of the other sandboxes, and a
memory hog must be killed inside its own sandbox, not by the host's OOM killer wherever it strikes. Each
sandbox gets ``<hierarchy>/rollout-executor/<marker>`` per controller (cgroup v1: one hierarchy each; v2:
one group holds both) with ``pids.max`` and the memory limit set (no swap beyond it). Its supervisor
server moves there once (``adopt``; a spare server, before the sandbox it will serve starts), so that
every command's init is born there; an init that is not (the server could not be moved, or a sweep
removed the group) moves itself there before starting the command (``join``, sandboxes/supervisor.py).
A move costs the kernel an RCU grace period, ~10 ms with cgroup v1; a birth in the group costs nothing.
The memory limit counts what the sandbox's processes allocate and the files they write to a tmpfs (its
/tmp, its own filesystem: sandboxes/diskfs.py); a process the kernel kills for it shows in ``oom_kills``.
Needs root and the controllers (cgroup v1's hierarchies, or v2 with them available at the root); without
them a sandbox has no such cap, which ``unavailable`` says.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time

# Standard library, and os.path rather than pathlib: each command's init imports this (by path).
if __package__:
    from sandboxes import proctree
else:  # imported by a command's init, with our directory on sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import proctree

DEFAULT_LIMIT = 2048
PIDS, MEMORY = "pids", "memory"
_V1 = "/sys/fs/cgroup"
_V2 = "/sys/fs/cgroup"
_OURS = "rollout-executor"
_found: dict[str, str] = {}  # controller -> our directory, once made


def _v1_root(controller: str) -> str:
    return os.path.join(_V1, controller)


def _parent(controller: str = PIDS) -> str | None:
    """Our directory in the controller's hierarchy, made if missing (None where there is none)."""
    if controller not in _found:
        _why_not(controller)
    return _found.get(controller)


def _enable(control: str, controller: str) -> None:
    if controller not in _read(control).split():
        proctree.write_small(control, "+" + controller)


def _why_not(controller: str = PIDS) -> str | None:
    """Why there is no directory of ours in the controller's hierarchy (one line); None once it is made."""
    if os.geteuid() != 0:
        return f"a sandbox's {controller} cap needs root"
    v2 = False
    if os.path.exists(os.path.join(_v1_root(controller), "cgroup.procs")):
        root = _v1_root(controller)
    elif controller in _read(os.path.join(_V2, "cgroup.controllers")).split():
        root, v2 = _V2, True
        try:
            _enable(os.path.join(_V2, "cgroup.subtree_control"), controller)
        except OSError as exc:
            return f"cannot enable the {controller} controller: {exc}"
    else:
        return f"no {controller} cgroup controller on this host"
    parent = os.path.join(root, _OURS)
    try:
        os.makedirs(parent, exist_ok=True)
        if v2:  # the sandboxes' groups under ours get the controller's files too
            _enable(os.path.join(parent, "cgroup.subtree_control"), controller)
    except OSError as exc:
        return f"cannot make {parent}: {exc}"
    _found[controller] = parent
    return None


def _read(path: str) -> str:
    try:
        return proctree.read_small(path)
    except OSError:
        return ""


def unavailable(controller: str = PIDS) -> str | None:
    """Why sandboxes get no cap of ``controller`` here, or None."""
    return None if controller in _found else _why_not(controller)


def _limit_files(group: str, controller: str, limit: int) -> list[tuple[str, str]]:
    if controller == PIDS:
        return [(os.path.join(group, "pids.max"), str(limit))]
    if os.path.exists(os.path.join(group, "memory.max")):  # v2: no swap beyond the limit either
        return [
            (os.path.join(group, "memory.max"), str(limit)),
            (os.path.join(group, "memory.swap.max"), "0"),
        ]
    # v1: memory and swap together, once swap accounting is there; the limit first, as it must not pass
    # the combined one (both are raised or lowered in the order that keeps it so).
    both = os.path.join(group, "memory.memsw.limit_in_bytes")
    files = [(os.path.join(group, "memory.limit_in_bytes"), str(limit))]
    if os.path.exists(both):
        current = _read(both).strip()
        raise_first = current.isdigit() and int(current) < limit
        files = [(both, str(limit)), *files] if raise_first else [*files, (both, str(limit))]
    return files


def set_limit(procs_path: str, limit: int, controller: str = PIDS) -> None:
    """Set the cap of the group whose ``cgroup.procs`` is ``procs_path``. Raises OSError."""
    for path, value in _limit_files(os.path.dirname(procs_path), controller, limit):
        if os.path.exists(path):
            proctree.write_small(path, value)


def make(name: str, limit: int = DEFAULT_LIMIT, controller: str = PIDS) -> str | None:
    """A cgroup capped at ``limit`` (tasks, or bytes) for one sandbox; the path of its ``cgroup.procs``
    (which a command's init writes itself into), or None where there is none."""
    parent = _parent(controller)
    if parent is None:
        return None
    group = os.path.join(parent, name)
    try:
        with contextlib.suppress(FileExistsError):  # v2: one group holds both controllers
            os.mkdir(group)
        set_limit(os.path.join(group, "cgroup.procs"), limit, controller)
    except OSError:
        remove(os.path.join(group, "cgroup.procs"))
        return None
    return os.path.join(group, "cgroup.procs")


def oom_kills(procs_path: str | None) -> int:
    """How many processes of the memory group whose ``cgroup.procs`` is ``procs_path`` the kernel has
    killed for its limit so far (0 where unknown)."""
    if not procs_path:
        return 0
    group = os.path.dirname(procs_path)
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        for line in _read(os.path.join(group, name)).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return 0


def killed_by_cap(memory_max: int, kills: int) -> str:
    """What a command's result says (``ExecResult.limit``) when it failed and the kernel killed ``kills``
    processes of its sandbox for a memory cap of ``memory_max`` bytes meanwhile: a kill by the cap
    (SIGKILL, or 137 from a shell between), not a signal sent from inside the sandbox."""
    mib = memory_max // 2**20
    return f"the sandbox's memory cap of {mib} MiB killed {kills} of its processes (out of memory)"


def own_memory_group() -> tuple[str, int] | None:
    """The memory group this process is in, as its ``cgroup.procs`` path, and its limit in bytes; None
    where it has no limit, or none can be read. The group /proc/self/cgroup names, under the controller's
    mount; or, where that path is not there, the mount itself: a container's engine mounts the container's
    own group there (cgroup v1 with no cgroup namespace: the path named is the host's)."""
    named = None
    for line in _read("/proc/self/cgroup").splitlines():
        _id, controllers, path = line.split(":", 2)
        if MEMORY in controllers.split(","):
            named = (_v1_root(MEMORY), path, "memory.limit_in_bytes")
        elif not controllers and named is None:
            named = (_V2, path, "memory.max")
    if named is None:
        return None
    root, path, limit_file = named
    group = os.path.join(root, path.lstrip("/"))
    if not os.path.isdir(group):
        group = root
    limit = _read(os.path.join(group, limit_file)).strip()
    # v1 says "no limit" with a number near 2**63 (rounded to the page size); v2 with "max".
    if not limit.isdigit() or int(limit) >= 2**62:
        return None
    return os.path.join(group, "cgroup.procs"), int(limit)


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


def sweep(controller: str = PIDS) -> None:
    """Remove the empty cgroups under ours: those of sandboxes whose owners died, and of live sandboxes
    whose server could not be moved in, between commands (each command's init makes its sandbox's
    again: ``join``)."""
    parent = _parent(controller)
    if parent is None:
        return
    for name in os.listdir(parent):
        group = os.path.join(parent, name)
        if os.path.isdir(group) and not _read(os.path.join(group, "cgroup.procs")).strip():
            try:
                os.rmdir(group)
            except OSError:
                pass


def adopt(procs_path: str, pid: int) -> None:
    """Move process ``pid`` (a sandbox's supervisor server) into the cgroup whose ``cgroup.procs`` is
    ``procs_path``: what it starts from then on is born there. Where it cannot be moved, each command's
    init joins the group itself (``join``)."""
    with contextlib.suppress(OSError):
        proctree.write_small(procs_path, str(pid))


def spare_from_oom_killer(pid: int) -> None:
    """Keep process ``pid`` (a sandbox's supervisor server, and what it forks) from the OOM killer where
    this process may (CAP_SYS_RESOURCE): a memory cap's kill must take a command of the sandbox, not its
    supervisor. Each command raises its own score to the top (supervisor.py), which is what keeps the
    supervisors where this cannot be done."""
    with contextlib.suppress(OSError):
        proctree.write_small(f"/proc/{pid}/oom_score_adj", "-1000")


def member(procs_path: str, controller: str = PIDS) -> bool:
    """Whether the calling process is in the cgroup whose ``cgroup.procs`` is ``procs_path`` already."""
    group = os.path.dirname(procs_path)
    for root, listed_as in ((_v1_root(controller), controller), (_V2, "")):
        if group.startswith(root + "/"):
            wanted = group[len(root) :]
            for line in _read("/proc/self/cgroup").splitlines():
                _id, listed, path = line.split(":", 2)
                if path == wanted and (listed_as in listed.split(",") if listed_as else not listed):
                    return True
            return False
    return False


def join(procs_path: str, limit: int, controller: str = PIDS) -> None:
    """Move the calling process into the cgroup whose ``cgroup.procs`` is ``procs_path``, making it (capped
    at ``limit``) if a sweep removed it. Raises OSError if that cannot be done."""
    for _ in range(3):  # a sweep may remove a group between its making and our joining it
        group = os.path.dirname(procs_path)
        os.makedirs(group, exist_ok=True)
        try:
            set_limit(procs_path, limit, controller)
            proctree.write_small(procs_path, "0")
            return
        except FileNotFoundError:
            continue
    raise OSError(f"cannot join the {controller} cap's cgroup {procs_path}")
