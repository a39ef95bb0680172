"""The Arrow store: a run directory of whole Parquet part files, each written then renamed into place."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from executor.schema import ROW_SCHEMA, upgrade

_PART = re.compile(r"^part-(\d{6,})\.parquet$")
RESUME_COLUMNS = ["task_id", "sample_index", "attempt", "decision", "final"]

Key = tuple[str, int]  # (task_id, sample_index)


class StoreError(Exception):
    """The output could not be written; what was written before stays readable."""


@dataclass
class ResumeState:
    """What a previous run left: which (task, sample) are final, and the last attempt of the rest."""

    final: set[Key] = field(default_factory=set)
    last_attempt: dict[Key, int] = field(default_factory=dict)
    retries_used: int = 0
    rows: int = 0


def part_files(rows_dir: Path) -> list[Path]:
    if not rows_dir.is_dir():
        return []
    return sorted(p for p in rows_dir.iterdir() if _PART.match(p.name))


class RunStore:
    """Buffers batches and writes them as part files. A crash loses at most the unflushed buffer,
    never a written row, and never leaves a torn file under a part name."""

    def __init__(self, run_dir: Path, flush_rows: int = 512, flush_interval_s: float = 2.0) -> None:
        self.run_dir = run_dir
        self.rows_dir = run_dir / "rows"
        self.rows_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.rows_dir.glob("*.tmp"):
            stale.unlink(missing_ok=True)  # left by a crash mid-write; its rows were never committed
        existing = part_files(self.rows_dir)
        self._next = int(_PART.match(existing[-1].name).group(1)) + 1 if existing else 0
        self._buffer: list[pa.RecordBatch] = []
        self._buffered_rows = 0
        self._flush_rows = flush_rows
        self._flush_interval_s = flush_interval_s
        self._last_flush = time.monotonic()
        self.rows_written = 0

    def append(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self._buffer.append(batch)
        self._buffered_rows += batch.num_rows
        if self._buffered_rows >= self._flush_rows:
            self.flush()

    def maybe_flush(self) -> None:
        if self._buffer and time.monotonic() - self._last_flush >= self._flush_interval_s:
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._buffer:
            return
        table = pa.Table.from_batches(self._buffer, schema=ROW_SCHEMA)
        final = self.rows_dir / f"part-{self._next:06d}.parquet"
        tmp = final.with_name(final.name + ".tmp")
        try:
            with tmp.open("wb") as fh:
                pq.write_table(table, fh, compression="zstd")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"{final}: could not write part file ({exc.strerror or exc})") from exc
        self._next += 1
        self.rows_written += table.num_rows
        self._buffer.clear()
        self._buffered_rows = 0

    def resume_state(self) -> ResumeState:
        return scan(self.rows_dir)


def iter_batches(rows_dir: Path, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    for path in part_files(rows_dir):
        # Part files of an older schema version read as this one: a resumed run spans both.
        yield from map(upgrade, pq.ParquetFile(path).iter_batches(columns=columns, batch_size=65_536))


def iter_rows_newest_first(rows_dir: Path, columns: list[str]) -> Iterator[tuple[Any, ...]]:
    """``columns`` of every row, from the last written back to the first: part files newest first,
    one read at a time, so a caller that needs only the tail stops without reading the rest."""
    for path in reversed(part_files(rows_dir)):
        table = pq.ParquetFile(path).read(columns=columns)
        yield from reversed(list(zip(*(table.column(c).to_pylist() for c in columns), strict=True)))


def scan(rows_dir: Path) -> ResumeState:
    """Read only the identity and decision columns of every part file."""
    state = ResumeState()
    for batch in iter_batches(rows_dir, RESUME_COLUMNS):
        cols = batch.to_pydict()
        for task_id, sample, attempt, decision, final in zip(
            cols["task_id"],
            cols["sample_index"],
            cols["attempt"],
            cols["decision"],
            cols["final"],
            strict=True,
        ):
            key = (task_id, sample)
            state.rows += 1
            if final:
                state.final.add(key)
            if decision == "retry":
                state.retries_used += 1
            if attempt > state.last_attempt.get(key, 0):
                state.last_attempt[key] = attempt
    return state


def read_table(run_dir: Path, columns: list[str] | None = None) -> pa.Table:
    batches = list(iter_batches(run_dir / "rows", columns))
    schema = pa.schema([ROW_SCHEMA.field(c) for c in columns]) if columns else ROW_SCHEMA
    return pa.Table.from_batches(batches, schema=schema)
