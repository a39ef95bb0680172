"""Codex CLI (``@openai/codex``): version, install, launch, parse, recognize.

Measured facts this adapter relies on (0.171.0, also 0.144.4; the tests and their fixtures hold the evidence):
- ``codex exec --json`` prints one JSON event per line on stdout; the native transcript is
  ``$CODEX_HOME/sessions/YYYY/MM/DD/rollout-<local time>-<thread_id>.jsonl``.
- Only the Responses wire API exists. ``request_max_retries`` / ``stream_max_retries`` accept 0 and are
  silently capped at 100; a negative value is a config error.
- With the default ``features.unbounded_connection_retries`` a refused connection makes Codex print
  ``Reconnecting... waiting for network`` forever; with ``features.plugins`` on it looks up chatgpt.com,
  github.com and api.github.com even with ``check_for_update_on_startup = false``. Both are turned off.
- When the endpoint sends no usage, ``turn.completed.usage`` is all zeros; the transcript's
  ``token_count`` then has ``info: null``. Zeros are therefore read as "unknown", never as a count.
"""

from __future__ import annotations

import logging
import posixpath
import re
import shutil
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
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

PACKAGE = "@openai/codex"
BIN_NAME = "codex"
TESTED_VERSION = "0.171.0"
KNOWN_WORKING_VERSIONS = ("0.171.0", "0.144.4")
ENTRY_SCRIPT = Path("node_modules") / "@openai" / "codex" / "bin" / "codex.js"

# The gateway retries upstream failures itself, so Codex re-sends nothing at the HTTP level; a stream cut
# after bytes have flowed is something only the harness can recover from, so it keeps two reconnects.
REQUEST_MAX_RETRIES = 0
STREAM_MAX_RETRIES = 2
API_KEY_ENV = "ROLLOUT_API_KEY"
PROVIDER_ID = "rollout"

MAX_TRANSCRIPT_BYTES = 64 * 1024 * 1024
MAX_LAST_MESSAGE_BYTES = 1024 * 1024
# Linux refuses a single argv string over 128 KiB (MAX_ARG_STRLEN); longer prompts go through stdin.
MAX_ARGV_PROMPT_BYTES = 100_000

# A Codex error report -> the failure it claims. First match wins, so Codex's own phrasings and the
# status it names come before words that may also occur inside an endpoint's error body (for a plain 400
# Codex prints the raw body as the message).
FAILURE_PATTERNS = failure_patterns(
    (r"ran out of room in the model's context window", FailureKind.MODEL_CONTEXT_LIMIT),
    (r"^unexpected status 40[13]\b", FailureKind.PROVIDER_AUTH_ERROR),
    (r"^unexpected status 429\b|last status: 429\b", FailureKind.RATE_LIMIT_EXCEEDED),
    (r"^unexpected status (408|5\d\d)\b|last status: (408|5\d\d)\b", FailureKind.PROVIDER_UNAVAILABLE),
    (r"experiencing high demand", FailureKind.PROVIDER_UNAVAILABLE),  # what Codex makes of a 5xx
    (r"^unexpected status 4\d\d\b", FailureKind.MODEL_REQUEST_ERROR),
    (
        r"^(stream disconnected before completion|connection failed)|transport error|network error",
        FailureKind.TRANSPORT_ERROR,
    ),
    (r"context_length_exceeded|maximum context length", FailureKind.MODEL_CONTEXT_LIMIT),
    (r"\bunauthorized\b|invalid_api_key", FailureKind.PROVIDER_AUTH_ERROR),
    (r"too many requests|rate_limit_exceeded", FailureKind.RATE_LIMIT_EXCEEDED),
    (r"400 bad request|invalid_request_error", FailureKind.MODEL_REQUEST_ERROR),
)
_RECONNECT_RE = re.compile(r"^Reconnecting\.\.\.")
_NON_FATAL_ERROR_ITEMS = (re.compile(r"^Model metadata for `.*` not found"),)
_THREAD_ID_RE = re.compile(r"[0-9a-fA-F-]{1,64}")

_KNOWN_EVENTS = frozenset(
    {"thread.started", "turn.started", "turn.completed", "turn.failed", "error"}
    | {"item.started", "item.updated", "item.completed"}
)
_KNOWN_ITEMS = frozenset(
    {"agent_message", "reasoning", "command_execution", "file_change", "mcp_tool_call", "web_search"}
    | {"todo_list", "error", "collab_tool_call"}
)
_KNOWN_RECORDS = frozenset(
    {"session_meta", "turn_context", "world_state", "response_item", "event_msg", "token_usage_record"}
    | {"compacted"}
)
_TOOL_STATUS = {"completed": "completed", "failed": "failed", "declined": "failed"}


def recognize_failure(message: str | None) -> FailureKind | None:
    """The failure kind a Codex error message claims, or None when no pattern knows it."""
    return first_match(FAILURE_PATTERNS, message[:MAX_SCANNED_CHARS]) if message else None


def toml_string(value: str) -> str:
    """A TOML basic string: quotes, backslashes and every control character escaped."""
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif code < 0x20 or code == 0x7F:
            out.append(_TOML_SHORT_ESCAPES.get(ch, f"\\u{code:04X}"))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


_TOML_SHORT_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def render_config(model: str, base_url: str) -> str:
    """``$CODEX_HOME/config.toml`` for one session: our endpoint, no prompts, nothing phoning home."""
    return "\n".join(
        [
            f"model = {toml_string(model)}",
            f"model_provider = {toml_string(PROVIDER_ID)}",
            'approval_policy = "never"',
            # The sandbox is the isolation; Codex's own (bwrap/landlock) would need privileges it lacks.
            'sandbox_mode = "danger-full-access"',
            "check_for_update_on_startup = false",
            "",
            f"[model_providers.{PROVIDER_ID}]",
            'name = "Rollout gateway"',
            f"base_url = {toml_string(base_url)}",
            f"env_key = {toml_string(API_KEY_ENV)}",
            'wire_api = "responses"',
            f"request_max_retries = {REQUEST_MAX_RETRIES}",
            f"stream_max_retries = {STREAM_MAX_RETRIES}",
            "",
            "[features]",
            "unbounded_connection_retries = false",
            "plugins = false",
            # Undo snapshots: a ghost commit of the workspace at every turn (~40 ms per rollout in a git
            # workspace, which ours always is), for an undo no throwaway sandbox will ever use.
            "undo = false",
            "",
            "[analytics]",
            "enabled = false",
            "",
            "[feedback]",
            "enabled = false",
            "",
        ]
    )


class CodexHarness:
    """The Codex CLI driven headlessly with ``codex exec --json``."""

    name = "codex"
    tested_version = TESTED_VERSION
    api: HarnessApi | None = "responses"  # wire_api "chat" is refused by 0.171.0 and 0.144.4 alike

    def __init__(self, version: str | None = None) -> None:
        self.version = version or TESTED_VERSION
        warn_if_untested(self.name, self.version, self.tested_version, KNOWN_WORKING_VERSIONS)

    # -- install ----------------------------------------------------------------------------------------

    def ensure_installed(self, cache_root: Path) -> Path:
        """Install this version into the cache (once); return its install directory."""
        # No install scripts: the platform binary arrives as an npm optional dependency, not a postinstall.
        npm_install(cache_root, PACKAGE, self.version, BIN_NAME)
        return npm_prefix(cache_root, PACKAGE, self.version)

    # -- launch -----------------------------------------------------------------------------------------

    async def prepare(self, sandbox: Sandbox, ctx: LaunchContext) -> Launch:
        codex_home = _codex_home(sandbox)
        await sandbox.write_file(
            posixpath.join(codex_home, "config.toml"), render_config(ctx.model, ctx.base_url).encode(), 0o600
        )
        entry = Path(ctx.install_dir) / ENTRY_SCRIPT
        extra_env: dict[str, str] = {}
        if not sandbox.shares_host_userland:
            # A container of the task's image: no node of ours there, so the native binary the entry
            # script would start, with what the script would set.
            command = [str(native_binary(Path(ctx.install_dir)))]
            extra_env = {"CODEX_MANAGED_BY_NPM": "1"}
        elif node := shutil.which("node"):
            # Starting the entry script with node directly spares us from relying on the sandbox PATH for
            # its "#!/usr/bin/env node" line.
            command = [node, str(entry)]
        else:
            command = [str(Path(ctx.install_dir) / "node_modules/.bin/codex")]
        argv = [
            *command,
            "exec",
            "--json",
            "--skip-git-repo-check",
            "-C",
            posixpath.normpath(sandbox.workdir),
            # Codex refuses a path with ".." or "//" here ("no-follow filesystem operations require a
            # normalized path").
            "-o",
            _last_message_path(sandbox),
        ]
        stdin: bytes | None = None
        encoded = ctx.prompt.encode("utf-8")
        # "-" makes Codex read the prompt from stdin: for "-" itself, NUL bytes and prompts too long for
        # one argv string. Otherwise the prompt is one argv element after "--", so a leading "-" is text.
        if ctx.prompt == "-" or "\0" in ctx.prompt or len(encoded) > MAX_ARGV_PROMPT_BYTES:
            argv += ["--", "-"]
            stdin = encoded
        else:
            argv += ["--", ctx.prompt]
        env = {
            "CODEX_HOME": codex_home,
            API_KEY_ENV: ctx.api_key,
            # The transcript's file name carries local time; UTC lets parse() find it from the thread id.
            "TZ": "UTC",
            **extra_env,
        }
        return Launch(argv=argv, env=env, stdin=stdin)

    # -- parse ------------------------------------------------------------------------------------------

    async def parse(self, sandbox: Sandbox, result: ExecResult) -> HarnessReport:
        state = _StreamState()
        raw = await read_event_stream(sandbox, result, state.gaps)
        await small_inline(len(raw), _parse_events, raw, state)

        transcript = _Transcript()
        path = await _find_transcript(sandbox, state.thread_id)
        if path is None:
            state.gaps.append("transcript_unavailable")
        else:
            data = await read_or_none(sandbox, path, MAX_TRANSCRIPT_BYTES)
            if data is None:
                state.gaps.append("transcript_unavailable")
                path = None
            else:
                if len(data) >= MAX_TRANSCRIPT_BYTES:
                    state.gaps.append("transcript_truncated")
                await small_inline(len(data), _parse_transcript, data, transcript, state.gaps)

        usage = state.usage if state.usage is not None else transcript.usage
        if usage is None:
            state.gaps.append("usage_unavailable")

        final_text = state.last_agent_text
        if final_text is None:
            last = await read_or_none(sandbox, _last_message_path(sandbox), MAX_LAST_MESSAGE_BYTES)
            if last:
                final_text = last.decode("utf-8", "replace")
        if final_text is None:
            final_text = transcript.last_agent_message
        if final_text is not None:
            final_text = bound_middle(final_text, MAX_MESSAGE_CHARS)

        messages = [
            Message(role="user", text=bound_middle(t, MAX_MESSAGE_CHARS)) for t in transcript.user_texts
        ]
        messages += state.messages

        claimed_message = state.turn_failed_message or state.last_error_message
        return HarnessReport(
            messages=messages,
            tool_calls=list(state.tool_calls.values()),
            usage=usage or Usage(),
            final_text=final_text,
            claimed_failure=recognize_failure(claimed_message),
            claimed_message=bound_middle(claimed_message, MAX_CLAIMED_MESSAGE_CHARS)
            if claimed_message
            else None,
            evidence_gaps=state.gaps,
            native_transcript_path=path,
            reconnects=state.reconnects,
        )


# ---------------------------------------------------------------------------------------------------------
# Paths


def native_binary(install_dir: Path) -> Path:
    """The platform's self-contained Codex binary in an npm install (what the entry script execs)."""
    found = sorted(install_dir.glob("node_modules/@openai/codex-linux-*/vendor/*/bin/codex"))
    if not found:
        raise SandboxError(f"no native codex binary under {install_dir}/node_modules/@openai")
    return found[0]


def _codex_home(sandbox: Sandbox) -> str:
    return posixpath.join(posixpath.normpath(sandbox.home), ".codex")


def _last_message_path(sandbox: Sandbox) -> str:
    return posixpath.join(posixpath.normpath(sandbox.home), "codex-last-message.txt")


def _transcript_candidates(codex_home: str, thread_id: str) -> list[str]:
    """Where Codex (under TZ=UTC) names the transcript of ``thread_id``.

    The thread id is a UUIDv7, whose first 48 bits are the creation time in ms; the file is named a moment
    later, to the second, so the same second and the next two are tried.
    """
    try:
        parsed = uuid.UUID(thread_id)
    except ValueError:
        return []
    if parsed.version != 7:
        return []
    paths = []
    try:
        created = datetime.fromtimestamp((parsed.int >> 80) / 1000, UTC).replace(microsecond=0)
        for offset in (0, 1, 2, -1):
            t = created + timedelta(seconds=offset)
            name = f"rollout-{t:%Y-%m-%dT%H-%M-%S}-{thread_id}.jsonl"
            paths.append(posixpath.join(codex_home, "sessions", f"{t:%Y}", f"{t:%m}", f"{t:%d}", name))
    except (ValueError, OverflowError, OSError):  # a forged id can name a time no calendar holds
        return []
    return paths


async def _find_transcript(sandbox: Sandbox, thread_id: str | None) -> str | None:
    codex_home = _codex_home(sandbox)
    if thread_id:
        for candidate in _transcript_candidates(codex_home, thread_id):
            if await _exists(sandbox, candidate):
                return candidate
    # The name was not where we expected (another TZ, another naming, no thread id): ask the sandbox.
    pattern = f"rollout-*-{thread_id}.jsonl" if thread_id else "rollout-*.jsonl"
    try:
        found = await sandbox.exec(
            ["find", posixpath.join(codex_home, "sessions"), "-type", "f", "-name", pattern],
            timeout=15,
            name="codex-find-transcript",
        )
    except (SandboxError, OSError) as exc:
        log.info("cannot list Codex transcripts in sandbox %s: %s", sandbox.id, exc)
        return None
    paths = sorted(line for line in found.stdout_tail.splitlines() if line.endswith(".jsonl"))
    return paths[-1] if paths else None


async def _exists(sandbox: Sandbox, path: str) -> bool:
    return await read_or_none(sandbox, path, 0) is not None


# ---------------------------------------------------------------------------------------------------------
# The event stream (stdout of ``codex exec --json``)


@dataclass
class _StreamState:
    thread_id: str | None = None
    messages: list[Message] = field(default_factory=list)
    tool_calls: dict[str, ToolCall] = field(default_factory=dict)
    usage: Usage | None = None
    last_agent_text: str | None = None
    turn_failed_message: str | None = None
    last_error_message: str | None = None
    reconnects: int = 0
    unparseable: int = 0
    gaps: list[str] = field(default_factory=list)
    unknown: set[str] = field(default_factory=set)

    def note_unknown(self, what: str, type_name: object) -> None:
        note_unknown_type(self.gaps, self.unknown, what, type_name)


def _parse_events(data: bytes, state: _StreamState) -> None:
    events, bad = json_lines(data)
    state.unparseable = bad
    for event in events:
        try:
            _apply_event(event, state)
        except (RecursionError, TypeError, ValueError, AttributeError):
            state.unparseable += 1
    if state.unparseable:
        state.gaps.append(f"event_stream_unparseable_lines:{state.unparseable}")


def _apply_event(event: dict[str, Any], state: _StreamState) -> None:
    kind = event.get("type")
    if kind == "thread.started":
        thread_id = event.get("thread_id")
        if isinstance(thread_id, str) and _THREAD_ID_RE.fullmatch(thread_id):
            state.thread_id = thread_id
    elif kind in ("item.started", "item.updated", "item.completed"):
        item = event.get("item")
        if isinstance(item, dict):
            _apply_item(item, completed=kind == "item.completed", state=state)
    elif kind == "turn.completed":
        state.last_error_message = None  # whatever was reported before, the turn recovered from it
        usage = _usage_of(event.get("usage"))
        if usage is not None:
            state.usage = usage if state.usage is None else add_usage(state.usage, usage)
    elif kind == "turn.failed":
        error = event.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        state.turn_failed_message = message if isinstance(message, str) else "turn failed without a message"
    elif kind == "error":
        message = event.get("message")
        if isinstance(message, str):
            if _RECONNECT_RE.match(message):
                state.reconnects += 1
            else:
                state.last_error_message = message
    elif kind not in _KNOWN_EVENTS:
        state.note_unknown("unknown_event_type", kind)


def _apply_item(item: dict[str, Any], *, completed: bool, state: _StreamState) -> None:
    item_type = item.get("type")
    item_id = str(item.get("id", len(state.tool_calls)))
    if item_type == "agent_message":
        text = item.get("text")
        if completed and isinstance(text, str):
            state.messages.append(Message(role="assistant", text=bound_middle(text, MAX_MESSAGE_CHARS)))
            state.last_agent_text = text
    elif item_type == "command_execution":
        exit_code = item.get("exit_code")
        state.tool_calls[item_id] = ToolCall(
            name="shell",
            call_id=item_id,
            arguments=bound_middle(as_text(item.get("command")), MAX_ARGUMENT_CHARS),
            status=_TOOL_STATUS.get(str(item.get("status")), "unknown") if completed else "unknown",
            exit_code=exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None,
            output=bound_middle(as_text(item.get("aggregated_output")), MAX_TOOL_OUTPUT_CHARS),
        )
    elif item_type in ("file_change", "mcp_tool_call", "web_search"):
        if item_type == "file_change":
            name, arguments, output = "file_change", item.get("changes"), None
        elif item_type == "mcp_tool_call":
            name = f"mcp:{as_text(item.get('server'))}/{as_text(item.get('tool'))}"
            arguments, output = item.get("arguments"), item.get("result") or item.get("error")
        else:
            name, arguments, output = "web_search", item.get("query"), None
        state.tool_calls[item_id] = ToolCall(
            name=name[:200],
            call_id=item_id,
            arguments=bound_middle(as_text(arguments), MAX_ARGUMENT_CHARS),
            status=_TOOL_STATUS.get(str(item.get("status")), "unknown") if completed else "unknown",
            output=bound_middle(as_text(output), MAX_TOOL_OUTPUT_CHARS) if output is not None else None,
        )
    elif item_type == "error":
        # Error items are warnings inside a turn (a failed turn ends with turn.failed instead); the
        # metadata one appears on every run against a model Codex does not know.
        message = as_text(item.get("message"))
        if not any(p.match(message) for p in _NON_FATAL_ERROR_ITEMS):
            log.debug("codex warning item: %s", message[:500])
    elif item_type not in _KNOWN_ITEMS:
        state.note_unknown("unknown_item_type", item_type)


# ---------------------------------------------------------------------------------------------------------
# The native transcript ($CODEX_HOME/sessions/.../rollout-*.jsonl)


@dataclass
class _Transcript:
    user_texts: list[str] = field(default_factory=list)
    usage: Usage | None = None
    last_agent_message: str | None = None
    # The record types it did not know, reported after the count of unparseable lines.
    unknown_gaps: list[str] = field(default_factory=list)
    unknown: set[str] = field(default_factory=set)


def _parse_transcript(data: bytes, transcript: _Transcript, gaps: list[str]) -> None:
    records, bad = json_lines(data)
    for record in records:
        try:
            _apply_record(record, transcript)
        except (RecursionError, TypeError, ValueError, AttributeError):
            bad += 1
    if bad:
        gaps.append(f"transcript_unparseable_lines:{bad}")
    gaps.extend(transcript.unknown_gaps)


def _apply_record(record: dict[str, Any], transcript: _Transcript) -> None:
    record_type = record.get("type")
    if record_type not in _KNOWN_RECORDS:
        note_unknown_type(transcript.unknown_gaps, transcript.unknown, "unknown_record_type", record_type)
        return
    payload = record.get("payload")
    if record_type != "event_msg" or not isinstance(payload, dict):
        return
    event = payload.get("type")
    if event == "item_completed":
        item = payload.get("item")
        if isinstance(item, dict) and item.get("type") == "UserMessage":
            parts = item.get("content")
            texts = [p.get("text") for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []
            transcript.user_texts.append("".join(t for t in texts if isinstance(t, str)))
    elif event == "token_count":
        info = payload.get("info")
        # info is null when the endpoint reported no usage; a later null must not erase an earlier count.
        if isinstance(info, dict):
            usage = _usage_of(info.get("total_token_usage"))
            if usage is not None:
                transcript.usage = usage
    elif event == "task_complete":
        last = payload.get("last_agent_message")
        if isinstance(last, str):
            transcript.last_agent_message = last


# ---------------------------------------------------------------------------------------------------------
# Small helpers


def _usage_of(data: object) -> Usage | None:
    """Codex's usage object, or None when it carries no counts (Codex writes zeros for "not reported")."""
    if not isinstance(data, dict):
        return None
    usage = Usage(
        input_tokens=int_or_none(data.get("input_tokens")),
        output_tokens=int_or_none(data.get("output_tokens")),
        cached_input_tokens=int_or_none(data.get("cached_input_tokens")),
        reasoning_tokens=int_or_none(data.get("reasoning_output_tokens")),
    )
    if not usage.input_tokens and not usage.output_tokens:
        return None
    return usage
