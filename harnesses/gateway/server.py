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
from urllib.parse import unquote

from aiohttp import web

from harnesses.gateway.attempt import Request
from harnesses.gateway.limits import MAX_REQUEST_BYTES, GatewayConfig, closed, not_served, route
from harnesses.gateway.relay import Relay
from harnesses.gateway.session import GatewaySession, OnAttempt
from harnesses.gateway.upstreams import Upstreams


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
        on_attempt: OnAttempt | None = None,
    ) -> None:
        self.config = config or GatewayConfig()
        self.upstreams = upstream if isinstance(upstream, Upstreams) else Upstreams(upstream)
        self._relay = Relay(self.upstreams, api_key, self.config)
        self._on_attempt = on_attempt
        self._sessions: dict[str, GatewaySession] = {}
        self._runner: web.AppRunner | None = None
        self._url: str | None = None
        self.unix_path: str | None = None  # the Unix socket it also listens on, if any

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("the gateway is not started")
        return self._url

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, unix_path: str | None = None) -> None:
        """Listen on ``host:port``; with ``unix_path`` on that Unix socket too, which is how a sandbox in
        its own network namespace reaches the gateway (``sandboxes/netns.py``)."""
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
            if unix_path is not None:
                await web.UnixSite(runner, unix_path).start()
                self.unix_path = unix_path
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
        if self.unix_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)
            self.unix_path = None

    def open_session(
        self, session_id: str, evidence_dir: Path, *, version: int | None = None
    ) -> GatewaySession:
        """A session pinned to the endpoint of policy ``version`` (the current one when None) and to one
        replica of it."""
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
        if session.closed_kind is not None:
            session.count_refused()
            return closed()
        task = asyncio.current_task()
        assert task is not None
        with session.serving(task):
            req: Request | None = None
            try:
                body, listing = await request.read(), kind == "listing"
                req = await self._relay.upstream_request(session, request, rest, body, listing=listing)
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


async def _answer_not_served(request: web.Request) -> web.Response:
    return not_served()
