"""Errors an endpoint reports inside a 200 answer, through the real gateway, with the scripted model's
``stream_error`` step upstream: recorded as that attempt's failure with a classified kind and the
endpoint's own message, never as a clean attempt."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from harnesses.gateway import CLOSED_BODY
from policy import FailureKind
from policy.http_errors import kind_for_stream_error
from tests.test_gateway import CHAT, RESPONSES, TEXT, ask, gateway_to, kinds, script

pytestmark = pytest.mark.timeout(60)

OVERFLOW = ("context_length_exceeded", "This model's maximum context length is 8192 tokens.")
RATE = ("rate_limit_exceeded", "Rate limit reached for scripted-model.")
SERVER = ("server_error", "The server had an error while processing your request.")
WORDLESS = (None, "something went wrong upstream")


@pytest.fixture
async def harness() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        yield client


def stream_error(error: tuple[str | None, str], form: str = "native", after_chunks: int = 2) -> dict:
    code, message = error
    return {
        "type": "stream_error",
        "code": code,
        "message": message,
        "form": form,
        "after_chunks": after_chunks,
    }


@pytest.mark.parametrize(
    ("path", "body", "form", "error", "kind"),
    [
        ("/chat/completions", CHAT, "native", SERVER, FailureKind.PROVIDER_UNAVAILABLE),
        ("/chat/completions", CHAT, "native", OVERFLOW, FailureKind.MODEL_CONTEXT_LIMIT),
        ("/chat/completions", CHAT, "event", RATE, FailureKind.RATE_LIMIT_EXCEEDED),
        ("/chat/completions", CHAT, "event", WORDLESS, FailureKind.PROVIDER_UNAVAILABLE),
        ("/responses", RESPONSES, "native", SERVER, FailureKind.PROVIDER_UNAVAILABLE),
        ("/responses", RESPONSES, "native", RATE, FailureKind.RATE_LIMIT_EXCEEDED),
        ("/responses", RESPONSES, "incomplete", OVERFLOW, FailureKind.MODEL_CONTEXT_LIMIT),
        ("/responses", RESPONSES, "event", SERVER, FailureKind.PROVIDER_UNAVAILABLE),
    ],
    ids=[
        "chat-chunk-server",
        "chat-chunk-overflow",
        "chat-event-rate",
        "chat-event-wordless",
        "responses-failed-server",
        "responses-failed-rate",
        "responses-incomplete-overflow",
        "responses-event-server",
    ],
)
async def test_an_error_inside_a_stream_is_the_attempts_failure(
    model, harness, tmp_path, path, body, form, error, kind
) -> None:
    """Relayed as it came (the harness reads the endpoint's own words), recorded with the classified kind,
    and not retried: bytes reached the harness. A retryable kind spends the session's budget (here one
    failed attempt, so it closes); an overflow is the agent's history, not the endpoint's failing."""
    script(model, "s1", stream_error(error, form), TEXT)
    async with gateway_to(model.base_url, max_attempts_per_session=1) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, {**body, "stream": True}, path)
        again = await ask(harness, session, body, path)

    assert response.status_code == 200
    assert b"partial answer" in response.content and error[1].encode() in response.content
    [record, *rest] = session.attempts
    assert (record.status, record.kind, record.streamed) == (200, kind, True)
    assert record.error_message == error[1]
    assert not record.client_aborted
    assert len(model.requests("s1")) == 1 + len(rest)  # the gateway did not send it again
    if kind is FailureKind.MODEL_CONTEXT_LIMIT:
        assert session.closed_kind is None and again.status_code == 200
        assert kinds(session)[1:] == [(200, FailureKind.NONE)]
    else:
        assert session.closed_kind is kind and (again.status_code, again.content) == (400, CLOSED_BODY)
        assert error[1] in (session.closed_message or "")
        assert rest == []
    assert session.last_failure() == record


@pytest.mark.parametrize(("path", "body"), [("/chat/completions", CHAT), ("/responses", RESPONSES)])
async def test_a_whole_answer_with_an_overflow_error_is_passed_on(
    model, harness, tmp_path, path, body
) -> None:
    script(model, "s1", stream_error(OVERFLOW))
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, body, path)

    assert response.status_code == 200
    assert response.json()["error"]["message"] == OVERFLOW[1]
    assert kinds(session) == [(200, FailureKind.MODEL_CONTEXT_LIMIT)]
    assert session.attempts[0].error_message == OVERFLOW[1] and not session.attempts[0].streamed
    assert session.closed_kind is None


async def test_a_whole_answer_with_a_server_error_is_retried(model, harness, tmp_path) -> None:
    """A non-streamed answer is held until complete, so nothing reached the harness: retried like a 5xx."""
    script(model, "s1", stream_error(SERVER), TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == TEXT["text"]
    assert kinds(session) == [(200, FailureKind.PROVIDER_UNAVAILABLE), (200, FailureKind.NONE)]
    assert session.attempts[0].error_message == SERVER[1]


async def test_whole_answers_with_errors_forever_close_the_session(model, harness, tmp_path) -> None:
    script(model, "s1", stream_error(RATE))
    async with gateway_to(model.base_url, max_attempts_per_request=2) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert (response.status_code, response.content) == (400, CLOSED_BODY)
    assert kinds(session) == [(200, FailureKind.RATE_LIMIT_EXCEEDED)] * 2
    assert session.closed_kind is FailureKind.RATE_LIMIT_EXCEEDED


async def test_a_harness_hanging_up_on_the_error_keeps_the_error(model, harness, tmp_path) -> None:
    """Codex stops reading at response.failed: the attempt is still the endpoint's failure, not a clean
    answer the harness had in full."""
    script(model, "s1", stream_error(SERVER), TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        headers = {"Authorization": f"Bearer {session.token}"}
        seen = b""
        async with harness.stream(
            "POST", session.base_url + "/responses", json={**RESPONSES, "stream": True}, headers=headers
        ) as response:
            async for chunk in response.aiter_raw():
                seen += chunk
                if b"response.failed" in seen:
                    break
        gateway.close_session(session)

    assert b"response.failed" in seen
    [record] = session.attempts
    assert (record.status, record.kind) == (200, FailureKind.PROVIDER_UNAVAILABLE)
    assert (record.error_message or "").startswith(SERVER[1])


async def test_sound_answers_are_not_errors(model, harness, tmp_path) -> None:
    """Responses objects carry "error": null all along a sound answer; that is no error."""
    script(model, "s1", TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        for body, path in ((RESPONSES, "/responses"), (CHAT, "/chat/completions")):
            for stream in (True, False):
                assert (await ask(harness, session, {**body, "stream": stream}, path)).status_code == 200

    assert kinds(session) == [(200, FailureKind.NONE)] * 4
    assert all(a.error_message is None for a in session.attempts)


def test_the_scripted_error_forms_are_what_the_apis_send() -> None:
    """The shapes the gateway is tested against, read back from the scripted model's own frames."""
    from harnesses.testing.scripted_model import parse_steps
    from harnesses.testing.scripted_model.chat import _chat_error_frame

    [native, event] = parse_steps([stream_error(SERVER), stream_error(RATE, "event")])
    chunk = json.loads(_chat_error_frame(native, "m", "id").decode().removeprefix("data: "))
    assert chunk["object"] == "chat.completion.chunk" and chunk["error"]["message"] == SERVER[1]
    assert _chat_error_frame(event, "m", "id").startswith(b"event: error\ndata: ")


@pytest.mark.parametrize(
    ("code", "message", "kind"),
    [
        ("context_length_exceeded", "", FailureKind.MODEL_CONTEXT_LIMIT),
        (400, "This model's maximum context length is 4096 tokens", FailureKind.MODEL_CONTEXT_LIMIT),
        (None, "prompt is too long: 300000 tokens > 200000 maximum", FailureKind.MODEL_CONTEXT_LIMIT),
        ("rate_limit_exceeded", "slow down", FailureKind.RATE_LIMIT_EXCEEDED),
        (429, "", FailureKind.RATE_LIMIT_EXCEEDED),
        ("429", None, FailureKind.RATE_LIMIT_EXCEEDED),
        (None, "Too Many Requests", FailureKind.RATE_LIMIT_EXCEEDED),
        ("server_error", "The server had an error", FailureKind.PROVIDER_UNAVAILABLE),
        (500, "boom", FailureKind.PROVIDER_UNAVAILABLE),
        (400, "invalid tool schema", FailureKind.PROVIDER_UNAVAILABLE),  # mid-answer: never graded
        (None, "failed (request 14290)", FailureKind.PROVIDER_UNAVAILABLE),  # a stray 429 is no rate limit
        (True, None, FailureKind.PROVIDER_UNAVAILABLE),
        (None, None, FailureKind.PROVIDER_UNAVAILABLE),
    ],
)
def test_kind_for_stream_error(code, message, kind) -> None:
    assert kind_for_stream_error(code, message) is kind


async def test_overflows_inside_answers_count_towards_the_cap(model, harness, tmp_path) -> None:
    """OpenCode compacts and asks again on an overflow, without end: one reported inside a 200 answer
    counts towards max_context_overflows like a 400 does."""
    script(model, "s1", stream_error(OVERFLOW))
    async with gateway_to(model.base_url, max_context_overflows=2) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        answers = [await ask(harness, session, {**CHAT, "stream": True}) for _ in range(4)]

    assert [a.status_code for a in answers] == [200, 200, 200, 400]
    assert answers[3].content == CLOSED_BODY
    assert kinds(session) == [(200, FailureKind.MODEL_CONTEXT_LIMIT)] * 3
    assert session.closed_kind is FailureKind.MODEL_CONTEXT_LIMIT
    assert "3 context overflows" in (session.closed_message or "")
