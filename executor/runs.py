"""The runs in an output root and the state of each: running, complete, stopped, incomplete, interrupted;
and the run lock that keeps one driver per run directory.

A driver holds its run with ``driver.json`` (host, boot id, pid and that process's start time, the
wall-clock time it started, a random token) for as long as it runs: the lock and the "running" marker
are one file. The state is read from that file and from ``summary.json``, which a driver writes when it
ends:

- ``running``: the lock names a live process on this host (or one on another host: we cannot check,
  so we believe it);
- ``interrupted``: the lock names a process that is gone (a SIGKILL, a crash, a reboot), or there are
  rows but neither a lock nor a summary;
- ``stopped``: the summary says the run was stopped (an auth error, an interrupt);
- ``incomplete``: the summary says pairs are still pending (a budget ran out); ``rollout run`` resumes;
- ``complete``: every pair is final.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from executor.storage import Location, Where, locate
from executor.store import iter_batches, part_files
from sandboxes.owner import boot_id, start_ticks

MARKER = "driver.json"
# Taking over a dead owner's lock races with other drivers doing the same; each round either takes the
# lock or finds a live owner, so a few rounds are plenty.
LOCK_TRIES = 5


class RunLockedError(Exception):
    """Another live driver holds the run directory: one line naming it, its owner and since when."""


def _owner_record() -> dict[str, Any]:
    pid = os.getpid()
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "pid_start": start_ticks(pid),  # /proc/<pid>/stat field 22
        "started_at": time.time(),
        "token": secrets.token_hex(8),
    }


def owner_alive(owner: dict[str, Any]) -> bool:
    """Whether the driver a lock names may still run. A lock naming no process (not one a driver
    wrote) is no one's. Another host's driver cannot be checked: it is believed. On this host: another
    boot id means it died in a reboot; else its pid must be alive and, when the lock recorded it,
    still have the same start time (not a reused pid)."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    if owner.get("host") != socket.gethostname():
        return True
    recorded_boot = owner.get("boot_id")
    if recorded_boot and boot_id() and recorded_boot != boot_id():
        return False
    return _process_alive(pid, owner.get("pid_start"))


def _process_alive(pid: int, recorded_start: object) -> bool:
    if not Path("/proc/self/stat").exists():  # no /proc to read start times from: the pid alone
        return _pid_exists(pid)
    ticks = start_ticks(pid)  # None for a process gone, or a zombie nobody reaped yet
    return ticks is not None and (recorded_start is None or ticks == recorded_start)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def describe_owner(run_dir: Location, owner: dict[str, Any]) -> str:
    """The refusal's one line; values from the file are bounded and escaped, it may hold anything."""
    started = owner.get("started_at")
    try:
        since = datetime.fromtimestamp(float(started), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (TypeError, ValueError, OverflowError, OSError):
        since = "an unknown time"
    host = repr(str(owner.get("host")))[1:-1][:100]
    pid = repr(owner.get("pid"))[:20]
    return (
        f"{run_dir} is in use by another driver (pid {pid} on {host}, since {since}); "
        f"if that driver is gone, remove {run_dir / MARKER}"
    )


@contextlib.contextmanager
def run_lock(where: Where) -> Iterator[dict[str, Any]]:
    """Hold the run directory ``where`` for this process until the block ends (however it ends), else
    RunLockedError.

    Nothing else in the run directory is touched before the lock is held. A lock whose owner is dead (see
    ``owner_alive``) is taken over, as a dead worker's sandboxes are reaped. On an object store the lock
    is as exclusive as ``Location.create`` is there (a conditional PUT on S3)."""
    run_dir = locate(where)
    run_dir.mkdir()
    record = _acquire(run_dir, _owner_record())
    try:
        yield record
    finally:
        _release(run_dir / MARKER, record["token"])


def check_free(where: Where) -> None:
    """RunLockedError if a live driver holds the run directory ``where`` now; reads only. For a look
    before costly start-up (a Ray cluster): ``run_lock`` still decides, since the lock may be taken after
    this look."""
    run_dir = locate(where)
    owner, inode = _read_lock(run_dir / MARKER)
    if inode is not None and owner_alive(owner):
        raise RunLockedError(describe_owner(run_dir, owner))


def _acquire(run_dir: Location, record: dict[str, Any]) -> dict[str, Any]:
    path = run_dir / MARKER
    for _ in range(LOCK_TRIES):
        if _create_exclusively(path, record):
            return record
        owner, inode = _read_lock(path)
        if inode is None:
            continue  # released between our attempt and our look: try again
        if owner_alive(owner):
            raise RunLockedError(describe_owner(run_dir, owner))
        _remove_stale(path, inode)
    raise RunLockedError(f"{run_dir}: could not take {MARKER} in {LOCK_TRIES} rounds (other drivers racing)")


def _create_exclusively(path: Location, record: dict[str, Any]) -> bool:
    """Create the lock with its content whole, or return False if it exists (``Location.create``): a
    reader never sees a lock half written."""
    return path.create(json.dumps(record).encode())


def _read_lock(path: Location) -> tuple[dict[str, Any], object | None]:
    """The lock's content and identity (see ``Location.read_identified``); identity None if there is
    no lock now."""
    found = path.read_identified(64 * 1024)
    if found is None:
        return {}, None
    raw, identity = found
    try:
        data = json.loads(raw)
    except ValueError:
        data = {}  # not ours (we write it whole): nobody can be shown to own it
    return (data if isinstance(data, dict) else {}), identity


def _remove_stale(path: Location, identity: object) -> None:
    """Remove the dead owner's lock, and only it: another driver may have taken it over and made a new
    one since we read it."""
    path.remove_if(identity)


def _release(path: Location, token: str) -> None:
    """Remove the lock if it is still ours (the token says so); never another driver's."""
    owner, inode = _read_lock(path)
    if inode is not None and owner.get("token") == token:
        path.unlink()


def _read_json(path: Location) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_run_dir(path: Location) -> bool:
    return path.is_dir() and ((path / "rows").is_dir() or (path / "config.yaml").is_file())


@dataclass
class RunInfo:
    run_id: str
    path: Location
    state: str
    rows: int
    final: int  # (task, sample) pairs with a final row
    by_decision: dict[str, int]  # over all rows: accept and mask are final, retry is not
    pending: int | None  # from the summary; None while unknown
    updated_at: float | None  # newest part file's mtime
    stopped: str | None = None


def run_state(where: Where) -> tuple[str, dict[str, Any]]:
    """The run's state and its summary (empty when it has none)."""
    run_dir = locate(where)
    summary = _read_json(run_dir / "summary.json")
    marker = _read_json(run_dir / MARKER)
    if marker:
        return ("running" if owner_alive(marker) else "interrupted"), summary
    if not summary:
        return "interrupted", summary
    if summary.get("stopped"):
        return "stopped", summary
    if summary.get("pending"):
        return "incomplete", summary
    return "complete", summary


def run_info(where: Where) -> RunInfo:
    run_dir = locate(where)
    state, summary = run_state(run_dir)
    rows = 0
    decisions: dict[str, int] = {}
    final: set[tuple[str, int]] = set()
    for batch in iter_batches(run_dir / "rows", ["task_id", "sample_index", "decision", "final"]):
        cols = batch.to_pydict()
        rows += batch.num_rows
        names = ("task_id", "sample_index", "decision", "final")
        for task, sample, decision, is_final in zip(*(cols[n] for n in names), strict=True):
            decisions[decision] = decisions.get(decision, 0) + 1
            if is_final:
                final.add((task, sample))
    parts = part_files(run_dir / "rows")
    updated = max((m for p in parts if (m := p.mtime()) is not None), default=None)
    # While a driver runs (or after it died) the summary, if any, is of an earlier pass: stale.
    pending = summary.get("pending") if state not in ("running", "interrupted") else None
    return RunInfo(
        run_id=run_dir.name,
        path=run_dir,
        state=state,
        rows=rows,
        final=len(final),
        by_decision=decisions,
        pending=pending,
        updated_at=updated,
        stopped=summary.get("stopped") if state == "stopped" else None,
    )


def list_runs(out_root: Where) -> list[RunInfo]:
    """Every run directory directly under ``out_root``, most recently updated first."""
    runs = [run_info(p) for p in locate(out_root).children() if is_run_dir(p)]
    return sorted(runs, key=lambda r: r.updated_at or 0.0, reverse=True)
