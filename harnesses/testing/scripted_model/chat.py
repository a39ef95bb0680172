"""The Chat Completions dialect (OpenCode, Pi, Hermes): a whole completion, its stream of chunks, and an
error inside a stream."""

from __future__ import annotations

import json
import time
from typing import Any

from harnesses.testing.scripted_model.replies import _Call, _generated, _Reply
from harnesses.testing.scripted_model.steps import StreamErrorStep
from harnesses.testing.scripted_model.tokens import _chunks, _logprob_entries, _pieces, _token_ids, _Tokens


def _chat_usage(usage: tuple[int, int]) -> dict[str, Any]:
    prompt, completion = usage
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": 0},
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


def _sse_chat(chunk: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


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
