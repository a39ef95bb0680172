"""The model gateway: the one door between a sandboxed harness and the real model endpoint.

One aiohttp server per worker; one unguessable URL prefix per session (``/s/<token>/v1/...``), so every
request is attributed to its rollout and a sandbox never sees the real API key. The gateway retries
429 / 5xx / 408 / transport failures upstream with the same body bytes while no byte of the answer has
reached the harness, records every upstream attempt as the session's authoritative evidence, and once it
gives up on a session answers every further request with the one neutral 400 that stops all four harnesses
after a single request (``reference/harnesses.md`` §9), so their own retry loops cannot multiply the load.

Every upstream attempt is bounded in time: its first body byte within ``first_byte_timeout_s`` of sending,
then no gap longer than ``chunk_timeout_s``; a stall is a ``model_timeout``, retried like a transport
failure while nothing reached the harness. An error the endpoint reports inside a 200 answer is that
attempt's failure. Only model calls and model listings reach the endpoint; any other path is answered
here. Per session it keeps the time spent waiting on the model and, at close, whether a request had
stalled (a deadline falling then is the model's fault, not the agent's).

Everything runs on the worker's event loop: call ``open_session`` / ``close_session`` from that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import secrets
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from pydantic import BaseModel, ConfigDict, Field
from yarl import URL

from policy import (
    FailureKind,
    Rule,
    backoff_delay,
    bound_text,
    error_message_of,
    is_retryable,
    kind_for_http,
    kind_for_stream_error,
    parse_retry_after,
)
from sandboxes.inline import small_inline

SESSION_HEADER = "x-rollout-session"  # the scripted model keys its scripts on it; a real endpoint ignores it

# The only answer that ends all four harnesses' loops after one request (harnesses.md §9). They match on
# the whole body, so it must stay free of status digits (429, 500, 503, ...) and of words like retry,
# rate, timeout, connection, overloaded or context; and at least 30 characters long for Hermes.
CLOSED_BODY = (
    b'{"error":{"message":"gateway: session closed by gateway policy; no further model calls allowed",'
    b'"type":"invalid_request_error","code":"gateway_session_closed"}}'
)
# Any path but a model call or a model listing: answered here, never forwarded with the real key (files,
# fine-tuning, batches, LoRA load/unload live there). As neutral as CLOSED_BODY, for the same reasons.
NOT_SERVED_BODY = (
    b'{"error":{"message":"gateway: this path is not served; only model calls and model listings pass",'
    b'"type":"invalid_request_error","code":"gateway_path_not_served"}}'
)
# A model listing the endpoint did not give (no answer, a stall, a 5xx): the harness's lookup goes on
# without it, and a 5xx's words must not reach a harness that matches on them.
NO_LISTING_BODY = (
    b'{"error":{"message":"gateway: the endpoint gave no usable model listing for this lookup",'
    b'"type":"invalid_request_error","code":"gateway_listing_missing"}}'
)

_MAX_REQUEST_BYTES = 256 * 2**20  # a long agent history passes aiohttp's 1 MiB default easily
_MAX_HELD_BYTES = 64 * 2**20  # a non-streamed answer is relayed whole up to this, streamed on past it
_MAX_ERROR_BODY_BYTES = 2**20  # an error answer is read (and relayed) up to this; real ones are tiny
_MAX_LISTING_BYTES = 16 * 2**20  # a model listing; OpenRouter's is a few MiB
_MAX_SNIFF_LINE_BYTES = 4 * 2**20  # an SSE line longer than this is not parsed for usage
# With capture_tokens the final Responses event repeats the prompt's ids and text: past 4 MiB in a long run.
_MAX_CAPTURE_LINE_BYTES = 48 * 2**20
_MAX_MESSAGE_CHARS = 2_000
_MAX_CAPTURED_TOKENS = 1_000_000  # per list per model call; past it the record says tokens_truncated
_MAX_TOKEN_ID = 2**31 - 1  # the row stores int32; an id past it is not a real vocabulary's
# The two model-call APIs whose requests ask for token ids when capture_tokens is on.
_CHAT_PATH, _RESPONSES_PATH = "/chat/completions", "/responses"
_MODEL_CALLS = frozenset({_CHAT_PATH[1:], _RESPONSES_PATH[1:]})  # POST, the path after /v1/
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_MAX_CONNECTIONS = 512
_KEEPALIVE_S = 30.0

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# The harness's Authorization carries only its session token; the gateway adds the real key itself.
_NOT_FORWARDED = _HOP_BY_HOP | {
    "host",
    "authorization",
    "content-length",
    "accept-encoding",
    "expect",
    SESSION_HEADER,
}
_NOT_RELAYED = _HOP_BY_HOP | {"content-length"}


class GatewayConfig(BaseModel):
    """The gateway's bounds. Attempt budgets count upstream attempts, the first one included."""

    model_config = ConfigDict(extra="forbid")

    max_attempts_per_request: int = Field(default=4, ge=1, le=100)
    # Failed upstream attempts (429 / 5xx / 408 / transport, stream cuts included) over the whole session.
    # Successful calls do not count: a long agent session makes hundreds of them.
    max_attempts_per_session: int = Field(default=24, ge=1)
    # Counted from a request's first failure: no retry starts past it.
    retry_deadline_s: float = Field(default=120.0, ge=0)
    backoff_base_s: float = Field(default=0.5, ge=0)  # exponential, full jitter, Retry-After as a floor
    backoff_cap_s: float = Field(default=8.0, ge=0)
    max_retry_after_s: float = Field(default=60.0, ge=0)  # a longer hint ends the retries of that request
    connect_timeout_s: float = Field(default=10.0, gt=0)
    # A stalled attempt is a model_timeout, retried like a transport failure while nothing reached the
    # harness. From sending an attempt to its first body byte (the wait for the headers included):
    first_byte_timeout_s: float = Field(default=120.0, gt=0)
    chunk_timeout_s: float = Field(default=60.0, gt=0)  # the longest gap between body bytes after that
    # How long a harness may stop reading before its answer is cut. Also the socket-level backstop behind
    # the two stall bounds (aiohttp's sock_read), never shorter than either of them.
    read_timeout_s: float = Field(default=300.0, gt=0)
    max_context_overflows: int = Field(default=3, ge=0)  # per session; OpenCode can loop on them forever
    keep_bodies: bool = True  # request and response bodies into the evidence dir, gzip
    max_body_bytes: int = Field(default=32 * 2**20, ge=0)  # per kept body; the record says when it was cut
    # Ask the endpoint (vLLM's OpenAI-compatible server) for token ids and logprobs and record them per
    # model call, so a trainer needs no retokenization. Off, requests go upstream byte for byte.
    capture_tokens: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # None: not asked for


class AttemptRecord(BaseModel):
    """One upstream attempt, as the endpoint answered it."""

    model_config = ConfigDict(extra="forbid")

    request_index: int  # 0-based, per session, in arrival order
    attempt: int  # 1-based within the request
    method: str
    path: str  # after /v1, e.g. "/responses"
    started_at: float  # epoch seconds
    status: int | None  # None: no HTTP answer at all
    kind: FailureKind  # NONE for a complete 2xx
    error_message: str | None = None
    latency_s: float
    ttfb_s: float | None = None  # to the first body byte, the one that matters for a streamed answer
    retry_after_s: float | None = None  # the usable Retry-After hint, None when absent or unusable
    streamed: bool = False  # the answer was an event stream
    response_bytes: int = 0
    request_sha256: str
    input_tokens: int | None = None  # None when the answer carried no usage, never 0 for unknown
    output_tokens: int | None = None
    # The API's own word: chat "stop" / "length" / "tool_calls"; Responses "completed" / "failed" or the
    # incomplete reason ("max_output_tokens").
    finish_reason: str | None = None
    request_file: str | None = None  # relative to the session's evidence dir; one file per request
    response_file: str | None = None
    request_truncated: bool = False
    response_truncated: bool = False
    # The harness went away (or stopped reading) before the answer was complete; kind is TRANSPORT_ERROR,
    # and this flag tells that from a failure of the endpoint.
    client_aborted: bool = False
    # With capture_tokens, what the endpoint returned; None when it returned none. The two completion
    # lists are one to one when of equal length (the Responses API gives logprobs for output text only,
    # so a function call's ids come without them).
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    tokens_truncated: bool = False  # a list reached _MAX_CAPTURED_TOKENS and was cut there


@dataclass(eq=False)
class GatewaySession:
    """One rollout's view of the gateway."""

    session_id: str
    token: str
    base_url: str  # what the harness gets as its base URL, ending in /v1
    evidence_dir: Path
    attempts: list[AttemptRecord] = field(default_factory=list)
    closed_kind: FailureKind | None = None  # why the gateway stopped serving it; None if it never did
    closed_message: str | None = None
    # Set by close_session: a request was still outstanding and had gone at least min(first_byte_timeout_s,
    # chunk_timeout_s) without an upstream byte, counted from its arrival and reset by each byte of its
    # answer, not by a retry (classify: a deadline that falls then is model_timeout, not agent_timeout).
    stalled_at_close: bool = False
    # Wall time with at least one of the session's requests (model calls and listings) outstanding at the
    # gateway, from arrival to the end of its answer (retries and backoff included, overlaps counted once),
    # frozen at close_session with a request still outstanding then counted up to that moment.
    # model_wait_now() is the live value.
    model_wait_s: float = 0.0
    _requests: int = field(default=0, init=False, repr=False)  # model calls forwarded upstream
    _refused: int = field(default=0, init=False, repr=False)  # answered with CLOSED_BODY, never forwarded
    _probes: int = field(default=0, init=False, repr=False)  # model listings forwarded, not attempts
    _probes_failed: int = field(default=0, init=False, repr=False)
    _pending: set[_Request] = field(default_factory=set, init=False, repr=False)  # outstanding requests
    _busy_since: float = field(default=0.0, init=False, repr=False)  # monotonic; valid while _pending
    # The last request to end: how long it had gone without an upstream byte if the harness hung up on it.
    _hung_up_silence: float | None = field(default=None, init=False, repr=False)
    _waited: float = field(default=0.0, init=False, repr=False)  # closed busy spells, summed
    _failures: int = field(default=0, init=False, repr=False)  # against max_attempts_per_session
    _overflows: int = field(default=0, init=False, repr=False)
    _ended: bool = field(default=False, init=False, repr=False)  # close_session was called
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set, init=False, repr=False)
    _live: set[_Attempt] = field(default_factory=set, init=False, repr=False)

    def last_failure(self) -> AttemptRecord | None:
        return next((a for a in reversed(self.attempts) if a.kind is not FailureKind.NONE), None)

    def model_wait_now(self) -> float:
        """Seconds spent waiting on the model so far, a request outstanding now included; after
        close_session, the frozen ``model_wait_s``."""
        if self._ended:
            return self.model_wait_s
        return self._waited + (time.monotonic() - self._busy_since if self._pending else 0.0)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self._requests,
            "refused_after_close": self._refused,
            "attempts": len(self.attempts),
            "by_kind": dict(Counter(a.kind.value for a in self.attempts)),
            "client_aborts": sum(a.client_aborted for a in self.attempts),
            "context_overflows": self._overflows,
            "closed_kind": self.closed_kind.value if self.closed_kind else None,
            "probes": self._probes,
            "probes_failed": self._probes_failed,
            "model_wait_s": round(self.model_wait_now(), 3),
            "stalled_at_close": self.stalled_at_close,
        }

    def _begin(self, req: _Request) -> None:
        if not self._pending:
            self._busy_since = req.arrived
        self._pending.add(req)

    def _end(self, req: _Request, *, hung_up: bool = False) -> None:
        if req in self._pending:
            now = time.monotonic()
            self._pending.discard(req)
            if not self._pending:
                self._waited += now - self._busy_since
            # A harness killed at its deadline hangs up first: the request it was waiting on is gone from
            # _pending by the time the session closes, but how long it had waited still tells whose the
            # time was.
            self._hung_up_silence = now - req.last_byte if hung_up else None

    def _close(self, kind: FailureKind, message: str) -> None:
        if self.closed_kind is None:  # the first cause is the one that explains the row
            self.closed_kind = kind
            self.closed_message = bound_text(message)


@dataclass(eq=False)
class _Request:
    """One harness request; the same bytes go upstream on every attempt."""

    session: GatewaySession
    index: int
    method: str
    path: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes
    sha256: str
    arrived: float  # monotonic
    last_byte: float  # monotonic: the arrival, then each upstream body byte of any attempt; not a retry
    capture_tokens: bool = False  # the body was rewritten to ask for token ids; parse the answer for them
    request_file: str | None = None
    request_truncated: bool = False
    # The body's kept copy, written while the first attempt goes upstream: (file name, (written, cut)).
    saving: tuple[str, asyncio.Future[tuple[bool, bool]]] | None = None

    async def saved(self) -> None:
        """Wait for the kept copy of the body, so that the attempt's record can name it."""
        if self.saving is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.saving[1])
            self.take_saved()

    def take_saved(self) -> None:
        if self.saving is None or not self.saving[1].done():
            return
        name, future = self.saving
        self.saving = None
        if not future.cancelled() and future.exception() is None:
            written, self.request_truncated = future.result()
            self.request_file = name if written else None


class _GzipCapture:
    """Compresses a body as it passes, up to a byte limit, so keeping it never holds the raw body."""

    def __init__(self, limit: int) -> None:
        self._zip = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31 writes a gzip header: gunzip reads it
        self._parts: list[bytes] = []
        self._left = limit
        self.truncated = False

    def feed(self, chunk: bytes) -> None:
        if len(chunk) > self._left:
            chunk, self.truncated = chunk[: self._left], True
        if chunk:
            self._left -= len(chunk)
            self._parts.append(self._zip.compress(chunk))

    def save(self, path: Path) -> bool:
        """False when the file could not be written: a gap in the evidence must not fail the request."""
        try:
            path.write_bytes(b"".join(self._parts) + self._zip.flush())
        except OSError:
            return False
        return True


class _TokenCapture:
    """Token ids and logprobs from the JSON objects of one answer, in the places vLLM puts them.

    Chat Completions: ``prompt_token_ids`` on the answer (a stream's first chunk), ``token_ids`` and
    ``logprobs.content`` on each choice (a chunk's delta). Responses API: ``logprobs`` on output text
    (each ``response.output_text.delta``, then whole in the final response object, which replaces the
    deltas) and, with ``enable_response_messages``, ``input_messages`` / ``output_messages`` of raw tokens.
    A logprob's token reads ``token_id:<id>`` when ids were asked for; those ids stand in when the answer
    carries no id list of its own.
    """

    def __init__(self) -> None:
        self.prompt: list[int] | None = None
        self.ids: list[int] | None = None  # from the answer's own id lists
        self.logprobs: list[float] | None = None
        self.logprob_ids: list[int] | None = []  # parsed from logprob tokens; None once one is not an id
        self.truncated = False

    def result(self) -> tuple[list[int] | None, list[int] | None, list[float] | None]:
        ids = self.ids if self.ids is not None else self.logprob_ids or None
        return self.prompt, ids, self.logprobs

    def take(self, obj: dict[str, Any]) -> None:
        if obj.get("type") == "response.output_text.delta":
            self._add_logprobs(obj.get("logprobs"))
            return
        response = obj.get("response") if isinstance(obj.get("response"), dict) else obj
        if response.get("object") == "response":
            self._take_response(response)
            return
        if "prompt_token_ids" in obj:
            self.prompt = self._ids(obj["prompt_token_ids"]) or self.prompt
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # harnesses ask for one choice; a second one is not this call's answer
            if (ids := self._ids(choice.get("token_ids"))) is not None:
                self.ids = self._bounded(self.ids or [], ids)
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict):
                self._add_logprobs(logprobs.get("content"))

    def _take_response(self, response: dict[str, Any]) -> None:
        entries: list[Any] = []
        for item in response.get("output") or []:
            for part in (item.get("content") or []) if isinstance(item, dict) else []:
                if isinstance(part, dict) and isinstance(part.get("logprobs"), list):
                    entries += part["logprobs"]
        if entries:  # the whole answer's logprobs: they replace what the deltas gave
            self.logprobs, self.logprob_ids = None, []
            self._add_logprobs(entries)
        prompt = self._raw_tokens(response.get("input_messages"))
        if prompt is not None:
            self.prompt = prompt
        output = self._raw_tokens(response.get("output_messages"))
        if output is not None:
            self.ids = output

    def _raw_tokens(self, messages: Any) -> list[int] | None:
        # vLLM's enable_response_messages: [{"type": "raw_message_tokens", "message": ..., "tokens": [...]}]
        found: list[int] | None = None
        for message in messages if isinstance(messages, list) else []:
            if isinstance(message, dict) and message.get("type") == "raw_message_tokens":
                if (ids := self._ids(message.get("tokens"))) is not None:
                    found = self._bounded(found or [], ids)
        return found

    def _add_logprobs(self, entries: Any) -> None:
        if not isinstance(entries, list):
            return
        values: list[float] = []
        ids: list[int] = []
        for entry in entries:
            value = entry.get("logprob") if isinstance(entry, dict) else None
            if not isinstance(value, int | float) or isinstance(value, bool):
                return  # not a logprob list this parser understands: keep none of it
            values.append(float(value))
            token = entry.get("token")
            if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
                ids.append(int(token[9:]))
        self.logprobs = self._bounded(self.logprobs or [], values)
        if self.logprob_ids is not None:
            self.logprob_ids = self._bounded(self.logprob_ids, ids) if len(ids) == len(values) else None

    def _ids(self, value: Any) -> list[int] | None:
        if not isinstance(value, list):
            return None
        if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _MAX_TOKEN_ID for v in value):
            return value
        return None

    def _bounded(self, kept: list[Any], more: list[Any]) -> list[Any]:
        room = _MAX_CAPTURED_TOKENS - len(kept)
        if len(more) > room:
            more, self.truncated = more[: max(room, 0)], True
        kept.extend(more)
        return kept


class _UsageSniffer:
    """Token usage and finish reason from an answer as it passes: chat or Responses, SSE or one JSON.
    With ``tokens``, the answer's token ids and logprobs too. And the first error the endpoint reported
    inside it, from the objects it parses anyway: an SSE ``event: error``, an object with a top-level
    ``error`` (a Chat chunk, a whole answer, a Responses object that failed or is incomplete with one),
    ``type: error`` / ``object: error``, or a Responses object whose status is ``failed``."""

    def __init__(self, tokens: _TokenCapture | None = None) -> None:
        self.tokens = tokens
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.finish_reason: str | None = None
        self.error: tuple[str | int | None, str] | None = None  # (code, message), bounded
        self._error_event = False  # the event line before this data line said "error"
        self._line_limit = _MAX_CAPTURE_LINE_BYTES if tokens else _MAX_SNIFF_LINE_BYTES
        # The unfinished line in parts, joined once its newline comes: a long line costs one copy.
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._overlong = False

    def feed_sse(self, chunk: bytes) -> None:
        if b"\n" not in chunk:
            if not self._overlong:  # the rest of an overlong line is dropped as it comes
                self._hold(chunk)
            return
        lines = (b"".join(self._pending) + chunk).split(b"\n")
        self._pending, self._pending_bytes = [], 0
        if self._overlong:
            lines.pop(0)  # the tail of a line too long to parse
            self._overlong = False
        self._hold(lines.pop())
        for line in lines:
            if line.startswith(b"data:"):
                if line[5:].strip() != b"[DONE]":
                    self.feed_json(line[5:])
                self._error_event = False
            elif line.startswith(b"event:"):
                self._error_event = line[6:].strip() == b"error"

    def _hold(self, part: bytes) -> None:
        self._pending.append(part)
        self._pending_bytes += len(part)
        if self._pending_bytes > self._line_limit:
            self._pending, self._pending_bytes, self._overlong = [], 0, True

    def feed_json(self, text: bytes) -> None:
        try:
            self._take(json.loads(text))
        except ValueError:
            pass

    def _take(self, obj: Any) -> None:
        if not isinstance(obj, dict):
            return
        if self.tokens is not None:
            self.tokens.take(obj)
        if self._error_event or obj.get("type") == "error" or obj.get("object") == "error":
            error = obj.get("error")
            self._note_error(error if isinstance(error, dict) else obj)
            return
        if isinstance(obj.get("response"), dict):  # a Responses event wraps the response object
            obj = obj["response"]
        if obj.get("error"):  # null on a sound Responses object
            self._note_error(obj["error"])
        elif obj.get("status") == "failed" and obj.get("object") == "response":
            self._note_error({"code": None, "message": "response.failed without an error object"})
        usage = obj.get("usage")
        if isinstance(usage, dict):
            given = usage.get("prompt_tokens", usage.get("input_tokens"))
            produced = usage.get("completion_tokens", usage.get("output_tokens"))
            if _is_count(given):
                self.input_tokens = given
            if _is_count(produced):
                self.output_tokens = produced
        for choice in obj.get("choices") or []:
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                self.finish_reason = choice["finish_reason"]
        if obj.get("object") == "response" and obj.get("status") in ("completed", "incomplete", "failed"):
            details = obj.get("incomplete_details")
            reason = details.get("reason") if isinstance(details, dict) else None
            self.finish_reason = reason if isinstance(reason, str) else obj["status"]

    def _note_error(self, payload: Any) -> None:
        if self.error is not None:  # the first error explains the answer; later ones follow from it
            return
        code: Any = None
        message: Any = payload
        if isinstance(payload, dict):
            code = payload.get("code") if payload.get("code") is not None else payload.get("type")
            message = payload.get("message")
            if not isinstance(message, str):
                message = json.dumps(payload, ensure_ascii=False)
        if not isinstance(code, int | str) or isinstance(code, bool):
            code = None
        text = message if isinstance(message, str) and message else "an error inside the answer, no message"
        self.error = (code[:200] if isinstance(code, str) else code, text[:_MAX_MESSAGE_CHARS])


def _ask_for_tokens(body: bytes, path: str, top_logprobs: int | None) -> bytes | None:
    """The request body with vLLM's token id and logprob parameters added; None when it is not a JSON
    object (it goes upstream as it came, and the endpoint answers it as it will)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    if path == _CHAT_PATH:
        data["logprobs"] = True
    else:
        include = data.get("include") if isinstance(data.get("include"), list) else []
        data["include"] = include + ([] if _LOGPROBS_INCLUDE in include else [_LOGPROBS_INCLUDE])
        # vLLM's only way to token ids on /responses: raw prompt and output tokens on the answer.
        data["enable_response_messages"] = True
    if top_logprobs is not None:
        data["top_logprobs"] = top_logprobs
    # Chat: logprob tokens as "token_id:<id>", prompt and output ids on the answer. /responses ignores
    # both today (vLLM logs unknown fields and goes on); sent so an endpoint that learns them answers.
    data["return_tokens_as_token_ids"] = True
    data["return_token_ids"] = True
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def _save_gzip(body: bytes, limit: int, path: Path) -> tuple[bool, bool]:
    """Write ``body`` (at most ``limit`` bytes of it) gzipped: (written, cut)."""
    capture = _GzipCapture(limit)
    capture.feed(body)
    return capture.save(path), capture.truncated


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class _StallTimer:
    """The time bounds of one upstream answer: its first body byte within ``first_byte_timeout_s`` of
    sending (the wait for the headers included), then no gap longer than ``chunk_timeout_s``."""

    __slots__ = ("_config", "_first_by", "req", "started")

    def __init__(self, req: _Request, config: GatewayConfig) -> None:
        self._config = config
        self._first_by = time.monotonic() + config.first_byte_timeout_s
        self.req = req  # its last_byte is stamped with each body byte
        self.started = False  # a body byte came

    def wait_s(self) -> float:
        """How long the next read may wait."""
        if self.started:
            return self._config.chunk_timeout_s
        return max(self._first_by - time.monotonic(), 0.0)

    def byte(self) -> None:
        self.started = True
        self.req.last_byte = time.monotonic()

    def message(self) -> str:
        if self.started:
            return f"stalled mid-answer: no byte for chunk_timeout_s={self._config.chunk_timeout_s:g}s"
        return f"stalled: no first byte within first_byte_timeout_s={self._config.first_byte_timeout_s:g}s"


class _Attempt:
    """One upstream attempt in flight; ``finish`` turns it into its record exactly once."""

    def __init__(self, req: _Request, number: int, config: GatewayConfig) -> None:
        self.req = req
        self.number = number
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self.timer = _StallTimer(req, config)
        self.status: int | None = None
        self.retry_after_s: float | None = None
        self.streamed = False
        self.ttfb_s: float | None = None
        self.response_bytes = 0
        self.tokens = _TokenCapture() if req.capture_tokens else None
        self.usage = _UsageSniffer(self.tokens)
        self.capture = _GzipCapture(config.max_body_bytes) if config.keep_bodies else None
        self.record: AttemptRecord | None = None
        # The answer's final event reached the harness: nothing that ends the attempt later undoes it.
        self.answer_delivered = False
        req.session._live.add(self)

    def received(self, chunk: bytes) -> None:
        if self.ttfb_s is None:
            self.ttfb_s = self.req.last_byte - self._t0  # stamped by the read that got this chunk
        self.response_bytes += len(chunk)
        if self.capture is not None:
            self.capture.feed(chunk)
        if self.streamed:
            self.usage.feed_sse(chunk)

    def finish(
        self, kind: FailureKind, message: str | None = None, *, client_aborted: bool = False
    ) -> AttemptRecord:
        if self.record is not None:  # close_session may have recorded it first
            return self.record
        failure = self.failure_inside()
        if failure is not None:
            # The endpoint's own report explains the attempt, whatever ended it afterwards.
            then = f" (then: {message})" if message and message != failure[1] else ""
            kind, message = failure[0], failure[1] + then
        elif self.answer_delivered and (client_aborted or kind is FailureKind.CANCELLED):
            # A harness that has its answer hangs up, or exits and has its session closed, before the
            # upstream's last bytes (Codex on response.completed): the endpoint answered in full.
            kind, message, client_aborted = FailureKind.NONE, None, False
        session, req = self.req.session, self.req
        req.take_saved()  # a record made before the copy was awaited (a cancel) names it if it is there
        prompt, ids, logprobs = self.tokens.result() if self.tokens else (None, None, None)
        response_file = None
        if self.capture is not None and self.response_bytes:
            name = f"resp-{req.index}-{self.number}.{'sse' if self.streamed else 'json'}.gz"
            response_file = name if self.capture.save(session.evidence_dir / name) else None
        self.record = AttemptRecord(
            request_index=req.index,
            attempt=self.number,
            method=req.method,
            path=req.path,
            started_at=self.started_at,
            status=self.status,
            kind=kind,
            error_message=bound_text(message, _MAX_MESSAGE_CHARS),
            latency_s=time.monotonic() - self._t0,
            ttfb_s=self.ttfb_s,
            retry_after_s=self.retry_after_s,
            streamed=self.streamed,
            response_bytes=self.response_bytes,
            request_sha256=req.sha256,
            input_tokens=self.usage.input_tokens,
            output_tokens=self.usage.output_tokens,
            finish_reason=self.usage.finish_reason,
            request_file=req.request_file,
            response_file=response_file,
            request_truncated=req.request_truncated,
            response_truncated=bool(self.capture and self.capture.truncated),
            client_aborted=client_aborted,
            prompt_token_ids=prompt,
            completion_token_ids=ids,
            completion_logprobs=logprobs,
            tokens_truncated=bool(self.tokens and self.tokens.truncated),
        )
        session._live.discard(self)
        session.attempts.append(self.record)
        return self.record

    def failure_inside(self) -> tuple[FailureKind, str] | None:
        """The error the endpoint reported inside its 200 answer, classified; None if it reported none."""
        if self.usage.error is None:
            return None
        code, message = self.usage.error
        return kind_for_stream_error(code, message), message


class Gateway:
    """One per worker process. ``on_attempt`` is called with each record as it is made (live progress,
    tests); it runs on the event loop and must neither block nor raise."""

    def __init__(
        self,
        upstream_base_url: str,
        api_key: str | None,
        config: GatewayConfig | None = None,
        *,
        on_attempt: Callable[[GatewaySession, AttemptRecord], None] | None = None,
    ) -> None:
        self.config = config or GatewayConfig()
        self._upstream = upstream_base_url.rstrip("/")
        self._api_key = api_key or None
        self._on_attempt = on_attempt
        self._backoff = Rule(
            backoff_base_s=self.config.backoff_base_s, backoff_cap_s=self.config.backoff_cap_s
        )
        self._rng = random.Random()
        self._sessions: dict[str, GatewaySession] = {}
        self._client: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._url: str | None = None
        self.unix_path: str | None = None  # the Unix socket it also listens on, if any

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the gateway is not started")
        return self._url

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, unix_path: str | None = None) -> None:
        """Listen on ``host:port``; with ``unix_path`` on that Unix socket too, which is how a sandbox in
        its own network namespace reaches the gateway (``sandboxes/netns.py``)."""
        if self._runner is not None:
            raise RuntimeError("the gateway is already started")
        app = web.Application(client_max_size=_MAX_REQUEST_BYTES)
        # Every method reaches the handler, which answers what it does not forward itself (a neutral
        # JSON 404, not aiohttp's plain-text 405); so does any other path.
        app.router.add_route("*", "/s/{token}/v1/{rest:.*}", self._handle)
        app.router.add_route("*", "/{tail:.*}", _answer_not_served)
        # Cancelling the handler when the harness hangs up is what cancels its upstream request.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            if unix_path is not None:
                await web.UnixSite(runner, unix_path).start()
                self.unix_path = unix_path
        except BaseException:
            await runner.cleanup()
            raise
        cfg = self.config
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=_MAX_CONNECTIONS, keepalive_timeout=_KEEPALIVE_S),
            # connect covers the wait for a pooled connection too. The stall bounds (asyncio.timeout around
            # each wait, _StallTimer) end a silent upstream first; sock_read is only the backstop behind
            # them, so it is never the shorter one.
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=cfg.connect_timeout_s,
                sock_read=max(cfg.read_timeout_s, cfg.first_byte_timeout_s, cfg.chunk_timeout_s),
            ),
            auto_decompress=False,  # relayed as received: the usage sniffer and the kept copy see those bytes
            # What the harness sent, and nothing of aiohttp's own in its place.
            skip_auto_headers=("User-Agent", "Content-Type"),
            trust_env=False,  # a proxy from the environment must never see the real key
        )
        self._runner = runner
        self._url = f"http://{host}:{runner.addresses[0][1]}"

    async def stop(self) -> None:
        for session in list(self._sessions.values()):
            self.close_session(session)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._client is not None:
            await self._client.close()
            self._client = None
        self._url = None
        if self.unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)
            self.unix_path = None

    def open_session(self, session_id: str, evidence_dir: Path) -> GatewaySession:
        token = secrets.token_urlsafe(32)
        evidence_dir.mkdir(parents=True, exist_ok=True)
        session = GatewaySession(session_id, token, f"{self.url}/s/{token}/v1", evidence_dir)
        self._sessions[token] = session
        return session

    def close_session(self, session: GatewaySession, stall_bound_s: float | None = None) -> None:
        """Stop serving the session, cut its in-flight requests and write ``attempts.jsonl``. Idempotent.

        The session's requests from now on get CLOSED_BODY. ``closed_kind`` is left as it is: the owner
        closing a session is not the endpoint failing. ``stall_bound_s``: a tighter bound than the
        gateway's own for ``stalled_at_close`` (the owner's share of a short deadline).
        """
        if session._ended:
            return
        now = time.monotonic()
        bound = min(
            self.config.first_byte_timeout_s,
            self.config.chunk_timeout_s,
            math.inf if stall_bound_s is None else stall_bound_s,
        )
        stalled = self._stalled(session, now, bound)
        hung_up_waiting = not session._pending and (session._hung_up_silence or 0.0) >= bound
        session.stalled_at_close = bool(stalled) or hung_up_waiting
        session.model_wait_s = session.model_wait_now()
        session._ended = True
        self._sessions.pop(session.token, None)
        for attempt in list(session._live):
            if attempt.req in stalled:  # so the record shows what the session's end cut short
                waited = now - attempt.req.last_byte
                message = f"the session was closed while this request had waited {waited:.1f}s for a byte"
                self._finish(attempt, FailureKind.MODEL_TIMEOUT, message)
            else:
                self._finish(attempt, FailureKind.CANCELLED, "the session was closed while this attempt ran")
        for task in session._tasks:
            task.cancel()
        lines = "".join(record.model_dump_json() + "\n" for record in session.attempts)
        # The records stay on the session for the row; the file is the copy kept beside the bodies.
        with contextlib.suppress(OSError):
            (session.evidence_dir / "attempts.jsonl").write_text(lines)

    @staticmethod
    def _stalled(session: GatewaySession, now: float, bound: float) -> set[_Request]:
        """The session's outstanding requests that have gone the stall bound without an upstream byte
        (an answer the harness already had in full is not waiting on the model)."""
        answered = {attempt.req for attempt in session._live if attempt.answer_delivered}
        return {r for r in session._pending if r not in answered and now - r.last_byte >= bound}

    # -- serving ----------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        session = self._sessions.get(request.match_info["token"])
        if session is None:
            return _closed()
        rest = request.rel_url.raw_path.split("/", 4)[4]
        # A URL library resolves dot segments, which would let a harness reach paths outside /v1 with the
        # real key; encoded slashes too ("models/..%2Ffiles").
        if any(part in (".", "..") for part in unquote(rest).split("/")):
            return _closed()
        route = _route(request.method, rest)
        if route is None:
            return _not_served()
        if session.closed_kind is not None:
            session._refused += 1
            return _closed()
        task = asyncio.current_task()
        assert task is not None
        session._tasks.add(task)
        req: _Request | None = None
        try:
            body = await request.read()
            req = await self._new_request(session, request, rest, body, listing=route == "listing")
            session._begin(req)
            if route == "listing":
                return await self._list_models(req, request)
            return await self._forward(req, request)
        except asyncio.CancelledError:
            if req is not None:
                session._end(req, hung_up=True)
            raise
        finally:
            session._tasks.discard(task)
            if req is not None:
                session._end(req)

    async def _new_request(
        self, session: GatewaySession, request: web.Request, rest: str, body: bytes, *, listing: bool
    ) -> _Request:
        arrived = time.monotonic()
        index = -1 if listing else session._requests  # a listing is no model call: no index, no record
        session._requests += not listing
        query = request.rel_url.raw_query_string
        api_path = "/" + rest
        capture = self.config.capture_tokens and not listing
        if capture:
            # Rewritten once, here: every attempt sends these bytes, and request_sha256 is theirs.
            # Off the loop: a long agent history takes a while to parse and serialize.
            rewritten = await asyncio.to_thread(_ask_for_tokens, body, api_path, self.config.top_logprobs)
            capture, body = rewritten is not None, rewritten or body
        saving = None
        if self.config.keep_bodies and body and not listing:
            # One file per request, not per attempt: every attempt sends these same bytes. Beside the first
            # attempt, not before it, and in a thread once the body is large (a long agent history).
            name = f"req-{index}.json.gz"
            path, limit = session.evidence_dir / name, self.config.max_body_bytes
            saving = (name, asyncio.ensure_future(small_inline(len(body), _save_gzip, body, limit, path)))
        return _Request(
            session=session,
            index=index,
            method=request.method,
            path=api_path,
            url=f"{self._upstream}/{rest}" + (f"?{query}" if query else ""),
            headers=self._upstream_headers(request, session),
            body=body,
            sha256=hashlib.sha256(body).hexdigest(),
            arrived=arrived,
            last_byte=arrived,
            capture_tokens=capture,
            saving=saving,
        )

    def _upstream_headers(self, request: web.Request, session: GatewaySession) -> list[tuple[str, str]]:
        named = {name.strip().lower() for name in request.headers.get("connection", "").split(",")}
        headers = [
            (name, value)
            for name, value in request.headers.items()
            # Any header carrying the session token (api-key, x-api-key, ...) stays on our side too.
            if name.lower() not in _NOT_FORWARDED and name.lower() not in named and session.token not in value
        ]
        # Identity, so the usage sniffer reads plain bytes and what is relayed is what was recorded.
        headers += [("accept-encoding", "identity"), (SESSION_HEADER, session.session_id)]
        if self._api_key:
            headers.append(("authorization", f"Bearer {self._api_key}"))
        return headers

    async def _forward(self, req: _Request, request: web.Request) -> web.StreamResponse:
        cfg, session = self.config, req.session
        first_failure_at: float | None = None
        for number in range(1, cfg.max_attempts_per_request + 1):
            if session.closed_kind is not None:  # another request of this session gave up meanwhile
                return _closed()
            outcome = await self._try(_Attempt(req, number, cfg), request)
            if isinstance(outcome, web.StreamResponse):
                return outcome
            last = outcome
            now = time.monotonic()
            first_failure_at = now if first_failure_at is None else first_failure_at
            delay = backoff_delay(self._backoff, number, last.retry_after_s, self._rng)
            stop = self._spend(session) or self._why_not_retry(number, last, now + delay - first_failure_at)
            if stop is not None:
                break
            await asyncio.sleep(delay)
        # _why_not_retry stops at the last attempt, so the loop always leaves through the break.
        answer = f"HTTP {last.status}" if last.status is not None else "no HTTP answer"
        message = (
            f"gateway gave up on request {req.index} ({stop}); last: {answer}: {last.error_message or ''}"
        )
        session._close(last.kind, message)
        return _closed()

    def _spend(self, session: GatewaySession) -> str | None:
        """Count one failed attempt against the session; say so once the session's budget is spent."""
        session._failures += 1
        if session._failures >= self.config.max_attempts_per_session:
            return f"the session's budget of {self.config.max_attempts_per_session} failed attempts is spent"
        return None

    def _why_not_retry(self, number: int, last: AttemptRecord, retrying_for_s: float) -> str | None:
        cfg = self.config
        if number >= cfg.max_attempts_per_request:
            return f"all {number} attempts failed"
        if last.retry_after_s is not None and last.retry_after_s > cfg.max_retry_after_s:
            return f"Retry-After {last.retry_after_s:.0f}s is past the {cfg.max_retry_after_s:.0f}s limit"
        if retrying_for_s > cfg.retry_deadline_s:
            return f"the next retry would pass the {cfg.retry_deadline_s:.0f}s retry deadline"
        return None

    async def _try(self, att: _Attempt, request: web.Request) -> web.StreamResponse | AttemptRecord:
        """One upstream attempt: the harness's answer, or the record of a failure worth retrying."""
        assert self._client is not None
        req = att.req
        try:
            try:
                async with asyncio.timeout(att.timer.wait_s()):
                    upstream = await self._send(req)
            except aiohttp.ClientError as exc:
                await req.saved()
                return self._finish(att, FailureKind.TRANSPORT_ERROR, _describe(exc))
            except TimeoutError:
                await req.saved()
                return self._finish(att, FailureKind.MODEL_TIMEOUT, att.timer.message())
            await req.saved()
            try:
                att.status = upstream.status
                if upstream.status >= 400:
                    return await self._answer_error(att, upstream)
                return await self._relay(att, upstream, request)
            finally:
                upstream.release()  # back to the pool if read to its end, else closed
        except asyncio.CancelledError:
            self._finish(att, FailureKind.TRANSPORT_ERROR, "client disconnected", client_aborted=True)
            raise

    async def _send(self, req: _Request) -> aiohttp.ClientResponse:
        assert self._client is not None
        return await self._client.request(
            req.method,
            URL(req.url, encoded=True),  # sent as the harness wrote it, not re-quoted
            headers=req.headers,
            data=req.body or None,
            allow_redirects=False,
        )

    async def _answer_error(
        self, att: _Attempt, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse | AttemptRecord:
        status, session = upstream.status, att.req.session
        body = bytearray()
        try:
            while chunk := await _read_upstream(upstream, att.timer):
                att.received(chunk)
                body += chunk[: _MAX_ERROR_BODY_BYTES - len(body)]
                if len(body) >= _MAX_ERROR_BODY_BYTES:
                    break
        except _UpstreamCut as cut:
            return self._finish(att, cut.kind, f"HTTP {status}, then {cut.message}")
        kind = kind_for_http(status, bytes(body))
        att.retry_after_s = parse_retry_after(upstream.headers.get("retry-after"))
        record = self._finish(att, kind, error_message_of(bytes(body), _MAX_MESSAGE_CHARS))
        if is_retryable(kind):
            return record
        if kind in (FailureKind.PROVIDER_AUTH_ERROR, FailureKind.ENDPOINT_CONFIG_ERROR):
            # Codex retries a 403 five times; the neutral 400 stops it, and the driver stops the run. A wrong
            # model name, route or account fails every later request the same way.
            session._close(kind, f"upstream answered HTTP {status}: {record.error_message or ''}")
            return _closed()
        if kind is FailureKind.MODEL_CONTEXT_LIMIT and self._overflowed(session, record):
            return _closed()
        # Passed on unchanged: a harness may compact on an overflow, and a plain 4xx is the model's to see.
        return web.Response(status=status, body=bytes(body), headers=_relayed(upstream.headers))

    async def _relay(
        self, att: _Attempt, upstream: aiohttp.ClientResponse, request: web.Request
    ) -> web.StreamResponse | AttemptRecord:
        att.streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")
        held: list[bytes] = []
        held_bytes = 0
        response: web.StreamResponse | None = None  # set once bytes go to the harness: no retry after
        try:
            while chunk := await _read_upstream(upstream, att.timer):
                att.received(chunk)
                if response is None:
                    held.append(chunk)
                    held_bytes += len(chunk)
                    if not att.streamed and held_bytes <= _MAX_HELD_BYTES:
                        continue
                    response = web.StreamResponse(status=upstream.status, headers=_relayed(upstream.headers))
                    await response.prepare(request)
                    chunk = b"".join(held)
                    held.clear()
                # A harness that stops reading must not hold the upstream stream open forever.
                async with asyncio.timeout(self.config.read_timeout_s):
                    await response.write(chunk)
                att.answer_delivered = att.usage.finish_reason is not None and att.usage.error is None
        except _UpstreamCut as cut:  # broken off, or stalled
            record = self._finish(att, cut.kind, cut.message)
            if response is None:
                return record
            # Bytes already reached the harness: pass the cut on; its own reconnect is a new request.
            self._spend_on_answered(att.req.session, record, "cut")
            _abort(request)
            return response
        except (ConnectionError, TimeoutError):
            self._finish(
                att,
                FailureKind.TRANSPORT_ERROR,
                "client disconnected or stopped reading",
                client_aborted=True,
            )
            _abort(request)
            return response or _closed()
        if response is None:
            body = b"".join(held)
            if not att.streamed:
                att.usage.feed_json(body)
            failure = att.failure_inside()
            if failure is not None and is_retryable(failure[0]):
                return self._finish(att, *failure)  # held whole, so nothing reached the harness: retried
            headers = _relayed(upstream.headers)
            response = web.Response(status=upstream.status, body=body, headers=headers)
            with contextlib.suppress(ConnectionError):
                await response.prepare(request)
        # The harness gets the end of its answer before the record and the kept body are written: they
        # are ours to wait for, not the harness's.
        try:
            await response.write_eof()
        except ConnectionError:
            self._finish(att, FailureKind.TRANSPORT_ERROR, "client disconnected", client_aborted=True)
            return response
        record = self._finish(att, FailureKind.NONE)  # an error inside the answer makes it a failure
        if is_retryable(record.kind):
            # The error event went to the harness, which may reconnect: a new request, as after a cut.
            self._spend_on_answered(att.req.session, record, "error inside the answer")
        elif record.kind is FailureKind.MODEL_CONTEXT_LIMIT:
            self._overflowed(att.req.session, record)  # its answer is gone; the cap ends the next one
        return response

    def _overflowed(self, session: GatewaySession, record: AttemptRecord) -> bool:
        """Count a context overflow; past the cap the session is closed (True)."""
        session._overflows += 1
        if session._overflows <= self.config.max_context_overflows:
            return False
        message = f"{session._overflows} context overflows in one session; last: {record.error_message or ''}"
        session._close(FailureKind.MODEL_CONTEXT_LIMIT, message)
        return True

    def _spend_on_answered(self, session: GatewaySession, record: AttemptRecord, what: str) -> None:
        """A failure after bytes reached the harness counts against the session; closes it once spent."""
        why = self._spend(session)
        if why:
            session._close(record.kind, f"{why}; last: {what}: {record.error_message or ''}")

    async def _list_models(self, req: _Request, request: web.Request) -> web.Response:
        """A model listing (Hermes looks up prices): forwarded once under the same time bounds, relayed
        whole, and no model attempt of the session. A 2xx or a 404 (no such model) is relayed; anything
        else gets a neutral 404, so that no status or words of a failing endpoint make a harness retry."""
        session = req.session
        session._probes += 1
        try:
            status, headers, body = await self._fetch_listing(req)
        except (aiohttp.ClientError, TimeoutError, _UpstreamCut):
            status, headers, body = None, None, None
        if status is None or body is None or not (200 <= status < 300 or status == 404):
            session._probes_failed += 1
            return web.Response(status=404, body=NO_LISTING_BODY, content_type="application/json")
        return web.Response(status=status, body=body, headers=headers)

    async def _fetch_listing(self, req: _Request) -> tuple[int, CIMultiDict[str], bytes | None]:
        """The listing's status, headers and body; no body when it is past _MAX_LISTING_BYTES."""
        timer = _StallTimer(req, self.config)
        async with asyncio.timeout(timer.wait_s()):
            upstream = await self._send(req)
        try:
            body = bytearray()
            while chunk := await _read_upstream(upstream, timer):
                body += chunk
                if len(body) > _MAX_LISTING_BYTES:
                    return upstream.status, _relayed(upstream.headers), None
            return upstream.status, _relayed(upstream.headers), bytes(body)
        finally:
            upstream.release()

    def _finish(
        self, att: _Attempt, kind: FailureKind, message: str | None = None, *, client_aborted: bool = False
    ) -> AttemptRecord:
        fresh = att.record is None
        record = att.finish(kind, message, client_aborted=client_aborted)
        if fresh and self._on_attempt is not None:
            self._on_attempt(att.req.session, record)
        return record


def _closed() -> web.Response:
    return web.Response(status=400, body=CLOSED_BODY, content_type="application/json")


def _not_served() -> web.Response:
    return web.Response(status=404, body=NOT_SERVED_BODY, content_type="application/json")


async def _answer_not_served(request: web.Request) -> web.Response:
    return _not_served()


def _route(method: str, rest: str) -> str | None:
    """What a request under /v1/ is: a model call, a model listing (GET models, GET models/<id>), or
    neither (None: answered here, never forwarded)."""
    if method == "POST" and rest in _MODEL_CALLS:
        return "call"
    if method == "GET" and (rest == "models" or (rest.startswith("models/") and len(rest) > len("models/"))):
        return "listing"
    return None


def _relayed(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _NOT_RELAYED)


class _UpstreamCut(Exception):
    """The upstream's answer broke off (TRANSPORT_ERROR) or stalled (MODEL_TIMEOUT); kept apart from the
    harness's side, whose write errors are ConnectionErrors too (aiohttp's ClientConnectionResetError is
    both) and whose stop in reading is a TimeoutError."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


async def _read_upstream(upstream: aiohttp.ClientResponse, timer: _StallTimer) -> bytes:
    """The next bytes of the answer as they arrive (b"" at its end), within the stall bounds."""
    try:
        async with asyncio.timeout(timer.wait_s()):
            chunk = await upstream.content.readany()
    except aiohttp.ClientError as exc:  # before TimeoutError: aiohttp's own read timeout is both
        raise _UpstreamCut(FailureKind.TRANSPORT_ERROR, _describe(exc)) from exc
    except TimeoutError:
        raise _UpstreamCut(FailureKind.MODEL_TIMEOUT, timer.message()) from None
    if chunk:
        timer.byte()
    return chunk


def _describe(exc: aiohttp.ClientError) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _abort(request: web.Request) -> None:
    # Closing without the final chunk makes the harness see a broken stream, not a clean (short) answer.
    if request.transport is not None:
        request.transport.abort()
