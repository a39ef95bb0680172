"""Stalls and time accounting in the model gateway, over real HTTP on 127.0.0.1 with the scripted model
upstream. Stalls come from the script (``hang``, with or without ``after_chunks``); the test waits on the
scripted model's request log, never on a clock. The bounds are small so that a test takes about a second;
no assertion depends on how long anything took, only on what must hold whatever the machine's speed."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from aiohttp import web

from harnesses.gateway import CLOSED_BODY, AttemptRecord, GatewayConfig, GatewaySession
from harnesses.testing.scripted_model import ScriptedModel
from policy import FailureKind
from tests.test_gateway import CHAT, RESPONSES, TEXT, ask, gateway_to, kinds, never, script, upstream_server

pytestmark = pytest.mark.timeout(60)

HANG = {"type": "hang", "max_s": 60}
STALL_S = 0.3  # a stall bound: the upstream's silence the gateway waits out before giving up on it
# Where the test must act inside one bound (close while an attempt is still live, or soon after a byte),
# a longer one, so that a loaded machine's slow wake-up does not pass it.
WIDE_S = 1.0
API = [("/chat/completions", CHAT), ("/responses", RESPONSES)]


async def read_stream(
    harness: httpx.AsyncClient, session: GatewaySession, path: str, body: dict[str, Any]
) -> tuple[bytes, Exception | None]:
    """Everything the harness received on a streamed request, and the error that ended it, if any."""
    received = bytearray()
    headers = {"Authorization": f"Bearer {session.token}"}
    try:
        async with harness.stream(
            "POST", session.base_url + path, json={**body, "stream": True}, headers=headers
        ) as response:
            async for chunk in response.aiter_raw():
                received += chunk
    except httpx.TransportError as exc:
        return bytes(received), exc
    return bytes(received), None


# -- a stall before any byte reached the harness: retried ------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize(("path", "body"), API, ids=["chat", "responses"])
async def test_a_first_byte_stall_is_retried_then_answered(model, harness, tmp_path, path, body, stream):
    script(model, "s1", HANG, TEXT)
    async with gateway_to(model.base_url, first_byte_timeout_s=STALL_S) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, {**body, "stream": stream}, path)

    assert response.status_code == 200
    assert TEXT["text"][:16].encode() in response.content
    assert kinds(session) == [(None, FailureKind.MODEL_TIMEOUT), (200, FailureKind.NONE)]
    stalled = session.attempts[0]
    assert stalled.error_message is not None and f"first_byte_timeout_s={STALL_S:g}s" in stalled.error_message
    assert stalled.ttfb_s is None and stalled.response_bytes == 0
    logged = model.requests("s1")
    assert [entry.step_type for entry in logged] == ["hang", "text"]
    assert logged[0].body == logged[1].body  # the same request, sent again
    assert session.closed_kind is None


async def test_headers_without_a_body_byte_are_a_first_byte_stall(model, harness, tmp_path) -> None:
    """The first-byte bound runs to the first byte of the body: headers alone do not start the answer."""
    script(model, "s1", {**HANG, "after_chunks": 0}, TEXT)
    async with gateway_to(model.base_url, first_byte_timeout_s=STALL_S, chunk_timeout_s=30) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert response.status_code == 200
    assert kinds(session) == [(200, FailureKind.MODEL_TIMEOUT), (200, FailureKind.NONE)]
    assert "first_byte_timeout_s" in (session.attempts[0].error_message or "")


async def test_a_held_answer_that_stalls_midway_is_retried(model, harness, tmp_path) -> None:
    """A non-streamed answer is held whole before it is relayed: a stall in its middle reached no one."""
    script(model, "s1", {**HANG, "after_chunks": 2}, TEXT)
    async with gateway_to(model.base_url, chunk_timeout_s=STALL_S) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session)

    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == TEXT["text"]
    assert kinds(session) == [(200, FailureKind.MODEL_TIMEOUT), (200, FailureKind.NONE)]
    assert f"chunk_timeout_s={STALL_S:g}s" in (session.attempts[0].error_message or "")
    assert session.attempts[0].response_bytes == 32  # two 16-byte pieces, then silence


async def test_a_stall_forever_closes_the_session_within_the_attempt_budget(model, harness, tmp_path):
    script(model, "s1", HANG)
    async with gateway_to(
        model.base_url, first_byte_timeout_s=STALL_S, max_attempts_per_request=3
    ) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        first = await ask(harness, session)
        later = await ask(harness, session, {**RESPONSES, "stream": True}, "/responses")

    assert (first.status_code, first.content) == (400, CLOSED_BODY)
    assert (later.status_code, later.content) == (400, CLOSED_BODY)
    assert kinds(session) == [(None, FailureKind.MODEL_TIMEOUT)] * 3
    assert len(model.requests("s1")) == 3  # the later request never went upstream
    assert session.closed_kind is FailureKind.MODEL_TIMEOUT
    assert session.closed_message is not None and "first_byte_timeout_s" in session.closed_message
    assert session.summary()["refused_after_close"] == 1


async def test_stalls_spend_the_session_budget_across_requests(model, harness, tmp_path) -> None:
    script(model, "s1", HANG)
    config = {"first_byte_timeout_s": STALL_S, "max_attempts_per_request": 4, "max_attempts_per_session": 2}
    async with gateway_to(model.base_url, **config) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        answer = await ask(harness, session)

    assert answer.content == CLOSED_BODY
    assert kinds(session) == [(None, FailureKind.MODEL_TIMEOUT)] * 2
    assert session.closed_kind is FailureKind.MODEL_TIMEOUT
    assert "budget of 2 failed attempts" in (session.closed_message or "")


# -- a stall after bytes reached the harness: passed on as a cut -------------------------------------------


@pytest.mark.parametrize(("path", "body"), API, ids=["chat", "responses"])
async def test_a_mid_stream_stall_is_passed_on_as_a_cut(model, harness, tmp_path, path, body) -> None:
    script(model, "s1", {**HANG, "after_chunks": 2}, TEXT)
    async with gateway_to(model.base_url, chunk_timeout_s=STALL_S) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        received, error = await read_stream(harness, session, path, body)
        again = await ask(harness, session, body, path)  # the harness's own reconnect: a new request

    assert isinstance(error, httpx.TransportError)  # a broken stream, not a clean short answer
    assert b"partial answer" in received
    assert b"[DONE]" not in received and b"response.completed" not in received
    assert kinds(session) == [(200, FailureKind.MODEL_TIMEOUT), (200, FailureKind.NONE)]
    assert f"chunk_timeout_s={STALL_S:g}s" in (session.attempts[0].error_message or "")
    assert [a.request_index for a in session.attempts] == [0, 1]  # not retried by the gateway
    assert [entry.step_type for entry in model.requests("s1")] == ["hang", "text"]
    assert again.status_code == 200 and session.closed_kind is None


async def test_a_mid_stream_stall_spends_the_session_budget(model, harness, tmp_path) -> None:
    script(model, "s1", {**HANG, "after_chunks": 1}, TEXT)
    async with gateway_to(model.base_url, chunk_timeout_s=STALL_S, max_attempts_per_session=1) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        _, error = await read_stream(harness, session, "/chat/completions", CHAT)
        again = await ask(harness, session)

    assert error is not None
    assert (again.status_code, again.content) == (400, CLOSED_BODY)
    assert kinds(session) == [(200, FailureKind.MODEL_TIMEOUT)]
    assert session.closed_kind is FailureKind.MODEL_TIMEOUT
    assert len(model.requests("s1")) == 1


# -- stalled at close ---------------------------------------------------------------------------------------


async def test_closed_during_a_stall_is_stalled_at_close(model, harness, tmp_path) -> None:
    """The stall clock starts at the request's arrival and a retry does not reset it: once the second
    attempt has reached the endpoint, the request has gone a full first-byte bound without a byte."""
    script(model, "s1", HANG)
    async with gateway_to(model.base_url, first_byte_timeout_s=WIDE_S, max_attempts_per_request=5) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        started = time.monotonic()
        call = asyncio.create_task(ask(harness, session))
        await model.wait_requests("s1", 2)
        live = session.model_wait_now()
        gateway.close_session(session)
        elapsed = time.monotonic() - started
        with pytest.raises(httpx.TransportError):
            await call

    assert session.stalled_at_close and session.summary()["stalled_at_close"] is True
    assert kinds(session) == [(None, FailureKind.MODEL_TIMEOUT), (None, FailureKind.MODEL_TIMEOUT)]
    assert "first_byte_timeout_s" in (session.attempts[0].error_message or "")
    assert "closed while this request had waited" in (session.attempts[1].error_message or "")
    # The request still outstanding at close is counted, up to the close.
    assert WIDE_S <= live <= session.model_wait_s <= elapsed
    assert session.model_wait_now() == session.model_wait_s  # frozen at close
    assert session.closed_kind is None  # the owner closed it; the gateway had not given up


async def test_closed_while_the_model_answers_is_not_stalled(model, harness, tmp_path) -> None:
    """A request older than the stall bound whose answer is flowing is not stalled: each byte resets
    the clock. The first attempt stalls (so the request is old), the second streams, then the close."""
    script(model, "s1", HANG, {**HANG, "after_chunks": 1})
    async with gateway_to(model.base_url, first_byte_timeout_s=WIDE_S) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        headers = {"Authorization": f"Bearer {session.token}"}
        body = {**CHAT, "stream": True}
        received = b""
        with pytest.raises(httpx.TransportError):
            async with harness.stream(
                "POST", session.base_url + "/chat/completions", json=body, headers=headers
            ) as response:
                async for chunk in response.aiter_raw():
                    received += chunk
                    if b"partial answer" in received:
                        gateway.close_session(session)

    assert not session.stalled_at_close
    assert kinds(session) == [(None, FailureKind.MODEL_TIMEOUT), (200, FailureKind.CANCELLED)]
    assert session.model_wait_s >= WIDE_S  # the stalled first attempt is model time all the same


async def test_closed_with_nothing_outstanding_is_not_stalled(model, harness, tmp_path) -> None:
    script(model, "s1", HANG, TEXT)
    async with gateway_to(model.base_url, first_byte_timeout_s=STALL_S) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        assert (await ask(harness, session)).status_code == 200
        gateway.close_session(session)

    assert not session.stalled_at_close
    assert session.model_wait_s >= STALL_S


# -- model wait time ----------------------------------------------------------------------------------------


async def test_overlapping_requests_are_counted_once(model, harness, tmp_path) -> None:
    """Two requests stall side by side, then are answered: the wait is their union, so it is at least
    one stall bound and never more than the test's own wall time (their sum would pass it)."""
    script(model, "s1", HANG, HANG, TEXT)
    async with gateway_to(model.base_url, first_byte_timeout_s=STALL_S) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        started = time.monotonic()
        answers = await asyncio.gather(ask(harness, session), ask(harness, session))
        elapsed = time.monotonic() - started
        open_value = session.model_wait_now()
        gateway.close_session(session)

    assert [a.status_code for a in answers] == [200, 200]
    assert Counter(kinds(session)) == {(None, FailureKind.MODEL_TIMEOUT): 2, (200, FailureKind.NONE): 2}
    each = [sum(a.latency_s for a in session.attempts if a.request_index == i) for i in (0, 1)]
    assert min(each) >= STALL_S  # each request alone waited a bound
    assert session.model_wait_s < sum(each)  # their union, not their sum
    assert STALL_S <= session.model_wait_s <= elapsed
    assert session.model_wait_s == open_value  # nothing outstanding between the last answer and close
    assert session.summary()["model_wait_s"] == round(session.model_wait_s, 3)


async def test_time_between_requests_is_not_model_wait(model: ScriptedModel, harness, tmp_path) -> None:
    """Session a is idle while session b waits out a stall: a's wait covers its own two requests only."""
    script(model, "a", TEXT)
    script(model, "b", HANG, TEXT)
    async with gateway_to(model.base_url, first_byte_timeout_s=STALL_S) as gateway:
        a = gateway.open_session("a", tmp_path / "a")
        b = gateway.open_session("b", tmp_path / "b")
        assert a.model_wait_now() == 0.0
        spells = []
        for session in (a, b, a):
            started = time.monotonic()
            assert (await ask(harness, session)).status_code == 200
            spells.append(time.monotonic() - started)
        gateway.close_session(a)
        gateway.close_session(b)

    assert b.model_wait_s >= STALL_S
    assert 0 < a.model_wait_s <= spells[0] + spells[2]
    assert a.model_wait_s < spells[1]  # the gap is b's stall; counting it would pass this


def test_config_bounds_and_defaults() -> None:
    config = GatewayConfig()
    assert (config.first_byte_timeout_s, config.chunk_timeout_s) == (120.0, 60.0)
    assert config.first_byte_timeout_s < config.read_timeout_s
    for bad in ({"first_byte_timeout_s": 0}, {"chunk_timeout_s": -1}):
        with pytest.raises(ValueError):
            GatewayConfig(**bad)


async def test_a_harness_that_stops_reading_is_not_a_stalled_model(harness, tmp_path) -> None:
    """The stall bounds time the upstream's reads only: while the gateway waits on a harness that
    stopped reading, the upstream is not read either, and that is the harness's doing (read_timeout_s)."""
    records: asyncio.Queue[AttemptRecord] = asyncio.Queue()
    piece = b"data: " + b"x" * 65_536 + b"\n\n"

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while True:  # ended by the gateway hanging up
            await response.write(piece)

    on_attempt = lambda _session, record: records.put_nowait(record)  # noqa: E731
    config = {"chunk_timeout_s": 0.1, "read_timeout_s": STALL_S, "keep_bodies": False}
    async with (
        upstream_server(endless) as upstream,
        gateway_to(upstream, on_attempt=on_attempt, **config) as gateway,
    ):
        session = gateway.open_session("s1", tmp_path / "s1")
        headers = {"Authorization": f"Bearer {session.token}"}
        async with harness.stream(
            "POST", session.base_url + "/chat/completions", json={**CHAT, "stream": True}, headers=headers
        ) as response:
            chunks = response.aiter_raw()  # kept: a dropped generator would close the stream
            await anext(chunks)  # then reads no more
            record = await asyncio.wait_for(records.get(), 30)

    assert (record.status, record.kind, record.client_aborted) == (200, FailureKind.TRANSPORT_ERROR, True)
    assert record.error_message == "client disconnected or stopped reading"
    assert session.closed_kind is None


async def test_a_harness_pausing_its_reading_does_not_count_against_the_model(harness, tmp_path) -> None:
    """The chunk bound times the wait for the upstream's next bytes, not the time spent handing them to
    a harness that is busy: a pause longer than chunk_timeout_s (here, while a second session waits out
    a first-byte stall, which takes longer than the chunk bound) leaves the answer flowing."""
    piece = b"data: " + b"x" * 65_536 + b"\n\n"

    async def upstream_app(request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/responses"):
            await never()  # the second session's stall
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while True:  # ended by the gateway hanging up
            await response.write(piece)

    config = {"chunk_timeout_s": 0.1, "first_byte_timeout_s": STALL_S, "max_attempts_per_request": 1}
    async with upstream_server(upstream_app) as upstream, gateway_to(upstream, **config) as gateway:
        flowing = gateway.open_session("flowing", tmp_path / "flowing")
        stalled = gateway.open_session("stalled", tmp_path / "stalled")
        headers = {"Authorization": f"Bearer {flowing.token}"}
        async with harness.stream(
            "POST", flowing.base_url + "/chat/completions", json={**CHAT, "stream": True}, headers=headers
        ) as response:
            chunks = response.aiter_raw()
            await anext(chunks)
            assert (await ask(harness, stalled, RESPONSES, "/responses")).content == CLOSED_BODY
            received = 0
            while received < 8 * 2**20:  # past every socket buffer between upstream and harness
                received += len(await anext(chunks))
            gateway.close_session(flowing)

    assert kinds(stalled) == [(None, FailureKind.MODEL_TIMEOUT)]
    assert kinds(flowing) == [(200, FailureKind.CANCELLED)]
    assert not flowing.stalled_at_close


async def _hang_up_while_waiting(model: ScriptedModel, harness: httpx.AsyncClient, session: Any) -> float:
    """The harness sends a request the model sits on, then hangs up (as a harness killed at its deadline
    does); returns a lower bound of how long the request had waited without a byte."""
    call = asyncio.create_task(ask(harness, session))
    await model.wait_requests("s1", 1)  # the request arrived at the gateway before this returned
    seen = time.monotonic()
    waited_at_least = time.monotonic() - seen  # positive, and at most the wait the hang-up ends
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    deadline = time.monotonic() + 10
    while session.outstanding() and time.monotonic() < deadline:  # the gateway notices the hang-up
        await asyncio.sleep(0.01)
    assert not session.outstanding()
    return waited_at_least


@pytest.mark.parametrize("past_the_bound", [True, False])
async def test_a_harness_hanging_up_on_a_stalled_request_leaves_the_session_stalled(
    model, harness, tmp_path, past_the_bound: bool
) -> None:
    """A harness killed at its deadline hangs up before the session closes: the request it waited on is
    gone, but how long it had waited still decides whose the time was."""
    script(model, "s1", HANG)
    async with gateway_to(model.base_url, first_byte_timeout_s=WIDE_S) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        waited_at_least = await _hang_up_while_waiting(model, harness, session)
        gateway.close_session(session, stall_bound_s=waited_at_least if past_the_bound else 3600.0)

    assert session.stalled_at_close is past_the_bound
