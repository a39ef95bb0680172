"""Reading a harness's own evidence out of its sandbox, bounded and forgiving: shared by every adapter.

A harness's output is untrusted: it may be cut, huge, not UTF-8, not JSON, or nested without end. These
helpers never raise on such input; they bound what they keep and leave the caller to record the gap.
"""

from __future__ import annotations

import json
import re
from typing import Any

from harnesses.base import Usage
from policy import FailureKind
from sandboxes.base import ExecResult, Sandbox, SandboxError

# Bounds on what an adapter reads of a harness's evidence and keeps of it in the row, the same for all.
MAX_EVENT_STREAM_BYTES = 64 * 1024 * 1024
MAX_ARGUMENT_CHARS = 4_000
MAX_TOOL_OUTPUT_CHARS = 4_000
MAX_MESSAGE_CHARS = 64_000
MAX_CLAIMED_MESSAGE_CHARS = 4_000
# Enough to show that a new harness version speaks of new things, too few for a hostile stream to flood.
MAX_UNKNOWN_TYPES = 20
MAX_SCANNED_CHARS = 20_000  # of an error message, matched against an adapter's failure patterns

_TYPE_NAME_RE = re.compile(r"[^A-Za-z0-9_.:-]")

FailurePatterns = tuple[tuple[re.Pattern[str], FailureKind], ...]


async def read_or_none(sandbox: Sandbox, path: str, limit: int) -> bytes | None:
    """The file's first ``limit`` bytes, or None if it cannot be read."""
    try:
        return await sandbox.read_file(path, limit)
    except (SandboxError, OSError):
        return None


async def read_event_stream(
    sandbox: Sandbox, result: ExecResult, gaps: list[str], limit: int = MAX_EVENT_STREAM_BYTES
) -> bytes:
    """The harness's stdout as bytes; a cut or missing stream is noted in ``gaps``."""
    data = await read_or_none(sandbox, result.stdout_path, limit) if result.stdout_path else None
    if data is None:
        # Only the tail survived: its first line is likely cut, and is then counted as unparseable.
        gaps.append("event_stream_partial")
        return result.stdout_tail.encode("utf-8", "replace")
    if len(data) >= limit or result.stdout_bytes > len(data):
        gaps.append("event_stream_truncated")
    return data


def json_lines(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """Each line that is a JSON object, and how many non-empty lines were not."""
    objects: list[dict[str, Any]] = []
    bad = 0
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            value = json.loads(line.decode("utf-8", "replace"))
        except (ValueError, RecursionError):
            bad += 1
            continue
        if isinstance(value, dict):
            objects.append(value)
        else:
            bad += 1
    return objects, bad


def int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def add_usage(a: Usage, b: Usage) -> Usage:
    """Summed counts; a count unknown on both sides stays unknown."""

    def add(x: int | None, y: int | None) -> int | None:
        return None if x is None and y is None else (x or 0) + (y or 0)

    return Usage(
        input_tokens=add(a.input_tokens, b.input_tokens),
        output_tokens=add(a.output_tokens, b.output_tokens),
        cached_input_tokens=add(a.cached_input_tokens, b.cached_input_tokens),
        reasoning_tokens=add(a.reasoning_tokens, b.reasoning_tokens),
    )


def as_text(value: object) -> str:
    """A string as it is; anything else as bounded JSON."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)[: MAX_ARGUMENT_CHARS * 2]
    except (TypeError, ValueError, RecursionError):
        return repr(type(value))


def bound_middle(text: str, limit: int) -> str:
    """At most ``limit`` characters, keeping the head and the tail (where errors usually are)."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - 40)  # 40 characters hold the marker for any realistic cut
    marker = f"\n... [{len(text) - keep} chars cut] ...\n"
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :]


def note_unknown_type(gaps: list[str], seen: set[str], what: str, type_name: object) -> None:
    """Record an event, record or part type the adapter does not know as the gap ``<what>:<type>``, once
    each and at most ``MAX_UNKNOWN_TYPES`` of them per ``seen``; the type is cleaned and cut, as it is the
    harness's to choose."""
    code = f"{what}:{_TYPE_NAME_RE.sub('_', str(type_name))[:64]}"
    if code not in seen and len(seen) < MAX_UNKNOWN_TYPES:
        seen.add(code)
        gaps.append(code)


def failure_patterns(*table: tuple[str, FailureKind]) -> FailurePatterns:
    """An adapter's table of error phrasings -> the failure each claims, compiled case-insensitively, in
    order: ``first_match`` takes the first that matches."""
    return tuple((re.compile(pattern, re.IGNORECASE), kind) for pattern, kind in table)


def first_match(patterns: FailurePatterns, text: str) -> FailureKind | None:
    """The kind of the first pattern found in ``text``, or None. Tables put the harness's own phrasings and
    the status it names before words an endpoint's error body (which harnesses quote) may also contain."""
    return next((kind for pattern, kind in patterns if pattern.search(text)), None)
