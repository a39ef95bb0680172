"""One harness request and each upstream attempt at it, up to the attempt's record.

A ``Request`` is what goes upstream, the same bytes on every attempt; an ``Attempt`` is one try in flight,
reading its answer within the stall bounds (``StallTimer``, ``read_upstream``) through the captures, and
``finish`` turns it into its ``AttemptRecord`` exactly once, on the session. Apart from the relay, which
decides what to do with an attempt's outcome, and from the server, which never sees an attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import aiohttp

from harnesses.gateway.capture import ContentScanner, GzipCapture, TokenCapture, UsageSniffer
from harnesses.gateway.limits import MAX_MESSAGE_CHARS, GatewayConfig
from harnesses.gateway.session import AttemptRecord, GatewaySession
from policy import FailureKind, bound_text, kind_for_stream_error


@dataclass(eq=False)
class Request:
    """One harness request; the same bytes go upstream on every attempt."""

    session: GatewaySession
    index: int
    method: str
    path: str
    url: str  # past the base URL (path and query): each attempt puts its replica's base URL before it
    headers: list[tuple[str, str]]
    body: bytes
    sha256: str
    arrived: float  # monotonic
    last_byte: float  # monotonic: the arrival, then each upstream content of any attempt; not a retry
    stream: bool = False  # the harness asked for an event stream: any other answer is not an answer
    capture_tokens: bool = False  # the body was rewritten to ask for token ids; parse the answer for them
    request_file: str | None = None
    request_truncated: bool = False
    # The body's kept copy, written while the first attempt goes upstream: (file name, (written, cut,
    # bytes written)).
    saving: tuple[str, asyncio.Future[tuple[bool, bool, int]]] | None = None

    async def saved(self) -> None:
        """Wait for the kept copy of the body, so that the attempt's record can name it."""
        if self.saving is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.saving[1])
            self.take_saved()

    def take_saved(self) -> None:
        if self.saving is None or not self.saving[1].done():
            return
        name, future = self.saving
        self.saving = None
        if not future.cancelled() and future.exception() is None:
            written, self.request_truncated, size = future.result()
            self.request_file = name if written else None
            self.session.kept(size)


class StallTimer:
    """The time bounds of one upstream answer: its first content within ``first_byte_timeout_s`` of
    sending (the wait for the headers included), then no gap between contents longer than
    ``chunk_timeout_s``. Content is what ``ContentScanner`` says it is: bytes that only keep a connection
    alive are no progress."""

    __slots__ = ("_by", "_config", "req", "started")

    def __init__(self, req: Request, config: GatewayConfig) -> None:
        self._config = config
        self._by = time.monotonic() + config.first_byte_timeout_s
        self.req = req  # its last_byte is stamped with each content
        self.started = False  # content came

    def wait_s(self) -> float:
        """How long the next read may wait."""
        return max(self._by - time.monotonic(), 0.0)

    def byte(self) -> None:
        """Content came: the next must come within ``chunk_timeout_s``."""
        self.started = True
        now = time.monotonic()
        self.req.last_byte = now
        self._by = now + self._config.chunk_timeout_s

    def message(self) -> str:
        if self.started:
            return f"stalled mid-answer: no content for chunk_timeout_s={self._config.chunk_timeout_s:g}s"
        return f"stalled: no content within first_byte_timeout_s={self._config.first_byte_timeout_s:g}s"


class Attempt:
    """One upstream attempt in flight; ``finish`` turns it into its record exactly once."""

    def __init__(self, req: Request, number: int, config: GatewayConfig) -> None:
        self.req = req
        self.number = number
        self.started_at = time.time()
        self._t0 = time.monotonic()
        self.timer = StallTimer(req, config)
        self.status: int | None = None
        self.retry_after_s: float | None = None
        self.streamed = False
        self.ttfb_s: float | None = None
        self.response_bytes = 0
        self.content = False  # some of the answer's bytes carried content
        self._scanner: ContentScanner | None = None  # made at the first byte, once streamed is known
        self.tokens = TokenCapture() if req.capture_tokens else None
        self.usage = UsageSniffer(self.tokens)
        # Past the session's max_kept_bytes_per_session nothing more is compressed or kept (noted on it).
        keep = config.keep_bodies and req.session.may_keep()
        self.capture = GzipCapture(config.max_body_bytes) if keep else None
        self._unkept = config.keep_bodies and not keep
        self.record: AttemptRecord | None = None
        # The answer's final event reached the harness: nothing that ends the attempt later undoes it.
        self.answer_delivered = False
        # Where it went (upstreams.py), set by the relay before sending.
        self.policy_version: int | None = None
        self.replica: str | None = None
        req.session.attempt_started(self)

    def received(self, chunk: bytes) -> None:
        if self._scanner is None:
            self._scanner = ContentScanner(self.streamed)
        if self._scanner.feed(chunk):
            self.timer.byte()
            self.content = True
            if self.ttfb_s is None:
                self.ttfb_s = self.req.last_byte - self._t0
        self.response_bytes += len(chunk)
        if self.capture is not None:
            self.capture.feed(chunk)
        if self.streamed:
            self.usage.feed_sse(chunk)

    def finish(
        self, kind: FailureKind, message: str | None = None, *, client_aborted: bool = False
    ) -> AttemptRecord:
        if self.record is not None:  # the session's end may have recorded it first
            return self.record
        failure = self.failure_inside()
        if failure is not None:
            # The endpoint's own report explains the attempt, whatever ended it afterwards.
            then = f" (then: {message})" if message and message != failure[1] else ""
            kind, message = failure[0], failure[1] + then
        elif self.answer_delivered and (client_aborted or kind is FailureKind.CANCELLED):
            # A harness that has its answer hangs up, or exits and has its session closed, before the
            # upstream's last bytes (Codex on response.completed): the endpoint answered in full.
            kind, message, client_aborted = FailureKind.NONE, None, False
        session, req = self.req.session, self.req
        req.take_saved()  # a record made before the copy was awaited (a cancel) names it if it is there
        prompt, ids, logprobs = self.tokens.result() if self.tokens else (None, None, None)
        response_file = None
        if self.capture is not None and self.response_bytes:
            name = f"resp-{req.index}-{self.number}.{'sse' if self.streamed else 'json'}.gz"
            response_file = name if self.capture.save(session.evidence_dir / name) else None
            session.kept(self.capture.saved_bytes)
        elif self._unkept and self.response_bytes:
            session.not_kept()
        self.record = AttemptRecord(
            request_index=req.index,
            attempt=self.number,
            method=req.method,
            path=req.path,
            started_at=self.started_at,
            status=self.status,
            kind=kind,
            error_message=bound_text(message, MAX_MESSAGE_CHARS),
            latency_s=time.monotonic() - self._t0,
            ttfb_s=self.ttfb_s,
            retry_after_s=self.retry_after_s,
            streamed=self.streamed,
            response_bytes=self.response_bytes,
            request_sha256=req.sha256,
            input_tokens=self.usage.input_tokens,
            output_tokens=self.usage.output_tokens,
            finish_reason=self.usage.finish_reason,
            request_file=req.request_file,
            response_file=response_file,
            request_truncated=req.request_truncated,
            response_truncated=bool(self.capture and self.capture.truncated),
            client_aborted=client_aborted,
            prompt_token_ids=prompt,
            completion_token_ids=ids,
            completion_logprobs=logprobs,
            tokens_truncated=bool(self.tokens and self.tokens.truncated),
            policy_version=self.policy_version,
            replica=self.replica,
        )
        session.attempt_finished(self, self.record)
        return self.record

    def failure_inside(self) -> tuple[FailureKind, str] | None:
        """The error the endpoint reported inside its 200 answer, classified; None if it reported none."""
        if self.usage.error is None:
            return None
        code, message = self.usage.error
        return kind_for_stream_error(code, message), message


class UpstreamCut(Exception):
    """The upstream's answer broke off (TRANSPORT_ERROR) or stalled (MODEL_TIMEOUT); kept apart from the
    harness's side, whose write errors are ConnectionErrors too (aiohttp's ClientConnectionResetError is
    both) and whose stop in reading is a TimeoutError."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


async def read_upstream(upstream: aiohttp.ClientResponse, timer: StallTimer) -> bytes:
    """The next bytes of the answer as they arrive (b"" at its end), within the stall bounds; the caller
    says which of them were content (``StallTimer.byte``)."""
    try:
        async with asyncio.timeout(timer.wait_s()):
            return await upstream.content.readany()
    except aiohttp.ClientError as exc:  # before TimeoutError: aiohttp's own read timeout is both
        raise UpstreamCut(FailureKind.TRANSPORT_ERROR, describe(exc)) from exc
    except TimeoutError:
        raise UpstreamCut(FailureKind.MODEL_TIMEOUT, timer.message()) from None


def describe(exc: aiohttp.ClientError) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
