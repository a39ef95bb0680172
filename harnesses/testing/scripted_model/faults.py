"""The answers that go wrong on purpose: a stream cut, a hang, keep-alives only, an answer that is none,
an error inside a 200. ``ScriptedModel`` (server.py) serves them for the steps that ask."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, Literal

from aiohttp import web

from harnesses.testing.scripted_model.chat import _chat_completion, _chat_error_frame, _chat_stream, _sse_chat
from harnesses.testing.scripted_model.errors import _abort_connection
from harnesses.testing.scripted_model.replies import _Reply
from harnesses.testing.scripted_model.responses import _response_events, _response_object, _sse_event
from harnesses.testing.scripted_model.steps import (
    BadAnswerStep,
    DropStep,
    HangStep,
    KeepaliveStep,
    StreamErrorStep,
)
from harnesses.testing.scripted_model.tokens import _DELTA_CHARS


class FaultAnswers:
    """The fault steps' answers, as methods of the server, which holds what they share."""

    # The server's: the event stop() sets, and its ids.
    _stopping: asyncio.Event | None

    def _next_id(self, prefix: str) -> str:
        raise NotImplementedError

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
