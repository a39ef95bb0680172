"""The side of the gateway that faces the endpoint: one harness request carried upstream and back.

``Relay`` holds the real API key and the upstream client. It turns a harness request into the bytes that
go upstream, retries them while no byte of the answer has reached the harness (the per-request budget and
deadline here, the per-session budget on the session), and relays the answer or the neutral 400. The
retry loop and the relay of an answer are one module because each attempt's answer decides the loop: once
bytes reached the harness there is no retry. The server routes to it and never talks to the endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
from dataclasses import replace

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from harnesses.gateway.attempt import Attempt, Request, StallTimer, UpstreamCut, describe, read_upstream
from harnesses.gateway.capture import save_gzip
from harnesses.gateway.limits import (
    KEEPALIVE_S,
    MAX_CONNECTIONS,
    MAX_ERROR_BODY_BYTES,
    MAX_HELD_BYTES,
    MAX_LISTING_BYTES,
    MAX_MESSAGE_CHARS,
    NOT_RELAYED,
    SESSION_HEADER,
    GatewayConfig,
    closed,
    no_listing,
    refused_body,
)
from harnesses.gateway.probe import MODEL_STATUSES, RUN_KINDS, RunProbe
from harnesses.gateway.session import AttemptRecord, GatewaySession
from harnesses.gateway.upstream import Pinned, Upstream, pin
from harnesses.gateway.upstreams import Upstreams
from policy import (
    FailureKind,
    Rule,
    backoff_delay,
    error_message_of,
    is_retryable,
    kind_for_http,
    parse_retry_after,
)
from sandboxes.inline import small_inline


class Relay:
    """Carries requests to ``upstreams`` (each session's replica, and the model of its policy version),
    with ``pins``'s key, output cap and parameters, within ``config``'s bounds. ``start`` before the first
    request, ``stop`` after the last; both on the gateway's event loop."""

    def __init__(self, upstreams: Upstreams, pins: Upstream, config: GatewayConfig) -> None:
        self.config = config
        self._upstreams = upstreams
        self._pins = pins
        self._backoff = Rule(backoff_base_s=config.backoff_base_s, backoff_cap_s=config.backoff_cap_s)
        self._rng = random.Random()
        self._client: aiohttp.ClientSession | None = None
        self._probes = RunProbe(self.fetch_small)

    def start(self) -> None:
        cfg = self.config
        self._client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_S),
            # connect covers the wait for a pooled connection too. The stall bounds (asyncio.timeout around
            # each wait, StallTimer) end a silent upstream first; sock_read is only the backstop behind
            # them, so it is never the shorter one.
            timeout=aiohttp.ClientTimeout(
                total=None,
                connect=cfg.connect_timeout_s,
                sock_read=max(cfg.read_timeout_s, cfg.first_byte_timeout_s, cfg.chunk_timeout_s),
            ),
            auto_decompress=False,  # relayed as received: the usage sniffer and the kept copy see those bytes
            skip_auto_headers=("User-Agent", "Content-Type"),  # only the headers _upstream_headers names
            trust_env=False,  # a proxy from the environment must never see the real key
        )

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def upstream_for(self, session: GatewaySession) -> Upstream:
        """The endpoint and pins a session's requests go to now: its replica, and the model name of the
        policy version it started under (the run's pins where the version names none)."""
        route = session.route
        if route is None:
            return replace(self._pins, base_url=self._upstreams.base_url())
        replica = self._upstreams.replica_for(route)
        return replace(self._pins, base_url=replica, model=route.model or self._pins.model)

    # -- the request that goes upstream -------------------------------------------------------------------

    async def upstream_request(
        self, session: GatewaySession, request: web.Request, rest: str, body: bytes, *, listing: bool
    ) -> Request | web.Response:
        """What goes upstream for the harness's ``request`` to ``/v1/<rest>``, on every attempt: the pinned
        body (``upstream.pin``) and the gateway's own headers; or the local answer to a body that is no
        JSON object, which never goes upstream."""
        arrived = time.monotonic()
        target = self.upstream_for(session)
        api_path = "/" + rest
        pinned = Pinned(body)
        if not listing:
            # Off the loop once large: a long agent history takes a while to parse and serialize.
            pinned = await small_inline(len(body), pin, body, api_path, target, self.config)
            if pinned.refused is not None:
                session.refused_body()
                return refused_body()
            session.pinned(pinned.changed)
        body = pinned.body
        index = session.next_request_index(listing=listing)
        # A query on a model call is the sandbox's choice of something the run did not set: not sent.
        query = request.rel_url.raw_query_string if listing else ""
        saving = None
        if self.config.keep_bodies and body and not listing:
            # One file per request, not per attempt: every attempt sends these same bytes. Beside the first
            # attempt, not before it, and in a thread once the body is large (a long agent history).
            name = f"req-{index}.json.gz"
            path, limit = session.evidence_dir / name, self.config.max_body_bytes
            if session.may_keep():
                saving = (name, asyncio.ensure_future(small_inline(len(body), save_gzip, body, limit, path)))
            else:
                session.not_kept()
        return Request(
            session=session,
            index=index,
            method=request.method,
            path=api_path,
            url=rest + (f"?{query}" if query else ""),  # under the replica's base URL, at each attempt
            headers=self._upstream_headers(request, session),
            body=body,
            sha256=hashlib.sha256(body).hexdigest(),
            arrived=arrived,
            last_byte=arrived,
            stream=pinned.stream,
            capture_tokens=pinned.capture_tokens,
            saving=saving,
        )

    def _upstream_headers(self, request: web.Request, session: GatewaySession) -> list[tuple[str, str]]:
        """Only what the gateway means to send: none of the harness's own headers (an organization,
        project or routing header, a client id) reach the endpoint."""
        headers = [("accept-encoding", "identity"), (SESSION_HEADER, session.session_id)]
        if request.method == "POST":
            headers.append(("content-type", "application/json"))
        headers += self._upstreams.headers(session.session_id)
        if self._pins.api_key:
            headers.append(("authorization", f"Bearer {self._pins.api_key}"))
        return headers

    # -- a model call: the retry loop ---------------------------------------------------------------------

    async def forward(self, req: Request, request: web.Request) -> web.StreamResponse:
        """A model call, retried within its budgets; the answer the harness gets."""
        cfg, session = self.config, req.session
        first_failure_at: float | None = None
        for number in range(1, cfg.max_attempts_per_request + 1):
            if session.closed_kind is not None:  # another request of this session gave up meanwhile
                return closed()
            att = Attempt(req, number, cfg)
            outcome = await self._attempt(att, request)
            self._note_replica(att, outcome)
            if isinstance(outcome, web.StreamResponse):
                return outcome
            last = outcome
            now = time.monotonic()
            first_failure_at = now if first_failure_at is None else first_failure_at
            delay = backoff_delay(self._backoff, number, last.retry_after_s, self._rng)
            stop = session.spend() or self._why_not_retry(number, last, now + delay - first_failure_at)
            if stop is not None:
                break
            await asyncio.sleep(delay)
        # _why_not_retry stops at the last attempt, so the loop always leaves through the break.
        answer = f"HTTP {last.status}" if last.status is not None else "no HTTP answer"
        message = (
            f"gateway gave up on request {req.index} ({stop}); last: {answer}: {last.error_message or ''}"
        )
        session.close(last.kind, message)
        return closed()

    def _note_replica(self, att: Attempt, outcome: web.StreamResponse | AttemptRecord) -> None:
        """A replica that gave no usable answer counts towards its removal; one that answered is well."""
        if att.replica is None:
            return
        if isinstance(outcome, web.StreamResponse):
            self._upstreams.succeeded(att.replica)
        elif outcome.kind in _REPLICA_FAILURES and not outcome.client_aborted:
            self._upstreams.failed(att.replica)

    def _why_not_retry(self, number: int, last: AttemptRecord, retrying_for_s: float) -> str | None:
        cfg = self.config
        if number >= cfg.max_attempts_per_request:
            return f"all {number} attempts failed"
        if last.retry_after_s is not None and last.retry_after_s > cfg.max_retry_after_s:
            return f"Retry-After {last.retry_after_s:.0f}s is past the {cfg.max_retry_after_s:.0f}s limit"
        if retrying_for_s > cfg.retry_deadline_s:
            return f"the next retry would pass the {cfg.retry_deadline_s:.0f}s retry deadline"
        return None

    # -- one attempt: its answer relayed, or its failure recorded for a retry --------------------------------

    async def _attempt(self, att: Attempt, request: web.Request) -> web.StreamResponse | AttemptRecord:
        """One upstream attempt: the harness's answer, or the record of a failure worth retrying."""
        assert self._client is not None
        req = att.req
        try:
            try:
                async with asyncio.timeout(att.timer.wait_s()):
                    upstream = await self._send(req, att)
            except aiohttp.ClientError as exc:
                await req.saved()
                return att.finish(FailureKind.TRANSPORT_ERROR, describe(exc))
            except TimeoutError:
                await req.saved()
                return att.finish(FailureKind.MODEL_TIMEOUT, att.timer.message())
            await req.saved()
            try:
                att.status = upstream.status
                if upstream.status >= 400:
                    return await self._answer_error(att, upstream)
                return await self._relay(att, upstream, request)
            finally:
                upstream.release()  # back to the pool if read to its end, else closed
        except asyncio.CancelledError:
            att.finish(FailureKind.TRANSPORT_ERROR, "client disconnected", client_aborted=True)
            raise

    async def fetch_small(
        self, url: str, headers: list[tuple[str, str]], body: bytes
    ) -> tuple[int, bytes] | None:
        """A POST of the gateway's own (the run's probe): its status and the start of its body; None for
        no HTTP answer. The caller bounds the time."""
        assert self._client is not None
        try:
            async with self._client.post(
                URL(url, encoded=True), headers=headers, data=body, allow_redirects=False
            ) as answer:
                body = bytearray()
                while len(body) < MAX_ERROR_BODY_BYTES and (chunk := await answer.content.readany()):
                    body += chunk
                return answer.status, bytes(body[:MAX_ERROR_BODY_BYTES])
        except aiohttp.ClientError:
            return None

    def _target(self, req: Request, att: Attempt | None = None) -> str:
        """The URL of this attempt: the session's replica (another, once its own is out of service)."""
        route = req.session.route
        replica = self._upstreams.replica_for(route) if route is not None else self._upstreams.base_url()
        if att is not None:
            att.replica = replica
            att.policy_version = self._upstreams.answering(route) if route is not None else None
        return f"{replica}/{req.url}"

    async def _send(self, req: Request, att: Attempt | None = None) -> aiohttp.ClientResponse:
        assert self._client is not None
        return await self._client.request(
            req.method,
            URL(self._target(req, att), encoded=True),  # sent as the harness wrote it, not re-quoted
            headers=req.headers,
            data=req.body or None,
            allow_redirects=False,
        )

    async def _answer_error(
        self, att: Attempt, upstream: aiohttp.ClientResponse
    ) -> web.StreamResponse | AttemptRecord:
        status, session = upstream.status, att.req.session
        body = bytearray()
        try:
            while chunk := await read_upstream(upstream, att.timer):
                att.received(chunk)
                body += chunk[: MAX_ERROR_BODY_BYTES - len(body)]
                if len(body) >= MAX_ERROR_BODY_BYTES:
                    break
        except UpstreamCut as cut:
            return att.finish(cut.kind, f"HTTP {status}, then {cut.message}")
        kind = kind_for_http(status, bytes(body))
        att.retry_after_s = parse_retry_after(upstream.headers.get("retry-after"))
        message = error_message_of(bytes(body), MAX_MESSAGE_CHARS)
        if kind in RUN_KINDS:
            # Only the run's model, key and URL may stop a run: the run's own probe tells whether they are
            # at fault or this request's content was (the sandbox wrote it, the session answers for it).
            verdict = await self._probes.verdict(att.req, self.upstream_for(session))
            if verdict is not None:
                kind, message = FailureKind.MODEL_REQUEST_ERROR, f"{message or ''} ({verdict})"
        record = att.finish(kind, message)
        if is_retryable(kind):
            return record
        if kind in RUN_KINDS or (kind is FailureKind.MODEL_REQUEST_ERROR and status not in MODEL_STATUSES):
            # Codex retries a 403 five times; the neutral 400 stops it. A wrong model name, route or account
            # fails every later request the same way, and the driver stops the run; an error this session's
            # request caused alone ends this session.
            session.close(kind, f"upstream answered HTTP {status}: {record.error_message or ''}")
            return closed()
        if kind is FailureKind.MODEL_CONTEXT_LIMIT and session.overflow(record):
            return closed()
        # Passed on unchanged: a harness may compact on an overflow, and a plain 4xx is the model's to see.
        return web.Response(status=status, body=bytes(body), headers=_relayed(upstream.headers))

    async def _relay(
        self, att: Attempt, upstream: aiohttp.ClientResponse, request: web.Request
    ) -> web.StreamResponse | AttemptRecord:
        content_type = upstream.headers.get("content-type", "")
        att.streamed = content_type.startswith("text/event-stream")
        held: list[bytes] = []
        held_bytes = 0
        response: web.StreamResponse | None = None  # set once bytes go to the harness: no retry after
        try:
            while chunk := await read_upstream(upstream, att.timer):
                att.received(chunk)
                if response is None:
                    held.append(chunk)
                    held_bytes += len(chunk)
                    # Held until the answer shows what it is: a stream until its first content (comments
                    # before it are no answer, and keep it retryable), any other body whole, up to a bound.
                    if held_bytes <= MAX_HELD_BYTES and (not att.content if att.streamed else True):
                        continue
                    bad = _not_asked(att, content_type, held[0])
                    if bad is not None:
                        return att.finish(FailureKind.PROVIDER_UNAVAILABLE, bad)
                    response = web.StreamResponse(status=upstream.status, headers=_relayed(upstream.headers))
                    await response.prepare(request)
                    chunk = b"".join(held)
                    held.clear()
                # A harness that stops reading must not hold the upstream stream open forever.
                async with asyncio.timeout(self.config.read_timeout_s):
                    await response.write(chunk)
                att.answer_delivered = att.usage.finish_reason is not None and att.usage.error is None
        except UpstreamCut as cut:  # broken off, or stalled
            record = att.finish(cut.kind, cut.message)
            if response is None:
                return record
            # Bytes already reached the harness: pass the cut on; its own reconnect is a new request.
            att.req.session.spend_after_answer(record, "cut")
            _abort(request)
            return response
        except (ConnectionError, TimeoutError):
            att.finish(
                FailureKind.TRANSPORT_ERROR,
                "client disconnected or stopped reading",
                client_aborted=True,
            )
            _abort(request)
            return response or closed()
        if response is None:
            body = b"".join(held)
            whole = att.usage.feed_json(body) if not att.streamed else None
            failure = att.failure_inside()
            if failure is not None and is_retryable(failure[0]):
                return att.finish(*failure)  # held whole, so nothing reached the harness: retried
            bad = _not_asked(att, content_type, body, whole=whole) if failure is None else None
            if bad is not None:
                return att.finish(FailureKind.PROVIDER_UNAVAILABLE, bad)  # a 5xx in all but its status
            headers = _relayed(upstream.headers)
            response = web.Response(status=upstream.status, body=body, headers=headers)
            with contextlib.suppress(ConnectionError):
                await response.prepare(request)
        elif att.streamed and not att.usage.ended:
            # Content reached the harness, then the stream ended cleanly without its terminal event: the
            # answer is cut short as surely as by a reset, and the harness must see it broken.
            record = att.finish(FailureKind.TRANSPORT_ERROR, "the stream ended without its terminal event")
            att.req.session.spend_after_answer(record, "cut")
            _abort(request)
            return response
        # The harness gets the end of its answer before the record and the kept body are written: they
        # are ours to wait for, not the harness's.
        try:
            await response.write_eof()
        except ConnectionError:
            att.finish(FailureKind.TRANSPORT_ERROR, "client disconnected", client_aborted=True)
            return response
        record = att.finish(FailureKind.NONE)  # an error inside the answer makes it a failure
        if is_retryable(record.kind):
            # The error event went to the harness, which may reconnect: a new request, as after a cut.
            att.req.session.spend_after_answer(record, "error inside the answer")
        elif record.kind is FailureKind.MODEL_CONTEXT_LIMIT:
            att.req.session.overflow(record)  # its answer is gone; the cap ends the next one
        return response

    # -- a model listing ----------------------------------------------------------------------------------

    async def list_models(self, req: Request) -> web.Response:
        """A model listing (Hermes looks up prices): forwarded once under the same time bounds, relayed
        whole, and no model attempt of the session. A 2xx or a 404 (no such model) is relayed; anything
        else gets a neutral 404, so that no status or words of a failing endpoint make a harness retry."""
        session = req.session
        session.count_listing()
        try:
            status, headers, body = await self._fetch_listing(req)
        except (aiohttp.ClientError, TimeoutError, UpstreamCut):
            status, headers, body = None, None, None
        if status is None or body is None or not (200 <= status < 300 or status == 404):
            session.count_failed_listing()
            return no_listing()
        return web.Response(status=status, body=body, headers=headers)

    async def _fetch_listing(self, req: Request) -> tuple[int, CIMultiDict[str], bytes | None]:
        """The listing's status, headers and body; no body when it is past MAX_LISTING_BYTES."""
        timer = StallTimer(req, self.config)
        async with asyncio.timeout(timer.wait_s()):
            upstream = await self._send(req)
        try:
            body = bytearray()
            while chunk := await read_upstream(upstream, timer):
                timer.byte()  # a listing is no answer of the model's: any byte of it is progress
                body += chunk
                if len(body) > MAX_LISTING_BYTES:
                    return upstream.status, _relayed(upstream.headers), None
            return upstream.status, _relayed(upstream.headers), bytes(body)
        finally:
            upstream.release()


def _not_asked(att: Attempt, content_type: str, head: bytes, *, whole: bool | None = None) -> str | None:
    """Why a 2xx answer is not what was asked (judged on its first bytes, or ``whole``: the held body
    parsed as a JSON object); None when it is one."""
    shown = content_type.split(";")[0].strip() or "none"
    what = f"HTTP {att.status} with content-type {shown}"
    if "html" in content_type.lower() or head.lstrip()[:1] == b"<":
        return f"{what}: a page, not an answer"
    if att.req.stream and not att.streamed:
        return f"{what}, not the event stream asked for"
    if att.streamed and not att.req.stream:
        return f"{what}, not the JSON answer asked for"
    if att.streamed and not att.content:
        return f"{what}: the stream carried no event"
    if not att.streamed and (whole is False or (whole is None and head.lstrip()[:1] != b"{")):
        return f"{what}: the body is not a JSON object"
    return None


# What says a replica is down rather than busy (a 429 is an answer: the replica is up and pushing back).
_REPLICA_FAILURES = frozenset(
    {FailureKind.TRANSPORT_ERROR, FailureKind.PROVIDER_UNAVAILABLE, FailureKind.MODEL_TIMEOUT}
)


def _relayed(headers: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in NOT_RELAYED)


def _abort(request: web.Request) -> None:
    # Closing without the final chunk makes the harness see a broken stream, not a clean (short) answer.
    if request.transport is not None:
        request.transport.abort()
