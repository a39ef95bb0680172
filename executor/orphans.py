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

from executor.storage import Location
from executor.store import ResumeState

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


def adopt(
    evidence: Location,
    state: ResumeState,
    named: Callable[[list[Location]], set[str]],
    write: Callable[[list[Orphan]], None],
) -> tuple[int, int]:
    """Give each orphan its row (``write``), counting its attempt in ``state``; remove the launch
    directories of attempts that have a row naming another (``named``: which of these the rows name).
    Returns (adopted, removed)."""
    orphans, doubtful = find(evidence, state)
    keep = named(doubtful) if doubtful else set()  # before the adopted rows are written
    if orphans:
        write(orphans)
        for o in orphans:
            key = (o.task_id, o.sample_index)
            state.last_attempt[key] = max(state.last_attempt.get(key, 0), o.attempt)
    removed = 0
    if doubtful:
        for loc in doubtful:
            if loc.uri not in keep:
                loc.remove_tree()
                removed += 1
    if orphans or removed:
        log.info("resume: %d launch directories given their rows, %d removed", len(orphans), removed)
    return len(orphans), removed
