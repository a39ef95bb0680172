"""What the gateway reads from the bytes passing through it, without holding them up.

A kept body compressed as it passes (``GzipCapture``), the usage, finish reason and in-answer error of an
answer, SSE or one JSON (``UsageSniffer``), its token ids and logprobs (``TokenCapture``), and the rewrite
of a request that asks the endpoint for them (``ask_for_tokens``). Pure byte and JSON work, apart from the
network and the session: each can be fed and tested on bytes alone.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

from harnesses.gateway.limits import (
    CHAT_PATH,
    MAX_CAPTURE_LINE_BYTES,
    MAX_CAPTURED_TOKENS,
    MAX_MESSAGE_CHARS,
    MAX_SNIFF_LINE_BYTES,
    MAX_TOKEN_ID,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_FINAL_EVENTS = (b'"response.completed"', b'"response.incomplete"', b'"response.failed"')


class ContentScanner:
    """Which bytes of an answer carry content, the only progress the stall bounds count. In an event
    stream, the bytes of a data line: comments (``: keep-alive``), event / id / retry lines and blank lines
    are not content, as a proxy sends them while a request waits in its queue. In any other body, bytes
    other than whitespace."""

    def __init__(self, sse: bool) -> None:
        self._sse = sse
        self._head = b""  # the current line's first bytes while its kind is not known
        self._data: bool | None = None  # the current line is a data line; None: not known yet

    def feed(self, chunk: bytes) -> bool:
        """Whether ``chunk`` carried content."""
        if not self._sse:
            return bool(chunk.strip())
        content = False
        pieces = chunk.split(b"\n")
        for number, piece in enumerate(pieces):
            ends = number < len(pieces) - 1
            if self._data is None:
                head = self._head + piece[: 5 - len(self._head)]
                if len(head) >= 5 or ends:
                    self._data, self._head = head.startswith(b"data:"), b""
                else:
                    self._head = head
            content = content or bool(self._data and piece)
            if ends:
                self._data, self._head = None, b""
        return content


class GzipCapture:
    """Compresses a body as it passes, up to a byte limit, so keeping it never holds the raw body."""

    def __init__(self, limit: int) -> None:
        # Level 1: a coding agent's request holds its whole conversation again, a few hundred KB a turn;
        # at zlib's default 6 a 259 KB body took 4.4 ms of the worker's CPU (58 MB/s), at 1 1.5 ms, for
        # a file a third larger (4.0x against 5.4x smaller than the body). wbits 31 writes a gzip header.
        self._zip = zlib.compressobj(1, zlib.DEFLATED, 31)
        self._parts: list[bytes] = []
        self._left = limit
        self.truncated = False
        self.saved_bytes = 0  # the file's size once saved

    def feed(self, chunk: bytes) -> None:
        if len(chunk) > self._left:
            chunk, self.truncated = chunk[: self._left], True
        if chunk:
            self._left -= len(chunk)
            self._parts.append(self._zip.compress(chunk))

    def save(self, path: Path) -> bool:
        """False when the file could not be written: a gap in the evidence must not fail the request."""
        data = b"".join(self._parts) + self._zip.flush()
        self._parts = []
        try:
            path.write_bytes(data)
        except OSError:
            return False
        self.saved_bytes = len(data)
        return True


class TokenCapture:
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
        if all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_TOKEN_ID for v in value):
            return value
        return None

    def _bounded(self, kept: list[Any], more: list[Any]) -> list[Any]:
        room = MAX_CAPTURED_TOKENS - len(kept)
        if len(more) > room:
            more, self.truncated = more[: max(room, 0)], True
        kept.extend(more)
        return kept


class UsageSniffer:
    """Token usage and finish reason from an answer as it passes: chat or Responses, SSE or one JSON.
    With ``tokens``, the answer's token ids and logprobs too. And the first error the endpoint reported
    inside it, from the objects it parses anyway: an SSE ``event: error``, an object with a top-level
    ``error`` (a Chat chunk, a whole answer, a Responses object that failed or is incomplete with one),
    ``type: error`` / ``object: error``, or a Responses object whose status is ``failed``."""

    def __init__(self, tokens: TokenCapture | None = None) -> None:
        self.tokens = tokens
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.finish_reason: str | None = None
        self.error: tuple[str | int | None, str] | None = None  # (code, message), bounded
        self._error_event = False  # the event line before this data line said "error"
        self._done = False  # a terminal event was seen that the parsed objects do not show
        self._line_limit = MAX_CAPTURE_LINE_BYTES if tokens else MAX_SNIFF_LINE_BYTES
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
                else:
                    self._done = True
                self._error_event = False
            elif line.startswith(b"event:"):
                self._error_event = line[6:].strip() == b"error"

    def _hold(self, part: bytes) -> None:
        self._pending.append(part)
        self._pending_bytes += len(part)
        if self._pending_bytes > self._line_limit:
            # Too long to parse; a Responses final event can be (it repeats the whole answer): its type,
            # near the line's start, still says the answer ended.
            head = b"".join(self._pending)[:512]
            self._done = self._done or any(t in head for t in _FINAL_EVENTS)
            self._pending, self._pending_bytes, self._overlong = [], 0, True

    def feed_json(self, text: bytes) -> bool:
        """Take one JSON text; whether it was a JSON object."""
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        self._take(obj)
        return isinstance(obj, dict)

    @property
    def ended(self) -> bool:
        """The answer's terminal event came: Chat's ``[DONE]`` or a finish reason, a Responses final
        event, or an error (a stream cut after any of them lost nothing the harness needs)."""
        return self._done or self.finish_reason is not None or self.error is not None

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
        self.error = (code[:200] if isinstance(code, str) else code, text[:MAX_MESSAGE_CHARS])


def ask_for_tokens(body: bytes, path: str, top_logprobs: int | None) -> bytes | None:
    """The request body with vLLM's token id and logprob parameters added; None when it is not a JSON
    object (it goes upstream as it came, and the endpoint answers it as it will)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    add_token_params(data, path, top_logprobs)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def add_token_params(data: dict[str, Any], path: str, top_logprobs: int | None) -> None:
    """Ask for vLLM's token ids and logprobs in the request object ``data``, in place."""
    if path == CHAT_PATH:
        data["logprobs"] = True
    else:
        include = data.get("include") if isinstance(data.get("include"), list) else []
        data["include"] = include + ([] if LOGPROBS_INCLUDE in include else [LOGPROBS_INCLUDE])
        # vLLM's only way to token ids on /responses: raw prompt and output tokens on the answer.
        data["enable_response_messages"] = True
    if top_logprobs is not None:
        data["top_logprobs"] = top_logprobs
    # Chat: logprob tokens as "token_id:<id>", prompt and output ids on the answer. /responses ignores
    # both today (vLLM logs unknown fields and goes on); sent so an endpoint that learns them answers.
    data["return_tokens_as_token_ids"] = True
    data["return_token_ids"] = True


def save_gzip(body: bytes, limit: int, path: Path) -> tuple[bool, bool, int]:
    """Write ``body`` (at most ``limit`` bytes of it) gzipped: (written, cut, bytes written)."""
    capture = GzipCapture(limit)
    capture.feed(body)
    return capture.save(path), capture.truncated, capture.saved_bytes


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
