"""Launch directories no row names, found when a run resumes, and the rows they are given.

Each launch of an attempt makes ``evidence/<rollout_id>.<tag>/`` as it starts (executor/session.py). A
driver that ends in order writes a row for every session it sent (its own, ``sandbox_lost`` or
``cancelled``); a driver killed outright does not, and the sessions it had in flight leave directories no
row names. On resume each such directory whose attempt has no row at all is given one, ``cancelled``
(retried, as any stopped attempt), naming it; the sample's next attempt then gets a number of its own.
A directory whose attempt already has a row (an older version reran the attempt) is removed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor.config import RunConfig
from executor.session import SessionRequest, lost_row
from executor.storage import Location
from executor.store import ResumeState, read_table
from executor.tasks import load_tasks
from policy import FailureKind

log = logging.getLogger(__name__)

# <task_id>.s<sample>.a<attempt>.<tag>, as executor.session.launch_dir names it (a task id may hold dots).
_LAUNCH_RE = re.compile(r"(?P<task>.+)\.s(?P<sample>\d+)\.a(?P<attempt>\d+)\.(?P<tag>[0-9a-f]{6})")


@dataclass(frozen=True)
class Orphan:
    task_id: str
    sample_index: int
    attempt: int
    evidence_dir: Location


def parse_launch(name: str) -> tuple[str, int, int] | None:
    """(task id, sample, attempt) of a launch directory's name; None for a name not a launch's."""
    match = _LAUNCH_RE.fullmatch(name)
    if match is None:
        return None
    return match["task"], int(match["sample"]), int(match["attempt"])


def find(evidence: Location, state: ResumeState) -> tuple[list[Orphan], list[Location]]:
    """The launch directories under ``evidence`` whose attempt has no row, one per attempt (to adopt),
    and those of an attempt with more than one, of which a row names at most one (to check, and remove
    those it does not name). Only the directory names and the resume state are read."""
    launches: dict[tuple[str, int, int], list[Location]] = {}
    for child in evidence.children():
        parsed = parse_launch(child.name)
        if parsed is not None:
            launches.setdefault(parsed, []).append(child)
    adopt: list[Orphan] = []
    doubtful: list[Location] = []
    for (task_id, sample, attempt), dirs in launches.items():
        key = (task_id, sample)
        if key not in state.final and attempt > state.last_attempt.get(key, 0):
            adopt.append(Orphan(task_id, sample, attempt, dirs[0]))
            doubtful += dirs[1:]  # no row names them, nor will: the adopted one is the attempt's
        elif len(dirs) > 1:
            doubtful += dirs
    return adopt, doubtful


def named(run_dir: Location, launches: list[Location]) -> set[str]:
    """Which of these launch directories a row of the run names."""
    wanted = {loc.uri for loc in launches}
    return wanted.intersection(read_table(run_dir, ["evidence_dir"]).column("evidence_dir").to_pylist())


def rows_for(found: list[Orphan], cfg: RunConfig) -> list[dict[str, Any]]:
    """The ``cancelled`` rows of launches a killed driver left without one, each naming its directory;
    none for a task since taken out of the task file (it runs no more)."""
    ids = {o.task_id for o in found}
    tasks = {t.id: t for t in load_tasks(Path(cfg.tasks)) if t.id in ids}
    message = "found on resume: the run's driver ended before this launch's row was written"
    return [
        lost_row(
            SessionRequest(cfg.run_id or "", tasks[o.task_id], o.sample_index, o.attempt),
            cfg.harness.name,
            cfg.sandbox.provider,
            message,
            {"evidence_dir": o.evidence_dir.uri},
            FailureKind.CANCELLED,
        )
        for o in found
        if o.task_id in tasks
    ]


def adopt(
    run_dir: Location, state: ResumeState, cfg: RunConfig, write: Callable[[list[dict[str, Any]]], None]
) -> tuple[int, int]:
    """Give each orphan under ``run_dir``'s evidence its row (``write``), counting its attempt in
    ``state``; remove the launch directories of attempts whose row names another. Returns (adopted,
    removed)."""
    orphans, doubtful = find(run_dir / "evidence", state)
    keep = named(run_dir, doubtful) if doubtful else set()  # before the adopted rows are written
    if orphans:
        write(rows_for(orphans, cfg))
        for o in orphans:
            key = (o.task_id, o.sample_index)
            state.last_attempt[key] = max(state.last_attempt.get(key, 0), o.attempt)
    removed = 0
    for loc in doubtful:
        if loc.uri not in keep:
            loc.remove_tree()
            removed += 1
    if orphans or removed:
        log.info("resume: %d launch directories given their rows, %d removed", len(orphans), removed)
    return len(orphans), removed
