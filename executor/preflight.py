"""Preflight: one look at the endpoint before any sandbox starts.

A wrong URL, key or model name, or an account out of credits, would fail every session of a run the same
way; caught here it costs one line and exit code 2, with nothing written. A few requests at most (plus
retries of a 5xx or a transport error): ``GET /models``, when the endpoint serves that list, and one
minimal non-streamed request on the API the configured harness speaks (the gateway's own probe,
``harnesses.gateway.upstream.probe_body``), which must answer 2xx.

It never refuses a working endpoint: only what every request of the run would also fail on. A list that
does not name the model (a proxy's wildcard routes, a list of aliases) refuses nothing when the request
itself is answered; it is named in the error line when the request fails too. A Chat request refused for
its ``max_tokens`` (the newest reasoning models want ``max_completion_tokens``) is sent again with the other
name, as the harnesses' own clients do. With no harness API to try (the ``command`` harness), a list that
lacks the model is a warning, not a refusal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import httpx

from harnesses.base import HarnessApi
from harnesses.gateway.upstream import API_PATHS, CHAT_TOKEN_FIELDS, probe_body, refuses_token_field
from policy import error_message_of

if TYPE_CHECKING:
    from executor.config import RunConfig

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 20.0
_ATTEMPTS = 3  # a 5xx or a transport error is tried twice more, within the overall timeout
_BACKOFF_S = 0.5
_MESSAGE_CHARS = 300  # of the endpoint's own error message: enough to read, short enough for one line
_SHOWN_MODELS = 10

Verdict = Literal["ok", "busy", "retry", "fail"]


class PreflightError(Exception):
    """The endpoint would fail the run: ``line`` says where, for which model, and what it answered."""

    def __init__(self, target: str, model: str, problem: str) -> None:
        self.target, self.model, self.problem = target, model, problem
        super().__init__(self.line)

    @property
    def line(self) -> str:
        where = f"preflight: {self.target} for model {self.model!r}"
        return f"{where}: {self.problem} (--no-preflight skips this check)"


@dataclass(frozen=True)
class PreflightResult:
    elapsed_s: float
    listed: bool  # the endpoint's /models list was read and names the model
    api: HarnessApi | None  # the API the minimal request went to; None: no request (command harness)
    warning: str | None  # one line when the endpoint answered 429 (busy), or listed the model not


def preflight(cfg: RunConfig, timeout_s: float = DEFAULT_TIMEOUT_S) -> PreflightResult:
    """Check the endpoint ``cfg`` names; with the scripted provider, a scripted model started here for
    the purpose (each worker starts its own, so the check takes no step of any task's script)."""
    from harnesses.registry import make_harness

    started = time.monotonic()
    api = make_harness(cfg.harness.name, cfg.harness.version, cfg.harness.command).api
    if cfg.model.provider == "scripted":
        where = "the scripted model"
        result = asyncio.run(_against_scripted(cfg.model.name, api, timeout_s))
    else:
        where = cfg.model.base_urls[0]  # one replica answers for all: same server, same model
        result = asyncio.run(check_endpoint(where, cfg.model.api_key(), cfg.model.name, api, timeout_s))
    log.debug(
        "preflight of %s passed in %.3f s (the checks: %.3f s; model listed: %s; request: %s)",
        where,
        time.monotonic() - started,
        result.elapsed_s,
        result.listed,
        result.api or "none",
    )
    return result


async def _against_scripted(model: str, api: HarnessApi | None, timeout_s: float) -> PreflightResult:
    from harnesses.testing.scripted_model import ScriptedModel

    server = ScriptedModel(model_names=(model,))
    await server.start()  # 127.0.0.1, a free port
    try:
        return await check_endpoint(server.base_url, None, model, api, timeout_s)
    finally:
        await server.stop()


async def check_endpoint(
    base_url: str, api_key: str | None, model: str, api: HarnessApi | None, timeout_s: float
) -> PreflightResult:
    """Raise PreflightError when the endpoint would fail the run; else say what was checked."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # trust_env=False: no HTTP(S)_PROXY from the environment ever sees the key.
    async with httpx.AsyncClient(
        trust_env=False, timeout=httpx.Timeout(timeout_s), headers=headers, follow_redirects=False
    ) as client:
        probe = _Probe(client, base_url.rstrip("/"), model)
        try:
            async with asyncio.timeout(timeout_s):
                listed = await probe.models()
                if api is not None:
                    await probe.request(api)
                elif probe.unlisted is not None:
                    probe.warn(f"preflight: {probe.unlisted}; with no harness API to try, the run goes on")
        except TimeoutError:
            raise probe.timed_out(timeout_s) from None
    return PreflightResult(time.monotonic() - started, listed, api, probe.warning)


class _Probe:
    """The two checks, sharing what the error line needs: the request under way, the last failure."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str) -> None:
        self.client, self.base_url, self.model = client, base_url, model
        self.target = f"GET {base_url}/models"
        self.last_problem: str | None = None
        self.warning: str | None = None
        self.unlisted: str | None = None  # the list did not name the model: said if the request fails too

    def fail(self, problem: str) -> PreflightError:
        return PreflightError(self.target, self.model, problem)

    def timed_out(self, timeout_s: float) -> PreflightError:
        last = f"; before that: {self.last_problem}" if self.last_problem else ""
        return self.fail(f"no answer within {timeout_s:g} s (--preflight-timeout){last}")

    async def models(self) -> bool:
        """True when /models lists the model; False when the endpoint serves no usable list."""
        response = await self._send("GET", "/models", None)
        status = response.status_code
        if status in (404, 405):
            return False  # the endpoint does not serve the list: nothing to check against
        if self._judge(response) == "busy":
            return False
        ids = _served_ids(response)
        if ids is None:
            log.debug("preflight: %s answered no OpenAI-style model list; not checked", self.target)
            return False
        if self.model in ids:
            return True
        # Not proof: a proxy serves models its list does not name (LiteLLM's wildcard routes). The request
        # decides; this is said with its failure.
        self.unlisted = f"GET {self.base_url}/models {_not_served(ids)}"
        return False

    async def request(self, api: HarnessApi) -> None:
        fields = CHAT_TOKEN_FIELDS if api == "chat" else ("max_output_tokens",)
        for field in fields:
            response = await self._send("POST", API_PATHS[api], probe_body(api, self.model, field))
            if field != fields[-1] and refuses_token_field(response.status_code, response.content, field):
                continue  # refused for the token field's name: the other name, as a harness's client would
            break
        self._judge(response)

    def _judge(self, response: httpx.Response) -> Verdict:
        """ok or busy (noted once as the warning), else raise: the retries are already spent."""
        verdict = _verdict(response.status_code)
        if verdict == "busy":
            self.warn(
                f"preflight: {self.target} for model {self.model!r}: {_http_problem(response)}; "
                "the endpoint is busy but answers, so the run goes on"
            )
        if verdict in ("ok", "busy"):
            return verdict
        listed = f"; and {self.unlisted}" if self.unlisted else ""
        raise self.fail(_http_problem(response) + listed)

    def warn(self, line: str) -> None:
        if self.warning is None:  # one line: the first thing worth saying
            self.warning = line

    async def _send(self, method: str, path: str, body: dict[str, Any] | None) -> httpx.Response:
        """The endpoint's answer; a 5xx or a transport error is tried again (the caller's timeout bounds
        it all). Raises once the attempts are spent."""
        url = self.base_url + path
        self.target = f"{method} {url}"
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                response = await self.client.request(method, url, json=body)
            except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
                raise self.fail(f"not a usable URL: {_describe(exc)}") from None
            except httpx.TransportError as exc:
                self.last_problem = f"transport error {_describe(exc)}"
            else:
                if _verdict(response.status_code) != "retry":
                    return response
                self.last_problem = _http_problem(response)
            if attempt < _ATTEMPTS:
                await asyncio.sleep(_BACKOFF_S * attempt)
        raise self.fail(f"{self.last_problem} ({_ATTEMPTS} attempts)")


def _verdict(status: int) -> Verdict:
    if 200 <= status < 300:
        return "ok"
    if status == 429:
        return "busy"  # the URL, the key and the model were all accepted
    if status >= 500 or status == 408:
        return "retry"
    return "fail"  # 401/403/402/404 and any other 4xx (or a redirect) will not change on a retry


def _served_ids(response: httpx.Response) -> list[str] | None:
    """The model ids of an OpenAI-style list (``{"data": [{"id": ...}]}``); None for anything else, or
    for a page of a longer list, where a missing name proves nothing."""
    try:
        data = response.json()
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("data"), list) or data.get("has_more"):
        return None
    ids = [item.get("id") for item in data["data"] if isinstance(item, dict)]
    return [i for i in ids if isinstance(i, str)]


def _not_served(ids: list[str]) -> str:
    if not ids:
        return "lists no model at all"
    shown = ", ".join(ids[:_SHOWN_MODELS])
    more = f" and {len(ids) - _SHOWN_MODELS} more" if len(ids) > _SHOWN_MODELS else ""
    return f"does not list it; it lists: {shown}{more}"


def _http_problem(response: httpx.Response) -> str:
    message = error_message_of(response.content, _MESSAGE_CHARS * 4)
    return f"HTTP {response.status_code}: {_one_line(message) if message else '(empty body)'}"


def _describe(exc: Exception) -> str:
    # httpx says "All connection attempts failed"; the OS error at the bottom of the chain says why.
    cause: BaseException | None = exc
    while cause is not None and not (isinstance(cause, OSError) and cause.errno):
        cause = cause.__cause__ or cause.__context__
    text = os.strerror(cause.errno) if isinstance(cause, OSError) and cause.errno else _one_line(str(exc))
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _MESSAGE_CHARS else flat[: _MESSAGE_CHARS - 1] + "…"
