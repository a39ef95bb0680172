"""A scripted, OpenAI-compatible model server that stands in for a real LLM endpoint.

Each session (keyed by the `x-rollout-session` header or a `/s/<key>/v1` URL prefix) plays its own list of
steps: text answers, tool calls matched to whatever shell or write tool the client offers, HTTP errors, a
stream cut mid-way (reset, or ended cleanly without its terminal event), an error inside a 200 answer, a
hang (before the answer or in its middle), a stream of keep-alive comments only, or a 2xx that is no
answer (an HTML page, JSON for a stream, an empty body). It
speaks Chat Completions (OpenCode, Pi, Hermes) and the Responses API (Codex) closely enough for those real
clients to run against it. An outage window (``outage``) answers every request with one error for a
while, whatever the scripts say, then lets them play on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import shlex
import signal
import socket
import struct
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from aiohttp import web
from multidict import CIMultiDict
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

SESSION_HEADER = "x-rollout-session"
AUX_TEXT = "Scripted test session"

_DELTA_CHARS = 16
MAX_WAITS = 8  # wait steps one request passes at most
_MAX_BODY_BYTES = 256 * 1024 * 1024  # long agent histories easily pass aiohttp's 1 MiB default

# Ordered by preference: the first name the client offers wins.
_SHELL_TOOLS = (
    "exec_command",
    "shell",
    "bash",
    "terminal",
    "shell_command",
    "local_shell",
    "run_shell_command",
    "execute_command",
    "run_command",
)
_WRITE_TOOLS = ("write", "write_file", "create_file", "file_write")
_PATH_KEYS = ("path", "file_path", "filePath", "filename")
_CONTENT_KEYS = ("content", "contents", "text")


# ---------------------------------------------------------------------------------------------------------
# Script steps


class _StepBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TextStep(_StepBase):
    type: Literal["text"]
    text: str
    finish_reason: Literal["stop", "length"] = "stop"
    usage: bool = True


class ShellStep(_StepBase):
    type: Literal["shell"]
    command: str


class WriteStep(_StepBase):
    type: Literal["write"]
    path: str
    content: str


class ToolStep(_StepBase):
    type: Literal["tool"]
    name: str
    arguments: dict[str, Any]


class ErrorStep(_StepBase):
    """An HTTP error. ``run_wide``: the endpoint refuses the run itself (its key, model or account), so
    from then on a request outside every session's script (the gateway's probe of the run's config, which
    carries no session) gets this error too; otherwise only the session's request does."""

    type: Literal["error"]
    status: int = Field(ge=100, le=599)
    headers: dict[str, str] = Field(default_factory=dict)
    body: str | None = None
    run_wide: bool = False


class DropStep(_StepBase):
    """Stream the start of a text answer, then break off: a reset (``clean`` false), or a clean end of
    the body without the stream's terminal event (``clean``), as a proxy that times out a stream does."""

    type: Literal["drop"]
    after_chunks: int = Field(default=2, ge=0)
    clean: bool = False


class KeepaliveStep(_StepBase):
    """Answer 200 as an event stream, send ``after_chunks`` text chunks (0: none), then only SSE comment
    lines (``: keep-alive``) every ``interval_s`` until ``max_s``, then cut: a proxy holding a request in
    its queue. No content ever comes after the chunks."""

    type: Literal["keepalive"]
    interval_s: float = Field(default=1.0, gt=0)
    max_s: float = Field(default=600.0, gt=0)
    after_chunks: int = Field(default=0, ge=0)


class BadAnswerStep(_StepBase):
    """A 2xx answer that is no answer: ``html``, a proxy's page; ``json``, a whole JSON answer to a request
    that asked for a stream (or an event stream to one that did not); ``empty``, no body at all."""

    type: Literal["bad_answer"]
    form: Literal["html", "json", "empty"] = "html"
    status: int = Field(default=200, ge=200, le=299)


class HangStep(_StepBase):
    """Say nothing until ``max_s``, then cut the connection. With ``after_chunks`` the answer starts
    first: a stream sends its preamble and that many text chunks (as ``drop`` does), a non-streamed answer
    its headers and that many 16-byte pieces of its JSON (0: the headers alone)."""

    type: Literal["hang"]
    max_s: float = Field(default=600.0, gt=0)
    after_chunks: int | None = Field(default=None, ge=0)


class WaitStep(_StepBase):
    """Hold the request until ``release(gate)`` is called (or ``max_s`` passed), then answer it with the
    script's next step: a session that finishes when a test, or a toy trainer, lets it."""

    type: Literal["wait"]
    gate: str
    max_s: float = Field(default=120.0, gt=0)


class StreamErrorStep(_StepBase):
    """A 200 answer that fails inside: a stream sends its preamble and ``after_chunks`` text chunks, then
    the error in the API's own form, then ends cleanly. ``form``: ``native`` is a Chat chunk carrying
    ``error`` / a Responses ``response.failed``; ``event`` is an SSE ``event: error``; ``incomplete`` is a
    Responses ``response.incomplete`` carrying the error (Chat: as ``native``). A non-streamed request
    gets a 200 JSON body with a top-level ``error``."""

    type: Literal["stream_error"]
    message: str = "The server had an error while processing your request."
    code: str | int | None = "server_error"
    after_chunks: int = Field(default=2, ge=0)
    form: Literal["native", "event", "incomplete"] = "native"


Step = Annotated[
    TextStep
    | ShellStep
    | WriteStep
    | ToolStep
    | ErrorStep
    | DropStep
    | HangStep
    | StreamErrorStep
    | KeepaliveStep
    | BadAnswerStep
    | WaitStep,
    Field(discriminator="type"),
]
_STEP_ADAPTER: TypeAdapter[Step] = TypeAdapter(Step)


def parse_steps(data: list[dict[str, Any]]) -> list[Step]:
    """Validate a JSON script; the error names the first bad step so a script author can find it."""
    if not isinstance(data, list):
        raise ValueError(f"a script must be a list of steps, got {type(data).__name__}")
    if not data:
        raise ValueError("a script must have at least one step")
    steps: list[Step] = []
    for index, item in enumerate(data):
        try:
            steps.append(_STEP_ADAPTER.validate_python(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"][1:])
            raise ValueError(f"step {index}: {where + ': ' if where else ''}{first['msg']}") from None
    return steps


# ---------------------------------------------------------------------------------------------------------
# Request log and per-session state


@dataclass
class RequestLog:
    t: float
    path: str
    api: Literal["responses", "chat"]
    aux: bool
    step_index: int | None
    step_type: str | None
    stream: bool
    body: dict[str, Any]


@dataclass
class _Session:
    steps: list[Step] | None
    position: int = 0
    log: list[RequestLog] = field(default_factory=list)


@dataclass(frozen=True)
class OutageReport:
    """An outage's window and how many requests it answered with its error."""

    seconds: float
    status: int
    started_at: float | None  # epoch seconds of its first request; None while none has come
    answered: int

    @property
    def ends_at(self) -> float | None:
        return None if self.started_at is None else self.started_at + self.seconds


@dataclass
class _Outage:
    seconds: float
    error: ErrorStep
    started: float | None = None  # monotonic, for the window itself
    started_at: float | None = None  # epoch, for comparing with other processes' records
    answered: int = 0


# ---------------------------------------------------------------------------------------------------------
# What the model answers, independent of the wire format


@dataclass(frozen=True)
class _Call:
    call_id: str
    name: str
    arguments: str  # JSON text, as both APIs carry it


@dataclass(frozen=True)
class _Reply:
    text: str = ""
    call: _Call | None = None
    finish_reason: Literal["stop", "length"] = "stop"
    usage: tuple[int, int] | None = None  # (input, output); None means "omit usage on the wire"


def _usage(request_bytes: int, produced: str) -> tuple[int, int]:
    # Deterministic from sizes, so tests and demos can predict token counts without a tokenizer.
    return request_bytes // 4, len(produced) // 4 + 1


def _tools(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Function tools by name with their JSON schema, from the Chat (nested) or Responses (flat) form."""
    found: dict[str, dict[str, Any]] = {}
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            continue
        spec = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = spec.get("name")
        if isinstance(name, str):
            params = spec.get("parameters")
            found[name] = params if isinstance(params, dict) else {}
    return found


def _pick(tools: dict[str, dict[str, Any]], preferred: tuple[str, ...]) -> str | None:
    lowered = {name.lower(): name for name in tools}
    return next((lowered[name] for name in preferred if name in lowered), None)


def _types(prop: dict[str, Any]) -> set[str]:
    declared = prop.get("type")
    types = {declared} if isinstance(declared, str) else set(declared or [])
    for alt in [*prop.get("anyOf", []), *prop.get("oneOf", [])]:
        if isinstance(alt, dict):
            types |= _types(alt)
    return types


def _placeholder(name: str, prop: dict[str, Any], purpose: str) -> Any:
    """A harmless value for a required argument the script says nothing about."""
    if "default" in prop:
        return prop["default"]
    if prop.get("enum"):
        return prop["enum"][0]
    types = _types(prop)
    if "string" in types:
        return "." if "dir" in name.lower() or name.lower() == "cwd" else purpose
    if "boolean" in types:
        return False
    if types & {"integer", "number"}:
        # A timeout too short would kill the command; 60000 is a minute in ms and merely long in seconds.
        return prop.get("minimum", 60000 if "timeout" in name.lower() else 1)
    if "array" in types:
        return []
    if "object" in types:
        return {}
    return None


def _fill_required(schema: dict[str, Any], args: dict[str, Any], purpose: str) -> dict[str, Any]:
    props = schema.get("properties") or {}
    for name in schema.get("required") or []:
        if name not in args:
            args[name] = _placeholder(name, props.get(name) or {}, purpose)
    return args


def _shell_arguments(schema: dict[str, Any], command: str) -> dict[str, Any]:
    props: dict[str, Any] = schema.get("properties") or {}
    required = list(schema.get("required") or [])
    if "cmd" in props:
        key = "cmd"
    elif "command" in props:
        key = "command"
    else:
        strings = [name for name in [*required, *props] if "string" in _types(props.get(name) or {})]
        key = strings[0] if strings else "command"
    types = _types(props.get(key) or {})
    value: Any = ["bash", "-lc", command] if "array" in types and "string" not in types else command
    return _fill_required(schema, {key: value}, "run command")


def _write_command(path: str, content: str) -> str:
    # printf '%s' with shell quoting copes with any content; a heredoc could collide with its delimiter.
    parent = path.rsplit("/", 1)[0] if "/" in path.strip("/") else ""
    prefix = f"mkdir -p {shlex.quote(parent)} && " if parent else ""
    return f"{prefix}printf '%s' {shlex.quote(content)} > {shlex.quote(path)}"


def _write_arguments(schema: dict[str, Any], path: str, content: str) -> dict[str, Any] | None:
    props = schema.get("properties") or {}
    path_key = next((key for key in _PATH_KEYS if key in props), None)
    content_key = next((key for key in _CONTENT_KEYS if key in props), None)
    if path_key is None or content_key is None:
        return None
    return _fill_required(schema, {path_key: path, content_key: content}, "write file")


# ---------------------------------------------------------------------------------------------------------
# Auxiliary requests (titles, summaries) that must not consume a scripted step


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def _system_text(body: dict[str, Any]) -> str:
    parts = [_text_of(body.get("instructions"))]
    items = body.get("messages") or body.get("input") or []
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and item.get("role") in ("system", "developer"):
                parts.append(_text_of(item.get("content")))
    return " ".join(parts).lower()


def _is_aux(body: dict[str, Any]) -> bool:
    model = str(body.get("model") or "").lower()
    if "small" in model or "aux" in model:
        return True
    system = _system_text(body)
    return not body.get("tools") and ("title" in system or "summar" in system)


# ---------------------------------------------------------------------------------------------------------
# Wire formats


def _chunks(text: str) -> list[str]:
    return [text[i : i + _DELTA_CHARS] for i in range(0, len(text), _DELTA_CHARS)]


# ---------------------------------------------------------------------------------------------------------
# Token ids and logprobs, when a request asks for them with vLLM's parameters


@dataclass(frozen=True)
class _Tokens:
    """What a request asked for: chat ``logprobs`` / ``top_logprobs`` / ``return_token_ids`` /
    ``return_tokens_as_token_ids``; Responses ``include: [message.output_text.logprobs]`` /
    ``enable_response_messages``. vLLM reads ``return_tokens_as_token_ids`` for /responses from a server
    flag; here the request's word stands in for it."""

    logprobs: bool
    ids: bool  # prompt and completion ids on the answer
    as_ids: bool  # a logprob's token reads "token_id:<id>"
    top: int
    prompt: tuple[int, ...]


def _pieces(text: str) -> list[str]:
    # The fake tokenizer: each word with the whitespace before it, so the pieces join back to the text.
    return re.findall(r"\s*\S+|\s+", text)


def _token_id(piece: str) -> int:
    return zlib.crc32(piece.encode()) % 100_000 + 1


def _token_ids(text: str) -> list[int]:
    return [_token_id(piece) for piece in _pieces(text)]


def _logprob(token_id: int) -> float:
    return -((token_id % 97) + 1) / 100


def _tokens_asked(body: dict[str, Any], api: Literal["responses", "chat"], raw: bytes) -> _Tokens | None:
    if api == "chat":
        logprobs, ids = bool(body.get("logprobs")), bool(body.get("return_token_ids"))
    else:
        include = body.get("include") if isinstance(body.get("include"), list) else []
        logprobs = "message.output_text.logprobs" in include
        ids = bool(body.get("enable_response_messages"))
    if not (logprobs or ids):
        return None
    top = body.get("top_logprobs")
    return _Tokens(
        logprobs=logprobs,
        ids=ids,
        as_ids=bool(body.get("return_tokens_as_token_ids")),
        top=top if isinstance(top, int) and not isinstance(top, bool) and 0 < top <= 20 else 0,
        prompt=tuple(_token_ids(raw.decode("utf-8", "replace"))),
    )


def _logprob_entries(text: str, tokens: _Tokens) -> list[dict[str, Any]]:
    def entry(piece: str, token_id: int, logprob: float) -> dict[str, Any]:
        shown = f"token_id:{token_id}" if tokens.as_ids else piece
        return {"token": shown, "logprob": logprob, "bytes": list(shown.encode())}

    out = []
    for piece in _pieces(text):
        token_id = _token_id(piece)
        alternatives = [entry(piece, token_id, _logprob(token_id))]
        alternatives += [
            entry(f"<alt{k}>", token_id + k, _logprob(token_id) - k) for k in range(1, tokens.top)
        ]
        out.append({**alternatives[0], "top_logprobs": alternatives[: tokens.top]})
    return out


def _generated(reply: _Reply) -> list[str]:
    """What the fake model generated, in the parts it streams: a call's name, then its arguments."""
    return [reply.call.name, reply.call.arguments] if reply.call else [reply.text]


def _chat_usage(usage: tuple[int, int]) -> dict[str, Any]:
    prompt, completion = usage
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def _responses_usage(usage: tuple[int, int]) -> dict[str, Any]:
    given, produced = usage
    return {
        "input_tokens": given,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": produced,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": given + produced,
    }


def _chat_finish(reply: _Reply) -> str:
    return "tool_calls" if reply.call else reply.finish_reason


def _chat_tool_call(call: _Call) -> dict[str, Any]:
    return {
        "id": call.call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _chat_completion(
    reply: _Reply, model: str, reply_id: str, tokens: _Tokens | None = None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": None if reply.call else reply.text}
    if reply.call:
        message["tool_calls"] = [_chat_tool_call(reply.call)]
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": _chat_finish(reply)}
    completion: dict[str, Any] = {
        "id": reply_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if reply.usage is not None:
        completion["usage"] = _chat_usage(reply.usage)
    if tokens is not None:
        _chat_tokens(choice, _generated(reply), tokens)
        if tokens.ids:
            completion["prompt_token_ids"] = list(tokens.prompt)
    return completion


def _chat_tokens(choice: dict[str, Any], parts: list[str], tokens: _Tokens) -> None:
    """Where vLLM puts a choice's (or a chunk's) tokens: ``token_ids`` and ``logprobs.content``."""
    if tokens.logprobs:
        choice["logprobs"] = {"content": [e for part in parts for e in _logprob_entries(part, tokens)]}
    if tokens.ids:
        choice["token_ids"] = [i for part in parts for i in _token_ids(part)]


def _chat_stream(
    reply: _Reply, model: str, reply_id: str, include_usage: bool, tokens: _Tokens | None = None
) -> list[dict[str, Any]]:
    created = int(time.time())

    def chunk(
        delta: dict[str, Any], finish: str | None = None, generated: str | None = None
    ) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if tokens is not None and generated is not None:  # the tokens this chunk carries
            _chat_tokens(choice, [generated], tokens)
        return {
            "id": reply_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [choice],
        }

    out = [chunk({"role": "assistant", "content": ""})]
    if tokens is not None and tokens.ids:
        out[0]["prompt_token_ids"] = list(tokens.prompt)  # vLLM: on the first chunk only
    if reply.call:
        opening = {**_chat_tool_call(reply.call), "index": 0}
        opening["function"] = {"name": reply.call.name, "arguments": ""}
        arguments = reply.call.arguments
        out.append(chunk({"tool_calls": [opening]}, generated=reply.call.name))
        out.append(
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}, None, arguments)
        )
    elif tokens is not None:  # one token a chunk, as vLLM streams
        out.extend(chunk({"content": piece}, None, piece) for piece in _pieces(reply.text))
    else:
        out.extend(chunk({"content": piece}) for piece in _chunks(reply.text))
    out.append(chunk({}, _chat_finish(reply)))
    if include_usage and reply.usage is not None:
        usage_chunk = chunk({})
        usage_chunk["choices"] = []
        usage_chunk["usage"] = _chat_usage(reply.usage)
        out.append(usage_chunk)
    return out


def _output_item(reply: _Reply, item_id: str, done: bool, tokens: _Tokens | None = None) -> dict[str, Any]:
    if reply.call:
        return {
            "type": "function_call",
            "id": item_id,
            "call_id": reply.call.call_id,
            "name": reply.call.name,
            "arguments": reply.call.arguments if done else "",
            "status": "completed" if done else "in_progress",
        }
    status = "in_progress" if not done else "incomplete" if reply.finish_reason == "length" else "completed"
    content = [{"type": "output_text", "text": reply.text, "annotations": []}] if done else []
    if content and tokens is not None and tokens.logprobs:
        content[0]["logprobs"] = _logprob_entries(reply.text, tokens)
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _response_object(
    reply: _Reply,
    body: dict[str, Any],
    model: str,
    response_id: str,
    item_id: str,
    done: bool,
    tokens: _Tokens | None = None,
) -> dict[str, Any]:
    incomplete = done and reply.finish_reason == "length" and not reply.call
    obj: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed" if done else "in_progress",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": [_output_item(reply, item_id, done=True, tokens=tokens)] if done else [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", False),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "truncation": body.get("truncation", "disabled"),
        "metadata": body.get("metadata") or {},
    }
    if done and reply.usage is not None:
        obj["usage"] = _responses_usage(reply.usage)
    elif not done:
        obj["usage"] = None
    if done and tokens is not None and tokens.ids:
        # vLLM's enable_response_messages: the raw prompt and output tokens, on the final object only.
        parts = _generated(reply)
        ids = [i for part in parts for i in _token_ids(part)]
        raw = "raw_message_tokens"
        obj["input_messages"] = [{"type": raw, "message": "", "tokens": list(tokens.prompt)}]
        obj["output_messages"] = [{"type": raw, "message": "".join(parts), "tokens": ids}]
    return obj


def _response_events(
    reply: _Reply,
    body: dict[str, Any],
    model: str,
    response_id: str,
    item_id: str,
    tokens: _Tokens | None = None,
) -> list[dict[str, Any]]:
    """The Responses API event sequence, without sequence numbers (added when sent)."""
    start = _response_object(reply, body, model, response_id, item_id, done=False)
    final = _response_object(reply, body, model, response_id, item_id, done=True, tokens=tokens)
    logprobs = tokens is not None and tokens.logprobs
    where = {"item_id": item_id, "output_index": 0}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": start},
        {"type": "response.in_progress", "response": start},
        {
            "type": "response.output_item.added",
            "output_index": 0,
            "item": _output_item(reply, item_id, False),
        },
    ]
    if reply.call:
        arguments = reply.call.arguments
        events += [
            {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
            {
                "type": "response.function_call_arguments.done",
                **where,
                "name": reply.call.name,
                "arguments": arguments,
            },
        ]
    else:
        part = {"type": "output_text", "text": "", "annotations": []}
        events.append({"type": "response.content_part.added", **where, "content_index": 0, "part": part})
        pieces = _pieces(reply.text) if tokens is not None else _chunks(reply.text)
        events += [
            {
                "type": "response.output_text.delta",
                **where,
                "content_index": 0,
                "delta": piece,
                "logprobs": _logprob_entries(piece, tokens) if tokens is not None and logprobs else [],
            }
            for piece in pieces
        ]
        events += [
            {
                "type": "response.output_text.done",
                **where,
                "content_index": 0,
                "text": reply.text,
                "logprobs": _logprob_entries(reply.text, tokens) if tokens is not None and logprobs else [],
            },
            {
                "type": "response.content_part.done",
                **where,
                "content_index": 0,
                "part": {**part, "text": reply.text},
            },
        ]
    events.append({"type": "response.output_item.done", "output_index": 0, "item": final["output"][0]})
    events.append({"type": f"response.{final['status']}", "response": final})
    return events


def _sse_chat(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


def _sse_event(event: dict[str, Any], sequence_number: int) -> bytes:
    event = {**event, "sequence_number": sequence_number}
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def _chat_error_frame(step: StreamErrorStep, model: str, reply_id: str) -> bytes:
    """A Chat stream's error: a chunk carrying ``error`` (as OpenRouter sends it), or an ``error`` event
    whose data has no ``error`` key, so only the event line says what it is."""
    error = {"message": step.message, "code": step.code}
    if step.form == "event":
        return f"event: error\ndata: {json.dumps(error)}\n\n".encode()
    chunk = {
        "id": reply_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "error"}],
        "error": error,
    }
    return _sse_chat(chunk)


# ---------------------------------------------------------------------------------------------------------
# Errors


def _error_body(message: str, kind: str, code: str | None, param: str | None = None) -> str:
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


# Bodies shaped like OpenAI's, since harnesses classify errors by their words (harnesses.md §2, §9).
_DEFAULT_ERROR_BODIES = {
    429: _error_body(
        "Rate limit reached for scripted-model. Please try again in 1s.",
        "rate_limit_error",
        "rate_limit_exceeded",
    ),
    400: _error_body(
        "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens. "
        "Please reduce the length of the messages.",
        "invalid_request_error",
        "context_length_exceeded",
        "messages",
    ),
    500: _error_body("The server had an error while processing your request.", "server_error", None),
}
# Free of the words and digits that make harnesses retry, so any other status is judged on status alone.
_NEUTRAL_ERROR_BODY = _error_body(
    "scripted model: this request was refused by the test script", "invalid_request_error", "scripted_error"
)


def _json_error(status: int, message: str, code: str | None = None) -> web.Response:
    return web.Response(
        status=status,
        text=_error_body(message, "invalid_request_error", code),
        content_type="application/json",
    )


def _error_response(step: ErrorStep) -> web.Response:
    body = step.body if step.body is not None else _DEFAULT_ERROR_BODIES.get(step.status, _NEUTRAL_ERROR_BODY)
    headers = CIMultiDict({"Content-Type": "application/json"})
    for name, value in step.headers.items():
        headers[name] = value  # replaces case-insensitively, so a script can override Content-Type
    return web.Response(status=step.status, body=body.encode(), headers=headers)


def _abort_connection(request: web.Request) -> None:
    """Cut the TCP connection with a reset, so the client sees a broken stream rather than a clean end."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


@web.middleware
async def _json_not_found(request: web.Request, handler: Any) -> web.StreamResponse:
    # Clients parse error bodies as JSON; aiohttp's default 404/405 pages are plain text.
    try:
        return await handler(request)
    except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
        return _json_error(404, f"no route for {request.method} {request.path}", "not_found")


# ---------------------------------------------------------------------------------------------------------
# The server


class ScriptedModel:
    def __init__(
        self,
        default_script: list[Step] | None = None,
        model_names: tuple[str, ...] = ("scripted-model",),
        *,
        refuse_unknown_models: bool = False,
    ) -> None:
        """``refuse_unknown_models``: a model call naming a model outside ``model_names`` gets a 404
        ``model_not_found`` (as vLLM and OpenAI answer) and takes no step; by default any name is served."""
        self._default_script = list(default_script) if default_script else None
        self._model_names = model_names
        self._refuse_unknown = refuse_unknown_models
        self._run_refusals: dict[str, ErrorStep] = {}  # by API: a run_wide error step played so far
        self._sessions: dict[str, _Session] = {}
        # set_script/requests may be called from another thread than the server's event loop.
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None
        self._base_url: str | None = None
        self._outage: _Outage | None = None
        # Every (method, path) that reached the server, /_ctl/ aside: what a proxy in front let through.
        self._seen: list[tuple[str, str]] = []
        self._arrived: asyncio.Event | None = None  # set (and replaced) on each logged model request
        self._gates: dict[str, asyncio.Event] = {}  # WaitStep's, on the server's loop
        self._released: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- public API ------------------------------------------------------------------------------------

    def set_script(self, session_key: str, steps: list[Step]) -> None:
        if not steps:
            raise ValueError("a script must have at least one step")
        with self._lock:
            session = self._sessions.setdefault(session_key, _Session(steps=None))
            session.steps = list(steps)
            session.position = 0

    def release(self, gate: str) -> None:
        """Let every request held at ``gate`` (a ``wait`` step) go on, and those that come later pass.
        From any thread."""
        with self._lock:
            self._released.add(gate)
            event, loop = self._gates.get(gate), self._loop
        if event is not None and loop is not None:
            loop.call_soon_threadsafe(event.set)

    async def _wait_at(self, step: WaitStep) -> None:
        with self._lock:
            if step.gate in self._released:
                return
            event = self._gates.setdefault(step.gate, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(step.max_s):
                await event.wait()

    def requests(self, session_key: str) -> list[RequestLog]:
        with self._lock:
            session = self._sessions.get(session_key)
            return list(session.log) if session else []

    def requests_seen(self) -> list[tuple[str, str]]:
        """(method, path) of every request that reached the server, any route, found or not."""
        with self._lock:
            return list(self._seen)

    async def wait_requests(self, session_key: str, count: int, timeout_s: float = 30.0) -> list[RequestLog]:
        """The session's log once it holds ``count`` model requests: a test's way to know an answer is
        under way (a hang, say) without sleeping. Call it on the server's event loop."""
        async with asyncio.timeout(timeout_s):
            while True:
                arrived = self._arrived
                log = self.requests(session_key)
                if len(log) >= count:
                    return log
                if arrived is None:
                    raise RuntimeError("ScriptedModel is not started")
                await arrived.wait()

    def outage(self, seconds: float, status: int = 429, headers: dict[str, str] | None = None) -> None:
        """Answer every request (control routes aside) with ``status`` for ``seconds``, then serve the
        scripts again. The window opens at the next request, not now, so a client's start-up is no part of
        it. Its requests take no script step and are counted in ``outage_report``, not in ``requests``."""
        if not seconds > 0:
            raise ValueError(f"outage seconds must be positive, got {seconds!r}")
        if not 100 <= status <= 599:
            raise ValueError(f"outage status must be an HTTP status (100-599), got {status!r}")
        error = ErrorStep(type="error", status=status, headers=headers or {})
        with self._lock:
            self._outage = _Outage(seconds, error)

    def outage_report(self) -> OutageReport | None:
        with self._lock:
            o = self._outage
            if o is None:
                return None
            return OutageReport(o.seconds, o.error.status, o.started_at, o.answered)

    @property
    def base_url(self) -> str:
        if self._base_url is None:
            raise RuntimeError("ScriptedModel is not started")
        return self._base_url

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if self._runner is not None:
            raise RuntimeError("ScriptedModel is already started")
        self._stopping = asyncio.Event()
        self._arrived = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        app = web.Application(
            client_max_size=_MAX_BODY_BYTES, middlewares=[_json_not_found, self._outage_gate]
        )
        for prefix in ("", "/s/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/responses", self._responses)
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_get(prefix + "/v1/models/{model_id:.+}", self._model)
        app.router.add_post("/_ctl/scripts/{session}", self._ctl_script)
        app.router.add_get("/_ctl/log/{session}", self._ctl_log)
        app.router.add_get("/_ctl/health", self._ctl_health)
        # Cancelling the handler when the client leaves is what ends a hang step early.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        bound_port = runner.addresses[0][1]
        shown = "127.0.0.1" if host in ("", "0.0.0.0") else f"[{host}]" if ":" in host else host
        self._base_url = f"http://{shown}:{bound_port}/v1"

    async def stop(self) -> None:
        if self._runner is None:
            return
        assert self._stopping is not None
        self._stopping.set()  # releases hanging handlers, so cleanup does not wait for max_s
        await self._runner.cleanup()
        self._runner = None
        self._base_url = None

    # -- script bookkeeping ----------------------------------------------------------------------------

    def _take_step(self, key: str) -> tuple[int | None, Step | None]:
        with self._lock:
            session = self._sessions.setdefault(key, _Session(steps=self._default_script))
            if not session.steps:
                return None, None
            index = min(session.position, len(session.steps) - 1)  # the last step repeats forever
            session.position += 1
            return index, session.steps[index]

    def _outage_error(self) -> ErrorStep | None:
        """The outage's error while its window is open, counting the request; None outside it."""
        with self._lock:
            outage = self._outage
            if outage is None:
                return None
            now = time.monotonic()
            if outage.started is None:
                outage.started, outage.started_at = now, time.time()
            if now - outage.started >= outage.seconds:
                return None
            outage.answered += 1
            return outage.error

    @web.middleware
    async def _outage_gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        # Before any handler, so an outage answers /models as well and never consumes a script step.
        if not request.path.startswith("/_ctl/"):
            with self._lock:
                self._seen.append((request.method, request.path))
            error = self._outage_error()
            if error is not None:
                return _error_response(error)
        return await handler(request)

    def _record(self, key: str, entry: RequestLog) -> None:
        with self._lock:
            self._sessions.setdefault(key, _Session(steps=self._default_script)).log.append(entry)
        if self._arrived is not None:  # wakes every waiter; each looks at the log again
            self._arrived.set()
            self._arrived = asyncio.Event()

    def _next_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):06d}"

    def _call_id(self, key: str) -> str:
        safe = re.sub(r"[^A-Za-z0-9_-]", "_", key)[:40]
        return self._next_id(f"call_{safe}_")

    def _reply_for(self, step: Step | None, key: str, body: dict[str, Any], raw_size: int) -> _Reply:
        if isinstance(step, TextStep):
            usage = _usage(raw_size, step.text) if step.usage else None
            return _Reply(text=step.text, finish_reason=step.finish_reason, usage=usage)
        if isinstance(step, ShellStep | WriteStep | ToolStep):
            planned = self._plan_call(step, key, _tools(body))
            if isinstance(planned, _Call):
                return _Reply(call=planned, usage=_usage(raw_size, planned.arguments))
            return _Reply(text=planned, usage=_usage(raw_size, planned))
        return _Reply(text="ok", usage=_usage(raw_size, "ok"))

    def _plan_call(
        self, step: ShellStep | WriteStep | ToolStep, key: str, tools: dict[str, dict[str, Any]]
    ) -> _Call | str:
        """The tool call a step asks for, fitted to the tools the client offered, or why none fits."""
        if isinstance(step, ToolStep):
            name, arguments = step.name, step.arguments
        else:
            writer = _pick(tools, _WRITE_TOOLS) if isinstance(step, WriteStep) else None
            write_arguments = _write_arguments(tools[writer], step.path, step.content) if writer else None
            shell = _pick(tools, _SHELL_TOOLS)
            if writer and write_arguments is not None:
                name, arguments = writer, write_arguments
            elif shell:
                command = (
                    step.command if isinstance(step, ShellStep) else _write_command(step.path, step.content)
                )
                name, arguments = shell, _shell_arguments(tools[shell], command)
            else:
                return f"scripted model: no tool for a {step.type} step was offered (tools: {sorted(tools)})"
        return _Call(self._call_id(key), name, json.dumps(arguments))

    # -- model endpoints -------------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_model(request, "chat")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_model(request, "responses")

    async def _serve_model(
        self, request: web.Request, api: Literal["responses", "chat"]
    ) -> web.StreamResponse:
        received = time.monotonic()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _json_error(400, "scripted model: the request body is not a JSON object", "invalid_json")

        key = request.headers.get(SESSION_HEADER) or request.match_info.get("session") or "default"
        if self._refuse_unknown and body.get("model") not in self._model_names:
            self._record(key, RequestLog(received, request.path, api, False, None, None, False, body))
            return _json_error(404, f"The model '{body.get('model')}' does not exist.", "model_not_found")
        aux = _is_aux(body)
        refused = self._run_refusals.get(api) if key == "default" else None
        index, step = (None, refused) if refused else (None, None) if aux else self._take_step(key)
        for _ in range(MAX_WAITS):  # a script of waits alone, its last repeating, must still answer
            if not isinstance(step, WaitStep):
                break
            await self._wait_at(step)
            index, step = self._take_step(key)
        if isinstance(step, WaitStep):
            step = None
        stream = bool(body.get("stream"))
        step_type = step.type if step else None if aux else "text"
        self._record(key, RequestLog(received, request.path, api, aux, index, step_type, stream, body))

        if isinstance(step, ErrorStep):
            if step.run_wide:
                self._run_refusals[api] = step
            return _error_response(step)
        model = str(body.get("model") or self._model_names[0])
        if isinstance(step, HangStep):
            return await self._hang(request, api, body, model, step)
        if isinstance(step, DropStep):
            return await self._drop(request, api, body, model, step)
        if isinstance(step, StreamErrorStep):
            return await self._stream_error(request, api, body, model, step)
        if isinstance(step, KeepaliveStep):
            return await self._keepalive(request, api, body, model, step)
        if isinstance(step, BadAnswerStep):
            return await self._bad_answer(request, api, body, model, step)
        if aux:
            reply = _Reply(text=AUX_TEXT, usage=_usage(len(raw), AUX_TEXT))
        else:
            reply = self._reply_for(step, key, body, len(raw))
        tokens = _tokens_asked(body, api, raw)
        if api == "chat":
            return await self._send_chat(request, body, model, reply, tokens)
        return await self._send_responses(request, body, model, reply, tokens)

    async def _send_chat(
        self, request: web.Request, body: dict[str, Any], model: str, reply: _Reply, tokens: _Tokens | None
    ) -> web.StreamResponse:
        reply_id = self._next_id("chatcmpl-")
        if not body.get("stream"):
            return web.json_response(_chat_completion(reply, model, reply_id, tokens))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        response = await self._open_sse(request)
        for chunk in _chat_stream(reply, model, reply_id, include_usage, tokens):
            await response.write(_sse_chat(chunk))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _send_responses(
        self, request: web.Request, body: dict[str, Any], model: str, reply: _Reply, tokens: _Tokens | None
    ) -> web.StreamResponse:
        response_id, item_id = self._next_id("resp_"), self._next_id("fc_" if reply.call else "msg_")
        if not body.get("stream"):
            final = _response_object(reply, body, model, response_id, item_id, done=True, tokens=tokens)
            return web.json_response(final)
        response = await self._open_sse(request)
        events = _response_events(reply, body, model, response_id, item_id, tokens)
        for number, event in enumerate(events):
            await response.write(_sse_event(event, number))
        await response.write_eof()
        return response

    async def _open_sse(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        return response

    def _partial_frames(
        self, api: Literal["responses", "chat"], body: dict[str, Any], model: str, chunks: int
    ) -> list[bytes]:
        """The SSE frames that start a text answer: the preamble and ``chunks`` text deltas."""
        text = ("partial answer " * (chunks + 1))[: chunks * _DELTA_CHARS]
        reply = _Reply(text=text)
        if api == "chat":
            preamble = 1  # the role chunk
            frames = [_sse_chat(c) for c in _chat_stream(reply, model, self._next_id("chatcmpl-"), False)]
        else:
            preamble = 4  # created, in_progress, output_item.added, content_part.added
            events = _response_events(reply, body, model, self._next_id("resp_"), self._next_id("msg_"))
            frames = [_sse_event(event, number) for number, event in enumerate(events)]
        return frames[: preamble + chunks]

    async def _drop(
        self,
        request: web.Request,
        api: Literal["responses", "chat"],
        body: dict[str, Any],
        model: str,
        step: DropStep,
    ) -> web.StreamResponse:
        """Stream the start of a text answer, then reset the connection mid-body or end it cleanly."""
        response = await self._open_sse(request)
        for frame in self._partial_frames(api, body, model, step.after_chunks):
            await response.write(frame)
        if step.clean:
            await response.write_eof()
        else:
            _abort_connection(request)
        return response

    async def _keepalive(
        self,
        request: web.Request,
        api: Literal["responses", "chat"],
        body: dict[str, Any],
        model: str,
        step: KeepaliveStep,
    ) -> web.StreamResponse:
        response = await self._open_sse(request)
        for frame in self._partial_frames(api, body, model, step.after_chunks) if step.after_chunks else []:
            await response.write(frame)
        assert self._stopping is not None
        ends = time.monotonic() + step.max_s
        try:
            while (left := ends - time.monotonic()) > 0:
                await response.write(b": keep-alive\n\n")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), min(step.interval_s, left))
                if self._stopping.is_set():
                    break
        except ConnectionError:  # the client gave up on the stream, as it should
            return response
        _abort_connection(request)
        return response

    async def _bad_answer(
        self,
        request: web.Request,
        api: Literal["responses", "chat"],
        body: dict[str, Any],
        model: str,
        step: BadAnswerStep,
    ) -> web.StreamResponse:
        if step.form == "html":
            page = "<html><head><title>Gateway</title></head><body>Please wait.</body></html>"
            return web.Response(status=step.status, text=page, content_type="text/html")
        if step.form == "empty":
            return web.Response(status=step.status, body=b"", content_type="application/json")
        if body.get("stream"):  # a whole answer where a stream was asked
            return web.json_response(self._whole_answer(api, body, model), status=step.status)
        response = await self._open_sse(request)  # a stream where a whole answer was asked
        for frame in self._partial_frames(api, body, model, 2):
            await response.write(frame)
        await response.write_eof()
        return response

    async def _hang(
        self,
        request: web.Request,
        api: Literal["responses", "chat"],
        body: dict[str, Any],
        model: str,
        step: HangStep,
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        if step.after_chunks is not None:
            if body.get("stream"):
                response = await self._open_sse(request)
                frames = self._partial_frames(api, body, model, step.after_chunks)
            else:
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                await response.prepare(request)
                whole = json.dumps(self._whole_answer(api, body, model)).encode()
                frames = [whole[i : i + _DELTA_CHARS] for i in range(0, len(whole), _DELTA_CHARS)]
                frames = frames[: step.after_chunks]
            for frame in frames:
                await response.write(frame)
        await self._wait_for_stop(step.max_s)
        _abort_connection(request)
        return response or web.Response(status=504)

    def _whole_answer(
        self, api: Literal["responses", "chat"], body: dict[str, Any], model: str
    ) -> dict[str, Any]:
        reply = _Reply(text="partial answer " * 8)
        if api == "chat":
            return _chat_completion(reply, model, self._next_id("chatcmpl-"))
        return _response_object(reply, body, model, self._next_id("resp_"), self._next_id("msg_"), done=True)

    async def _wait_for_stop(self, max_s: float) -> None:
        # A client that gives up cancels the handler (handler_cancellation); stop() sets the event.
        assert self._stopping is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), max_s)

    async def _stream_error(
        self,
        request: web.Request,
        api: Literal["responses", "chat"],
        body: dict[str, Any],
        model: str,
        step: StreamErrorStep,
    ) -> web.StreamResponse:
        """A 200 answer that starts, then reports an error inside it and ends cleanly."""
        error = {"message": step.message, "code": step.code}
        if not body.get("stream"):
            return web.json_response({"error": {**error, "type": "server_error"}})
        frames = self._partial_frames(api, body, model, step.after_chunks)
        if api == "chat":
            frames.append(_chat_error_frame(step, model, self._next_id("chatcmpl-")))
            frames.append(b"data: [DONE]\n\n")
        else:
            frames.append(self._responses_error_frame(step, body, model, len(frames)))
        response = await self._open_sse(request)
        for frame in frames:
            await response.write(frame)
        await response.write_eof()
        return response

    def _responses_error_frame(
        self, step: StreamErrorStep, body: dict[str, Any], model: str, number: int
    ) -> bytes:
        error = {"code": step.code, "message": step.message}
        if step.form == "event":
            return _sse_event({"type": "error", **error, "param": None}, number)
        final = _response_object(_Reply(), body, model, self._next_id("resp_"), "", done=False)
        final.update(status="failed", error=error, output=[])
        if step.form == "incomplete":
            final.update(status="incomplete", incomplete_details={"reason": "error"})
        return _sse_event({"type": f"response.{final['status']}", "response": final}, number)

    # -- models and control ----------------------------------------------------------------------------

    def _model_entry(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "scripted"}

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [self._model_entry(n) for n in self._model_names]}
        )

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        if name not in self._model_names:
            return _json_error(404, f"The model '{name}' does not exist", "model_not_found")
        return web.json_response(self._model_entry(name))

    async def _ctl_script(self, request: web.Request) -> web.Response:
        try:
            payload = json.loads(await request.read())
        except ValueError:
            return _json_error(400, 'body must be JSON: {"steps": [...]}')
        if not isinstance(payload, dict) or "steps" not in payload:
            return _json_error(400, "body must be a JSON object with a 'steps' list")
        try:
            steps = parse_steps(payload["steps"])
        except ValueError as exc:
            return _json_error(400, f"bad script: {exc}", "bad_script")
        key = request.match_info["session"]
        self.set_script(key, steps)
        return web.json_response({"ok": True, "session": key, "steps": len(steps)})

    async def _ctl_log(self, request: web.Request) -> web.Response:
        key = request.match_info["session"]
        return web.json_response(
            {"session": key, "requests": [asdict(entry) for entry in self.requests(key)]}
        )

    async def _ctl_health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})


# ---------------------------------------------------------------------------------------------------------
# CLI


def _load_script_file(path: str) -> list[Step]:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    return parse_steps(data["steps"] if isinstance(data, dict) and "steps" in data else data)


def serve(host: str, port: int, script_file: str | None) -> None:
    """Serve in the foreground until Ctrl-C or SIGTERM; the script file becomes the default script."""
    default_script = _load_script_file(script_file) if script_file else None

    async def main() -> None:
        model = ScriptedModel(default_script)
        await model.start(host, port)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, done.set)
        print(f"scripted model listening on {model.base_url}", flush=True)
        try:
            await done.wait()
        finally:
            await model.stop()

    asyncio.run(main())
