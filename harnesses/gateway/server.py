"""The gateway's server: its lifecycle, its sessions and the routing of each harness request.

``Gateway`` listens (TCP, and a Unix socket for a sandbox in its own network namespace), opens and closes
sessions, and routes a request under ``/s/<token>/v1/`` to the relay (a model call or a model listing) or
answers it itself (an unknown session, a path it does not serve, a closed session). It keeps each request
outstanding on its session for the model-wait accounting. Apart from the relay: nothing here talks to the
endpoint or holds the real key.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from aiohttp import web

from harnesses.gateway.attempt import Request
from harnesses.gateway.limits import (
    MAX_REQUEST_BYTES,
    GatewayConfig,
    closed,
    no_listing,
    not_served,
    not_the_harness,
    route,
)
from harnesses.gateway.relay import Relay
from harnesses.gateway.session import GatewaySession, OnAttempt
from harnesses.gateway.upstream import Upstream
from harnesses.gateway.upstreams import Upstreams
from policy import FailureKind
from sandboxes.netns import other_socket


class Gateway:
    """One per worker process. ``upstream``: the endpoint's base URL, or the versions and replicas a
    trainer's run has (``upstreams.py``). ``on_attempt`` is called with each record as it is made (live
    progress, tests); it runs on the event loop and must neither block nor raise."""

    def __init__(
        self,
        upstream: str | Upstreams,
        api_key: str | None,
        config: GatewayConfig | None = None,
        *,
        model: str | None = None,
        max_output_tokens: int | None = None,
        parameters: dict[str, Any] | None = None,
        on_attempt: OnAttempt | None = None,
    ) -> None:
        """``model``, ``max_output_tokens`` and ``parameters`` are the run's pins (``upstream.Upstream``):
        with ``model`` None the name a harness sends passes (a gateway driven alone, in tests)."""
        self.config = config or GatewayConfig()
        # A URL alone is one replica serving ``model``; a trainer's Upstreams carries its versions' names.
        self.upstreams = upstream if isinstance(upstream, Upstreams) else Upstreams(upstream, model)
        pins = Upstream(
            self.upstreams.base_url(), api_key or None, model, max_output_tokens, dict(parameters or {})
        )
        self._relay = Relay(self.upstreams, pins, self.config)
        self._bodies = BodyBudget(self.config.max_inflight_body_bytes)
        self._on_attempt = on_attempt
        self._sessions: dict[str, GatewaySession] = {}
        self._runner: web.AppRunner | None = None
        self._url: str | None = None
        self.unix_path: str | None = None  # the Unix socket it also listens on, if any
        # Where a sandbox's forwarder sends the connections its model client did not make (netns.py): a
        # Unix socket beside ``unix_path``, and a port of its own for a remote sandbox's agent to dial.
        self._other_path: str | None = None
        self.other_port: int | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the gateway is not started")
        return self._url

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, unix_path: str | None = None) -> None:
        """Listen on ``host:port``; with ``unix_path`` on that Unix socket too, which is how a sandbox in
        its own network namespace reaches the gateway (``sandboxes/netns.py``), and on its other socket,
        where the sandbox's forwarder sends what its harness's process did not open."""
        if self._runner is not None:
            raise RuntimeError("the gateway is already started")
        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        # Every method reaches the handler, which answers what it does not forward itself (a neutral
        # JSON 404, not aiohttp's plain-text 405); so does any other path.
        app.router.add_route("*", "/s/{token}/v1/{rest:.*}", self._handle)
        app.router.add_route("*", "/{tail:.*}", _answer_not_served)
        # Cancelling the handler when the harness hangs up is what cancels its upstream request.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            ours = len(runner.addresses)
            await web.TCPSite(runner, host, 0).start()
            self.other_port = runner.addresses[ours][1]
            if unix_path is not None:
                await web.UnixSite(runner, unix_path).start()
                self.unix_path = unix_path
                await web.UnixSite(runner, other_socket(unix_path)).start()
                self._other_path = other_socket(unix_path)
        except BaseException:
            await runner.cleanup()
            raise
        self._relay.start()
        self._runner = runner
        self._url = f"http://{host}:{runner.addresses[0][1]}"

    async def stop(self) -> None:
        for session in list(self._sessions.values()):
            self.close_session(session)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self._relay.stop()
        self._url = None
        for path in (self.unix_path, self._other_path):
            if path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        self.unix_path = self._other_path = self.other_port = None

    def open_session(
        self, session_id: str, evidence_dir: Path, *, version: int | None = None, one_client: bool = False
    ) -> GatewaySession:
        """A session pinned to the endpoint of policy ``version`` (the current one when None) and to one
        replica of it. ``one_client``: its harness makes its model calls from one process, and a call
        that another process of its sandbox made is refused (``GatewaySession.one_client``)."""
        token = secrets.token_urlsafe(32)
        evidence_dir.mkdir(parents=True, exist_ok=True)
        session = GatewaySession(
            session_id,
            token,
            f"{self.url}/s/{token}/v1",
            evidence_dir,
            config=self.config,
            on_attempt=self._on_attempt,
            route=self.upstreams.pin(version),
            one_client=one_client,
        )
        self._sessions[token] = session
        return session

    def close_session(self, session: GatewaySession, stall_bound_s: float | None = None) -> None:
        """Stop serving the session, cut its in-flight requests and write ``attempts.jsonl``. Idempotent.

        The session's requests from now on get CLOSED_BODY. ``closed_kind`` is left as it is: the owner
        closing a session is not the endpoint failing. ``stall_bound_s``: a tighter bound than the
        gateway's own for ``stalled_at_close`` (the owner's share of a short deadline).
        """
        if self._sessions.pop(session.token, None) is not None and session.route is not None:
            self.upstreams.unpin(session.route)
        session.end(stall_bound_s)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        session = self._sessions.get(request.match_info["token"])
        if session is None:
            return closed()
        rest = request.rel_url.raw_path.split("/", 4)[4]
        # A URL library resolves dot segments, which would let a harness reach paths outside /v1 with the
        # real key; encoded slashes too ("models/..%2Ffiles").
        if any(part in (".", "..") for part in unquote(rest).split("/")):
            return closed()
        kind = route(request.method, rest)
        if kind is None:
            return not_served()
        if session.one_client and self._from_another_process(request):
            session.count_not_the_client()
            return not_the_harness()
        if session.closed_kind is not None:
            session.count_refused()
            return closed()
        if not session.enter():
            return closed()  # past max_concurrent_requests: answered here, the session goes on
        task = asyncio.current_task()
        assert task is not None
        try:
            with session.serving(task):
                return await self._serve(session, request, rest, listing=kind == "listing")
        finally:
            session.leave()

    def _from_another_process(self, request: web.Request) -> bool:
        """Whether the request came in on the other socket or port: a process of the sandbox that is not
        its model client opened the connection (sandboxes/netns.py)."""
        transport = request.transport
        if transport is None:
            return False
        where = transport.get_extra_info("sockname")
        if isinstance(where, str):
            return where == self._other_path
        return isinstance(where, tuple) and len(where) >= 2 and where[1] == self.other_port

    async def _serve(
        self, session: GatewaySession, request: web.Request, rest: str, *, listing: bool
    ) -> web.StreamResponse:
        """One request within the session's bounds and the worker's: its turn in the session's rate, its
        body read within max_request_bytes and held within the worker's max_inflight_body_bytes."""
        cfg = self.config
        if listing and session.listings_spent():
            return no_listing()  # the harness's lookup goes on without it; the session is not the worse
        if not listing and session.over_request_count():
            return closed()
        await session.rate_turn()  # model calls and listings alike: each one goes upstream
        size = request.content_length
        if size is not None and size > cfg.max_request_bytes:
            session.too_large(size)
            return closed()
        # A body of unknown length (chunked) may be as large as the bound: room for that much is held.
        unknown = cfg.max_request_bytes if request.can_read_body else 0
        held = min(size if size is not None else unknown, cfg.max_request_bytes)
        if not await self._bodies.take(held, cfg.first_byte_timeout_s):
            message = (
                f"the worker's gateway holds {self._bodies.used} bytes of request bodies in flight "
                f"(max_inflight_body_bytes={cfg.max_inflight_body_bytes}); no room for {held} more "
                f"within {cfg.first_byte_timeout_s:g}s"
            )
            session.close(FailureKind.PROVIDER_UNAVAILABLE, message)
            return closed()
        req: Request | None = None
        try:
            body = await _read_body(request, cfg.max_request_bytes)
            if body is None:
                session.too_large(cfg.max_request_bytes + 1)
                return closed()
            prepared = await self._relay.upstream_request(session, request, rest, body, listing=listing)
            if isinstance(prepared, web.Response):
                return prepared
            req = prepared
            session.request_began(req)
            if listing:
                return await self._relay.list_models(req)
            return await self._relay.forward(req, request)
        except asyncio.CancelledError:
            if req is not None:
                session.request_ended(req, hung_up=True)
            raise
        finally:
            if req is not None:
                session.request_ended(req)
            self._bodies.give(held)


class BodyBudget:
    """The request bodies one worker holds in memory at once, across all its sessions."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._freed = asyncio.Event()  # set (and replaced) whenever room is given back

    async def take(self, size: int, timeout_s: float) -> bool:
        """Room for ``size`` bytes, waited for up to ``timeout_s``; False when none came. One body alone
        always fits, so a limit below max_request_bytes slows the worker but never stops it."""
        try:
            async with asyncio.timeout(timeout_s):
                while size and self.used and self.used + size > self.limit:
                    await self._freed.wait()
        except TimeoutError:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        self.used -= size
        self._freed.set()
        self._freed = asyncio.Event()


async def _read_body(request: web.Request, limit: int) -> bytes | None:
    """The request body, or None once it passes ``limit`` bytes (the rest is never read)."""
    parts: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


async def _answer_not_served(request: web.Request) -> web.Response:
    return not_served()
