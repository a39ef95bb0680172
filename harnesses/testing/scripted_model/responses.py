"""The Responses API dialect (Codex): a response object, and the event sequence that streams it."""

from __future__ import annotations

import json
import time
from typing import Any

from harnesses.testing.scripted_model.replies import _generated, _Reply
from harnesses.testing.scripted_model.tokens import _chunks, _logprob_entries, _pieces, _token_ids, _Tokens


def _responses_usage(usage: tuple[int, int]) -> dict[str, Any]:
    given, produced = usage
    return {
        "input_tokens": given,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": produced,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": given + produced,
    }


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


def _sse_event(event: dict[str, Any], sequence_number: int) -> bytes:
    event = {**event, "sequence_number": sequence_number}
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
