"""The model gateway over real HTTP on 127.0.0.1: the scripted model upstream, and a small aiohttp upstream
written here for what a script cannot express (a chunk held until the test says so, a cut before any byte,
the headers the upstream saw, an answer that never comes)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from harnesses.gateway import (
    CLOSED_BODY,
    NO_LISTING_BODY,
    NOT_SERVED_BODY,
    SESSION_HEADER,
    AttemptRecord,
    Gateway,
    GatewayConfig,
    GatewaySession,
)
from harnesses.testing.scripted_model import SESSION_HEADER as SCRIPTED_SESSION_HEADER
from harnesses.testing.scripted_model import ScriptedModel, parse_steps
from policy import FailureKind

FAST = {"backoff_base_s": 0.01, "backoff_cap_s": 0.05}
CHAT = {"model": "scripted-model", "messages": [{"role": "user", "content": "say hi"}]}
RESPONSES = {"model": "scripted-model", "input": "say hi"}
TEXT = {"type": "text", "text": "hi there, this is a scripted answer"}
OVERFLOW = json.dumps(
    {
        "error": {
            "message": "This model's maximum context length is 8192 tokens.",
            "type": "invalid_request_error",
            "code": "context_length_exceeded",
        }
    }
)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def gateway_to(
    upstream: str,
    api_key: str | None = None,
    on_attempt: Callable[[GatewaySession, AttemptRecord], None] | None = None,
    pins: dict[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[Gateway]:
    """``pins``: the run's (``model``, ``max_output_tokens``, ``parameters``); none by default."""
    gateway = Gateway(
        upstream, api_key, GatewayConfig(**{**FAST, **config}), on_attempt=on_attempt, **(pins or {})
    )
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop()


@contextlib.asynccontextmanager
async def upstream_server(handler: Handler) -> AsyncIterator[str]:
    """A one-handler upstream for what the scripted model cannot do; yields its base URL (…/v1)."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


async def never() -> None:
    """An upstream that does not answer; the gateway hanging up cancels it long before the bound."""
    await asyncio.wait_for(asyncio.Event().wait(), 120)


def script(model: ScriptedModel, session_id: str, *steps: dict[str, Any]) -> None:
    model.set_script(session_id, parse_steps(list(steps)))


async def ask(
    harness: httpx.AsyncClient,
    session: GatewaySession,
    body: dict[str, Any] = CHAT,
    path: str = "/chat/completions",
) -> httpx.Response:
    return await harness.post(
        session.base_url + path,
        content=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {session.token}", "Content-Type": "application/json"},
    )


def kinds(session: GatewaySession) -> list[tuple[int | None, FailureKind]]:
    return [(a.status, a.kind) for a in session.attempts]


def sse_data(raw: bytes) -> list[dict[str, Any]]:
    lines = raw.decode().splitlines()
    return [json.loads(line[5:]) for line in lines if line.startswith("data:") and "[DONE]" not in line]


def gunzip(session: GatewaySession, name: str | None) -> bytes:
    assert name is not None
    return gzip.decompress((session.evidence_dir / name).read_bytes())


# -- retries ---------------------------------------------------------------------------------------------


async def test_429_with_retry_after_is_retried_with_the_same_bytes(model, harness, tmp_path) -> None:
    script(model, "s1", {"type": "error", "status": 429, "headers": {"Retry-After": "1"}}, TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == TEXT["text"]
    assert kinds(session) == [(429, FailureKind.RATE_LIMIT_EXCEEDED), (200, FailureKind.NONE)]
    assert session.attempts[0].retry_after_s == 1.0
    assert session.attempts[0].error_message is not None
    assert "Rate limit" in session.attempts[0].error_message
    sent = json.dumps(CHAT).encode()
    assert {a.request_sha256 for a in session.attempts} == {hashlib.sha256(sent).hexdigest()}
    logged = model.requests("s1")
    assert [entry.body for entry in logged] == [CHAT, CHAT]
    assert logged[1].t - logged[0].t >= 1.0
    assert session.closed_kind is None
    assert session.last_failure() == session.attempts[0]


async def test_retry_after_as_http_date_is_honoured(model, harness, tmp_path) -> None:
    # An HTTP date has whole seconds, so four seconds ahead is at least three seconds away: two of them
    # for the gateway's start and the first request on a loaded machine before the hint reads 1 s.
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=4), usegmt=True)
    script(model, "s1", {"type": "error", "status": 429, "headers": {"Retry-After": when}}, TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert response.status_code == 200
    hint = session.attempts[0].retry_after_s
    assert hint is not None and 1.0 < hint <= 4.0
    logged = model.requests("s1")
    assert logged[1].t - logged[0].t >= 1.0


@pytest.mark.parametrize("value", ["NaN", "inf", "-5", "soon", ""])
async def test_unusable_retry_after_falls_back_to_backoff(model, harness, tmp_path, value: str) -> None:
    script(model, "s1", {"type": "error", "status": 429, "headers": {"Retry-After": value}}, TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert response.status_code == 200
    assert kinds(session) == [(429, FailureKind.RATE_LIMIT_EXCEEDED), (200, FailureKind.NONE)]
    assert session.attempts[0].retry_after_s is None
    assert len(model.requests("s1")) == 2


async def test_429_forever_closes_the_session_with_the_neutral_400(model, harness, tmp_path) -> None:
    script(model, "s1", {"type": "error", "status": 429})
    async with gateway_to(model.base_url, max_attempts_per_request=3) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        first = await ask(harness, session)
        forwarded = len(model.requests("s1"))
        second = await ask(harness, session)

    assert (first.status_code, first.content) == (400, CLOSED_BODY)
    assert (second.status_code, second.content) == (400, CLOSED_BODY)
    assert kinds(session) == [(429, FailureKind.RATE_LIMIT_EXCEEDED)] * 3
    assert forwarded == 3
    assert len(model.requests("s1")) == 3  # the second request never went upstream
    assert session.closed_kind is FailureKind.RATE_LIMIT_EXCEEDED
    assert session.closed_message is not None and "HTTP 429" in session.closed_message
    assert session.summary()["refused_after_close"] == 1
    assert session.summary()["by_kind"] == {"rate_limit_exceeded": 3}


def test_closed_body_is_neutral() -> None:
    # harnesses.md §9: each of these makes at least one of the four harnesses retry a 400.
    text = CLOSED_BODY.decode().lower()
    digits = ["429", "500", "502", "503", "504", "524"]
    words = ["rate", "retry", "try again", "timeout", "timed out", "connection", "network", "server"]
    words += ["overloaded", "capacity", "exhausted", "terminated", "context", "token"]
    assert [word for word in digits + words if word in text] == []
    message = json.loads(CLOSED_BODY)["error"]["message"]
    assert len(message) >= 30  # Hermes reads a short 400 in a long session as a full context window


async def test_session_budget_spans_requests(model, harness, tmp_path) -> None:
    script(model, "s1", {"type": "error", "status": 429}, TEXT, {"type": "error", "status": 429})
    config = {"max_attempts_per_request": 4, "max_attempts_per_session": 3}
    async with gateway_to(model.base_url, **config) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        first = await ask(harness, session)
        second = await ask(harness, session)

    assert first.status_code == 200
    assert (second.status_code, second.content) == (400, CLOSED_BODY)
    # One failure spent on request 0, two more on request 1: three in all, though request 1 had four.
    assert [(a.request_index, a.attempt) for a in session.attempts] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert session.closed_kind is FailureKind.RATE_LIMIT_EXCEEDED
    assert session.closed_message is not None and "budget" in session.closed_message


async def test_500_then_success(model, harness, tmp_path) -> None:
    script(model, "s1", {"type": "error", "status": 500}, TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert response.status_code == 200
    assert kinds(session) == [(500, FailureKind.PROVIDER_UNAVAILABLE), (200, FailureKind.NONE)]
    assert session.closed_kind is None


async def test_503_forever_is_provider_unavailable(model, harness, tmp_path) -> None:
    script(model, "s1", {"type": "error", "status": 503})
    async with gateway_to(model.base_url, max_attempts_per_request=2) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert (response.status_code, response.content) == (400, CLOSED_BODY)
    assert kinds(session) == [(503, FailureKind.PROVIDER_UNAVAILABLE)] * 2
    assert session.closed_kind is FailureKind.PROVIDER_UNAVAILABLE


async def test_retry_after_past_the_limit_ends_the_retries(model, harness, tmp_path) -> None:
    script(model, "s1", {"type": "error", "status": 429, "headers": {"Retry-After": "120"}}, TEXT)
    async with gateway_to(model.base_url, max_retry_after_s=60) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert (response.status_code, response.content) == (400, CLOSED_BODY)
    assert len(model.requests("s1")) == 1
    assert session.closed_kind is FailureKind.RATE_LIMIT_EXCEEDED
    assert session.closed_message is not None and "Retry-After 120s" in session.closed_message


async def test_no_retry_starts_past_the_retry_deadline(model, harness, tmp_path) -> None:
    script(model, "s1", {"type": "error", "status": 503, "headers": {"Retry-After": "1"}}, TEXT)
    async with gateway_to(model.base_url, retry_deadline_s=0.5) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert (response.status_code, response.content) == (400, CLOSED_BODY)
    assert len(model.requests("s1")) == 1
    assert session.closed_kind is FailureKind.PROVIDER_UNAVAILABLE
    assert session.closed_message is not None and "deadline" in session.closed_message


async def test_connection_refused_is_a_transport_error(harness, tmp_path) -> None:
    with socket.socket() as probe:  # a port nobody listens on once the probe is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with gateway_to(f"http://127.0.0.1:{port}/v1", max_attempts_per_request=3) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert (response.status_code, response.content) == (400, CLOSED_BODY)
    assert kinds(session) == [(None, FailureKind.TRANSPORT_ERROR)] * 3
    assert all(a.error_message and "Cannot connect" in a.error_message for a in session.attempts)
    assert session.closed_kind is FailureKind.TRANSPORT_ERROR


# -- answers that are not retried --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (401, FailureKind.PROVIDER_AUTH_ERROR),
        (403, FailureKind.PROVIDER_AUTH_ERROR),
        (404, FailureKind.ENDPOINT_CONFIG_ERROR),  # the model does not exist
        (402, FailureKind.ENDPOINT_CONFIG_ERROR),  # the account is out of credits
    ],
)
async def test_a_configuration_error_closes_the_session_at_once(
    model, harness, tmp_path, status: int, kind: FailureKind
) -> None:
    """The endpoint refuses everything, the run's own probe too: the run's config is wrong."""
    model.outage(600, status)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        first = await ask(harness, session)
        second = await ask(harness, session)

    assert (first.status_code, first.content) == (400, CLOSED_BODY)
    assert (second.status_code, second.content) == (400, CLOSED_BODY)
    assert kinds(session) == [(status, kind)]
    report = model.outage_report()
    assert report is not None and report.answered == 2  # the request and the run's probe, nothing after
    assert session.closed_kind is kind


@pytest.mark.parametrize("status", [401, 403, 404, 402])
async def test_a_configuration_class_error_only_this_session_draws_is_the_sessions(
    model, harness, tmp_path, status: int
) -> None:
    """The run's own probe to the same URL is answered: the request's content drew the error, so it is
    the session's (graded as the agent's), never a stop of the run; one probe serves the worker."""
    script(model, "s1", {"type": "error", "status": status})
    script(model, "s2", {"type": "error", "status": status})
    async with gateway_to(model.base_url) as gateway:
        first_session = gateway.open_session("s1", tmp_path / "s1")
        second_session = gateway.open_session("s2", tmp_path / "s2")
        first = await ask(harness, first_session)
        second = await ask(harness, second_session)
        again = await ask(harness, first_session)

    assert (first.status_code, second.status_code, again.status_code) == (400, 400, 400)
    for session in (first_session, second_session):
        assert kinds(session) == [(status, FailureKind.MODEL_REQUEST_ERROR)]
        assert session.closed_kind is FailureKind.MODEL_REQUEST_ERROR
        assert "this request drew the error" in (session.closed_message or "")
    assert len(model.requests("default")) == 1  # the probe, once for both sessions


async def test_context_overflow_is_passed_through_then_capped(model, harness, tmp_path) -> None:
    script(model, "s1", {"type": "error", "status": 400, "body": OVERFLOW})
    async with gateway_to(model.base_url, max_context_overflows=2) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        answers = [await ask(harness, session) for _ in range(4)]

    assert [(a.status_code, a.text) for a in answers[:2]] == [(400, OVERFLOW)] * 2
    assert [(a.status_code, a.content) for a in answers[2:]] == [(400, CLOSED_BODY)] * 2
    assert kinds(session) == [(400, FailureKind.MODEL_CONTEXT_LIMIT)] * 3  # no retries
    assert len(model.requests("s1")) == 3
    assert session.closed_kind is FailureKind.MODEL_CONTEXT_LIMIT
    assert session.summary()["context_overflows"] == 3


async def test_other_4xx_is_passed_through_and_the_session_goes_on(model, harness, tmp_path) -> None:
    body = '{"error":{"message":"Invalid tool schema","type":"invalid_request_error"}}'
    script(model, "s1", {"type": "error", "status": 422, "body": body}, TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        first = await ask(harness, session)
        second = await ask(harness, session)

    assert (first.status_code, first.text) == (422, body)
    assert second.status_code == 200
    assert kinds(session) == [(422, FailureKind.MODEL_REQUEST_ERROR), (200, FailureKind.NONE)]
    assert session.closed_kind is None


# -- streaming and cuts -----------------------------------------------------------------------------------


async def test_stream_chunks_reach_the_harness_as_they_arrive(harness, tmp_path) -> None:
    first_seen = asyncio.Event()
    upstream_done = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"index":0,"delta":{"content":"one"}}]}\n\n')
        # Only a harness that already read the first chunk can release the rest: no buffering.
        await asyncio.wait_for(first_seen.wait(), 30)
        await response.write(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        upstream_done.set()
        return response

    async with upstream_server(stream) as upstream, gateway_to(upstream) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        headers = {"Authorization": f"Bearer {session.token}"}
        body = {**CHAT, "stream": True}
        async with harness.stream(
            "POST", session.base_url + "/chat/completions", json=body, headers=headers
        ) as r:
            chunks = r.aiter_raw()
            first = await anext(chunks)
            assert not upstream_done.is_set()
            first_seen.set()
            rest = b"".join([chunk async for chunk in chunks])

    assert b'"content":"one"' in first
    assert rest.endswith(b"data: [DONE]\n\n")
    assert kinds(session) == [(200, FailureKind.NONE)]
    assert session.attempts[0].streamed and session.attempts[0].finish_reason == "stop"


async def test_cut_after_bytes_is_passed_on_and_not_retried(model, harness, tmp_path) -> None:
    script(model, "s1", {"type": "drop", "after_chunks": 2}, TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        received = bytearray()
        headers = {"Authorization": f"Bearer {session.token}"}
        body = {**CHAT, "stream": True}
        with pytest.raises(httpx.TransportError):
            async with harness.stream(
                "POST", session.base_url + "/chat/completions", json=body, headers=headers
            ) as response:
                async for chunk in response.aiter_raw():
                    received += chunk
        again = await ask(harness, session)  # the harness's own reconnect: a new request

    assert b"partial answer" in received
    assert b"[DONE]" not in received
    assert kinds(session) == [(200, FailureKind.TRANSPORT_ERROR), (200, FailureKind.NONE)]
    assert [a.request_index for a in session.attempts] == [0, 1]
    assert again.status_code == 200
    assert session.closed_kind is None


async def test_reconnects_after_cuts_spend_the_session_budget(model, harness, tmp_path) -> None:
    script(model, "s1", {"type": "drop", "after_chunks": 1})
    body = {**CHAT, "stream": True}
    async with gateway_to(model.base_url, max_attempts_per_session=2) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        for _ in range(2):  # the harness reconnecting after each cut
            with pytest.raises(httpx.TransportError):
                await ask(harness, session, body)
        third = await ask(harness, session, body)

    assert (third.status_code, third.content) == (400, CLOSED_BODY)
    assert kinds(session) == [(200, FailureKind.TRANSPORT_ERROR)] * 2
    assert len(model.requests("s1")) == 2
    assert session.closed_kind is FailureKind.TRANSPORT_ERROR


async def test_cut_before_any_byte_is_retried(harness, tmp_path) -> None:
    calls = 0

    async def flaky(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)  # headers go out at once
        if calls == 1:
            assert request.transport is not None
            request.transport.close()  # then the stream ends before its first byte
            return response
        await response.write(b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\ndata: [DONE]\n\n')
        return response

    async with upstream_server(flaky) as upstream, gateway_to(upstream) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, {**CHAT, "stream": True})

    assert response.status_code == 200
    assert response.content.endswith(b"data: [DONE]\n\n")
    assert kinds(session) == [(200, FailureKind.TRANSPORT_ERROR), (200, FailureKind.NONE)]
    assert calls == 2


async def test_harness_hanging_up_cancels_the_upstream_request(harness, tmp_path) -> None:
    arrived, upstream_cancelled = asyncio.Event(), asyncio.Event()
    records: asyncio.Queue[AttemptRecord] = asyncio.Queue()

    async def slow(request: web.Request) -> web.StreamResponse:
        arrived.set()
        try:
            await never()  # answers never; ended by the gateway hanging up
        finally:
            upstream_cancelled.set()
        raise AssertionError("unreachable")

    on_attempt = lambda _session, record: records.put_nowait(record)  # noqa: E731
    async with upstream_server(slow) as upstream, gateway_to(upstream, on_attempt=on_attempt) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        call = asyncio.create_task(ask(harness, session))
        await asyncio.wait_for(arrived.wait(), 30)
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        record = await asyncio.wait_for(records.get(), 30)
        await asyncio.wait_for(upstream_cancelled.wait(), 30)

    assert record.client_aborted
    assert (record.status, record.kind) == (None, FailureKind.TRANSPORT_ERROR)
    assert session.attempts == [record]
    assert session.closed_kind is None


@pytest.mark.parametrize("end", ["hang_up", "close_session"])
@pytest.mark.parametrize("answered", [True, False], ids=["after_final_event", "mid_answer"])
async def test_an_answer_the_harness_had_in_full_stays_answered(harness, tmp_path, end, answered) -> None:
    """Codex exits on response.completed; the upstream's last bytes may still be on their way when the
    harness hangs up or its session is closed. That attempt was answered; one cut mid-answer was not."""
    records: asyncio.Queue[AttemptRecord] = asyncio.Queue()
    created = {"type": "response.created", "response": {"object": "response", "status": "in_progress"}}
    usage = {"input_tokens": 11, "output_tokens": 3}
    final = {"object": "response", "status": "completed", "usage": usage}
    done = {"type": "response.completed", "response": final}

    async def held_open(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {json.dumps(created)}\n\n".encode())
        if answered:
            await response.write(f"data: {json.dumps(done)}\n\n".encode())
        await never()
        raise AssertionError("unreachable")

    on_attempt = lambda _session, record: records.put_nowait(record)  # noqa: E731
    last = b"response.completed" if answered else b"response.created"
    async with upstream_server(held_open) as upstream, gateway_to(upstream, on_attempt=on_attempt) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        headers = {"Authorization": f"Bearer {session.token}"}
        seen = b""
        with contextlib.suppress(httpx.TransportError):
            async with harness.stream(
                "POST", session.base_url + "/responses", json={**RESPONSES, "stream": True}, headers=headers
            ) as r:
                async for chunk in r.aiter_raw():
                    seen += chunk
                    if last in seen:
                        break
                if end == "close_session":
                    gateway.close_session(session)
        record = await asyncio.wait_for(records.get(), 30)

    assert last in seen
    if answered:
        assert (record.status, record.kind, record.client_aborted) == (200, FailureKind.NONE, False)
        assert (record.input_tokens, record.output_tokens, record.finish_reason) == (11, 3, "completed")
    else:
        cut = FailureKind.TRANSPORT_ERROR if end == "hang_up" else FailureKind.CANCELLED
        assert (record.status, record.kind, record.client_aborted) == (200, cut, end == "hang_up")
    assert session.attempts == [record]


async def test_close_session_cuts_in_flight_requests(harness, tmp_path) -> None:
    arrived = asyncio.Event()
    calls = 0

    async def slow(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        arrived.set()
        await never()
        raise AssertionError("unreachable")

    async with upstream_server(slow) as upstream, gateway_to(upstream) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        call = asyncio.create_task(ask(harness, session))
        await asyncio.wait_for(arrived.wait(), 30)
        gateway.close_session(session)
        # Recorded by close_session itself, so attempts.jsonl has it.
        assert kinds(session) == [(None, FailureKind.CANCELLED)]
        with pytest.raises(httpx.TransportError):
            await call
        later = await ask(harness, session)
        gateway.close_session(session)  # the executor closes twice (after the run and in finally)

    assert (later.status_code, later.content) == (400, CLOSED_BODY)
    assert calls == 1
    assert session.closed_kind is None  # the owner closed it, not the gateway's policy
    lines = (session.evidence_dir / "attempts.jsonl").read_text().splitlines()
    assert [AttemptRecord.model_validate_json(line) for line in lines] == session.attempts


# -- sessions, keys and paths ------------------------------------------------------------------------------


async def test_unknown_token_gets_the_neutral_400(model, harness, tmp_path) -> None:
    async with gateway_to(model.base_url) as gateway:
        gateway.open_session("s1", tmp_path / "s1")
        response = await harness.post(gateway.url + "/s/not-a-token/v1/chat/completions", json=CHAT)

    assert (response.status_code, response.content) == (400, CLOSED_BODY)
    assert model.requests("s1") == []


async def test_sessions_are_kept_apart(model, harness, tmp_path) -> None:
    script(model, "a", {"type": "error", "status": 429})
    script(model, "b", TEXT)
    async with gateway_to(model.base_url, max_attempts_per_request=2) as gateway:
        a = gateway.open_session("a", tmp_path / "a")
        b = gateway.open_session("b", tmp_path / "b")
        answer_a, answer_b = await asyncio.gather(ask(harness, a), ask(harness, b))

    assert answer_a.content == CLOSED_BODY and answer_b.status_code == 200
    assert a.token != b.token and a.closed_kind is FailureKind.RATE_LIMIT_EXCEEDED and b.closed_kind is None
    assert (len(model.requests("a")), len(model.requests("b"))) == (2, 1)


@pytest.mark.parametrize("api_key", ["sk-real-secret-key-123", None])
async def test_real_key_goes_upstream_and_nowhere_else(harness, tmp_path, api_key: str | None) -> None:
    seen: list[dict[str, str]] = []
    paths: list[str] = []

    async def capture(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        paths.append(request.path_qs)
        await request.read()
        return web.json_response(
            {"choices": [{"index": 0, "message": {"content": "ok"}, "finish_reason": "stop"}]}
        )

    async with upstream_server(capture) as upstream, gateway_to(upstream, api_key) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await harness.post(
            session.base_url + "/chat/completions?api-version=2024-10-01",
            json=CHAT,
            headers={
                "Authorization": f"Bearer {session.token}",
                "api-key": session.token,
                SESSION_HEADER: "someone-else",
                "x-stainless-lang": "js",
            },
        )

    assert response.status_code == 200
    [headers] = seen
    lowered = {name.lower(): value for name, value in headers.items()}
    assert lowered.get("authorization") == (f"Bearer {api_key}" if api_key else None)
    assert all(session.token not in value for value in headers.values())
    assert paths == ["/v1/chat/completions"]  # a query on a model call is the sandbox's, not sent
    assert lowered[SESSION_HEADER] == "s1"
    assert "x-stainless-lang" not in lowered and "api-key" not in lowered  # only the gateway's own
    assert SESSION_HEADER == SCRIPTED_SESSION_HEADER
    files = sorted(p.name for p in session.evidence_dir.iterdir())
    assert files == ["attempts.jsonl", "req-0.json.gz", "resp-0-1.json.gz"]
    if api_key:
        for path in session.evidence_dir.iterdir():
            data = path.read_bytes()
            text = gzip.decompress(data) if path.suffix == ".gz" else data
            assert api_key.encode() not in text
        assert api_key not in repr(session) and api_key not in json.dumps(session.summary())


async def test_paths_outside_v1_are_refused(harness, tmp_path) -> None:
    calls = 0

    async def count(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        return web.json_response({})

    async with upstream_server(count) as upstream, gateway_to(upstream) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await harness.get(session.base_url + "/%2e%2e/admin")

    assert (response.status_code, response.content) == (400, CLOSED_BODY)
    assert calls == 0


async def test_models_listing_passes_through_and_is_no_model_attempt(model, harness, tmp_path) -> None:
    """Hermes looks up prices with GET /models: forwarded, but not one of the session's model calls
    (a session that only listed models made no model call)."""
    script(model, "s1", TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        listing = await harness.get(session.base_url + "/models")
        one = await harness.get(session.base_url + "/models/scripted-model")
        missing = await harness.get(session.base_url + "/models/no-such-model")
        assert session.attempts == []
        call = await ask(harness, session)

    assert listing.status_code == 200
    assert [m["id"] for m in listing.json()["data"]] == ["scripted-model"]
    assert (one.status_code, one.json()["id"]) == (200, "scripted-model")
    assert missing.status_code == 404 and "does not exist" in missing.json()["error"]["message"]
    assert ("GET", "/v1/models") in model.requests_seen()
    assert ("GET", "/v1/models/scripted-model") in model.requests_seen()
    assert call.status_code == 200
    assert [(a.request_index, a.method, a.path, a.kind) for a in session.attempts] == [
        (0, "POST", "/chat/completions", FailureKind.NONE)
    ]
    summary = session.summary()
    assert (summary["probes"], summary["probes_failed"], summary["requests"]) == (3, 0, 1)
    assert sorted(p.name for p in session.evidence_dir.iterdir() if p.name.startswith("req-")) == [
        "req-0.json.gz"
    ]


async def test_a_listing_the_endpoint_does_not_give_is_a_neutral_404(harness, tmp_path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with gateway_to(f"http://127.0.0.1:{port}/v1") as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await harness.get(session.base_url + "/models")

    assert (response.status_code, response.content) == (404, NO_LISTING_BODY)
    assert session.attempts == [] and session.closed_kind is None
    assert (session.summary()["probes"], session.summary()["probes_failed"]) == (1, 1)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/files"),
        ("GET", "/files"),
        ("POST", "/fine_tuning/jobs"),
        ("POST", "/batches"),
        ("POST", "/load_lora_adapter"),
        ("POST", "/unload_lora_adapter"),
        ("DELETE", "/models/scripted-model"),
        ("POST", "/models"),
        ("GET", "/chat/completions"),
        ("PUT", "/responses"),
        ("DELETE", "/responses/resp_1"),
        ("GET", "/responses/resp_1"),
        ("POST", "/chat/completions/"),
        ("POST", "/completions"),
        ("POST", "/embeddings"),
        ("GET", "/models/"),
        ("PATCH", "/chat/completions"),
    ],
)
async def test_other_routes_never_reach_the_endpoint(model, harness, tmp_path, method, path) -> None:
    script(model, "s1", TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await harness.request(
            method,
            session.base_url + path,
            content=json.dumps(CHAT).encode(),
            headers={"Authorization": f"Bearer {session.token}", "Content-Type": "application/json"},
        )
        after = await ask(harness, session)  # the session goes on: a wrong path is no model failure

    assert (response.status_code, response.content) == (404, NOT_SERVED_BODY)
    assert model.requests_seen() == [("POST", "/v1/chat/completions")]  # only the model call that followed
    assert after.status_code == 200
    assert [(a.request_index, a.path) for a in session.attempts] == [(0, "/chat/completions")]
    assert session.summary()["probes"] == 0 and session.closed_kind is None


async def test_paths_beside_the_session_prefix_get_the_neutral_404(model, harness, tmp_path) -> None:
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        for url in (gateway.url + "/v1/chat/completions", session.base_url[: -len("/v1")] + "/v2/models"):
            response = await harness.post(url, json=CHAT)
            assert (response.status_code, response.content) == (404, NOT_SERVED_BODY)

    assert model.requests_seen() == []


def test_local_answers_are_neutral() -> None:
    """What the gateway answers itself must not make a harness retry (harnesses.md §9)."""
    for body in (NOT_SERVED_BODY, NO_LISTING_BODY):
        text = body.decode().lower()
        assert not any(d in text for d in ["429", "500", "502", "503", "504", "524"])
        words = ["rate", "retry", "try again", "timeout", "timed out", "connection", "network", "server"]
        words += ["overloaded", "capacity", "exhausted", "terminated", "context", "token", "fetch"]
        words += ["unavailable", "limit", "too many", "socket"]
        assert not any(w in text for w in words), text
        assert len(json.loads(body)["error"]["message"]) >= 30


# -- what the record says ---------------------------------------------------------------------------------


def _expected_usage(path: str, stream: bool, raw: bytes) -> tuple[int | None, int | None]:
    """The usage the harness itself received, read the plain way."""
    if not stream:
        usage = json.loads(raw).get("usage")
    elif path == "/chat/completions":
        usage = next((c["usage"] for c in sse_data(raw) if c.get("usage")), None)
    else:
        usage = sse_data(raw)[-1]["response"].get("usage")
    if usage is None:
        return None, None
    if path == "/chat/completions":
        return usage["prompt_tokens"], usage["completion_tokens"]
    return usage["input_tokens"], usage["output_tokens"]


@pytest.mark.parametrize(
    ("path", "stream", "step", "finish"),
    [
        ("/chat/completions", True, {}, "stop"),
        ("/chat/completions", True, {"finish_reason": "length"}, "length"),
        ("/chat/completions", True, {"usage": False}, "stop"),
        ("/chat/completions", False, {}, "stop"),
        ("/chat/completions", False, {"usage": False}, "stop"),
        ("/responses", True, {}, "completed"),
        ("/responses", True, {"finish_reason": "length"}, "max_output_tokens"),
        ("/responses", True, {"usage": False}, "completed"),
        ("/responses", False, {}, "completed"),
    ],
)
async def test_usage_and_finish_reason_are_sniffed(
    model, harness, tmp_path, path: str, stream: bool, step: dict[str, Any], finish: str
) -> None:
    script(model, "s1", {**TEXT, **step})
    base = CHAT if path == "/chat/completions" else RESPONSES
    body = {**base, "stream": stream}
    if stream and path == "/chat/completions":
        body["stream_options"] = {"include_usage": True}
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, body, path)

    assert response.status_code == 200
    [record] = session.attempts
    expected = _expected_usage(path, stream, response.content)
    assert (record.input_tokens, record.output_tokens) == expected
    assert (expected == (None, None)) == (step.get("usage") is False)
    assert record.finish_reason == finish
    assert record.streamed is stream
    assert record.response_bytes == len(response.content)
    if stream:
        assert record.ttfb_s is not None and record.ttfb_s <= record.latency_s


async def test_bodies_are_kept_gzipped(model, harness, tmp_path) -> None:
    script(model, "s1", {"type": "error", "status": 429, "headers": {"Retry-After": "0"}}, TEXT)
    body = {**CHAT, "stream": True}
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, body)

    failed, answered = session.attempts
    assert failed.request_file == answered.request_file == "req-0.json.gz"
    assert gunzip(session, failed.request_file) == json.dumps(body).encode()
    assert json.loads(gunzip(session, failed.response_file))["error"]["code"] == "rate_limit_exceeded"
    assert answered.response_file == "resp-0-2.sse.gz"
    assert gunzip(session, answered.response_file) == response.content
    assert not (failed.request_truncated or answered.response_truncated)
    lines = (session.evidence_dir / "attempts.jsonl").read_text().splitlines()
    assert [AttemptRecord.model_validate_json(line) for line in lines] == session.attempts


async def test_kept_bodies_are_bounded(model, harness, tmp_path) -> None:
    script(model, "s1", TEXT)
    async with gateway_to(model.base_url, max_body_bytes=20) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    [record] = session.attempts
    assert record.request_truncated and record.response_truncated
    assert gunzip(session, record.request_file) == json.dumps(CHAT).encode()[:20]
    assert gunzip(session, record.response_file) == response.content[:20]
    assert record.response_bytes == len(response.content)


async def test_bodies_can_be_left_out(model, harness, tmp_path) -> None:
    script(model, "s1", TEXT)
    async with gateway_to(model.base_url, keep_bodies=False) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        await ask(harness, session)

    assert [(a.request_file, a.response_file) for a in session.attempts] == [(None, None)]
    assert sorted(p.name for p in session.evidence_dir.iterdir()) == ["attempts.jsonl"]


async def test_a_lost_evidence_dir_does_not_fail_the_request(model, harness, tmp_path) -> None:
    script(model, "s1", TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        shutil.rmtree(session.evidence_dir)
        response = await ask(harness, session)

    assert response.status_code == 200
    assert [(a.kind, a.request_file, a.response_file) for a in session.attempts] == [
        (FailureKind.NONE, None, None)
    ]


def test_config_rejects_unknown_and_invalid_fields() -> None:
    with pytest.raises(ValueError):
        GatewayConfig(max_attempts=3)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        GatewayConfig(max_attempts_per_request=0)


def test_open_session_needs_a_started_gateway(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError):
        Gateway("http://127.0.0.1:1/v1", None).open_session("s1", tmp_path / "s1")


async def test_stop_is_safe_twice_and_records_survive(model, harness, tmp_path) -> None:
    script(model, "s1", TEXT)
    gateway = Gateway(model.base_url, None)
    await gateway.start()
    session = gateway.open_session("s1", tmp_path / "s1")
    await ask(harness, session)
    await gateway.stop()
    await gateway.stop()
    assert kinds(session) == [(200, FailureKind.NONE)]
    assert len((session.evidence_dir / "attempts.jsonl").read_text().splitlines()) == 1
