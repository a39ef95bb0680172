"""``rollout export``: a run's rows as a training set with a documented, versioned schema.

``--train`` (the default selection) keeps only rows that are final, unmasked and accepted: the rows a
trainer may learn from. ``--all`` keeps every attempt and adds the decision columns. The schema is
``TRAIN_SCHEMA`` below (version ``TRAIN_SCHEMA_VERSION``, stored in the Parquet metadata under
``rollout_executor_train_schema`` and as the ``schema_version`` column); docs/schema.md documents each
column, and ``executor/row.py`` says which it keeps.
Part files are read one batch at a time and the output is written whole, then renamed into place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from executor.row import columns
from executor.schema import ROW_SCHEMA, upgrade
from executor.storage import Location, Where, local_copy, locate
from executor.store import iter_batches
from executor.tasks import InputError, load_tasks

TRAIN_SCHEMA_VERSION = "2"  # 2: token ids and logprobs in model_calls (a column added since: no bump)
# A trainer's submissions (executor/api.py), each kept as a file in this folder of the run directory.
SUBMITTED_TASKS = "tasks"
Format = Literal["parquet", "jsonl"]

_TRAIN_COLUMNS = columns("train")
_ALL_COLUMNS = columns("all")
# The export's own columns, after the row's identity and placement: the task and the model asked.
_TASK_AT = _TRAIN_COLUMNS.index("status")


def _schema(with_decisions: bool) -> pa.Schema:
    fields = [
        pa.field("schema_version", pa.string()),
        *(ROW_SCHEMA.field(n) for n in _TRAIN_COLUMNS[:_TASK_AT]),
        pa.field("model", pa.string()),
        pa.field("prompt", pa.large_string()),
        pa.field("task_metadata", pa.large_string()),
        *(ROW_SCHEMA.field(n) for n in _TRAIN_COLUMNS[_TASK_AT:]),
    ]
    if with_decisions:
        fields += [ROW_SCHEMA.field(n) for n in _ALL_COLUMNS]
    return pa.schema(fields, metadata={"rollout_executor_train_schema": TRAIN_SCHEMA_VERSION})


TRAIN_SCHEMA = _schema(with_decisions=False)
ALL_SCHEMA = _schema(with_decisions=True)


def trainable(batch: pa.RecordBatch) -> pa.Array:
    """The rows a trainer may use: final, not masked, accepted."""
    return pc.and_(
        pc.and_(
            pc.fill_null(batch.column("final"), False), pc.invert(pc.fill_null(batch.column("masked"), True))
        ),
        pc.equal(pc.fill_null(batch.column("decision"), ""), "accept"),
    )


def task_index(run_dir: Where) -> dict[str, tuple[str, str]]:
    """task id -> (prompt, metadata JSON), from the run's task snapshots, else the config's task file."""
    index: dict[str, tuple[str, str]] = {}
    for found in task_files(run_dir):
        with local_copy(found) as path:
            index.update((t.id, (t.prompt, json.dumps(t.metadata, sort_keys=True))) for t in load_tasks(path))
    return index


def task_files(where: Where) -> list[Location]:
    """The run's task snapshots: the config's (beside it) and a trainer's submissions (``tasks/``, in
    the order made); without any, the config's task file where it still is."""
    run_dir = locate(where)
    found = [run_dir / name for name in ("tasks.jsonl", "tasks.parquet") if (run_dir / name).is_file()]
    submitted = run_dir / SUBMITTED_TASKS
    if submitted.is_dir():
        found += sorted(submitted.children(), key=lambda p: p.name)
    if found:
        return found
    configured = run_config(run_dir).get("tasks")
    return [locate(configured)] if configured and Path(configured).is_file() else []


def run_config(run_dir: Where) -> dict[str, Any]:
    try:
        data = yaml.safe_load((locate(run_dir) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def export_batches(run_dir: Where, include_all: bool = False) -> Iterator[pa.RecordBatch]:
    tasks = task_index(run_dir)
    model = (run_config(run_dir).get("model") or {}).get("name")
    for batch in iter_batches(locate(run_dir) / "rows", [*_TRAIN_COLUMNS, *_ALL_COLUMNS]):
        batch = upgrade(batch)  # a run resumed across a schema change has older part files too
        if not include_all:
            batch = batch.filter(trainable(batch))
        if batch.num_rows:
            yield as_export(batch, include_all, tasks, [model] * batch.num_rows)


def as_export(
    batch: pa.RecordBatch, include_all: bool, tasks: Mapping[str, tuple[str, str]], models: list[str | None]
) -> pa.RecordBatch:
    """Rows in the export's schema: ``tasks`` maps a task id to its (prompt, metadata JSON), ``models``
    names the model each row asked for."""
    schema = ALL_SCHEMA if include_all else TRAIN_SCHEMA
    known = [tasks.get(i) for i in batch.column("task_id").to_pylist()]
    extra = {
        "schema_version": pa.array([TRAIN_SCHEMA_VERSION] * batch.num_rows, pa.string()),
        "model": pa.array(models, pa.string()),
        "prompt": pa.array([k[0] if k else None for k in known], pa.large_string()),
        "task_metadata": pa.array([k[1] if k else None for k in known], pa.large_string()),
    }
    arrays = [extra[f.name] if f.name in extra else batch.column(f.name) for f in schema]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def export(where: Where, out: Path, fmt: Format = "parquet", include_all: bool = False) -> int:
    """Write the export to ``out`` (whole, then renamed into place); return the number of rows."""
    run_dir = locate(where)
    if not (run_dir / "rows").is_dir():
        raise InputError(f"{run_dir}: not a run directory (no rows/ inside)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    rows = 0
    schema = ALL_SCHEMA if include_all else TRAIN_SCHEMA
    try:
        if fmt == "parquet":
            with pq.ParquetWriter(str(tmp), schema, compression="zstd") as writer:
                for batch in export_batches(run_dir, include_all):
                    writer.write_batch(batch)
                    rows += batch.num_rows
        else:
            with tmp.open("w", encoding="utf-8") as fh:
                for batch in export_batches(run_dir, include_all):
                    for row in batch.to_pylist():
                        fh.write(json.dumps(row, default=_json_default, ensure_ascii=False) + "\n")
                    rows += batch.num_rows
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return rows


def _json_default(value: object) -> str:
    isoformat = getattr(value, "isoformat", None)
    return isoformat() if callable(isoformat) else str(value)
