"""The outcome vocabulary and the retry / grade / mask policy. Imports nothing of ours."""

from policy.breaker import BreakerConfig, CircuitBreaker
from policy.groups import GroupAction, GroupBook, GroupMode, GroupVerdict, decide_group
from policy.http_errors import (
    error_message_of,
    is_context_overflow,
    is_retryable,
    kind_for_http,
    kind_for_stream_error,
    parse_retry_after,
)
from policy.outcome import (
    KIND_INFO,
    MAX_ERROR_MESSAGE_CHARS,
    Decision,
    FailureKind,
    KindInfo,
    Outcome,
    Status,
    bound_text,
    status_for,
)
from policy.rules import DEFAULT_RULES, FinalAs, PolicyConfig, Rule, Verdict, backoff_delay, decide
from policy.staleness import (
    InFlightAction,
    StaleAction,
    StalenessConfig,
    stale_reason,
    staleness,
    too_stale,
)

__all__ = [
    "DEFAULT_RULES",
    "KIND_INFO",
    "MAX_ERROR_MESSAGE_CHARS",
    "BreakerConfig",
    "CircuitBreaker",
    "Decision",
    "FailureKind",
    "FinalAs",
    "GroupAction",
    "GroupBook",
    "GroupMode",
    "GroupVerdict",
    "InFlightAction",
    "KindInfo",
    "Outcome",
    "PolicyConfig",
    "Rule",
    "StaleAction",
    "StalenessConfig",
    "Status",
    "Verdict",
    "backoff_delay",
    "bound_text",
    "decide",
    "decide_group",
    "error_message_of",
    "is_context_overflow",
    "is_retryable",
    "kind_for_http",
    "kind_for_stream_error",
    "parse_retry_after",
    "stale_reason",
    "staleness",
    "status_for",
    "too_stale",
]
