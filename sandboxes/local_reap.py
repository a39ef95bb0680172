"""Ending a local sandbox's processes from outside, by its marker: a sandbox's own stop when it must, and
the reaper of sandboxes whose owner died or whose TTL passed (``reap_stale``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from sandboxes import diskfs, owner, pidlimit, proctree
from sandboxes import supervisor as sup
from sandboxes.base import (
    check_directory_name,
)
from sandboxes.environment import (
    marker_entry,
)
from sandboxes.owner import boot_id, start_ticks

# The provider's logger, whichever of its modules logs.
log = logging.getLogger("sandboxes.local")


DESCRIPTOR_NAME = "sandbox.json"
_REMOVING_SUFFIX = ".removing"  # a stopped sandbox's directory, moved aside until it is deleted
DEFAULT_KILL_GRACE_S = 1.0


def _kill_tree(roots: Sequence[int], marker: bytes, *, sweep: bool, grace_s: float) -> bool:
    """Kill the trees under ``roots`` (and, with ``sweep``, every process carrying ``marker``).

    A root counts only if it still carries the marker, so a recycled pid is never mistaken for ours.
    With a grace, the roots (supervisors) are asked first: they end their own trees in order and record
    that they were terminated, which their owner reports as a lost sandbox rather than a crash.
    """
    me = os.getpid()

    def ours(pid: int) -> bool:
        return start_ticks(pid) is not None and proctree.has_env_entry(pid, marker)

    if grace_s > 0 and (supervisors := {pid for pid in roots if ours(pid)}):
        proctree.send(supervisors, signal.SIGTERM)
        proctree.wait_gone(
            lambda: {pid for pid in supervisors if ours(pid)}, grace_s + sup.DRAIN_S, time.sleep
        )

    def find() -> set[int]:
        procs = proctree.snapshot()
        found: set[int] = set()
        for root in roots:
            if root in procs and procs[root].alive and proctree.has_env_entry(root, marker):
                found |= {root} | proctree.descendants(procs, root)
        if sweep:
            found |= {
                pid for pid, info in procs.items() if info.alive and proctree.has_env_entry(pid, marker)
            }
        found.discard(me)
        return {pid for pid in found if pid in procs and procs[pid].alive}

    return proctree.kill_processes(find, grace_s=grace_s, idle=time.sleep)


def reap_stale(
    root: Path, run_id: str | None = None, *, now: float | None = None, grace_s: float = DEFAULT_KILL_GRACE_S
) -> list[str]:
    """Kill the processes of local sandboxes under ``root`` whose owner is dead or whose TTL has passed,
    and remove their descriptors; a dead owner's sandbox directory goes too, unless its provider kept
    directories (``keep``). Returns the ids reaped; idempotent. Blocking: call it in a thread from async
    code. Sandboxes of other machines are left to their own.

    An owner is dead when its record's lock is free (sandboxes/owner.py): a pid would not do, since the
    reaper may see another PID namespace than the owner did. Processes are found by the sandbox's marker
    in this reaper's /proc; a dead owner's processes in a namespace it cannot see are not its to kill."""
    root = Path(root)
    if run_id is not None:
        check_directory_name("run_id", run_id)
    pattern = f"{run_id}/*/{DESCRIPTOR_NAME}" if run_id else f"*/*/{DESCRIPTOR_NAME}"
    now = time.time() if now is None else now
    host, boot = socket.gethostname(), boot_id()
    reaped: list[str] = []
    for path in sorted(root.glob(pattern)):
        try:
            desc = json.loads(path.read_text(encoding="utf-8"))
            sandbox_id, marker = str(desc["id"]), marker_entry(str(desc["marker"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if desc.get("boot_id") == boot:  # this machine since its last boot: its processes may run
            # A sandbox without an owner record (an older version's) has only its TTL to end it.
            name = desc.get("owner")
            owner_dead = isinstance(name, str) and owner.known_dead(root, name)
            if not owner_dead and now < float(desc["ttl_deadline"]):
                continue
            roots = [int(pid) for pid in desc.get("supervisor_pids", [])]
            if desc.get("server_pid"):
                roots.append(int(desc["server_pid"]))
            if not _kill_tree(roots, marker, sweep=True, grace_s=grace_s):
                log.warning("reap_stale: processes of %s survived; leaving its descriptor", sandbox_id)
                continue
            pidlimit.remove(desc.get("pids_cgroup"), 2.0)
            pidlimit.remove(desc.get("memory_cgroup"), 2.0)
            # A live owner (its TTL passed) still reads the logs on the session's own tmpfs: its to take.
            session = bool(desc.get("session_fs")) and owner_dead
            if desc.get("disk_fs") or session:
                with contextlib.suppress(OSError):
                    diskfs.unmount(str(path.parent), session=session)
        elif desc.get("host") != host:
            continue  # another machine's
        else:
            owner_dead = True  # this host before its last boot: its owner died with it
        path.unlink(missing_ok=True)  # gone already with the session's tmpfs
        # A live owner whose TTL passed still collects from the directory, and removes it at its stop.
        if owner_dead and not desc.get("keep"):
            shutil.rmtree(path.parent, ignore_errors=True)
        reaped.append(sandbox_id)
    # Directories whose deletion a worker began but did not live to finish, and the empty mount points it
    # kept for later sessions (diskfs.MountPoints); nothing runs in them.
    for suffix in (_REMOVING_SUFFIX, diskfs.SPARE_SUFFIX):
        for aside in root.glob(f"{run_id or '*'}/*{suffix}"):
            if (
                aside.is_dir()
                and not (aside / DESCRIPTOR_NAME).exists()
                and _remover_gone(root, aside.name, suffix)
            ):
                shutil.rmtree(aside, ignore_errors=True)
    return reaped


def _remover_gone(root: Path, aside: str, suffix: str) -> bool:
    name = aside.removesuffix(suffix).rpartition(".")[2]
    # An aside named after its session alone is an older version's: nobody is deleting it any more.
    return not owner.is_owner_name(name) or owner.known_dead(root, name)
