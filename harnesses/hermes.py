"""Hermes Agent (PyPI ``hermes-agent``): version, install, launch, parse, recognize.

Measured facts this adapter relies on (0.19.0; the tests and their fixtures hold the evidence):
- ``hermes -z PROMPT`` (oneshot) prints only the final text on stdout. It has no event stream, and it
  exits 0 when the model failed, printing the error sentence *as the answer* ("API call failed after 1
  retries: HTTP 429: ...", "HTTP 400: ...", "Context length exceeded (154 tokens). Cannot compress
  further."). It exits 2 when the turn failed or was cut with no text at all (a stream dropped on every
  try), and 1 with "hermes -z: agent failed: ..." on stderr when the agent itself raised.
- ``--usage-file`` gets JSON written even on failure: ``completed``, ``failed``, token counts (null
  before any answered call), ``api_calls``, ``session_id`` (null on an early failure).
- The transcript is the SQLite ``$HERMES_HOME/state.db`` (WAL mode): ``sessions`` and ``messages``
  (role user/assistant/tool, ``tool_calls`` JSON on assistant rows, tool results by ``tool_call_id``;
  the terminal tool's result is JSON with ``output`` and ``exit_code``).
- Against a loopback endpoint Hermes probes for a local server (LM Studio, Ollama, llama.cpp, vLLM
  paths) to learn the context window, vision support and prices. ``model.context_length``,
  ``model.ollama_num_ctx`` and ``model.supports_vision`` answer the first two up front; the price lookup
  has no knob and costs one ``GET /v1/props`` (404) and one ``GET /v1/models`` after the first answer.
  The other probe paths lie outside ``/v1`` and never reach the endpoint.
- At run time Hermes would ``pip install`` optional extras; ``security.allow_lazy_installs: false``
  and ``HERMES_DISABLE_LAZY_INSTALLS=1`` stop that. With the web, browser and vision toolsets left out it
  looks nothing up on the internet during a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import posixpath
import re
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

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
    as_text,
    bound_middle,
    failure_patterns,
    first_match,
    int_or_none,
    read_or_none,
)
from harnesses.install import venv_install, venv_prefix
from policy import FailureKind
from sandboxes.base import ExecResult, Sandbox

log = logging.getLogger(__name__)

PACKAGE = "hermes-agent"
BIN_NAME = "hermes"
TESTED_VERSION = "0.19.0"
KNOWN_WORKING_VERSIONS = ("0.19.0",)

# 1 is Hermes's "no retry": the gateway retries upstream failures itself. A stream cut mid-answer is
# still recovered: Hermes asks for a continuation of a truncated answer, outside this retry loop.
API_MAX_RETRIES = 1
# Told up front so Hermes does not probe the endpoint for it; compression starts from this figure, and a
# real overflow is reported by the endpoint anyway.
CONTEXT_LENGTH = 131_072
# A coding agent's tools: the shell and files. Web, browser and vision tools would reach the internet.
TOOLSETS = "terminal,file"

MAX_DB_BYTES = 64 * 1024 * 1024
MAX_USAGE_FILE_BYTES = 64 * 1024
MAX_STDOUT_BYTES = 4 * 1024 * 1024
MAX_DB_ROWS = 20_000
# SQLite virtual-machine steps between progress checks, and how many checks a query may take: a crafted
# database cannot keep the parser busy for long.
_SQLITE_PROGRESS_STEPS = 10_000
_SQLITE_MAX_PROGRESS_CALLS = 2_000

# The bootstrap reads the prompt from a file: argv would cap its length (128 KiB per string) and make a
# leading "-" an option. ``--oneshot=`` keeps any text one value.
_BOOTSTRAP = (
    "import sys\n"
    "from hermes_cli.main import main\n"
    "with open(sys.argv[1], encoding='utf-8') as f:\n"
    "    prompt = f.read()\n"
    "sys.argv = ['hermes', '--oneshot=' + prompt, *sys.argv[2:]]\n"
    "sys.exit(main())\n"
)

# A Hermes error report -> the failure it claims. First match wins: Hermes's own phrasings and the HTTP
# status it names come before words that may also occur inside an endpoint's error body, which Hermes
# quotes after the status.
FAILURE_PATTERNS = failure_patterns(
    (
        r"^Context length exceeded|Cannot compress further|^Request payload too large",
        FailureKind.MODEL_CONTEXT_LIMIT,
    ),
    (r"\bHTTP 40[13]\b", FailureKind.PROVIDER_AUTH_ERROR),
    (r"\bHTTP 429\b", FailureKind.RATE_LIMIT_EXCEEDED),
    (r"\bHTTP (408|5\d\d)\b", FailureKind.PROVIDER_UNAVAILABLE),
    (r"context_length_exceeded|maximum context length", FailureKind.MODEL_CONTEXT_LIMIT),
    (r"\bHTTP 4\d\d\b|^Model generated invalid tool call", FailureKind.MODEL_REQUEST_ERROR),
    (r"^Billing or credits exhausted", FailureKind.PROVIDER_AUTH_ERROR),
    (r"truncated due to output length", FailureKind.MODEL_OUTPUT_LIMIT),
    # Hermes takes a cut stream for a truncated answer and asks for continuations until it gives up.
    (r"remained truncated after", FailureKind.TRANSPORT_ERROR),
    (r"connection (error|refused|reset)|\btimed out\b|APIConnectionError", FailureKind.TRANSPORT_ERROR),
    (r"\bunauthorized\b|invalid_api_key", FailureKind.PROVIDER_AUTH_ERROR),
    (r"too many requests|rate_limit_exceeded|rate limit", FailureKind.RATE_LIMIT_EXCEEDED),
)
# Exit code 2 with nothing printed: the turn failed or was cut without any text. Measured for a stream
# dropped on every try (Hermes takes the cut answer for a truncated one and asks to continue it).
NO_ANSWER_MESSAGE = "hermes -z ended without an answer (exit code 2: failed or partial turn)"
_AGENT_FAILED_RE = re.compile(r"^hermes -z: (.{1,4000})$", re.MULTILINE)
# How Hermes's own error sentences begin: without a usage file, a stdout that starts so is no answer.
_ERROR_SENTENCE_RE = re.compile(
    r"^(API call failed after \d+ retries|HTTP \d{3}: |Context length exceeded|Request payload too large"
    r"|Invalid API response after|Billing or credits exhausted|Model generated invalid tool call)"
)


def recognize_failure(message: str | None) -> FailureKind | None:
    """The failure kind a Hermes error sentence claims, or None when no pattern knows it."""
    if not message:
        return None
    if message == NO_ANSWER_MESSAGE:
        return FailureKind.TRANSPORT_ERROR
    return first_match(FAILURE_PATTERNS, message[:MAX_SCANNED_CHARS])


def render_config(model: str, base_url: str, api_key: str) -> str:
    """``$HERMES_HOME/config.yaml`` for one session: our endpoint, no probes, no installs, few retries."""
    config = {
        "model": {
            "default": model,
            "provider": "custom",
            "base_url": base_url,
            "api_key": api_key,
            "context_length": CONTEXT_LENGTH,
            "ollama_num_ctx": CONTEXT_LENGTH,
            "supports_vision": False,
        },
        "agent": {"api_max_retries": API_MAX_RETRIES},
        "security": {"allow_lazy_installs": False},
    }
    return yaml.safe_dump(config, sort_keys=False, allow_unicode=False)


class HermesHarness:
    """Hermes Agent driven headlessly with ``hermes -z`` (oneshot)."""

    name = "hermes"
    tested_version = TESTED_VERSION
    api: HarnessApi | None = "chat"  # provider "custom" speaks Chat Completions

    def __init__(self, version: str | None = None) -> None:
        self.version = version or TESTED_VERSION
        warn_if_untested(self.name, self.version, self.tested_version, KNOWN_WORKING_VERSIONS)

    # -- install ----------------------------------------------------------------------------------------

    def ensure_installed(self, cache_root: Path) -> Path:
        """Install this version into its own venv in the cache (once); return the venv directory."""
        venv_install(cache_root, PACKAGE, self.version, BIN_NAME)
        return venv_prefix(cache_root, PACKAGE, self.version)

    # -- launch -----------------------------------------------------------------------------------------

    async def prepare(self, sandbox: Sandbox, ctx: LaunchContext) -> Launch:
        hermes_home = _hermes_home(sandbox)
        config = render_config(ctx.model, ctx.base_url, ctx.api_key)
        await sandbox.write_file(posixpath.join(hermes_home, "config.yaml"), config.encode(), 0o600)
        await sandbox.write_file(_prompt_path(sandbox), ctx.prompt.encode("utf-8"), 0o600)
        python = str(Path(ctx.install_dir) / "bin" / "python")
        argv = [python, "-c", _BOOTSTRAP, _prompt_path(sandbox)]
        argv += ["--usage-file", _usage_path(sandbox), "--toolsets", TOOLSETS]
        env = {
            "HERMES_HOME": hermes_home,
            "HERMES_DISABLE_LAZY_INSTALLS": "1",
            "HERMES_NONINTERACTIVE": "1",
            "PYTHONNOUSERSITE": "1",
        }
        return Launch(argv=argv, env=env)

    # -- parse ------------------------------------------------------------------------------------------

    async def parse(self, sandbox: Sandbox, result: ExecResult) -> HarnessReport:
        gaps: list[str] = []
        usage_file = await _read_usage_file(sandbox, gaps)
        stdout = await _read_stdout(sandbox, result, gaps)

        db_path = posixpath.join(_hermes_home(sandbox), "state.db")
        native_transcript: str | None = None
        transcript = _Transcript()
        db = await read_or_none(sandbox, db_path, MAX_DB_BYTES)
        if not db:
            gaps.append("transcript_unavailable")
        elif len(db) >= MAX_DB_BYTES:
            gaps.append("transcript_truncated")  # a cut SQLite file cannot be read
        else:
            native_transcript = db_path
            wal = await read_or_none(sandbox, db_path + "-wal", MAX_DB_BYTES) or b""
            session_id = usage_file.get("session_id")
            await asyncio.to_thread(
                _parse_database, db, wal, session_id if isinstance(session_id, str) else None, transcript
            )
            gaps += transcript.gaps

        usage = _usage_of(usage_file) or transcript.usage
        if usage is None:
            gaps.append("usage_unavailable")

        claimed_message = _claimed_message(result, usage_file, stdout)
        final_text: str | None = None
        if claimed_message is None:
            # The database's last assistant text stands in only for a run that ended normally: a killed
            # Hermes leaves a middle turn there.
            final_text = stdout or (transcript.last_assistant_text if result.exit_code == 0 else None)
        messages = transcript.messages
        if not messages and final_text:
            messages = [Message(role="assistant", text=bound_middle(final_text, MAX_MESSAGE_CHARS))]
        return HarnessReport(
            messages=messages,
            tool_calls=transcript.tool_calls,
            usage=usage or Usage(),
            final_text=bound_middle(final_text, MAX_MESSAGE_CHARS) if final_text else None,
            claimed_failure=recognize_failure(claimed_message),
            claimed_message=bound_middle(claimed_message, MAX_CLAIMED_MESSAGE_CHARS)
            if claimed_message
            else None,
            evidence_gaps=gaps,
            native_transcript_path=native_transcript,
            reconnects=None,  # Hermes does not say when it re-sends a request
        )


def _hermes_home(sandbox: Sandbox) -> str:
    return posixpath.join(posixpath.normpath(sandbox.home), ".hermes")


def _usage_path(sandbox: Sandbox) -> str:
    return posixpath.join(posixpath.normpath(sandbox.home), "hermes-usage.json")


def _prompt_path(sandbox: Sandbox) -> str:
    return posixpath.join(posixpath.normpath(sandbox.home), "hermes-prompt.txt")


# ---------------------------------------------------------------------------------------------------------
# What the run said: stdout, the usage file, the exit code


async def _read_usage_file(sandbox: Sandbox, gaps: list[str]) -> dict[str, Any]:
    data = await read_or_none(sandbox, _usage_path(sandbox), MAX_USAGE_FILE_BYTES)
    if data is None:
        gaps.append("usage_file_unavailable")
        return {}
    try:
        value = json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        gaps.append("usage_file_unparseable")
        return {}
    return value


async def _read_stdout(sandbox: Sandbox, result: ExecResult, gaps: list[str]) -> str:
    data = await read_or_none(sandbox, result.stdout_path, MAX_STDOUT_BYTES) if result.stdout_path else None
    if data is None:
        if result.stdout_bytes > len(result.stdout_tail.encode("utf-8", "replace")):
            gaps.append("stdout_partial")
        return result.stdout_tail.strip()
    return data.decode("utf-8", "replace").strip()


def _claimed_message(result: ExecResult, usage_file: dict[str, Any], stdout: str) -> str | None:
    """Hermes's own word that the run failed, or None when it claims an answer."""
    if result.exit_code == 1:
        match = _AGENT_FAILED_RE.search(result.stderr_tail)
        return match.group(1) if match else f"hermes -z exited 1: {result.stderr_tail.strip()[-2000:]}"
    if result.exit_code == 2 and not stdout:
        return NO_ANSWER_MESSAGE
    failed = usage_file.get("failed")
    if failed is True or (usage_file.get("completed") is False and stdout):
        # On failure the "answer" on stdout is Hermes's error sentence.
        return stdout or (
            as_text(usage_file.get("failure")) or "hermes reported a failed run without a message"
        )
    if not isinstance(failed, bool) and _ERROR_SENTENCE_RE.match(stdout):
        return stdout
    return None


def _usage_of(data: dict[str, Any]) -> Usage | None:
    """Token counts from the usage file or a sessions row; None when it has none (zeros mean none too:
    Hermes counts 0 for answers that carried no usage)."""
    usage = Usage(
        input_tokens=int_or_none(data.get("input_tokens")),
        output_tokens=int_or_none(data.get("output_tokens")),
        cached_input_tokens=int_or_none(data.get("cache_read_tokens")),
        reasoning_tokens=int_or_none(data.get("reasoning_tokens")),
    )
    if not usage.input_tokens and not usage.output_tokens:
        return None
    return usage


# ---------------------------------------------------------------------------------------------------------
# The native transcript ($HERMES_HOME/state.db)


@dataclass
class _Transcript:
    messages: list[Message] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage | None = None
    last_assistant_text: str | None = None
    gaps: list[str] = field(default_factory=list)


_SESSION_COLUMNS = ("id", "input_tokens", "output_tokens", "cache_read_tokens", "reasoning_tokens")
_SYSTEM_NOTE_PREFIX = "[System: "
_MESSAGE_QUERY = (
    "SELECT role, substr(content, 1, ?), tool_call_id, substr(tool_calls, 1, ?) FROM messages "
    "WHERE session_id = ? ORDER BY id LIMIT ?"
)


def _parse_database(db: bytes, wal: bytes, session_id: str | None, transcript: _Transcript) -> None:
    """Read the session's messages from a private copy of the database (and its write-ahead log)."""
    try:
        session, rows = _query_copy(db, wal, session_id)
    except (sqlite3.Error, OverflowError, ValueError) as exc:
        transcript.gaps.append("transcript_unparseable")
        log.info("hermes state.db unreadable: %s", str(exc)[:200])
        return
    if session is None:
        transcript.gaps.append("transcript_no_session")
        return
    transcript.usage = _usage_of(dict(zip(_SESSION_COLUMNS, session, strict=True)))
    _apply_rows(rows, transcript)


def _query_copy(db: bytes, wal: bytes, session_id: str | None) -> tuple[tuple[Any, ...] | None, list[Any]]:
    with tempfile.TemporaryDirectory(prefix="hermes-db-") as tmp:
        path = Path(tmp) / "state.db"
        path.write_bytes(db)
        if wal:
            (Path(tmp) / "state.db-wal").write_bytes(wal)
        calls = 0

        def progress() -> int:
            nonlocal calls
            calls += 1
            return 1 if calls > _SQLITE_MAX_PROGRESS_CALLS else 0  # non-zero interrupts the query

        with contextlib.closing(sqlite3.connect(path.as_uri() + "?mode=ro", uri=True)) as conn:
            conn.set_progress_handler(progress, _SQLITE_PROGRESS_STEPS)
            # The file came from the sandbox: nothing in its schema may run as code.
            conn.execute("PRAGMA trusted_schema = OFF")
            conn.execute("PRAGMA query_only = ON")
            columns = ", ".join(_SESSION_COLUMNS)
            if session_id is not None:
                session = conn.execute(
                    f"SELECT {columns} FROM sessions WHERE id = ?", (session_id,)
                ).fetchone()
            else:
                session = None
            if session is None:  # an early failure leaves no id in the usage file; oneshot makes one session
                session = conn.execute(
                    f"SELECT {columns} FROM sessions ORDER BY started_at DESC LIMIT 1"
                ).fetchone()
            if session is None:
                return None, []
            limit = MAX_MESSAGE_CHARS + 1
            rows = conn.execute(_MESSAGE_QUERY, (limit, limit, session[0], MAX_DB_ROWS)).fetchall()
            return session, rows


def _apply_rows(rows: list[Any], transcript: _Transcript) -> None:
    calls: dict[str, ToolCall] = {}
    bad = 0
    for role, content, tool_call_id, tool_calls in rows:
        text = _str(content)
        if role == "user":
            # Hermes's own notes to the model (asking to continue a cut answer) are stored as user turns.
            who = "system" if text.startswith(_SYSTEM_NOTE_PREFIX) else "user"
            transcript.messages.append(Message(role=who, text=bound_middle(text, MAX_MESSAGE_CHARS)))
        elif role == "assistant":
            if text:
                transcript.messages.append(
                    Message(role="assistant", text=bound_middle(text, MAX_MESSAGE_CHARS))
                )
                transcript.last_assistant_text = text
            bad += _add_calls(_loads(tool_calls), calls) if tool_calls else 0
        elif role == "tool":
            call = calls.get(_str(tool_call_id))
            if call is None:
                bad += 1
            else:
                _apply_result(call, text)
        else:
            bad += 1
    transcript.tool_calls = list(calls.values())
    if bad:
        transcript.gaps.append(f"transcript_unparseable_rows:{bad}")


def _add_calls(value: object, calls: dict[str, ToolCall]) -> int:
    """Add an assistant row's tool calls; return how many entries could not be read."""
    if not isinstance(value, list):
        return 1
    bad = 0
    for entry in value:
        function = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            bad += 1
            continue
        call_id = entry.get("id") if isinstance(entry.get("id"), str) else f"call-{len(calls)}"
        calls[call_id] = ToolCall(
            name=function["name"][:200],
            call_id=call_id[:200],
            arguments=bound_middle(as_text(function.get("arguments")), MAX_ARGUMENT_CHARS),
        )
    return bad


def _apply_result(call: ToolCall, content: str) -> None:
    """A tool result: the terminal tool's is JSON with ``exit_code``; others say ``error`` or not."""
    result = _loads(content)
    if isinstance(result, dict):
        exit_code = _exit_code(result.get("exit_code"))
        output = result.get("output") if "output" in result else content
        if exit_code is not None:
            status = "completed" if exit_code == 0 else "failed"
        else:
            status = "failed" if result.get("error") or result.get("success") is False else "completed"
        error = result.get("error")
        if error and status == "failed" and not output:
            output = error
    else:
        exit_code, output, status = None, content, "completed"
    call.status = status
    call.exit_code = exit_code
    call.output = bound_middle(as_text(output), MAX_TOOL_OUTPUT_CHARS)


def _exit_code(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else ""


def _loads(data: object) -> object:
    text = _str(data)
    try:
        return json.loads(text) if text else None
    except (ValueError, RecursionError):
        return None
