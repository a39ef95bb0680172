"""The row's one definition: the schema, the readers' columns and docs/schema.md all come from it."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from executor.export import ALL_SCHEMA, TRAIN_SCHEMA
from executor.row import (
    COLUMNS,
    RECORDS,
    Message,
    ModelCall,
    Row,
    ToolCall,
    columns,
    columns_of,
)
from executor.schema import ROW_SCHEMA, rows_to_batch
from harnesses import base
from harnesses.gateway import AttemptRecord
from policy import FailureKind


@pytest.mark.parametrize("record", [Row, *RECORDS.values()], ids=lambda r: r.__name__)
def test_every_column_has_a_one_line_meaning(record):
    for column in columns_of(record):
        assert column.doc.strip() and "\n" not in column.doc and "|" not in column.doc, column.name


def test_the_arrow_schema_is_the_definition():
    assert tuple(ROW_SCHEMA.names) == COLUMNS
    calls = ROW_SCHEMA.field("model_calls").type.value_type
    assert [calls.field(i).name for i in range(calls.num_fields)] == list(
        c.name for c in columns_of(ModelCall)
    )


@pytest.mark.parametrize(
    ("record", "producer"),
    [(ModelCall, AttemptRecord), (ToolCall, base.ToolCall), (Message, base.Message)],
    ids=["ModelCall", "ToolCall", "Message"],
)
def test_each_nested_record_is_taken_from_fields_its_producer_has(record, producer):
    missing = {c.name for c in columns_of(record)} - set(producer.model_fields)
    assert not missing, f"{producer.__name__} lacks {sorted(missing)}"


def test_a_row_built_through_the_definition_reads_back_as_built():
    attempt = AttemptRecord(
        request_index=0,
        attempt=1,
        method="POST",
        path="/responses",
        started_at=1.5,
        status=429,
        kind=FailureKind.RATE_LIMIT_EXCEEDED,
        latency_s=0.2,
        retry_after_s=2.0,
        request_sha256="ab",
        prompt_token_ids=[1, 2],
    )
    row = Row(
        run_id="r",
        rollout_id="t.s0.a1",
        task_id="t",
        sample_index=0,
        attempt=1,
        started_at=datetime(2026, 12, 1, tzinfo=UTC),
        messages=[Message.of(base.Message(role="user", text="fix it"))],
        tool_calls=[ToolCall.of(base.ToolCall(name="shell", status="failed", exit_code=7))],
        model_calls=[ModelCall.of(attempt)],
    )
    back = rows_to_batch([row.to_dict()]).to_pylist()[0]
    assert back["model_calls"][0]["kind"] == "rate_limit_exceeded" and back["model_calls"][0]["status"] == 429
    assert back["model_calls"][0]["prompt_token_ids"] == [1, 2]
    assert back["tool_calls"] == [
        {
            "name": "shell",
            "call_id": None,
            "arguments": None,
            "status": "failed",
            "exit_code": 7,
            "output": None,
        }
    ]
    assert back["messages"] == [{"role": "user", "text": "fix it"}]
    assert back["evidence_gaps"] == [] and back["reward"] is None
    assert back["started_at"] == row.started_at


def test_the_readers_take_their_columns_from_the_definition():
    from executor import report, status

    assert status.COLUMNS == list(columns("status")) and report._COLUMNS == list(columns("report"))
    row_part = [n for n in TRAIN_SCHEMA.names if n in COLUMNS]
    assert row_part == list(columns("train"))
    assert ALL_SCHEMA.names == TRAIN_SCHEMA.names + list(columns("all"))
    assert "model_calls" in TRAIN_SCHEMA.names and "model_attempts" not in ROW_SCHEMA.names
