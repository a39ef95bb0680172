"""What the driver takes and gives: a ``Submission`` of tasks, a trainer's ``Announcement`` of a policy
version, the ``RunSummary`` it ends with, and a sample waiting in its retry queue (``Retry``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from executor.store import Key
from executor.tasks import Task, load_tasks
from policy import GroupMode


@dataclass(order=True)
class Retry:
    ready_at: float
    seq: int
    task: Task = field(compare=False)
    sample_index: int = field(compare=False)
    attempt: int = field(compare=False)


@dataclass
class RunSummary:
    run_id: str
    run_dir: str
    rows: int
    final: int
    pending: int
    by_decision: dict[str, int]
    by_status: dict[str, int]
    by_failure_kind: dict[str, int]
    stopped: str | None
    exit_code: int
    # "policy" (e.g. provider_auth_error), "breaker", "store", "signal" (SIGTERM, SIGINT: exit 128 + signum),
    # "cancelled" (a trainer's cancel or close)
    stopped_by: str | None = None
    masked: int = 0
    # Training-facing statistics: final accepted rows with a reward only; masked rows never count.
    reward: dict[str, float | int | None] = field(default_factory=dict)
    breaker: dict[str, object] = field(default_factory=dict)
    # When the run's fixed costs fell (executor/phases.py): seconds after the command started.
    phases: dict[str, float] = field(default_factory=dict)
    # A trainer's run (executor/api.py): the last policy version, and what staleness did to rows.
    versions: dict[str, int] = field(default_factory=dict)


@dataclass
class Submission:
    """Tasks handed to a run: a task file (read lazily, as the run goes) or tasks in memory, each run
    ``samples`` times under the group policy ``group``. ``snapshot``: keep a copy in the run directory
    (``tasks/``), so that export and replay find a row's task; the config's own task file has its
    snapshot beside the config instead."""

    tasks: Path | list[Task]
    samples: int
    group: GroupMode = GroupMode.NONE
    snapshot: bool = True
    expected: int = 0  # (task, sample) pairs it names, counted before its first session
    pending: int = 0  # of those, not final yet when counted

    def load(self) -> Iterator[Task]:
        return load_tasks(self.tasks) if isinstance(self.tasks, Path) else iter(self.tasks)

    def count(self, final: set[Key]) -> None:
        for task in self.load():
            self.expected += self.samples
            self.pending += sum((task.id, s) not in final for s in range(self.samples))


@dataclass(frozen=True)
class Announcement:
    """A trainer's policy version and where it is served (None: where the version before it was)."""

    version: int
    base_urls: tuple[str, ...] | None = None
    model: str | None = None

    def to_json(self) -> str:
        urls = list(self.base_urls) if self.base_urls else None
        return json.dumps({"version": self.version, "base_urls": urls, "model": self.model})
