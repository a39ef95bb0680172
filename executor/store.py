"""The Arrow store: a run directory of whole Parquet part files, local or on an object store
(``executor.storage``). Each part is created whole under a name that must not exist yet (a link from a
private temporary on a local disk, a conditional PUT on S3): a part file is created, never replaced, and
a crash never leaves a torn file under a part name."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from executor.schema import ROW_SCHEMA, stored_names, upgrade
from executor.storage import Location, Where, describe_error, locate, parquet_bytes

_PART = re.compile(r"^part-(\d{6,})\.parquet$")
RESUME_COLUMNS = ["task_id", "sample_index", "attempt", "decision", "final"]
# A part name taken meanwhile (it should not be: one driver per run holds the lock) moves the writer on to
# the next number, this many times at most.
PART_NAME_TRIES = 64

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


def part_files(rows_dir: Where) -> list[Location]:
    return [p for p in locate(rows_dir).children() if _PART.match(p.name)]


class RunStore:
    """Buffers batches and writes them as part files. A crash loses at most the unflushed buffer,
    never a written row, and never leaves a torn file under a part name.

    Making one touches nothing on disk: the rows directory is made, and temporaries left by a crash
    removed, at the first flush. The driver flushes only while it holds the run's lock
    (``executor.runs.run_lock``), so a driver refused the lock has written and removed nothing."""

    def __init__(
        self,
        run_dir: Where,
        flush_rows: int = 512,
        flush_interval_s: float = 2.0,
        *,
        on_written: Callable[[pa.Table], None] | None = None,
    ) -> None:
        """``on_written``: called with each part's rows once the part is written (and only then: a row
        handed on is a row a crash cannot lose)."""
        self.run_dir = locate(run_dir)
        self._on_written = on_written
        self.rows_dir = self.run_dir / "rows"
        self._next: int | None = None  # the next part number, known once the directory is opened
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
        try:
            self._next = self._write_part(table, self._open()) + 1
        except OSError as exc:
            cause = exc.strerror or describe_error(exc)
            raise StoreError(f"{self.rows_dir}: could not write a part file ({cause})") from exc
        self.rows_written += table.num_rows
        self._buffer.clear()
        self._buffered_rows = 0
        if self._on_written is not None:
            self._on_written(table)

    def _open(self) -> int:
        """The next part number; the first time, make the directory and remove stale temporaries."""
        if self._next is None:
            self.rows_dir.mkdir()
            # Every temporary here is a dead writer's, never a live one's: only the holder of the run's
            # lock writes part files, and that is us (see the class's docstring). An object store has none.
            for stale in self.rows_dir.children():
                if stale.name.endswith(".tmp"):
                    stale.unlink()
            existing = part_files(self.rows_dir)
            self._next = int(_PART.match(existing[-1].name).group(1)) + 1 if existing else 0
        return self._next

    def _write_part(self, table: pa.Table, number: int) -> int:
        """Create ``table`` whole under the first free part name from ``number`` on; returns the number
        it took. A name that exists is never replaced."""
        data = parquet_bytes(table)
        for candidate in range(number, number + PART_NAME_TRIES):
            if (self.rows_dir / f"part-{candidate:06d}.parquet").create(data):
                return candidate
        raise FileExistsError(
            f"part-{number:06d} to part-{number + PART_NAME_TRIES - 1:06d} all exist: "
            "is another driver writing to this run?"
        )

    def resume_state(self) -> ResumeState:
        return scan(self.rows_dir)


def iter_batches(rows_dir: Where, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
    """``columns`` (all of the schema's when None) of every row, in that order. Part files of an older
    schema version read as this one (a resumed run spans both): a column added since reads as null, one
    renamed since under today's name."""
    names = list(columns) if columns is not None else list(ROW_SCHEMA.names)
    for path in part_files(rows_dir):
        part = path.parquet()
        stored = stored_names(names, part.schema_arrow.names)
        for batch in part.iter_batches(columns=stored, batch_size=65_536):
            yield _complete(upgrade(batch), names)


def _complete(batch: pa.RecordBatch, names: list[str]) -> pa.RecordBatch:
    """``batch`` with exactly ``names``: one missing from its file (older schema) becomes nulls."""
    if batch.schema.names == names:
        return batch
    arrays = [
        batch.column(n) if n in batch.schema.names else pa.nulls(batch.num_rows, ROW_SCHEMA.field(n).type)
        for n in names
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema([ROW_SCHEMA.field(n) for n in names]))


def iter_rows_newest_first(rows_dir: Where, columns: list[str]) -> Iterator[tuple[Any, ...]]:
    """``columns`` of every row, from the last written back to the first: part files newest first,
    one read at a time, so a caller that needs only the tail stops without reading the rest."""
    for path in reversed(part_files(rows_dir)):
        table = path.parquet().read(columns=columns)
        yield from reversed(list(zip(*(table.column(c).to_pylist() for c in columns), strict=True)))


def scan(rows_dir: Where) -> ResumeState:
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


def read_table(run_dir: Where, columns: list[str] | None = None) -> pa.Table:
    batches = list(iter_batches(locate(run_dir) / "rows", columns))
    schema = pa.schema([ROW_SCHEMA.field(c) for c in columns]) if columns else ROW_SCHEMA
    return pa.Table.from_batches(batches, schema=schema)
