"""One table from what an endpoint answered to a failure kind, so adapters never grep for "429"."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

from policy.outcome import FailureKind

# Codes and phrases an OpenAI-compatible server uses for a context overflow inside a 400/413.
_CONTEXT_MARKERS = (
    "context_length_exceeded",
    "maximum context length",
    "context window",
    "prompt is too long",
    "too many tokens",
)

RETRYABLE_KINDS = frozenset(
    {
        FailureKind.RATE_LIMIT_EXCEEDED,
        FailureKind.PROVIDER_UNAVAILABLE,
        FailureKind.TRANSPORT_ERROR,
        FailureKind.MODEL_TIMEOUT,
    }
)
# The 4xx a model's own turn can cause (the request it built): graded by default. Every other 4xx says the
# endpoint, model name, route or account is wrong, which no sample can be blamed for.
_MODEL_REQUEST_STATUSES = frozenset({400, 413, 422})


def is_context_overflow(body: str | bytes | None) -> bool:
    if not body:
        return False
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    text = text[:20_000].lower()
    return any(marker in text for marker in _CONTEXT_MARKERS)


def kind_for_http(status: int | None, body: str | bytes | None = None) -> FailureKind:
    """The failure kind of one upstream answer; ``None`` status means no HTTP answer at all."""
    if status is None:
        return FailureKind.TRANSPORT_ERROR
    if status < 400:
        return FailureKind.NONE
    if status == 429:
        return FailureKind.RATE_LIMIT_EXCEEDED
    if status in (401, 403):
        return FailureKind.PROVIDER_AUTH_ERROR
    if status == 408 or status >= 500:
        return FailureKind.PROVIDER_UNAVAILABLE
    if status in (400, 413) and is_context_overflow(body):
        return FailureKind.MODEL_CONTEXT_LIMIT
    if status in _MODEL_REQUEST_STATUSES:
        return FailureKind.MODEL_REQUEST_ERROR
    return FailureKind.ENDPOINT_CONFIG_ERROR


# Words an endpoint uses for a rate limit inside an error event (a status digit alone is not trusted: a
# message such as "(request 14290)" would match it).
_RATE_LIMIT_MARKERS = ("rate_limit", "rate limit", "ratelimit", "too many requests", "throttl")
_MAX_SCANNED_CHARS = 20_000


def kind_for_stream_error(code: object, message: object) -> FailureKind:
    """The failure kind of an error the endpoint reported inside a 200 answer (an SSE ``error`` event, a
    chunk carrying ``error``, ``response.failed``). An endpoint failing mid-answer is the infrastructure's,
    never the sample's: only an overflow (the agent's history) and a rate limit are told apart."""
    if isinstance(code, bool):
        code = None
    text = f"{code if code is not None else ''} {message if message is not None else ''}"
    text = text[:_MAX_SCANNED_CHARS].lower()
    if any(marker in text for marker in _CONTEXT_MARKERS):
        return FailureKind.MODEL_CONTEXT_LIMIT
    if code == 429 or code == "429" or any(marker in text for marker in _RATE_LIMIT_MARKERS):
        return FailureKind.RATE_LIMIT_EXCEEDED
    return FailureKind.PROVIDER_UNAVAILABLE


def is_retryable(kind: FailureKind) -> bool:
    return kind in RETRYABLE_KINDS


def error_message_of(body: str | bytes | None, limit: int = 2_000) -> str | None:
    """The ``error.message`` of an OpenAI-style error body, else the body's start."""
    if not body:
        return None
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return text[:limit]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"][:limit]
        if isinstance(err, str):
            return err[:limit]
    return text[:limit]


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or HTTP date).

    Returns None when absent or unusable (NaN, infinite, negative, unparseable), so the caller falls back
    to its own backoff rather than waiting forever or not at all.
    """
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
        return max(seconds, 0.0)
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        return None
    return seconds
