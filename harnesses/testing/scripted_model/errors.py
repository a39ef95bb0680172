"""HTTP errors as OpenAI words them, and the connection reset a broken stream is."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from harnesses.testing.scripted_model.steps import ErrorStep


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
