"""The explicit, versioned Arrow schema of a row: one row per attempt."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

# 2: token ids and logprobs in model_attempts; 3: verifier_runs, t_model_wait_s. An older part file reads
# as this version: a struct field or a column added since reads as null (store.iter_batches).
SCHEMA_VERSION = "3"

_TOOL_CALL = pa.struct(
    [
        ("name", pa.string()),
        ("call_id", pa.string()),
        ("arguments", pa.large_string()),
        ("status", pa.string()),
        ("exit_code", pa.int32()),
        ("output", pa.large_string()),
    ]
)
_MESSAGE = pa.struct([("role", pa.string()), ("text", pa.large_string())])
_MODEL_ATTEMPT = pa.struct(
    [
        ("request_index", pa.int32()),
        ("attempt", pa.int32()),
        ("path", pa.string()),
        ("started_at", pa.float64()),
        ("status", pa.int32()),
        ("kind", pa.string()),
        ("error_message", pa.large_string()),
        ("latency_s", pa.float64()),
        ("ttfb_s", pa.float64()),
        ("retry_after_s", pa.float64()),
        ("streamed", pa.bool_()),
        ("response_bytes", pa.int64()),
        ("request_sha256", pa.string()),
        ("input_tokens", pa.int64()),
        ("output_tokens", pa.int64()),
        ("finish_reason", pa.string()),
        # gateway.capture_tokens: what the endpoint returned, null when off or when it returned none
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("completion_logprobs", pa.list_(pa.float32())),
        ("tokens_truncated", pa.bool_()),
    ]
)

IDENTITY = ("run_id", "rollout_id", "task_id", "sample_index", "attempt")
DECISION = ("decision", "decision_reason", "masked", "final", "retry_delay_s")

_FIELDS: list[tuple[str, pa.DataType]] = [
    # identity
    ("run_id", pa.string()),
    ("rollout_id", pa.string()),
    ("task_id", pa.string()),
    ("sample_index", pa.int32()),
    ("attempt", pa.int32()),
    # placement
    ("harness", pa.string()),
    ("harness_version", pa.string()),
    ("version_tested", pa.bool_()),
    ("sandbox_provider", pa.string()),
    ("sandbox_id", pa.string()),
    ("node_id", pa.string()),
    ("worker_id", pa.string()),
    # result
    ("status", pa.string()),
    ("failure_kind", pa.string()),
    ("http_status", pa.int32()),
    ("error_message", pa.large_string()),
    ("error_detail", pa.large_string()),  # JSON
    ("retry_after_s", pa.float64()),
    ("exit_code", pa.int32()),
    ("timed_out", pa.bool_()),
    # evidence
    ("final_text", pa.large_string()),
    ("messages", pa.list_(_MESSAGE)),
    ("tool_calls", pa.list_(_TOOL_CALL)),
    ("input_tokens", pa.int64()),
    ("output_tokens", pa.int64()),
    ("cached_input_tokens", pa.int64()),
    ("reasoning_tokens", pa.int64()),
    ("model_attempts", pa.list_(_MODEL_ATTEMPT)),
    ("workspace_diff", pa.large_string()),
    ("evidence_dir", pa.string()),
    ("evidence_gaps", pa.list_(pa.string())),
    ("stdout_tail", pa.large_string()),
    ("stderr_tail", pa.large_string()),
    # grading
    ("reward", pa.float64()),
    ("verified", pa.bool_()),
    ("verifier_exit_code", pa.int32()),
    ("verifier_runs", pa.int32()),  # how many times the verifier ran (re-runs after an error)
    # cleanup
    ("cleanup_ok", pa.bool_()),
    # decision (filled by the driver)
    ("decision", pa.string()),
    ("decision_reason", pa.string()),
    ("masked", pa.bool_()),
    ("final", pa.bool_()),
    ("retry_delay_s", pa.float64()),
    # timings
    ("started_at", pa.timestamp("ms", tz="UTC")),
    ("t_setup_s", pa.float64()),
    ("t_agent_s", pa.float64()),
    ("t_model_wait_s", pa.float64()),  # of the agent phase: a model request outstanding (the gateway's)
    ("t_verify_s", pa.float64()),
    ("t_cleanup_s", pa.float64()),
    ("t_total_s", pa.float64()),
]

ROW_SCHEMA = pa.schema(_FIELDS, metadata={"rollout_executor_schema": SCHEMA_VERSION})
COLUMNS = tuple(name for name, _ in _FIELDS)


def rows_to_batch(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    """Build a batch; every column is named in the schema, a missing key becomes null."""
    unknown = set().union(*(row.keys() for row in rows)) - set(COLUMNS) if rows else set()
    if unknown:
        raise ValueError(f"row has columns outside the schema: {sorted(unknown)}")
    return pa.RecordBatch.from_pylist(rows, schema=ROW_SCHEMA)


def attempt_fields(batch: pa.RecordBatch, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The named fields of every model attempt in ``batch``, as Python: only those, so a row's token id
    lists (capture_tokens: up to a million per call) never become Python objects in the driver."""
    attempts = batch.column("model_attempts").flatten()
    return pa.StructArray.from_arrays([attempts.field(n) for n in names], names=list(names)).to_pylist()


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


def upgrade(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch read from an older part file, its columns cast to this schema's types: a struct field
    added since (version 2's token ids) reads as null."""
    wanted = pa.schema([ROW_SCHEMA.field(name) for name in batch.schema.names])
    return batch if batch.schema.equals(wanted, check_metadata=False) else batch.cast(wanted)


def with_decisions(batch: pa.RecordBatch, decisions: dict[str, list[Any]]) -> pa.RecordBatch:
    """A copy of ``batch`` with the decision columns replaced."""
    arrays = [
        pa.array(decisions[name], type=ROW_SCHEMA.field(name).type) if name in decisions else column
        for name, column in zip(batch.schema.names, batch.columns, strict=True)
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=ROW_SCHEMA)
