"""The gateway as the policy's boundary: what a sandbox may ask of it, over real HTTP on 127.0.0.1.

A hostile agent names another model, asks for many choices or a priority tier, sends its own headers,
floods the gateway with requests or bodies; an endpoint (or a proxy before it) answers 200 with a page,
keeps a stream alive with comments and never a token, or ends a stream without its last event. Each test
plays the sandbox's side with a plain HTTP client, the scripted model (or a one-handler server) upstream,
and checks what reached the endpoint and what the session recorded. No assertion depends on timing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from harnesses.gateway import CLOSED_BODY, GatewaySession
from harnesses.gateway.limits import REFUSED_BODY
from policy import FailureKind
from tests.test_gateway import CHAT, RESPONSES, TEXT, ask, gateway_to, kinds, never, script, upstream_server

pytestmark = pytest.mark.timeout(60)

RUN_MODEL = "run-model"
PINS = {"model": RUN_MODEL}
STALL_S = 0.5


async def read_stream(
    harness: httpx.AsyncClient, session: GatewaySession, path: str, body: dict[str, Any]
) -> None:
    """Ask for a stream and read it to its end, as a harness does."""
    async with harness.stream(
        "POST",
        session.base_url + path,
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {session.token}"},
    ) as response:
        async for _ in response.aiter_bytes():
            pass


def _chat_answer() -> dict[str, Any]:
    return {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    }


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[str, list[tuple[dict[str, str], bytes]]]]:
    """An upstream that answers every call and keeps what reached it: (headers, body)."""
    seen: list[tuple[dict[str, str], bytes]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(({k.lower(): v for k, v in request.headers.items()}, await request.read()))
        return web.json_response(_chat_answer())

    async with upstream_server(handler) as url:
        yield url, seen


# -- 1. pinned requests ------------------------------------------------------------------------------------


async def test_the_upstream_sees_the_runs_model_and_parameters_not_the_sandboxs(
    recorder, harness, tmp_path
) -> None:
    url, seen = recorder
    hostile = {
        "model": "gpt-5-pro",
        "messages": [{"role": "user", "content": "hi"}],
        "n": 128,
        "max_tokens": 1_000_000,
        "service_tier": "priority",
        "user": "someone",
        "metadata": {"k": "v"},
        "top_k": 1,
        "chat_template_kwargs": {"enable_thinking": False},
        "store": True,
        "stream_options": {"include_usage": True, "x": 1},
        "tools": [
            {"type": "function", "function": {"name": "bash", "parameters": {}}},
            {"type": "web_search_preview"},
        ],
        "temperature": 0.3,
    }
    pins = {"model": RUN_MODEL, "max_output_tokens": 1000, "parameters": {"temperature": 1.0}}
    async with gateway_to(url, "sk-real", pins=pins) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await harness.post(
            session.base_url + "/chat/completions",
            json=hostile,
            headers={
                "Authorization": f"Bearer {session.token}",
                "OpenAI-Organization": "org-other",
                "OpenAI-Project": "proj-other",
                "X-Anything": "1",
            },
        )

    assert response.status_code == 200
    [(headers, raw)] = seen
    sent = json.loads(raw)
    assert sent == {
        "model": RUN_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1000,
        "store": False,
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "bash", "parameters": {}}}],
        "temperature": 1.0,
    }
    assert set(headers) <= {
        "host",
        "accept",
        "accept-encoding",
        "content-type",
        "content-length",
        "authorization",
        "x-rollout-session",
    }
    assert headers["authorization"] == "Bearer sk-real"
    noted = session.summary()["pinned_fields"]
    assert {"model", "n", "max_tokens", "service_tier", "temperature", "tools"} <= set(noted)


async def test_a_body_the_run_would_send_itself_goes_upstream_byte_for_byte(recorder, harness, tmp_path):
    url, seen = recorder
    body = json.dumps({"model": RUN_MODEL, "input": "hi", "stream": False, "max_output_tokens": 10}).encode()
    async with gateway_to(url, pins=PINS) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        await harness.post(
            session.base_url + "/responses",
            content=body,
            headers={"Authorization": f"Bearer {session.token}"},
        )
    assert seen[0][1] == body
    assert session.summary()["pinned_fields"] == {}


async def test_an_absent_output_cap_is_added_when_the_run_sets_one(recorder, harness, tmp_path) -> None:
    url, seen = recorder
    async with gateway_to(url, pins={"model": RUN_MODEL, "max_output_tokens": 500}) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        await ask(harness, session, CHAT)
        await ask(harness, session, RESPONSES, "/responses")
    assert json.loads(seen[0][1])["max_completion_tokens"] == 500
    assert json.loads(seen[1][1])["max_output_tokens"] == 500


def _one_reading(raw: bytes) -> dict[str, Any]:
    """``raw`` as JSON that every parser reads alike: UTF-8, no object naming a key twice."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        assert len({k for k, _ in pairs}) == len(pairs), f"a key twice: {pairs}"
        return dict(pairs)

    return json.loads(raw.decode("utf-8"), object_pairs_hook=unique)


@pytest.mark.parametrize(
    "raw",
    [
        # The run's model last (what Python's json keeps), another first (what a first-wins parser keeps).
        b'{"model":"o3-pro","model":"run-model","input":"hi","stream_options":{"include_usage":true}}',
        # The same key, once escaped: one name to any JSON parser.
        b'{"\\u006dodel":"o3-pro","model":"run-model","input":"hi"}',
        b'{"model":"run-model","input":"hi","tools":[{"type":"web_search","type":"function","name":"f"}]}',
        '{"model":"run-model","input":"hi"}'.encode("utf-16"),
        b'\xef\xbb\xbf{"model":"run-model","input":"hi"}',  # a UTF-8 byte order mark
    ],
    ids=["model-twice", "model-escaped", "tool-type-twice", "utf-16", "bom"],
)
async def test_a_body_other_parsers_may_read_otherwise_goes_upstream_as_the_gateway_read_it(
    raw, recorder, harness, tmp_path
) -> None:
    url, seen = recorder
    async with gateway_to(url, pins=PINS) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await harness.post(
            session.base_url + "/responses", content=raw, headers={"Authorization": f"Bearer {session.token}"}
        )
    assert response.status_code == 200
    [(_, sent)] = seen
    body = _one_reading(sent)
    assert body["model"] == RUN_MODEL and body["input"] == "hi"
    assert b"o3-pro" not in sent and b"web_search" not in sent
    assert "(ambiguous body)" in session.summary()["pinned_fields"]


@pytest.mark.parametrize("stream", ["true", 1, "1", None])
async def test_a_stream_flag_that_is_no_boolean_goes_upstream_as_the_gateway_read_it(
    stream, harness, tmp_path
) -> None:
    """An endpoint's lax parser (pydantic's, as vLLM's) reads "true", "1" and 1 as a stream; the gateway
    reads only true so. Sent as the sandbox wrote it, the stream it never asked for would be judged an
    upstream failure: masked, never graded, at the sandbox's will."""
    seen: list[dict[str, Any]] = []

    async def lax(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if body.get("stream") in (True, "true", "1"):
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "ok"}}]}
            events = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
            return web.Response(text=events, content_type="text/event-stream")
        return web.json_response(_chat_answer())

    async with upstream_server(lax) as url, gateway_to(url, pins=PINS) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, {**CHAT, "stream": stream})
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "ok"
    assert [body["stream"] for body in seen] == [False]
    assert kinds(session) == [(200, FailureKind.NONE)] and session.closed_kind is None


async def test_a_lone_surrogate_in_a_rewritten_body_goes_upstream_escaped(
    recorder, harness, tmp_path
) -> None:
    url, seen = recorder
    async with gateway_to(url, pins=PINS) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await harness.post(
            session.base_url + "/responses",
            content=b'{"model":"o3-pro","input":"hi \\ud800"}',
            headers={"Authorization": f"Bearer {session.token}"},
        )
    assert response.status_code == 200
    [(_, sent)] = seen
    assert _one_reading(sent) == {"model": RUN_MODEL, "input": "hi \ud800"}


@pytest.mark.parametrize(
    "raw",
    [b"[1, 2, 3]", b'{"model":"run-model","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"],
    ids=["array", "nested-past-the-parsers-depth"],
)
async def test_a_body_that_is_no_json_object_never_goes_upstream(raw, recorder, harness, tmp_path) -> None:
    url, seen = recorder
    async with gateway_to(url, pins=PINS) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await harness.post(
            session.base_url + "/chat/completions",
            content=raw,
            headers={"Authorization": f"Bearer {session.token}"},
        )
    assert (response.status_code, response.content) == (400, REFUSED_BODY)
    assert seen == [] and session.summary()["refused_bodies"] == 1


async def test_a_foreign_model_that_the_endpoint_would_404_is_answered_by_the_runs(harness, tmp_path):
    """The issue's case: an endpoint that 404s a model it does not serve, a sandbox naming another one.
    Pinned, the request names the run's model and is answered; the run is never stopped."""
    from harnesses.testing.scripted_model import ScriptedModel

    served = ScriptedModel(model_names=(RUN_MODEL,), refuse_unknown_models=True)
    await served.start()
    try:
        script(served, "s1", TEXT)
        async with gateway_to(served.base_url, pins=PINS) as gateway:
            session = gateway.open_session("s1", tmp_path / "s1")
            response = await ask(harness, session, {**CHAT, "model": "o3-pro-2025"})
    finally:
        await served.stop()
    assert response.status_code == 200
    assert kinds(session) == [(200, FailureKind.NONE)] and session.closed_kind is None


# -- 2. bounds per session and per worker --------------------------------------------------------------------


async def test_a_session_past_its_request_count_is_closed_as_its_own_limit(model, harness, tmp_path):
    script(model, "s1", TEXT)
    async with gateway_to(model.base_url, max_requests_per_session=3) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        answers = [await ask(harness, session) for _ in range(5)]
    assert [a.status_code for a in answers] == [200, 200, 200, 400, 400]
    assert len(model.requests("s1")) == 3
    assert session.closed_kind is FailureKind.AGENT_REQUEST_LIMIT


async def test_a_request_past_the_rate_waits_for_its_turn_and_never_goes_upstream_early(
    model, harness, tmp_path
) -> None:
    script(model, "s1", TEXT)
    async with gateway_to(model.base_url, max_requests_per_minute=2) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        await ask(harness, session)
        await ask(harness, session)
        third = asyncio.ensure_future(ask(harness, session))
        async with asyncio.timeout(20):
            while session.summary()["rate_waits"] == 0:
                await asyncio.sleep(0.01)
        assert len(model.requests("s1")) == 2  # the third waits its turn at the gateway
        gateway.close_session(session)
        await asyncio.gather(third, return_exceptions=True)  # cut by the close
    assert len(model.requests("s1")) == 2
    assert session.summary()["rate_waits"] == 1


async def test_requests_past_the_sessions_concurrency_are_answered_at_once(harness, tmp_path) -> None:
    async def slow(request: web.Request) -> web.StreamResponse:
        await never()
        return web.Response()

    async with upstream_server(slow) as url, gateway_to(url, max_concurrent_requests=1) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        first = asyncio.ensure_future(ask(harness, session))
        async with asyncio.timeout(20):
            while session.outstanding() == 0:
                await asyncio.sleep(0.01)
        second = await ask(harness, session)
        assert (second.status_code, second.content) == (400, CLOSED_BODY)
        assert session.closed_kind is None and session.summary()["over_concurrency"] == 1
        gateway.close_session(session)
        await asyncio.gather(first, return_exceptions=True)


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_past_the_bound_is_never_read_whole_or_sent(model, harness, tmp_path, chunked):
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 8000}]}).encode()

    async def parts() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    async with gateway_to(model.base_url, max_request_bytes=4096) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await harness.post(
            session.base_url + "/chat/completions",
            content=parts() if chunked else body,
            headers={"Authorization": f"Bearer {session.token}"},
        )
    assert (response.status_code, response.content) == (400, CLOSED_BODY)
    assert model.requests("s1") == []
    assert session.closed_kind is FailureKind.AGENT_REQUEST_LIMIT
    assert "max_request_bytes=4096" in (session.closed_message or "")


async def test_bodies_past_the_kept_bytes_bound_are_not_kept_and_the_gap_is_said(model, harness, tmp_path):
    script(model, "s1", TEXT)
    async with gateway_to(model.base_url, max_kept_bytes_per_session=1) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        await ask(harness, session)
        await ask(harness, session)
    first, second = session.attempts
    assert first.request_file and first.response_file  # within the bound when they were kept
    assert second.request_file is None and second.response_file is None
    [gap] = session.evidence_gaps()
    assert gap.startswith("model_bodies_not_kept: 2 bodies")


async def test_the_workers_bodies_in_flight_are_bounded_across_sessions(harness, tmp_path) -> None:
    async def slow(request: web.Request) -> web.StreamResponse:
        await never()
        return web.Response()

    body = {**CHAT, "messages": [{"role": "user", "content": "x" * 1500}]}
    bounds = {"max_inflight_body_bytes": 2048, "first_byte_timeout_s": 1.0, "max_attempts_per_request": 100}
    async with upstream_server(slow) as url, gateway_to(url, retry_deadline_s=60, **bounds) as gateway:
        holder = gateway.open_session("s1", tmp_path / "s1")
        waiter = gateway.open_session("s2", tmp_path / "s2")
        held = asyncio.ensure_future(ask(harness, holder, body))
        async with asyncio.timeout(20):
            while holder.outstanding() == 0:
                await asyncio.sleep(0.01)
        answer = await ask(harness, waiter, body)
        lookup = gateway.open_session("s3", tmp_path / "s3")
        listing = await harness.get(
            lookup.base_url + "/models", headers={"Authorization": f"Bearer {lookup.token}"}
        )
        assert listing.status_code == 404 and lookup.summary()["probes"] == 1  # no body: never waits for room
        gateway.close_session(holder)
        await asyncio.gather(held, return_exceptions=True)
    assert (answer.status_code, answer.content) == (400, CLOSED_BODY)
    assert waiter.closed_kind is FailureKind.PROVIDER_UNAVAILABLE and waiter.attempts == []
    assert "max_inflight_body_bytes=2048" in (waiter.closed_message or "")


# -- 3. progress is content ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [("/chat/completions", CHAT), ("/responses", RESPONSES)])
async def test_keepalive_comments_are_no_progress(model, harness, tmp_path, path, body) -> None:
    """A stream of comments and never a token stalls, and the harness never sees them: retried, then
    the session's budget ends it."""
    script(model, "s1", {"type": "keepalive", "interval_s": 0.1, "max_s": 60})
    bounds = {"first_byte_timeout_s": STALL_S, "max_attempts_per_request": 2, "max_attempts_per_session": 2}
    async with gateway_to(model.base_url, **bounds) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        first = await ask(harness, session, {**body, "stream": True}, path)
        second = await ask(harness, session, {**body, "stream": True}, path)
    assert (first.status_code, first.content) == (400, CLOSED_BODY)
    assert (second.status_code, second.content) == (400, CLOSED_BODY)
    assert [k for _, k in kinds(session)] == [FailureKind.MODEL_TIMEOUT] * 2
    assert all(a.ttfb_s is None and a.response_bytes > 0 for a in session.attempts)
    assert len(model.requests("s1")) == 2
    assert session.closed_kind is FailureKind.MODEL_TIMEOUT


async def test_keepalives_after_content_do_not_keep_a_stalled_answer_alive(model, harness, tmp_path):
    script(model, "s1", {"type": "keepalive", "interval_s": 0.1, "max_s": 60, "after_chunks": 2})
    async with gateway_to(model.base_url, chunk_timeout_s=STALL_S, max_attempts_per_session=1) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        with pytest.raises(httpx.HTTPError):  # the harness sees the answer broken off
            await read_stream(harness, session, "/chat/completions", CHAT)
    [record] = session.attempts
    assert record.kind is FailureKind.MODEL_TIMEOUT and "mid-answer" in (record.error_message or "")
    assert session.closed_kind is FailureKind.MODEL_TIMEOUT  # the one failure the budget allowed


# -- 4. answers judged before the harness sees them ---------------------------------------------------------


@pytest.mark.parametrize(
    ("form", "stream"), [("html", True), ("html", False), ("json", True), ("json", False), ("empty", False)]
)
async def test_a_200_that_is_no_answer_is_retried_like_a_5xx(model, harness, tmp_path, form, stream):
    script(model, "s1", {"type": "bad_answer", "form": form}, TEXT)
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, {**CHAT, "stream": stream})
    assert response.status_code == 200
    assert kinds(session) == [(200, FailureKind.PROVIDER_UNAVAILABLE), (200, FailureKind.NONE)]
    assert session.attempts[0].request_sha256 == session.attempts[1].request_sha256
    if stream:
        assert b"data: [DONE]" in response.content
    else:
        assert response.json()["choices"][0]["message"]["content"] == TEXT["text"]


@pytest.mark.parametrize(("path", "body"), [("/chat/completions", CHAT), ("/responses", RESPONSES)])
async def test_a_stream_that_ends_without_its_terminal_event_is_a_cut(model, harness, tmp_path, path, body):
    script(model, "s1", {"type": "drop", "after_chunks": 2, "clean": True})
    async with gateway_to(model.base_url) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        with pytest.raises(httpx.HTTPError):  # the harness sees the answer broken off
            await read_stream(harness, session, path, body)
    [record] = session.attempts
    assert (record.status, record.kind) == (200, FailureKind.TRANSPORT_ERROR)
    assert record.error_message == "the stream ended without its terminal event"


# -- 5. retry storms end -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("step", "upstream"),
    [
        # Cut after content reached the harness: no retry of the gateway's, each re-ask spends the budget.
        ({"type": "drop", "after_chunks": 2, "clean": True}, 4),
        # Nothing reached the harness: the gateway retries (2 attempts) and gives up on the session.
        ({"type": "bad_answer", "form": "html"}, 2),
        ({"type": "keepalive", "interval_s": 0.1, "max_s": 60}, 2),
    ],
)
async def test_a_harness_re_asking_forever_makes_a_bounded_number_of_upstream_requests(
    model, harness, tmp_path, step, upstream
) -> None:
    script(model, "s1", step)
    bounds = {"first_byte_timeout_s": STALL_S, "max_attempts_per_request": 2, "max_attempts_per_session": 4}
    async with gateway_to(model.base_url, **bounds) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        for _ in range(12):  # a harness's own retry loop
            try:
                await ask(harness, session, {**CHAT, "stream": True})
            except httpx.HTTPError:
                pass  # a cut passed on
    assert len(model.requests("s1")) == upstream
    assert session.closed_kind is not None and session.summary()["refused_after_close"] >= 12 - upstream


async def test_what_pinning_changed_is_counted_and_bounded_for_the_row(recorder, harness, tmp_path) -> None:
    url, _seen = recorder
    async with gateway_to(url, pins=PINS) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        for start in range(0, 200, 20):  # 200 distinct junk fields over 10 requests
            junk = {f"junk_{i}": 1 for i in range(start, start + 20)}
            await ask(harness, session, {**CHAT, **junk})
    reached = session.bounds_reached()["pinned_fields"]
    assert len(reached) <= 51 and reached["model"] == 10
    assert sum(reached.values()) == 10 + 10 * 19  # 20 names noted per request, the model among them
