"""Tasks loaded from JSONL, Parquet or a directory of Harbor tasks, one at a time, with errors that name the
line (what one task is: executor/task.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from executor.input_text import unique_json_object
from executor.task import InputError, Task, Verifier

# What one task is lives in executor/task.py (executor/harbor.py's loader builds them too); these names
# are said here as well, where the loaders and their callers have always found them.
__all__ = ["InputError", "Task", "Verifier", "load_tasks", "location_of", "task_at"]


def location_of(loc: tuple[Any, ...]) -> str:
    """A validation error's key path as one bounded line: keys come from the input, so escape them."""
    parts = []
    for part in loc[:8]:
        text = str(part)
        if not text.isprintable():
            text = repr(text)[1:-1]  # a control character in a key must not break the error's line
        parts.append(text if len(text) <= 60 else text[:57] + "...")
    return ".".join(parts) or "(root)"


def _describe(err: ValidationError) -> str:
    first = err.errors()[0]
    return f"{location_of(first['loc'])}: {first['msg']}"


def load_tasks(path: Path) -> Iterator[Task]:
    """Yield tasks one at a time, so a 100k-task file is never held whole as models. A directory holds
    Harbor-format tasks (executor/harbor.py)."""
    if not path.exists():
        raise InputError(f"{path}: task file not found")
    if path.is_dir():
        from executor.harbor import load_harbor_tasks

        yield from load_harbor_tasks(path)
        return
    if path.suffix == ".parquet":
        yield from _load_parquet(path)
        return
    seen: set[str] = set()
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                data = json.loads(raw, object_pairs_hook=unique_json_object)
            except (ValueError, RecursionError) as exc:
                raise InputError(f"{path}:{lineno}: not valid JSON ({str(exc)[:120]})") from None
            yield task_at(data, f"{path}:{lineno}", seen)


def _load_parquet(path: Path) -> Iterator[Task]:
    import pyarrow.parquet as pq

    seen: set[str] = set()
    try:
        reader = pq.ParquetFile(path)
    except Exception as exc:
        raise InputError(f"{path}: not a readable Parquet file ({str(exc)[:120]})") from None
    row = 0
    for batch in reader.iter_batches(batch_size=1024):
        for data in batch.to_pylist():
            row += 1
            for key in ("workspace", "verify", "model_script", "metadata"):
                if isinstance(data.get(key), str):
                    try:
                        data[key] = json.loads(data[key], object_pairs_hook=unique_json_object)
                    except (ValueError, RecursionError) as exc:
                        raise InputError(
                            f"{path}: row {row}: {key}: not valid JSON ({str(exc)[:120]})"
                        ) from None
            data = {k: v for k, v in data.items() if v is not None}
            yield task_at(data, f"{path}: row {row}", seen)


def task_at(data: Any, where: str, seen: set[str]) -> Task:
    if not isinstance(data, dict):
        raise InputError(f"{where}: a task must be a JSON object")
    try:
        task = Task.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"{where}: {_describe(exc)}") from None
    if task.id in seen:
        raise InputError(f"{where}: duplicate task id {task.id!r}")
    seen.add(task.id)
    return task
