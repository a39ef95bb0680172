"""Whose fault an upstream 401 / 403 / 404 / 402 is: the run's, or the one request's that got it.

Only what the executor controls (the model name, the key, the URL) may stop a run, since every session
would fail the same way. After pinning those are the run's own on every request, yet a request's content
(written in the sandbox) can still draw such an answer: a proxy that answers 404 for a parameter it
routes on, a 403 from a content filter. So before a session's 4xx of that class is taken as the run's,
the gateway sends the run's own smallest request (``upstream.probe_body``, the preflight's) to the same
URL with the same key: when that is answered 2xx, the request's content caused the error and it is the
session's (``model_request_error``); when it fails the same way, the run's config is wrong and the run
stops; when it fails otherwise or not at all (a 5xx, a cut), the probe proves nothing and the error is
taken as the run's, as before (a sandbox cannot make the run's own request fail). One probe per URL at a
time, its verdict kept ``PROBE_TTL_S``, so a session looping on such errors costs the endpoint nothing more.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from harnesses.gateway.attempt import Request
from harnesses.gateway.limits import RESPONSES_PATH
from harnesses.gateway.upstream import CHAT_TOKEN_FIELDS, Upstream, probe_body, refuses_token_field
from policy import FailureKind

# The kinds that say the run's config is wrong; the statuses a request's own content is expected to draw.
RUN_KINDS = frozenset({FailureKind.PROVIDER_AUTH_ERROR, FailureKind.ENDPOINT_CONFIG_ERROR})
MODEL_STATUSES = frozenset({400, 413, 422})
PROBE_TTL_S = 60.0
PROBE_TIMEOUT_S = 30.0

# (url, headers, JSON body) -> (status, body); None: no HTTP answer.
Fetch = Callable[[str, list[tuple[str, str]], bytes], Awaitable[tuple[int, bytes] | None]]


class RunProbe:
    """The run's own probe of an upstream URL, shared by every session of the worker."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._verdicts: dict[str, tuple[float, asyncio.Future[int | None]]] = {}

    async def verdict(self, req: Request, target: Upstream) -> str | None:
        """Why ``req``'s 401/403/402/404-class failure is the session's (a line for its record); None when
        it is the run's, or the probe could not tell."""
        now, url = time.monotonic(), target.url(req.url, "")
        held = self._verdicts.get(url)
        if held is None or now - held[0] > PROBE_TTL_S:
            future: asyncio.Future[int | None] = asyncio.ensure_future(self._probe(req, target, url))
            held = (now, future)
            self._verdicts[url] = held
        try:
            status = await asyncio.shield(held[1])
        except Exception:  # a probe that broke proves nothing
            status = None
        if status is not None and 200 <= status < 300:
            return f"the run's own request to this URL got HTTP {status}: this request drew the error"
        return None  # failed the same way (the run's), or proved nothing (taken as the run's)

    async def _probe(self, req: Request, target: Upstream, url: str) -> int | None:
        model = target.model or _model_of(req.body)
        api = "responses" if req.path == RESPONSES_PATH else "chat"
        headers = [
            (name, value) for name, value in req.headers if name.lower() in ("authorization", "content-type")
        ]
        status: int | None = None
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                for field in CHAT_TOKEN_FIELDS if api == "chat" else ("max_output_tokens",):
                    body = json.dumps(probe_body(api, model, field)).encode()
                    answer = await self._fetch(url, headers, body)
                    if answer is None:
                        return None
                    status, text = answer
                    if not refuses_token_field(status, text, field):
                        break
        except TimeoutError:
            return None
        return status


def _model_of(body: bytes) -> str:
    try:
        data: Any = json.loads(body)
    except ValueError:
        return ""
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else ""
