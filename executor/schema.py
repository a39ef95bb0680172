"""The explicit, versioned Arrow schema of a row: one row per attempt."""

from __future__ import annotations

import sys
from typing import Any

import pyarrow as pa

from executor.row import COLUMNS, SCHEMA_VERSION, Column, Row, columns_of

# Columns renamed since an earlier version: the name in an older part file -> today's (version 4).
RENAMED = {"model_attempts": "model_calls"}

_SCALARS = {
    str(t): t
    for t in (
        pa.string(),
        pa.large_string(),
        pa.int32(),
        pa.int64(),
        pa.float32(),
        pa.float64(),
        pa.bool_(),
        pa.timestamp("ms", tz="UTC"),
    )
}


def _arrow(column: Column) -> pa.DataType:
    """The Arrow type ``column`` declares: a scalar by pyarrow's name for it, a ``list<scalar>``, a
    ``map<scalar, scalar>``, or a list of a nested record (a struct of that record's columns)."""
    if column.record is not None:
        return pa.list_(pa.struct([(c.name, _arrow(c)) for c in columns_of(column.record)]))
    if column.arrow.startswith("list<"):
        return pa.list_(_SCALARS[column.arrow[len("list<") : -1]])
    if column.arrow.startswith("map<"):  # map<key, value>; reads back as a list of (key, value) pairs
        key, value = column.arrow[len("map<") : -1].split(", ")
        return pa.map_(_SCALARS[key], _SCALARS[value])
    return _SCALARS[column.arrow]


ROW_SCHEMA = pa.schema(
    [(c.name, _arrow(c)) for c in columns_of(Row)], metadata={"rollout_executor_schema": SCHEMA_VERSION}
)

_ROW_STRUCT = pa.struct(list(ROW_SCHEMA))


def rows_to_batch(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    """Build a batch; every column is named in the schema, a missing key becomes null."""
    unknown = set().union(*(row.keys() for row in rows)) - set(COLUMNS) if rows else set()
    if unknown:
        raise ValueError(f"row has columns outside the schema: {sorted(unknown)}")
    # The rows converted as structs in one pass: from_pylist's column-by-column conversion costs twice
    # as much for the one row a session's worker sends (~0.25 against ~0.12 ms, 57 columns).
    batch = pa.RecordBatch.from_struct_array(pa.array(rows, type=_ROW_STRUCT))
    return batch.replace_schema_metadata(ROW_SCHEMA.metadata)


_ROW_INDEX = {name: i for i, name in enumerate(ROW_SCHEMA.names)}


def model_call_fields(batch: pa.RecordBatch, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The named fields of every model call in ``batch``, as Python: only those, so a row's token id
    lists (capture_tokens: up to a million per call) never become Python objects in the driver."""
    calls = batch.column("model_calls").flatten()
    return pa.StructArray.from_arrays([calls.field(n) for n in names], names=list(names)).to_pylist()


class _NoPandas:
    """An import finder that refuses pandas: pyarrow imports it, when it is installed, at its first
    conversion of Python values (0.2-0.4 s of CPU, before a process's first row), and nothing a driver or
    a worker does needs it. (A None in sys.modules would not do: pyarrow's compiled import takes the None
    for the module.)"""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] == "pandas":
            raise ModuleNotFoundError(f"{name}: not imported by rollout's driver or workers", name=name)
        return None


def refuse_pandas() -> None:
    """Keep pandas out of this process, where it is ours alone: the ``rollout`` command's, a worker
    actor's (Ray gives an actor a process of its own). Not a library user's, whose code may want it."""
    if "pandas" not in sys.modules and not any(isinstance(f, _NoPandas) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoPandas())


def warm_up() -> None:
    """Pay pyarrow's one-time costs at start-up: its first conversion of Python objects imports pandas
    when that is installed (~0.3-0.5 s of CPU), which would otherwise stall the first session's row and
    every session sharing that process's event loop."""
    rows_to_batch([{}]).to_pylist()


def batch_to_wire(batch: pa.RecordBatch) -> bytes:
    """A worker's rows as they travel to the driver: an Arrow IPC stream. Ray pickles a RecordBatch
    (schema and all) in ~1.5 ms a row; these bytes take ~0.04 ms, and ~0.06 ms to read back."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def batch_from_wire(data: bytes) -> pa.RecordBatch:
    """The batch ``batch_to_wire`` sent; a stream of another schema raises ValueError."""
    batch = pa.ipc.open_stream(data).read_next_batch()
    if not batch.schema.equals(ROW_SCHEMA, check_metadata=False):
        sent = (batch.schema.metadata or {}).get(b"rollout_executor_schema", b"?").decode(errors="replace")
        raise ValueError(
            f"a worker sent rows of schema version {sent[:20]}, this driver writes version {SCHEMA_VERSION}: "
            "are the driver and the workers running the same code?"
        )
    return batch


def stored_names(names: list[str], present: list[str]) -> list[str]:
    """The columns to read from a part file holding ``present`` for today's ``names``: a column renamed
    since is asked for by the name that file has (``upgrade`` renames it back)."""
    old = {new: old for old, new in RENAMED.items() if old in present}
    return [old.get(name, name) for name in names]


def upgrade(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch read from an older part file as this version: a renamed column under today's name, every
    column cast to this schema's type (a struct field added since, version 2's token ids, reads as null)."""
    if any(name in RENAMED for name in batch.schema.names):
        batch = batch.rename_columns([RENAMED.get(name, name) for name in batch.schema.names])
    wanted = pa.schema([ROW_SCHEMA.field(name) for name in batch.schema.names])
    return batch if batch.schema.equals(wanted, check_metadata=False) else batch.cast(wanted)


def with_decisions(batch: pa.RecordBatch, decisions: dict[str, list[Any]]) -> pa.RecordBatch:
    """A copy of ``batch`` (of ``ROW_SCHEMA``) with the decision columns replaced: those alone, where a
    batch rebuilt from every column took twice as long (~80 us a row, 57 columns, the driver's)."""
    if not batch.schema.equals(ROW_SCHEMA, check_metadata=False):
        raise ValueError("rows of another schema than this version's cannot be decided")
    for name, values in decisions.items():
        i = _ROW_INDEX[name]
        field = ROW_SCHEMA.field(i)
        batch = batch.set_column(i, field, pa.array(values, type=field.type))
    same = batch.schema.metadata == ROW_SCHEMA.metadata
    return batch if same else batch.replace_schema_metadata(ROW_SCHEMA.metadata)
