"""`rollout export`: only trainable rows for --train, every row with --all; pandas and pyarrow read it."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from executor.export import ALL_SCHEMA, TRAIN_SCHEMA, TRAIN_SCHEMA_VERSION, export
from executor.schema import rows_to_batch
from executor.store import RunStore, read_table

REPO = Path(__file__).parents[1]


def _rollout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )


@pytest.mark.integration
def test_train_export_of_the_demo_run(demo_run, tmp_path):
    out = tmp_path / "train.parquet"
    proc = _rollout("export", str(demo_run), "--train", str(out))
    assert proc.returncode == 0, proc.stderr
    source = read_table(demo_run).to_pylist()
    trainable = {
        r["rollout_id"] for r in source if r["final"] and not r["masked"] and r["decision"] == "accept"
    }

    table = pq.read_table(out)
    assert table.schema.equals(TRAIN_SCHEMA, check_metadata=False)
    assert table.schema.metadata[b"rollout_executor_train_schema"] == TRAIN_SCHEMA_VERSION.encode()
    df = pd.read_parquet(out)
    assert set(df.rollout_id) == trainable and len(df) == len(trainable) == 5
    # Their rows were a retry and a mask: 429 forever, and a model that never answers.
    assert not {"rate-limit-forever", "model-hangs"} & set(df.task_id)
    assert (df.schema_version == TRAIN_SCHEMA_VERSION).all() and (df.model == "scripted-model").all()
    fix = df[df.task_id == "fix-add"].iloc[0]
    assert fix.prompt.startswith("The test in test_calc.py fails") and fix.reward == 1.0
    assert [m["role"] for m in fix.messages] == ["user", "assistant"]
    assert [t["exit_code"] for t in fix.tool_calls] == [1, 0, 0]
    assert len(fix.model_calls) >= 1 and all(c["status"] == 200 for c in fix.model_calls)
    assert fix.input_tokens == sum(c["input_tokens"] for c in fix.model_calls)


@pytest.mark.integration
def test_all_export_as_json_lines(demo_run, tmp_path):
    out = tmp_path / "all.jsonl"
    proc = _rollout("export", str(demo_run), "--train", str(out), "--format", "jsonl", "--all")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == read_table(demo_run).num_rows
    assert set(rows[0]) == set(ALL_SCHEMA.names)
    forever = sorted((r for r in rows if r["task_id"] == "rate-limit-forever"), key=lambda r: r["attempt"])
    assert [(r["decision"], r["final"], r["masked"], r["reward"]) for r in forever] == [
        ("retry", False, False, None),
        ("mask", True, True, None),
    ]
    assert pd.read_json(out, lines=True).shape[0] == len(rows)


@pytest.mark.integration
def test_export_of_a_run_still_going(partial_run, tmp_path):
    n = export(partial_run, tmp_path / "t.parquet")
    assert n == pq.read_table(tmp_path / "t.parquet").num_rows <= 3


def _row(i: int, **decision: object) -> dict[str, object]:
    return {
        "run_id": "r",
        "rollout_id": f"t{i}.s0.a1",
        "task_id": f"t{i}",
        "sample_index": 0,
        "attempt": 1,
        "status": "completed",
        "failure_kind": "none",
        "reward": 1.0,
        "started_at": datetime.now(UTC),
        **decision,
    }


def test_train_never_holds_a_masked_or_non_final_row(tmp_path):
    run = tmp_path / "r"
    store = RunStore(run)
    rows = [
        _row(0, decision="accept", final=True, masked=False),  # the only trainable one
        _row(1, decision="mask", final=True, masked=True),
        _row(2, decision="retry", final=False, masked=False),
        _row(3, decision="accept", final=False, masked=False),  # inconsistent: not final
        _row(4, decision="accept", final=True, masked=True),  # inconsistent: masked
        _row(5, decision=None, final=None, masked=None),  # undecided
    ]
    store.append(rows_to_batch(rows))
    store.flush()
    assert export(run, tmp_path / "t.parquet") == 1
    assert pq.read_table(tmp_path / "t.parquet").column("rollout_id").to_pylist() == ["t0.s0.a1"]
    assert export(run, tmp_path / "all.parquet", include_all=True) == len(rows)
    prompts = pq.read_table(tmp_path / "t.parquet").column("prompt").to_pylist()
    assert prompts == [None]  # no task file for this run: null, never a guess


def test_export_input_errors(tmp_path):
    proc = _rollout("export", str(tmp_path), "--train", str(tmp_path / "x.parquet"))
    assert proc.returncode == 2 and "not a run directory" in proc.stderr
    (tmp_path / "rows").mkdir()
    proc = _rollout("export", str(tmp_path), "--train", str(tmp_path / "x.csv"), "--format", "csv")
    assert proc.returncode == 2 and "--format" in proc.stderr
    assert not (tmp_path / "x.csv").exists()
