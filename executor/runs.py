"""The runs in an output root and the state of each: running, complete, stopped, incomplete, interrupted.

A driver marks its run as running with ``driver.json`` (pid, host, start time) for as long as it runs.
The state is read from that file and from ``summary.json``, which a driver writes when it ends:

- ``running``: the marker names a live process on this host (or another host: we cannot check, so we
  believe it);
- ``interrupted``: the marker names a process that is gone (a SIGKILL, a crash), or there are rows but
  neither a marker nor a summary;
- ``stopped``: the summary says the run was stopped (an auth error, an interrupt);
- ``incomplete``: the summary says pairs are still pending (a budget ran out); ``rollout run`` resumes;
- ``complete``: every pair is final.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor.store import iter_batches, part_files

MARKER = "driver.json"


@contextlib.contextmanager
def running_marker(run_dir: Path) -> Iterator[None]:
    """Mark ``run_dir`` as driven by this process until the block ends (however it ends)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / MARKER
    tmp = path.with_name(f"{MARKER}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time()}))
    os.replace(tmp, path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if _read_json(path).get("pid") == os.getpid():
                path.unlink()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _alive(pid: object, host: object) -> bool:
    if host != socket.gethostname():
        return True  # another machine's driver: nothing here can tell, so trust the marker
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and ((path / "rows").is_dir() or (path / "config.yaml").is_file())


@dataclass
class RunInfo:
    run_id: str
    path: Path
    state: str
    rows: int
    final: int  # (task, sample) pairs with a final row
    by_decision: dict[str, int]  # over all rows: accept and mask are final, retry is not
    pending: int | None  # from the summary; None while unknown
    updated_at: float | None  # newest part file's mtime
    stopped: str | None = None


def run_state(run_dir: Path) -> tuple[str, dict[str, Any]]:
    """The run's state and its summary (empty when it has none)."""
    summary = _read_json(run_dir / "summary.json")
    marker = _read_json(run_dir / MARKER)
    if marker:
        return ("running" if _alive(marker.get("pid"), marker.get("host")) else "interrupted"), summary
    if not summary:
        return "interrupted", summary
    if summary.get("stopped"):
        return "stopped", summary
    if summary.get("pending"):
        return "incomplete", summary
    return "complete", summary


def run_info(run_dir: Path) -> RunInfo:
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
    updated = max((p.stat().st_mtime for p in parts), default=None)
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


def list_runs(out_root: Path) -> list[RunInfo]:
    """Every run directory directly under ``out_root``, most recently updated first."""
    runs = [run_info(p) for p in sorted(out_root.iterdir()) if is_run_dir(p)]
    return sorted(runs, key=lambda r: r.updated_at or 0.0, reverse=True)
