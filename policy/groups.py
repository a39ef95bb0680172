"""The group policy for GRPO-style sampling: the samples of one task are trained together or not at all.

A row once written is never rewritten, so the group's decision must exist before its rows are written:
the driver holds the final rows of a task's samples here until the whole group is final, then writes
them together, each carrying the group's decision. What is held is bounded: at most ``samples`` rows
per open group, and only groups with a sample in flight or waiting for a retry are open. A crash loses
only held rows, which were never rows: their samples run again on resume.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

T = TypeVar("T")


class GroupMode(StrEnum):
    NONE = "none"  # every sample stands alone
    MASK_GROUP = "mask_group"  # one masked sample masks all the task's samples
    RESUBMIT_GROUP = "resubmit_group"  # run the whole group again (within budget), then mask it


class GroupAction(StrEnum):
    KEEP = "keep"  # write each row with its own decision
    MASK = "mask"  # write every row masked
    RESUBMIT = "resubmit"  # write every row as a non-final retry and run all samples again


@dataclass(frozen=True)
class GroupVerdict:
    action: GroupAction
    reason: str = ""


def decide_group(
    mode: GroupMode,
    masked: list[bool],
    *,
    resubmits_done: int,
    max_resubmits: int,
    budget_left: int,
) -> GroupVerdict:
    """The decision for a whole group, given which of its final rows the per-row policy masked."""
    bad = sum(masked)
    if mode is GroupMode.NONE or bad == 0:
        return GroupVerdict(GroupAction.KEEP)
    what = f"{bad} of {len(masked)} samples masked"
    if mode is GroupMode.RESUBMIT_GROUP:
        if resubmits_done < max_resubmits and budget_left >= len(masked):
            return GroupVerdict(
                GroupAction.RESUBMIT, f"group: {what}; resubmitted ({resubmits_done + 1} of {max_resubmits})"
            )
        why = "group resubmits used" if resubmits_done >= max_resubmits else "run retry budget spent"
        return GroupVerdict(GroupAction.MASK, f"group: {what}; {why}")
    return GroupVerdict(GroupAction.MASK, f"group: {what}")


@dataclass
class _Open(Generic[T]):
    size: int
    rows: dict[int, T] = field(default_factory=dict)
    masked: dict[int, bool] = field(default_factory=dict)
    resubmits: int = 0


class GroupBook(Generic[T]):
    """Final rows held per task until all its expected samples are final.

    ``expect`` names how many samples of a task this run still has to finish: all of them on a fresh
    run, fewer on a resume that finds some already final (written before the group policy was set).
    """

    def __init__(self) -> None:
        self._open: dict[str, _Open[T]] = {}

    def expect(self, task_id: str, size: int) -> None:
        self._open.setdefault(task_id, _Open(size))

    @property
    def held_rows(self) -> int:
        return sum(len(g.rows) for g in self._open.values())

    def resubmits(self, task_id: str) -> int:
        group = self._open.get(task_id)
        return group.resubmits if group else 0

    def hold(self, task_id: str, sample: int, row: T, masked: bool) -> list[tuple[int, T, bool]] | None:
        """Hold one final row; the whole group (sample, row, masked) once its last sample is in."""
        group = self._open[task_id]
        group.rows[sample] = row
        group.masked[sample] = masked
        if len(group.rows) < group.size:
            return None
        out = [(s, group.rows[s], group.masked[s]) for s in sorted(group.rows)]
        group.rows.clear()
        group.masked.clear()
        return out

    def resubmitted(self, task_id: str) -> None:
        self._open[task_id].resubmits += 1

    def close(self, task_id: str) -> None:
        self._open.pop(task_id, None)
