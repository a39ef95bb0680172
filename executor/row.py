"""The one definition of a row: one row per attempt, with the model calls, tool calls and messages it holds.

Every column is declared here once, with its Arrow type and its meaning. ``executor/schema.py`` builds
the pyarrow schema from it, ``export``, ``status`` and ``report`` take their columns from its views, and
``docs/schema.md`` is rendered from it (``python -m executor.docs`` writes it; a test keeps it current).
No pyarrow here: the CLI and the harness side import this without paying for it.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from functools import cache
from typing import Any, Literal

# 2: token ids and logprobs in the model calls; 3: verifier_runs, t_model_wait_s; 4: model_attempts
# renamed model_calls (the export's name) and the columns ordered as the export lists them; 5:
# sandbox_isolation; 6: review_sandbox_id, rewards, verifier_stdout_tail, verifier_stderr_tail; 7:
# policy_version and staleness, and each model call's policy_version and replica. An older part file
# reads as this version (schema.upgrade).
SCHEMA_VERSION = "7"

# Who reads a column besides the dataset itself: the training export (``train``: always, ``all``: only
# with --all), ``rollout status`` and ``rollout report``.
View = Literal["train", "all", "status", "report"]


def col(arrow: str, doc: str, *views: View, required: bool = False, empty_list: bool = False) -> Any:
    """A column: its Arrow type (pyarrow's own spelling, or ``list<Record>`` for nested records), its
    one-line meaning, and the views that read it. Null unless set, or an empty list with ``empty_list``."""
    meta = {"arrow": arrow, "doc": doc, "views": frozenset(views)}
    if required:
        return field(metadata=meta)
    if empty_list:
        return field(default_factory=list, metadata=meta)
    return field(default=None, metadata=meta)


@dataclass(frozen=True)
class Column:
    name: str
    arrow: str
    doc: str
    views: frozenset[str]
    record: type | None  # the nested record of a ``list<Record>`` column


@cache
def columns_of(record: type) -> tuple[Column, ...]:
    """The declared columns of a row or of a nested record, in order."""
    return tuple(
        Column(f.name, arrow, f.metadata["doc"], f.metadata["views"], RECORDS.get(arrow[len("list<") : -1]))
        for f in dataclasses.fields(record)
        for arrow in [f.metadata["arrow"]]
    )


@cache
def names_of(record: type) -> tuple[str, ...]:
    return tuple(c.name for c in columns_of(record))


@cache
def _values(record: type) -> Callable[[object], tuple[Any, ...]]:
    """Reads the declared fields of ``record`` off an object, in order, in one C call: a row is built
    and read once per attempt, and getattr one field at a time was most of its cost."""
    return operator.attrgetter(*names_of(record))


class _Record:
    """A nested record, built from the object that produced it (the gateway's attempt record, the
    harness's tool call or message) by taking the fields declared here, by name: the producer may hold
    more, and a field it lacks fails here rather than becoming a silent null."""

    __slots__ = ()

    @classmethod
    def of(cls, source: object) -> Any:
        return cls(*[v.value if isinstance(v, Enum) else v for v in _values(cls)(source)])


@dataclass(slots=True)
class ModelCall(_Record):
    """One upstream attempt of a model request, as the gateway recorded it."""

    request_index: int | None = col("int32", "the request, 0-based, per session in arrival order")
    attempt: int | None = col("int32", "the attempt within the request, 1-based (the gateway retries)")
    path: str | None = col("string", 'the API path after /v1, e.g. "/responses"')
    started_at: float | None = col("double", "when the attempt started, epoch seconds")
    status: int | None = col("int32", "the endpoint's HTTP status; null when no HTTP answer came at all")
    kind: str | None = col("string", "the attempt's failure kind; none for a complete 2xx answer")
    error_message: str | None = col("large_string", "the endpoint's own error message, bounded")
    latency_s: float | None = col("double", "seconds from sending the request to the end of its answer")
    ttfb_s: float | None = col("double", "seconds to the answer's first content (keep-alives are not)")
    retry_after_s: float | None = col("double", "the usable Retry-After hint; null when absent or unusable")
    streamed: bool | None = col("bool", "the answer was an event stream")
    response_bytes: int | None = col("int64", "bytes of the answer's body")
    request_sha256: str | None = col(
        "string", "SHA-256 of the request body (the bodies are under evidence_dir/model/)"
    )
    input_tokens: int | None = col("int64", "input tokens the answer reported; null when it reported none")
    output_tokens: int | None = col("int64", "output tokens the answer reported; null when it reported none")
    finish_reason: str | None = col("string", 'the API\'s own word: "stop", "length", "completed", ...')
    prompt_token_ids: list[int] | None = col(
        "list<int32>", "with gateway.capture_tokens, the prompt's token ids the endpoint returned, else null"
    )
    completion_token_ids: list[int] | None = col(
        "list<int32>", "with gateway.capture_tokens, the completion's token ids the endpoint returned"
    )
    completion_logprobs: list[float] | None = col(
        "list<float>", "their logprobs, one to one when of equal length (Responses: output text only)"
    )
    tokens_truncated: bool | None = col("bool", "a token list passed 1M entries and was cut there")
    policy_version: int | None = col(
        "int64", "the policy version that answered: the latest announced for the endpoint the call went to"
    )
    replica: str | None = col("string", "the base URL of the replica that answered")


@dataclass(slots=True)
class ToolCall(_Record):
    """One tool call of the agent, as the harness's transcript shows it."""

    name: str | None = col("string", "the tool's name")
    call_id: str | None = col("string", "the harness's id for the call")
    arguments: str | None = col("large_string", "the call's arguments, as bounded JSON text")
    status: str | None = col("string", "completed, failed or unknown")
    exit_code: int | None = col("int32", "the command's exit code, for a shell call")
    output: str | None = col("large_string", "what the tool returned, bounded")


@dataclass(slots=True)
class Message(_Record):
    """One turn of the normalized transcript."""

    role: str | None = col("string", "user, assistant, tool or system")
    text: str | None = col("large_string", "the turn's text, bounded")


RECORDS: dict[str, type[_Record]] = {"ModelCall": ModelCall, "ToolCall": ToolCall, "Message": Message}


@dataclass(slots=True)
class Row:
    """One attempt of one sample of one task, from its sandbox's start to its decision."""

    # identity
    run_id: str = col("string", "the run", "train", required=True)
    rollout_id: str = col("string", "the attempt: TASK.sN.aN", "train", "status", "report", required=True)
    task_id: str = col("string", "the task", "train", "status", "report", required=True)
    sample_index: int = col("int32", "which sample of the task", "train", "status", "report", required=True)
    attempt: int = col(
        "int32", "which attempt of the sample, from 1", "train", "status", "report", required=True
    )
    # placement
    harness: str | None = col("string", "the harness CLI", "train", "status", "report")
    harness_version: str | None = col("string", "the harness's version", "train")
    version_tested: bool | None = col("bool", "that version is the one the adapter was tested with")
    sandbox_provider: str | None = col(
        "string", "the sandbox provider (local, slurm, ecs)", "status", "report"
    )
    sandbox_id: str | None = col("string", "the sandbox's id")
    review_sandbox_id: str | None = col(
        "string", "the fresh sandbox the diff and the verifier ran in, never the agent's (grading.py)"
    )
    sandbox_isolation: str | None = col(
        "string",
        "the isolation layers the sandbox's commands ran under: network, pids, filesystem, user, nested (a"
        " container's root commands out of its agent's reach, sandboxes/nest.py); none",
    )
    node_id: str | None = col("string", "the Ray node the attempt ran on")
    worker_id: str | None = col("string", "the worker actor the attempt ran in")
    policy_version: int | None = col(
        "int64", "the trainer's policy version the session started under (docs/training.md)", "train"
    )
    # result
    status: str | None = col("string", "completed, incomplete or failed", "train", "status", "report")
    failure_kind: str | None = col(
        "string", "why it did not complete cleanly; none when it did", "train", "status", "report"
    )
    http_status: int | None = col("int32", "the HTTP status behind the failure, if any", "all", "status")
    error_message: str | None = col(
        "large_string", "what went wrong, at most 16,000 characters", "all", "status"
    )
    error_detail: str | None = col("large_string", "structured detail of the failure, as JSON")
    retry_after_s: float | None = col("double", "the endpoint's Retry-After behind the failure, if any")
    exit_code: int | None = col("int32", "the harness's exit code")
    timed_out: bool | None = col("bool", "the harness ran past its deadline")
    # evidence
    final_text: str | None = col("large_string", "the harness's last answer", "train")
    messages: list[Message] | None = col("list<Message>", "the normalized transcript", "train")
    tool_calls: list[ToolCall] | None = col("list<ToolCall>", "every tool call, in order", "train")
    model_calls: list[ModelCall] | None = col(
        "list<ModelCall>",
        "every upstream model attempt as the gateway recorded it; bodies in evidence_dir/model/",
        "train",
        "report",
    )
    input_tokens: int | None = col(
        "int64", "summed over the answered model calls; null when unknown, never 0", "train", "report"
    )
    output_tokens: int | None = col(
        "int64", "summed over the answered model calls; null when unknown, never 0", "train", "report"
    )
    cached_input_tokens: int | None = col("int64", "as the harness reported them; null when unknown")
    reasoning_tokens: int | None = col("int64", "as the harness reported them; null when unknown")
    workspace_diff: str | None = col("large_string", "the agent's changes to the workspace, as a git diff")
    evidence_gaps: list[str] = col(
        "list<string>",
        "what could not be observed or kept, e.g. usage_unavailable, worker_lost, evidence_upload_failed",
        empty_list=True,
    )
    stdout_tail: str | None = col("large_string", "the end of the harness's stdout")
    stderr_tail: str | None = col("large_string", "the end of the harness's stderr")
    # grading
    reward: float | None = col(
        "double",
        "the verifier's reward: in [0, 1] for a command's, a Harbor task's main metric as its tests gave it; "
        "null when ungraded or masked",
        "train",
        "status",
        "report",
    )
    rewards: dict[str, float] | None = col(
        "map<string, double>",
        "every metric the verifier reported (a Harbor reward.json's, or reward.txt's as 'reward')",
        "train",
    )
    verified: bool | None = col("bool", "a verifier graded the attempt", "train")
    verifier_exit_code: int | None = col("int32", "the verifier's exit code, of its last run")
    verifier_runs: int | None = col("int32", "how many times the verifier ran (re-runs after an error)")
    verifier_stdout_tail: str | None = col("large_string", "the end of the verifier's stdout (last run)")
    verifier_stderr_tail: str | None = col("large_string", "the end of the verifier's stderr (last run)")
    # cleanup
    cleanup_ok: bool | None = col("bool", "the sandbox was confirmed stopped")
    # decision (the driver's)
    decision: str | None = col("string", "accept, mask or retry", "all", "status", "report")
    decision_reason: str | None = col("string", "why, in the policy's words", "all")
    masked: bool | None = col("bool", "kept as evidence only, never a training signal", "all", "status")
    final: bool | None = col(
        "bool", "the last attempt of its sample (accepted or masked)", "all", "status", "report"
    )
    retry_delay_s: float | None = col("double", "for a retry, the delay before the next attempt")
    staleness: int | None = col(
        "int32", "policy versions announced between the session's start and the decision on it", "train"
    )
    # where and when
    evidence_dir: str | None = col(
        "string", "the directory of this launch's evidence (a URI for a run on an object store)", "train"
    )
    started_at: datetime | None = col("timestamp[ms, tz=UTC]", "when the attempt started", "train")
    # timings
    t_setup_s: float | None = col(
        "double", "seconds to start the sandbox and lay out the workspace", "report"
    )
    t_agent_s: float | None = col("double", "seconds the harness ran", "report")
    t_model_wait_s: float | None = col(
        "double", "of the agent's seconds, those a model request was outstanding"
    )
    t_verify_s: float | None = col("double", "seconds of the diff and the verifier", "report")
    t_cleanup_s: float | None = col("double", "seconds to stop the sandbox", "report")
    t_total_s: float | None = col(
        "double", "seconds of setup, agent, verify and cleanup together", "status", "report"
    )

    def to_dict(self) -> dict[str, Any]:
        """The row as the column -> value mapping an Arrow batch is built from. Shallow: a list of a
        nested record's (a million token ids) goes in as it is, never copied."""
        out = dict(zip(COLUMNS, _values(Row)(self), strict=True))
        for name in _NESTED:
            items = out[name]
            if items:
                fields, values = names_of(type(items[0])), _values(type(items[0]))
                out[name] = [dict(zip(fields, values(item), strict=True)) for item in items]
        return out


COLUMNS = names_of(Row)
_NESTED = tuple(c.name for c in columns_of(Row) if c.record is not None)


def columns(view: View) -> tuple[str, ...]:
    """The columns ``view`` reads, in the row's order."""
    return tuple(c.name for c in columns_of(Row) if view in c.views)


def _table(columns: tuple[Column, ...], with_export: bool) -> list[str]:
    head = ["column", "Arrow type", "meaning"] + (["in the export"] if with_export else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in columns:
        cells = [f"`{c.name}`", c.arrow, c.doc] + ([_export_of(c)] if with_export else [])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _export_of(column: Column) -> str:
    return "yes" if "train" in column.views else "with --all" if "all" in column.views else ""


def schema_markdown() -> str:
    """docs/schema.md: every column of a row and of its nested records, from the definition above."""
    lines = [
        "# Output schema",
        "",
        "<!-- Generated from executor/row.py by `python -m executor.docs`; a test fails when it differs. -->",
        "",
        f"A run writes one row per attempt to `rows/part-*.parquet` (schema version {SCHEMA_VERSION}, in the",
        "Parquet metadata under `rollout_executor_schema`; older part files read as this version). *In the",
        "export*: the columns `rollout export` keeps, with its own `model`, `prompt` and `task_metadata`.",
        "",
        "## Row",
        "",
        *_table(columns_of(Row), with_export=True),
    ]
    for column in columns_of(Row):
        if column.record is not None:
            lines += [
                "",
                f"## {column.record.__name__}: `{column.name}[]`",
                "",
                column.record.__doc__ or "",
                "",
            ]
            lines += _table(columns_of(column.record), with_export=False)
    return "\n".join(lines) + "\n"
