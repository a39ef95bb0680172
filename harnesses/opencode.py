"""OpenCode (``opencode-ai``): version, install, launch, parse, recognize.

Measured facts this adapter relies on (1.18.33, also 1.17.11; the tests and their fixtures hold the evidence):
- ``opencode run --format json`` prints one JSON event per line: ``step_start``, ``text``, ``tool_use``,
  ``step_finish`` (with the step's token counts) and ``error``; each carries a ``part`` (or an ``error``).
  The native transcript is a SQLite database (``OPENCODE_DB``) whose ``part.data`` holds the same part
  objects, and whose user messages hold the prompt, which the event stream never shows.
- A positional prompt with spaces reaches the model wrapped in literal quotes; a prompt on stdin arrives
  intact, so the prompt always goes through stdin.
- ``--title`` names the session, so no title request goes to the model at all (without it one goes to
  ``small_model`` before the first real request).
- When the endpoint sends no usage, ``step_finish.tokens`` is all zeros (and has no ``total``): zeros are
  read as "unknown", never as a count.
- The binary arrives as an npm optional dependency and its postinstall links the one that suits the CPU
  (AVX2 or baseline), so this install runs install scripts.
- Its own retries (5, honouring Retry-After, exponential otherwise) have no knob; the gateway ends them by
  closing the session, whose neutral 400 stops OpenCode at once. After a context overflow it compacts and
  retries, which loops if the overflow persists: the gateway's overflow cap ends that too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import posixpath
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnesses.base import (
    HarnessApi,
    HarnessReport,
    Launch,
    LaunchContext,
    Message,
    ToolCall,
    Usage,
    warn_if_untested,
)
from harnesses.evidence import (
    MAX_ARGUMENT_CHARS,
    MAX_CLAIMED_MESSAGE_CHARS,
    MAX_MESSAGE_CHARS,
    MAX_SCANNED_CHARS,
    MAX_TOOL_OUTPUT_CHARS,
    add_usage,
    as_text,
    bound_middle,
    failure_patterns,
    first_match,
    int_or_none,
    json_lines,
    note_unknown_type,
    read_event_stream,
    read_or_none,
)
from harnesses.install import npm_install, npm_prefix
from policy import FailureKind
from sandboxes.base import ExecResult, Sandbox, SandboxError
from sandboxes.inline import small_inline

log = logging.getLogger(__name__)

PACKAGE = "opencode-ai"
BIN_NAME = "opencode"
TESTED_VERSION = "1.18.33"
KNOWN_WORKING_VERSIONS = ("1.18.33", "1.17.11")
PROVIDER_ID = "rollout"
API_KEY_ENV = "ROLLOUT_API_KEY"
SESSION_TITLE = "rollout"
DEFAULT_OUTPUT_TOKENS = 8192
CONTEXT_TOKENS = 200_000

MAX_DB_BYTES = 256 * 1024 * 1024
MAX_DB_ROWS = 100_000

# Switches that keep OpenCode from phoning home, fetching model lists, downloading language servers or
# plugins, and reading configuration other than ours (a workspace may ship its own opencode.json).
QUIET_ENV = {
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    "OPENCODE_DISABLE_CLAUDE_CODE": "1",
    "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
    "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
    "OPENCODE_PURE": "1",
}

# An OpenCode error report, flattened to "<name> status=<code> code=<errno> <message>" -> the failure it
# claims. First match wins: its own error names and the HTTP status it names come before words that may
# also occur inside an endpoint's error message.
FAILURE_PATTERNS = failure_patterns(
    (r"^ContextOverflowError\b", FailureKind.MODEL_CONTEXT_LIMIT),
    (r"^ProviderAuthError\b| status=40[13]\b", FailureKind.PROVIDER_AUTH_ERROR),
    (r" status=429\b", FailureKind.RATE_LIMIT_EXCEEDED),
    (r" status=(408|5\d\d)\b", FailureKind.PROVIDER_UNAVAILABLE),
    (
        r" code=(ECONNRESET|ECONNREFUSED|ETIMEDOUT|EPIPE|ECONNABORTED|UND_ERR_\w+)\b",
        FailureKind.TRANSPORT_ERROR,
    ),
    (r"context_length_exceeded|maximum context length", FailureKind.MODEL_CONTEXT_LIMIT),
    (r" status=4\d\d\b", FailureKind.MODEL_REQUEST_ERROR),
    (r"connection reset|socket connection was closed|fetch failed", FailureKind.TRANSPORT_ERROR),
)
_KNOWN_EVENTS = frozenset({"step_start", "text", "tool_use", "step_finish", "reasoning", "error"})
_KNOWN_PARTS = frozenset(
    {"text", "tool", "step-start", "step-finish", "reasoning", "file", "patch", "snapshot", "agent"}
    | {"subtask", "retry", "compaction"}
)
_TOOL_STATUS = {"completed": "completed", "error": "failed"}


def recognize_failure(error: object) -> tuple[FailureKind | None, str | None]:
    """The failure an OpenCode ``error`` object claims, and its message; (None, None) for no error."""
    if not isinstance(error, dict):
        return None, None
    name = as_text(error.get("name"))[:100]
    data = error.get("data") if isinstance(error.get("data"), dict) else {}
    message = as_text(data.get("message")) or name or "error without a message"
    status = int_or_none(data.get("statusCode"))
    metadata = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    errno = as_text(metadata.get("code"))[:100]
    signature = f"{name} status={status} code={errno} {message[:MAX_SCANNED_CHARS]}"
    return first_match(FAILURE_PATTERNS, signature), message


def render_config(model: str, base_url: str, max_output_tokens: int | None) -> str:
    """``opencode.json`` for one session: our endpoint only, everything allowed, nothing shared."""
    config = {
        "$schema": "https://opencode.ai/config.json",
        "model": f"{PROVIDER_ID}/{model}",
        # Auxiliary requests (titles, summaries) go to the same model: the gateway knows no other.
        "small_model": f"{PROVIDER_ID}/{model}",
        "autoupdate": False,
        "share": "disabled",
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
        "provider": {
            PROVIDER_ID: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Rollout gateway",
                # The token stays in the environment; OpenCode substitutes it when it loads the config.
                "options": {"baseURL": base_url, "apiKey": "{env:" + API_KEY_ENV + "}"},
                "models": {
                    model: {
                        "name": model,
                        "limit": {
                            "context": CONTEXT_TOKENS,
                            "output": max_output_tokens or DEFAULT_OUTPUT_TOKENS,
                        },
                    }
                },
            }
        },
    }
    return json.dumps(config, indent=2, ensure_ascii=False)


def _config_path(sandbox: Sandbox) -> str:
    return posixpath.join(sandbox.home, ".config", "opencode", "opencode.json")


def _db_path(sandbox: Sandbox) -> str:
    return posixpath.join(sandbox.home, ".local", "share", "opencode", "rollout.db")


def _merged_db_path(sandbox: Sandbox) -> str:
    return posixpath.join(sandbox.home, ".local", "share", "opencode", "rollout-transcript.db")


class OpenCodeHarness:
    """OpenCode driven headlessly with ``opencode run --format json``."""

    name = "opencode"
    tested_version = TESTED_VERSION
    api: HarnessApi | None = "chat"  # @ai-sdk/openai-compatible calls /chat/completions

    def __init__(self, version: str | None = None) -> None:
        self.version = version or TESTED_VERSION
        warn_if_untested(self.name, self.version, self.tested_version, KNOWN_WORKING_VERSIONS)

    def ensure_installed(self, cache_root: Path) -> Path:
        """Install this version into the cache (once); return its install directory."""
        # The postinstall picks the binary this CPU can run and links it into bin/.
        npm_install(cache_root, PACKAGE, self.version, BIN_NAME, scripts=True)
        return npm_prefix(cache_root, PACKAGE, self.version)

    async def prepare(self, sandbox: Sandbox, ctx: LaunchContext) -> Launch:
        config = render_config(ctx.model, ctx.base_url, ctx.max_output_tokens)
        await sandbox.write_file(_config_path(sandbox), config.encode(), 0o600)
        binary = Path(ctx.install_dir) / "node_modules" / ".bin" / BIN_NAME
        argv = [str(binary), "run", "--format", "json", "-m", f"{PROVIDER_ID}/{ctx.model}"]
        argv += ["--title", SESSION_TITLE]
        env = {
            **QUIET_ENV,
            "OPENCODE_CONFIG": _config_path(sandbox),
            "OPENCODE_DB": _db_path(sandbox),
            API_KEY_ENV: ctx.api_key,
        }
        # stdin, not argv: OpenCode wraps a positional prompt that has spaces in literal quotes.
        return Launch(argv=argv, env=env, stdin=ctx.prompt.encode("utf-8"))

    async def parse(self, sandbox: Sandbox, result: ExecResult) -> HarnessReport:
        gaps: list[str] = []
        stream = _Parts(gaps)
        raw = await read_event_stream(sandbox, result, stream.gaps)
        await small_inline(len(raw), _parse_events, raw, stream)

        transcript = _Parts(gaps)
        path: str | None = _db_path(sandbox)
        db = await read_or_none(sandbox, path, MAX_DB_BYTES) if path else None
        if not db:
            gaps.append("transcript_unavailable")
            path = None
        elif len(db) >= MAX_DB_BYTES:
            gaps.append("transcript_truncated")  # a cut SQLite file cannot be read
            path = None
        else:
            wal = await read_or_none(sandbox, path + "-wal", MAX_DB_BYTES) or b""
            merged = await asyncio.to_thread(_parse_database, db, wal, transcript)
            if wal and merged is not None:
                # Most of the session sits in the write-ahead log until OpenCode checkpoints; the copy
                # kept as evidence is one self-contained file.
                try:
                    await sandbox.write_file(_merged_db_path(sandbox), merged, 0o600)
                    path = _merged_db_path(sandbox)
                except (SandboxError, OSError):
                    gaps.append("transcript_wal_not_kept")

        # The database is the fuller record (it holds the prompt, and survives a cut stream); the stream
        # is the fallback, and the only place errors are reported.
        best = transcript if transcript.parts_seen else stream
        usage = best.usage if best.usage is not None else stream.usage
        if usage is None:
            gaps.append("usage_unavailable")
        claimed_kind, claimed_message = stream.claimed or transcript.claimed or (None, None)
        messages = transcript.user_messages + best.messages
        final_text = best.last_text if best.last_text is not None else stream.last_text
        return HarnessReport(
            messages=messages,
            tool_calls=list(best.tool_calls.values()),
            usage=usage or Usage(),
            final_text=bound_middle(final_text, MAX_MESSAGE_CHARS) if final_text is not None else None,
            claimed_failure=claimed_kind,
            claimed_message=bound_middle(claimed_message, MAX_CLAIMED_MESSAGE_CHARS)
            if claimed_message
            else None,
            evidence_gaps=_dedupe(gaps),
            native_transcript_path=path,
            reconnects=None,
        )


# ---------------------------------------------------------------------------------------------------------
# Parts: the common unit of the event stream and the database


@dataclass
class _Parts:
    gaps: list[str]
    messages: list[Message] = field(default_factory=list)
    user_messages: list[Message] = field(default_factory=list)
    tool_calls: dict[str, ToolCall] = field(default_factory=dict)
    usage: Usage | None = None
    last_text: str | None = None
    claimed: tuple[FailureKind | None, str | None] | None = None
    parts_seen: int = 0
    unknown: set[str] = field(default_factory=set)

    def note_unknown(self, what: str, type_name: object) -> None:
        note_unknown_type(self.gaps, self.unknown, what, type_name)

    def error(self, error: object) -> None:
        kind, message = recognize_failure(error)
        if message is not None:
            self.claimed = (kind, message)

    def apply(self, part: dict[str, Any], role: str) -> None:
        self.parts_seen += 1
        part_type = part.get("type")
        if role == "user":
            if part_type == "text" and not part.get("synthetic"):
                self.user_messages.append(
                    Message(role="user", text=bound_middle(as_text(part.get("text")), MAX_MESSAGE_CHARS))
                )
            return
        if part_type == "text":
            text = part.get("text")
            if isinstance(text, str) and not part.get("synthetic"):
                self.messages.append(Message(role="assistant", text=bound_middle(text, MAX_MESSAGE_CHARS)))
                self.last_text = text
        elif part_type == "tool":
            self._tool(part)
        elif part_type == "step-finish":
            usage = _usage_of(part.get("tokens"))
            if usage is not None:
                self.usage = usage if self.usage is None else add_usage(self.usage, usage)
        elif part_type not in _KNOWN_PARTS:
            self.note_unknown("unknown_part_type", part_type)

    def _tool(self, part: dict[str, Any]) -> None:
        state = part.get("state") if isinstance(part.get("state"), dict) else {}
        metadata = state.get("metadata") if isinstance(state.get("metadata"), dict) else {}
        exit_code = metadata.get("exit")
        exit_code = exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None
        status = _TOOL_STATUS.get(str(state.get("status")), "unknown")
        if status == "completed" and exit_code not in (None, 0):
            status = "failed"  # OpenCode calls a command "completed" whatever its exit code
        output = state.get("output") if state.get("status") != "error" else state.get("error")
        call_id = as_text(part.get("callID") or part.get("id") or len(self.tool_calls))[:200]
        self.tool_calls[call_id] = ToolCall(
            name=as_text(part.get("tool"))[:200] or "unknown",
            call_id=call_id,
            arguments=bound_middle(as_text(state.get("input")), MAX_ARGUMENT_CHARS),
            status=status,
            exit_code=exit_code,
            output=bound_middle(as_text(output), MAX_TOOL_OUTPUT_CHARS) if output is not None else None,
        )


def _usage_of(tokens: object) -> Usage | None:
    """A step's token counts, or None when it has none (OpenCode writes zeros for "not reported")."""
    if not isinstance(tokens, dict):
        return None
    cache = tokens.get("cache") if isinstance(tokens.get("cache"), dict) else {}
    usage = Usage(
        input_tokens=int_or_none(tokens.get("input")),
        output_tokens=int_or_none(tokens.get("output")),
        cached_input_tokens=int_or_none(cache.get("read")),
        reasoning_tokens=int_or_none(tokens.get("reasoning")),
    )
    if not usage.input_tokens and not usage.output_tokens:
        return None
    return usage


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


# ---------------------------------------------------------------------------------------------------------
# The event stream (stdout of ``opencode run --format json``)


def _parse_events(data: bytes, parts: _Parts) -> None:
    events, bad = json_lines(data)
    for event in events:
        try:
            kind = event.get("type")
            if kind == "error":
                parts.error(event.get("error"))
            elif kind in _KNOWN_EVENTS:
                part = event.get("part")
                if isinstance(part, dict):
                    parts.apply(part, "assistant")
            else:
                parts.note_unknown("unknown_event_type", kind)
        except (RecursionError, TypeError, ValueError, AttributeError):
            bad += 1
    if bad:
        parts.gaps.append(f"event_stream_unparseable_lines:{bad}")


# ---------------------------------------------------------------------------------------------------------
# The native transcript (SQLite, OPENCODE_DB)


def _parse_database(db: bytes, wal: bytes, parts: _Parts) -> bytes | None:
    """Read messages and parts from a copy of the database and its write-ahead log, if any.

    Returns the copy with the log folded in, or None when the database could not be read.
    """
    with tempfile.TemporaryDirectory(prefix="opencode-db-") as tmp:
        path = Path(tmp) / "opencode.db"
        path.write_bytes(db)
        if wal:
            (Path(tmp) / "opencode.db-wal").write_bytes(wal)
        try:
            with contextlib.closing(sqlite3.connect(path)) as conn:
                roles = {
                    row[0]: row[1]
                    for row in conn.execute(
                        "SELECT id, data FROM message ORDER BY time_created, id LIMIT ?", (MAX_DB_ROWS,)
                    )
                }
                rows = conn.execute(
                    "SELECT message_id, data FROM part ORDER BY id LIMIT ?", (MAX_DB_ROWS,)
                ).fetchall()
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            merged = path.read_bytes()
        except sqlite3.Error as exc:
            parts.gaps.append("transcript_unparseable")
            log.info("opencode database unreadable: %s", str(exc)[:200])
            return None
    messages: dict[str, dict[str, Any]] = {}
    bad = 0
    for message_id, data in roles.items():
        value = _loads(data)
        if isinstance(value, dict):
            messages[message_id] = value
        else:
            bad += 1
    for message_id, data in rows:
        part = _loads(data)
        if not isinstance(part, dict):
            bad += 1
            continue
        message = messages.get(message_id, {})
        try:
            parts.apply(part, "user" if message.get("role") == "user" else "assistant")
        except (RecursionError, TypeError, ValueError, AttributeError):
            bad += 1
    for message in messages.values():
        if message.get("role") == "assistant" and message.get("error") is not None:
            parts.error(message.get("error"))
    if bad:
        parts.gaps.append(f"transcript_unparseable_rows:{bad}")
    return merged


def _loads(data: object) -> object:
    if isinstance(data, bytes):
        data = data.decode("utf-8", "replace")
    if not isinstance(data, str):
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None
