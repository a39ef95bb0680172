"""The outcome vocabulary: what happened to one attempt, as data rather than scattered strings."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_ERROR_MESSAGE_CHARS = 16_000


class Status(StrEnum):
    """How far the harness got."""

    COMPLETED = "completed"  # the harness finished its turn
    INCOMPLETE = "incomplete"  # stopped by a limit; partial work is kept and gradable
    FAILED = "failed"  # no usable result


class Decision(StrEnum):
    """What the driver does with a row."""

    ACCEPT = "accept"  # final and trainable
    MASK = "mask"  # final, kept as evidence, excluded from training
    RETRY = "retry"  # not final: a new attempt follows


class FailureKind(StrEnum):
    """Why an attempt did not complete cleanly; one per row. See ``KIND_INFO`` for each kind's sentence."""

    NONE = "none"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    PROVIDER_UNAVAILABLE = "provider_unavailable"
    TRANSPORT_ERROR = "transport_error"
    PROVIDER_AUTH_ERROR = "provider_auth_error"
    MODEL_REQUEST_ERROR = "model_request_error"
    ENDPOINT_CONFIG_ERROR = "endpoint_config_error"
    MODEL_TIMEOUT = "model_timeout"
    MODEL_CONTEXT_LIMIT = "model_context_limit"
    MODEL_OUTPUT_LIMIT = "model_output_limit"
    AGENT_TIMEOUT = "agent_timeout"
    AGENT_CRASH = "agent_crash"
    AGENT_SELF_INFLICTED = "agent_self_inflicted"
    AGENT_NO_RESULT = "agent_no_result"
    AGENT_NO_MODEL_CALL = "agent_no_model_call"
    AGENT_REQUEST_LIMIT = "agent_request_limit"
    SETUP_FAILED = "setup_failed"
    TASK_INVALID = "task_invalid"
    SANDBOX_START_FAILED = "sandbox_start_failed"
    SANDBOX_LOST = "sandbox_lost"
    VERIFIER_ERROR = "verifier_error"
    VERIFIER_TIMEOUT = "verifier_timeout"
    CLEANUP_FAILED = "cleanup_failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class KindInfo:
    status: Status | None  # None: the kind keeps the status the session already had
    infrastructure: bool  # not the model's or the agent's doing: never a reward of 0
    meaning: str


KIND_INFO: dict[FailureKind, KindInfo] = {
    FailureKind.NONE: KindInfo(Status.COMPLETED, False, "a clean completion"),
    FailureKind.RATE_LIMIT_EXCEEDED: KindInfo(
        Status.FAILED, True, "the endpoint kept answering 429 past the gateway's budget"
    ),
    FailureKind.PROVIDER_UNAVAILABLE: KindInfo(
        Status.FAILED, True, "5xx / 408 / gateway timeout past the gateway's budget"
    ),
    FailureKind.TRANSPORT_ERROR: KindInfo(
        Status.FAILED, True, "refused, reset, stream cut, header or idle timeout: no HTTP status"
    ),
    FailureKind.PROVIDER_AUTH_ERROR: KindInfo(
        Status.FAILED, True, "401 / 403: a configuration error, not the model's"
    ),
    FailureKind.MODEL_REQUEST_ERROR: KindInfo(
        Status.FAILED, False, "400 / 413 / 422 that is not a context overflow"
    ),
    FailureKind.ENDPOINT_CONFIG_ERROR: KindInfo(
        Status.FAILED, True, "402 / 404 / 405 or another 4xx: the endpoint, model, route or account is wrong"
    ),
    FailureKind.MODEL_TIMEOUT: KindInfo(
        Status.FAILED,
        True,
        "the endpoint accepted a request and stalled past the gateway's bounds, or the deadline fell "
        "while it stalled",
    ),
    FailureKind.MODEL_CONTEXT_LIMIT: KindInfo(Status.INCOMPLETE, False, "the context window was exceeded"),
    FailureKind.MODEL_OUTPUT_LIMIT: KindInfo(
        Status.INCOMPLETE, False, "the model stopped on max output tokens"
    ),
    FailureKind.AGENT_TIMEOUT: KindInfo(
        Status.INCOMPLETE, False, "the deadline killed the harness while the model answered promptly"
    ),
    FailureKind.AGENT_CRASH: KindInfo(
        Status.FAILED, True, "the harness died with no model error to explain it"
    ),
    FailureKind.AGENT_SELF_INFLICTED: KindInfo(
        Status.FAILED,
        False,
        "after the model had acted in the sandbox, the harness was killed by a signal none of ours sent, "
        "hit a bound of its sandbox, died, or reported a failure the gateway never saw: the agent's doing",
    ),
    FailureKind.AGENT_NO_RESULT: KindInfo(
        Status.FAILED, False, "the harness exited cleanly after model calls but produced no final answer"
    ),
    FailureKind.AGENT_NO_MODEL_CALL: KindInfo(
        Status.FAILED, True, "the harness exited without a single model request: a launch problem"
    ),
    FailureKind.AGENT_REQUEST_LIMIT: KindInfo(
        Status.INCOMPLETE,
        False,
        "the session passed the gateway's bound on its model calls (count or request body size)",
    ),
    FailureKind.SETUP_FAILED: KindInfo(Status.FAILED, True, "workspace setup or harness install failed"),
    FailureKind.TASK_INVALID: KindInfo(
        Status.FAILED,
        True,
        "the task itself cannot run or be graded, the same for every attempt: a file missing or a field "
        "refused, its image's build failed, its tests wrote no reward",
    ),
    FailureKind.SANDBOX_START_FAILED: KindInfo(Status.FAILED, True, "the sandbox never became ready"),
    FailureKind.SANDBOX_LOST: KindInfo(
        Status.FAILED, True, "the sandbox, its worker or its node died mid-session"
    ),
    FailureKind.VERIFIER_ERROR: KindInfo(
        None, True, "the verifier could not grade: killed by a signal, exit 126/127 or its reserved code"
    ),
    FailureKind.VERIFIER_TIMEOUT: KindInfo(None, True, "the verifier ran past its timeout"),
    FailureKind.CLEANUP_FAILED: KindInfo(None, False, "the sandbox could not be confirmed stopped"),
    FailureKind.CANCELLED: KindInfo(Status.FAILED, True, "the run was stopped; resubmitted on resume"),
}


def status_for(kind: FailureKind, session_status: Status = Status.FAILED) -> Status:
    """The row status a kind implies; kinds without their own status keep the session's."""
    return KIND_INFO[kind].status or session_status


def bound_text(text: str | None, limit: int = MAX_ERROR_MESSAGE_CHARS) -> str | None:
    """Cut a text to ``limit`` characters, marking the cut, so no error text grows without bound."""
    if text is None or len(text) <= limit:
        return text
    marker = f"... [{len(text) - limit + 40} chars cut]"
    return text[: limit - len(marker)] + marker


class Outcome(BaseModel):
    """The classification of one attempt, before the policy's decision."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: Status
    failure_kind: FailureKind = FailureKind.NONE
    http_status: int | None = None
    error_message: str | None = None
    error_detail: dict[str, Any] = Field(default_factory=dict)
    retry_after_s: float | None = None  # the endpoint's last Retry-After hint, a floor for the backoff

    @field_validator("error_message")
    @classmethod
    def _bounded(cls, value: str | None) -> str | None:
        return bound_text(value)

    @classmethod
    def of(cls, kind: FailureKind, message: str | None = None, **extra: Any) -> Outcome:
        return cls(status=status_for(kind), failure_kind=kind, error_message=message, **extra)
