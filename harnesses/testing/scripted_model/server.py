"""The scripted model's HTTP server: sessions and their scripts, the request log, the outage window, the
model endpoints of both dialects, the control routes, and ``serve`` for ``rollout model serve``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from aiohttp import web

from harnesses.testing.scripted_model.chat import _chat_completion, _chat_stream, _sse_chat
from harnesses.testing.scripted_model.errors import _error_response, _json_error, _json_not_found
from harnesses.testing.scripted_model.faults import FaultAnswers
from harnesses.testing.scripted_model.replies import (
    _SHELL_TOOLS,
    _WRITE_TOOLS,
    AUX_TEXT,
    _Call,
    _is_aux,
    _pick,
    _Reply,
    _shell_arguments,
    _tools,
    _usage,
    _write_arguments,
    _write_command,
)
from harnesses.testing.scripted_model.responses import _response_events, _response_object, _sse_event
from harnesses.testing.scripted_model.steps import (
    BadAnswerStep,
    DropStep,
    ErrorStep,
    HangStep,
    KeepaliveStep,
    ShellStep,
    Step,
    StreamErrorStep,
    TextStep,
    ToolStep,
    WaitStep,
    WriteStep,
    parse_steps,
)
from harnesses.testing.scripted_model.tokens import _Tokens, _tokens_asked

SESSION_HEADER = "x-rollout-session"
MAX_WAITS = 8  # wait steps one request passes at most
_MAX_BODY_BYTES = 256 * 1024 * 1024  # long agent histories easily pass aiohttp's 1 MiB default


# Request log and per-session state


@dataclass
class RequestLog:
    t: float
    path: str
    api: Literal["responses", "chat"]
    aux: bool
    step_index: int | None
    step_type: str | None
    stream: bool
    body: dict[str, Any]


@dataclass
class _Session:
    steps: list[Step] | None
    position: int = 0
    log: list[RequestLog] = field(default_factory=list)


@dataclass(frozen=True)
class OutageReport:
    """An outage's window and how many requests it answered with its error."""

    seconds: float
    status: int
    started_at: float | None  # epoch seconds of its first request; None while none has come
    answered: int

    @property
    def ends_at(self) -> float | None:
        return None if self.started_at is None else self.started_at + self.seconds


@dataclass
class _Outage:
    seconds: float
    error: ErrorStep
    started: float | None = None  # monotonic, for the window itself
    started_at: float | None = None  # epoch, for comparing with other processes' records
    answered: int = 0


class ScriptedModel(FaultAnswers):
    def __init__(
        self,
        default_script: list[Step] | None = None,
        model_names: tuple[str, ...] = ("scripted-model",),
        *,
        refuse_unknown_models: bool = False,
    ) -> None:
        """``refuse_unknown_models``: a model call naming a model outside ``model_names`` gets a 404
        ``model_not_found`` (as vLLM and OpenAI answer) and takes no step; by default any name is served."""
        self._default_script = list(default_script) if default_script else None
        self._model_names = model_names
        self._refuse_unknown = refuse_unknown_models
        self._run_refusals: dict[str, ErrorStep] = {}  # by API: a run_wide error step played so far
        self._sessions: dict[str, _Session] = {}
        # set_script/requests may be called from another thread than the server's event loop.
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._stopping: asyncio.Event | None = None
        self._base_url: str | None = None
        self._outage: _Outage | None = None
        # Every (method, path) that reached the server, /_ctl/ aside: what a proxy in front let through.
        self._seen: list[tuple[str, str]] = []
        self._arrived: asyncio.Event | None = None  # set (and replaced) on each logged model request
        self._gates: dict[str, asyncio.Event] = {}  # WaitStep's, on the server's loop
        self._released: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- public API ------------------------------------------------------------------------------------

    def set_script(self, session_key: str, steps: list[Step]) -> None:
        if not steps:
            raise ValueError("a script must have at least one step")
        with self._lock:
            session = self._sessions.setdefault(session_key, _Session(steps=None))
            session.steps = list(steps)
            session.position = 0

    def release(self, gate: str) -> None:
        """Let every request held at ``gate`` (a ``wait`` step) go on, and those that come later pass.
        From any thread."""
        with self._lock:
            self._released.add(gate)
            event, loop = self._gates.get(gate), self._loop
        if event is not None and loop is not None:
            loop.call_soon_threadsafe(event.set)

    async def _wait_at(self, step: WaitStep) -> None:
        with self._lock:
            if step.gate in self._released:
                return
            event = self._gates.setdefault(step.gate, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(step.max_s):
                await event.wait()

    def requests(self, session_key: str) -> list[RequestLog]:
        with self._lock:
            session = self._sessions.get(session_key)
            return list(session.log) if session else []

    def requests_seen(self) -> list[tuple[str, str]]:
        """(method, path) of every request that reached the server, any route, found or not."""
        with self._lock:
            return list(self._seen)

    async def wait_requests(self, session_key: str, count: int, timeout_s: float = 30.0) -> list[RequestLog]:
        """The session's log once it holds ``count`` model requests: a test's way to know an answer is
        under way (a hang, say) without sleeping. Call it on the server's event loop."""
        async with asyncio.timeout(timeout_s):
            while True:
                arrived = self._arrived
                log = self.requests(session_key)
                if len(log) >= count:
                    return log
                if arrived is None:
                    raise RuntimeError("ScriptedModel is not started")
                await arrived.wait()

    def outage(self, seconds: float, status: int = 429, headers: dict[str, str] | None = None) -> None:
        """Answer every request (control routes aside) with ``status`` for ``seconds``, then serve the
        scripts again. The window opens at the next request, not now, so a client's start-up is no part of
        it. Its requests take no script step and are counted in ``outage_report``, not in ``requests``."""
        if not seconds > 0:
            raise ValueError(f"outage seconds must be positive, got {seconds!r}")
        if not 100 <= status <= 599:
            raise ValueError(f"outage status must be an HTTP status (100-599), got {status!r}")
        error = ErrorStep(type="error", status=status, headers=headers or {})
        with self._lock:
            self._outage = _Outage(seconds, error)

    def outage_report(self) -> OutageReport | None:
        with self._lock:
            o = self._outage
            if o is None:
                return None
            return OutageReport(o.seconds, o.error.status, o.started_at, o.answered)

    @property
    def base_url(self) -> str:
        if self._base_url is None:
            raise RuntimeError("ScriptedModel is not started")
        return self._base_url

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if self._runner is not None:
            raise RuntimeError("ScriptedModel is already started")
        self._stopping = asyncio.Event()
        self._arrived = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        app = web.Application(
            client_max_size=_MAX_BODY_BYTES, middlewares=[_json_not_found, self._outage_gate]
        )
        for prefix in ("", "/s/{session}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/responses", self._responses)
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_get(prefix + "/v1/models/{model_id:.+}", self._model)
        app.router.add_post("/_ctl/scripts/{session}", self._ctl_script)
        app.router.add_get("/_ctl/log/{session}", self._ctl_log)
        app.router.add_get("/_ctl/health", self._ctl_health)
        # Cancelling the handler when the client leaves is what ends a hang step early.
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        bound_port = runner.addresses[0][1]
        shown = "127.0.0.1" if host in ("", "0.0.0.0") else f"[{host}]" if ":" in host else host
        self._base_url = f"http://{shown}:{bound_port}/v1"

    async def stop(self) -> None:
        if self._runner is None:
            return
        assert self._stopping is not None
        self._stopping.set()  # releases hanging handlers, so cleanup does not wait for max_s
        await self._runner.cleanup()
        self._runner = None
        self._base_url = None

    # -- script bookkeeping ----------------------------------------------------------------------------

    def _take_step(self, key: str) -> tuple[int | None, Step | None]:
        with self._lock:
            session = self._sessions.setdefault(key, _Session(steps=self._default_script))
            if not session.steps:
                return None, None
            index = min(session.position, len(session.steps) - 1)  # the last step repeats forever
            session.position += 1
            return index, session.steps[index]

    def _outage_error(self) -> ErrorStep | None:
        """The outage's error while its window is open, counting the request; None outside it."""
        with self._lock:
            outage = self._outage
            if outage is None:
                return None
            now = time.monotonic()
            if outage.started is None:
                outage.started, outage.started_at = now, time.time()
            if now - outage.started >= outage.seconds:
                return None
            outage.answered += 1
            return outage.error

    @web.middleware
    async def _outage_gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        # Before any handler, so an outage answers /models as well and never consumes a script step.
        if not request.path.startswith("/_ctl/"):
            with self._lock:
                self._seen.append((request.method, request.path))
            error = self._outage_error()
            if error is not None:
                return _error_response(error)
        return await handler(request)

    def _record(self, key: str, entry: RequestLog) -> None:
        with self._lock:
            self._sessions.setdefault(key, _Session(steps=self._default_script)).log.append(entry)
        if self._arrived is not None:  # wakes every waiter; each looks at the log again
            self._arrived.set()
            self._arrived = asyncio.Event()

    def _next_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):06d}"

    def _call_id(self, key: str) -> str:
        safe = re.sub(r"[^A-Za-z0-9_-]", "_", key)[:40]
        return self._next_id(f"call_{safe}_")

    def _reply_for(self, step: Step | None, key: str, body: dict[str, Any], raw_size: int) -> _Reply:
        if isinstance(step, TextStep):
            usage = _usage(raw_size, step.text) if step.usage else None
            return _Reply(text=step.text, finish_reason=step.finish_reason, usage=usage)
        if isinstance(step, ShellStep | WriteStep | ToolStep):
            planned = self._plan_call(step, key, _tools(body))
            if isinstance(planned, _Call):
                return _Reply(call=planned, usage=_usage(raw_size, planned.arguments))
            return _Reply(text=planned, usage=_usage(raw_size, planned))
        return _Reply(text="ok", usage=_usage(raw_size, "ok"))

    def _plan_call(
        self, step: ShellStep | WriteStep | ToolStep, key: str, tools: dict[str, dict[str, Any]]
    ) -> _Call | str:
        """The tool call a step asks for, fitted to the tools the client offered, or why none fits."""
        if isinstance(step, ToolStep):
            name, arguments = step.name, step.arguments
        else:
            writer = _pick(tools, _WRITE_TOOLS) if isinstance(step, WriteStep) else None
            write_arguments = _write_arguments(tools[writer], step.path, step.content) if writer else None
            shell = _pick(tools, _SHELL_TOOLS)
            if writer and write_arguments is not None:
                name, arguments = writer, write_arguments
            elif shell:
                command = (
                    step.command if isinstance(step, ShellStep) else _write_command(step.path, step.content)
                )
                name, arguments = shell, _shell_arguments(tools[shell], command)
            else:
                return f"scripted model: no tool for a {step.type} step was offered (tools: {sorted(tools)})"
        return _Call(self._call_id(key), name, json.dumps(arguments))

    # -- model endpoints -------------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_model(request, "chat")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve_model(request, "responses")

    async def _serve_model(
        self, request: web.Request, api: Literal["responses", "chat"]
    ) -> web.StreamResponse:
        received = time.monotonic()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return _json_error(400, "scripted model: the request body is not a JSON object", "invalid_json")

        key = request.headers.get(SESSION_HEADER) or request.match_info.get("session") or "default"
        if self._refuse_unknown and body.get("model") not in self._model_names:
            self._record(key, RequestLog(received, request.path, api, False, None, None, False, body))
            return _json_error(404, f"The model '{body.get('model')}' does not exist.", "model_not_found")
        aux = _is_aux(body)
        refused = self._run_refusals.get(api) if key == "default" else None
        index, step = (None, refused) if refused else (None, None) if aux else self._take_step(key)
        for _ in range(MAX_WAITS):  # a script of waits alone, its last repeating, must still answer
            if not isinstance(step, WaitStep):
                break
            await self._wait_at(step)
            index, step = self._take_step(key)
        if isinstance(step, WaitStep):
            step = None
        stream = bool(body.get("stream"))
        step_type = step.type if step else None if aux else "text"
        self._record(key, RequestLog(received, request.path, api, aux, index, step_type, stream, body))

        if isinstance(step, ErrorStep):
            if step.run_wide:
                self._run_refusals[api] = step
            return _error_response(step)
        model = str(body.get("model") or self._model_names[0])
        if isinstance(step, HangStep):
            return await self._hang(request, api, body, model, step)
        if isinstance(step, DropStep):
            return await self._drop(request, api, body, model, step)
        if isinstance(step, StreamErrorStep):
            return await self._stream_error(request, api, body, model, step)
        if isinstance(step, KeepaliveStep):
            return await self._keepalive(request, api, body, model, step)
        if isinstance(step, BadAnswerStep):
            return await self._bad_answer(request, api, body, model, step)
        if aux:
            reply = _Reply(text=AUX_TEXT, usage=_usage(len(raw), AUX_TEXT))
        else:
            reply = self._reply_for(step, key, body, len(raw))
        tokens = _tokens_asked(body, api, raw)
        if api == "chat":
            return await self._send_chat(request, body, model, reply, tokens)
        return await self._send_responses(request, body, model, reply, tokens)

    async def _send_chat(
        self, request: web.Request, body: dict[str, Any], model: str, reply: _Reply, tokens: _Tokens | None
    ) -> web.StreamResponse:
        reply_id = self._next_id("chatcmpl-")
        if not body.get("stream"):
            return web.json_response(_chat_completion(reply, model, reply_id, tokens))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        response = await self._open_sse(request)
        for chunk in _chat_stream(reply, model, reply_id, include_usage, tokens):
            await response.write(_sse_chat(chunk))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _send_responses(
        self, request: web.Request, body: dict[str, Any], model: str, reply: _Reply, tokens: _Tokens | None
    ) -> web.StreamResponse:
        response_id, item_id = self._next_id("resp_"), self._next_id("fc_" if reply.call else "msg_")
        if not body.get("stream"):
            final = _response_object(reply, body, model, response_id, item_id, done=True, tokens=tokens)
            return web.json_response(final)
        response = await self._open_sse(request)
        events = _response_events(reply, body, model, response_id, item_id, tokens)
        for number, event in enumerate(events):
            await response.write(_sse_event(event, number))
        await response.write_eof()
        return response

    # -- models and control ----------------------------------------------------------------------------

    def _model_entry(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "scripted"}

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [self._model_entry(n) for n in self._model_names]}
        )

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["model_id"]
        if name not in self._model_names:
            return _json_error(404, f"The model '{name}' does not exist", "model_not_found")
        return web.json_response(self._model_entry(name))

    async def _ctl_script(self, request: web.Request) -> web.Response:
        try:
            payload = json.loads(await request.read())
        except ValueError:
            return _json_error(400, 'body must be JSON: {"steps": [...]}')
        if not isinstance(payload, dict) or "steps" not in payload:
            return _json_error(400, "body must be a JSON object with a 'steps' list")
        try:
            steps = parse_steps(payload["steps"])
        except ValueError as exc:
            return _json_error(400, f"bad script: {exc}", "bad_script")
        key = request.match_info["session"]
        self.set_script(key, steps)
        return web.json_response({"ok": True, "session": key, "steps": len(steps)})

    async def _ctl_log(self, request: web.Request) -> web.Response:
        key = request.match_info["session"]
        return web.json_response(
            {"session": key, "requests": [asdict(entry) for entry in self.requests(key)]}
        )

    async def _ctl_health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})


# CLI


def _load_script_file(path: str) -> list[Step]:
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    return parse_steps(data["steps"] if isinstance(data, dict) and "steps" in data else data)


def serve(host: str, port: int, script_file: str | None) -> None:
    """Serve in the foreground until Ctrl-C or SIGTERM; the script file becomes the default script."""
    default_script = _load_script_file(script_file) if script_file else None

    async def main() -> None:
        model = ScriptedModel(default_script)
        await model.start(host, port)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, done.set)
        print(f"scripted model listening on {model.base_url}", flush=True)
        try:
            await done.wait()
        finally:
            await model.stop()

    asyncio.run(main())
