"""Preflight against real servers on 127.0.0.1: the scripted model (its default script gives any status
and body) or a small aiohttp app. A misconfigured endpoint costs one line and exit code 2, nothing
written; a busy one passes with a warning; the scripted provider always passes."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from executor.config import load_config
from executor.preflight import PreflightError, check_endpoint, preflight
from executor.store import read_table
from harnesses.testing.scripted_model import ScriptedModel, parse_steps

REPO = Path(__file__).parents[1]
TASKS = REPO / "examples" / "tasks.jsonl"
MODEL = "my-model"
NOT_FOUND = json.dumps(
    {"error": {"message": f"The model `{MODEL}` does not exist.", "code": "model_not_found"}}
)


async def _scripted(*steps: dict, names: tuple[str, ...] = (MODEL,)) -> ScriptedModel:
    server = ScriptedModel(parse_steps(list(steps)) if steps else None, model_names=names)
    await server.start()
    return server


@pytest.fixture
async def servers() -> AsyncIterator[list[ScriptedModel]]:
    started: list[ScriptedModel] = []
    yield started
    for server in started:
        await server.stop()


async def _serve(servers: list[ScriptedModel], *steps: dict, names: tuple[str, ...] = (MODEL,)) -> str:
    server = await _scripted(*steps, names=names)
    servers.append(server)
    return server.base_url


async def _rollout_run(tmp_path: Path, *args: str, harness: str = "codex") -> tuple[int, str]:
    """The real `rollout run` in a subprocess; this loop keeps serving the test's endpoint meanwhile."""
    config = tmp_path / "run.yaml"
    extra = "harness: {name: command, command: 'echo done'}\n" if harness == "command" else ""
    config.write_text(
        f"tasks: {TASKS}\nout: {tmp_path / 'out'}\nsandbox: {{root: {tmp_path / 'sandboxes'}}}\n"
        f"concurrency: {{workers: 1, sessions_per_worker: 1}}\n{extra}"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "executor.cli",
        "run",
        str(config),
        *args,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "80", "RAY_TMPDIR": "/tmp/rollout-ray-tests", "PF_KEY": "sk-test"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(proc.communicate(), timeout=600)
    assert proc.returncode is not None
    return proc.returncode, stderr.decode()


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# -- the command line: one line, exit 2, nothing written ---------------------------------------------------


async def test_a_model_the_endpoint_does_not_have_exits_2_with_one_line(tmp_path, servers):
    url = await _serve(servers, {"type": "error", "status": 404, "body": NOT_FOUND})
    code, stderr = await _rollout_run(
        tmp_path, "--model-url", url, "--model", MODEL, "--api-key-env", "PF_KEY"
    )
    assert code == 2, stderr
    (line,) = _lines(stderr)
    assert line.startswith(f"error: preflight: POST {url}/responses for model '{MODEL}': HTTP 404: "), line
    assert f"The model `{MODEL}` does not exist." in line and "--no-preflight" in line
    assert "sk-test" not in stderr
    assert not (tmp_path / "out").exists()


async def test_an_unreachable_endpoint_names_the_transport_error(tmp_path):
    with socket.socket() as sock:  # a port nothing listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        code, stderr = await _rollout_run(tmp_path, "--model-url", url, "--model", MODEL)
    assert code == 2, stderr
    (line,) = _lines(stderr)
    assert f"preflight: GET {url}/models for model '{MODEL}': transport error ConnectError: " in line
    assert "Connection refused (3 attempts)" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.integration
async def test_no_preflight_skips_the_check(tmp_path, servers):
    """The endpoint refuses every request, /models included, so a preflight would exit 2; with
    --no-preflight the run starts anyway (the command harness makes no model call) and the endpoint saw
    no request at all."""
    server = await _scripted()
    server.outage(3600, status=401)  # /models too: the preflight fails whatever the harness's API
    servers.append(server)
    args = ("--model-url", server.base_url, "--model", MODEL, "--tasks", str(_one_task(tmp_path)))
    code, stderr = await _rollout_run(tmp_path, *args, "--no-preflight", harness="command")
    assert code != 2 and "preflight" not in stderr, stderr
    assert len(read_table(tmp_path / "out" / "run")) >= 1
    report = server.outage_report()
    assert report is not None and report.answered == 0


def _one_task(tmp_path: Path) -> Path:
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"id": "one", "prompt": "say done"}) + "\n")
    return path


# -- what the endpoint answers ---------------------------------------------------------------------------


async def test_a_model_missing_from_the_list_passes_when_the_request_works(servers):
    """A proxy's list need not name every model it serves (LiteLLM's wildcards): the request decides."""
    url = await _serve(servers, names=("served-0", "served-1"))
    result = await check_endpoint(url, None, MODEL, "chat", 20)
    assert (result.listed, result.api, result.warning) == (False, "chat", None)


async def test_a_model_missing_from_the_list_and_refused_fails_naming_what_is_served(servers):
    names = tuple(f"served-{i}" for i in range(12))
    url = await _serve(servers, {"type": "error", "status": 404, "body": NOT_FOUND}, names=names)
    with pytest.raises(PreflightError) as caught:
        await check_endpoint(url, None, MODEL, "chat", 20)
    assert caught.value.target == f"POST {url}/chat/completions"
    served = ", ".join(names[:10])
    assert f"GET {url}/models does not list it; it lists: {served} and 2 more" in caught.value.line
    assert "HTTP 404: The model `my-model` does not exist." in caught.value.line


async def test_a_model_missing_from_the_list_is_a_warning_with_no_api_to_try(servers):
    url = await _serve(servers, names=("served-0",))
    result = await check_endpoint(url, None, MODEL, None, 20)
    assert result.listed is False and "does not list it" in (result.warning or "")


async def test_a_chat_model_that_refuses_max_tokens_is_asked_with_max_completion_tokens(servers):
    """The newest reasoning models refuse max_tokens; the preflight asks again as a harness's client would."""
    refusal = json.dumps(
        {
            "error": {
                "message": "Unsupported parameter: 'max_tokens' is not supported with this model. "
                "Use 'max_completion_tokens' instead.",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": "unsupported_parameter",
            }
        }
    )
    url = await _serve(
        servers, {"type": "error", "status": 400, "body": refusal}, {"type": "text", "text": "OK"}
    )
    result = await check_endpoint(url, None, MODEL, "chat", 20)
    assert result.api == "chat"
    sent = [entry.body for entry in servers[0].requests("default")]
    assert ["max_tokens" in b for b in sent] == [True, False]
    assert sent[1]["max_completion_tokens"] == 16


@pytest.mark.parametrize(
    ("status", "api", "path"),
    [
        (401, "chat", "/chat/completions"),
        (402, "responses", "/responses"),
        (403, "chat", "/chat/completions"),
    ],
)
async def test_an_auth_or_billing_answer_fails_at_once(servers, status, api, path):
    url = await _serve(servers, {"type": "error", "status": status}, {"type": "text", "text": "OK"})
    with pytest.raises(PreflightError) as caught:
        await check_endpoint(url, "sk-test", MODEL, api, 20)
    assert caught.value.target == f"POST {url}{path}"
    assert caught.value.problem.startswith(f"HTTP {status}: scripted model: this request was refused")
    assert len(servers[0].requests("default")) == 1  # not retried: the second step was never taken


async def test_a_busy_endpoint_passes_with_one_warning(servers):
    url = await _serve(servers, {"type": "error", "status": 429})
    result = await check_endpoint(url, None, MODEL, "responses", 20)
    assert result.api == "responses" and result.listed
    assert result.warning is not None
    assert result.warning.startswith(
        f"preflight: POST {url}/responses for model '{MODEL}': HTTP 429: Rate limit"
    )


async def test_a_server_error_is_retried_then_passes(servers):
    url = await _serve(servers, {"type": "error", "status": 503}, {"type": "text", "text": "OK"})
    result = await check_endpoint(url, None, MODEL, "chat", 20)
    assert result.warning is None
    assert [r.step_type for r in servers[0].requests("default")] == ["error", "text"]


async def test_a_lasting_server_error_fails_after_three_attempts(servers):
    url = await _serve(servers, {"type": "error", "status": 500})
    with pytest.raises(PreflightError) as caught:
        await check_endpoint(url, None, MODEL, "chat", 20)
    assert caught.value.problem == (
        "HTTP 500: The server had an error while processing your request. (3 attempts)"
    )
    assert len(servers[0].requests("default")) == 3


async def test_an_endpoint_that_never_answers_fails_at_the_timeout(servers):
    url = await _serve(servers, {"type": "hang", "max_s": 600})
    with pytest.raises(PreflightError) as caught:
        await check_endpoint(url, None, MODEL, "responses", 1)
    assert caught.value.target == f"POST {url}/responses"
    assert caught.value.problem == "no answer within 1 s (--preflight-timeout)"


# -- an endpoint without /models, and the key ------------------------------------------------------------


class _NoModelList:
    """An endpoint with no /models route, answering the chat request with a chosen status."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.seen: list[tuple[str, str, str | None]] = []  # (method, path, Authorization)

    async def start(self) -> tuple[web.AppRunner, str]:
        app = web.Application(middlewares=[self._record])
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1"

    @web.middleware
    async def _record(self, request: web.Request, handler: object) -> web.StreamResponse:
        self.seen.append((request.method, request.path, request.headers.get("Authorization")))
        return await handler(request)  # type: ignore[operator]

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert body["stream"] is False and body["max_tokens"] <= 16
        if self.status != 200:
            return web.json_response({"error": {"message": "Incorrect API key provided"}}, status=self.status)
        return web.json_response({"object": "chat.completion", "choices": [{"message": {"content": "OK"}}]})


@pytest.mark.parametrize("status", [200, 401])
async def test_without_a_model_list_the_request_is_still_checked(status):
    endpoint = _NoModelList(status)
    runner, url = await endpoint.start()
    try:
        if status == 200:
            result = await check_endpoint(url, "sk-test", MODEL, "chat", 20)
            assert (result.listed, result.api) == (False, "chat")
        else:
            with pytest.raises(PreflightError, match="HTTP 401: Incorrect API key provided"):
                await check_endpoint(url, "sk-test", MODEL, "chat", 20)
    finally:
        await runner.cleanup()
    assert endpoint.seen == [
        ("GET", "/v1/models", "Bearer sk-test"),
        ("POST", "/v1/chat/completions", "Bearer sk-test"),
    ]


async def test_a_proxy_in_the_environment_never_sees_the_key(servers, monkeypatch):
    proxy = _NoModelList(200)  # stands in for a proxy: it records whatever reaches it
    runner, proxy_url = await proxy.start()
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, proxy_url.removesuffix("/v1"))
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    url = await _serve(servers)
    try:
        await check_endpoint(url, "sk-test", MODEL, "chat", 20)
    finally:
        await runner.cleanup()
    assert proxy.seen == []
    assert len(servers[0].requests("default")) == 1


# -- the scripted provider -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("harness", "api"), [("codex", "responses"), ("opencode", "chat"), ("command", None)]
)
def test_the_scripted_provider_passes(tmp_path, harness, api):
    (tmp_path / "run.yaml").write_text(f"tasks: {TASKS}\nharness: {{name: {harness}}}\n")
    result = preflight(load_config(tmp_path / "run.yaml"))
    assert (result.listed, result.api, result.warning) == (True, api, None)


async def test_a_preflight_takes_no_step_of_a_sessions_script(servers):
    """The gateway names each session in a header; the preflight names none, so a scripted model serving
    tasks' scripts answers it from its default session."""
    server = await _scripted()
    servers.append(server)
    server.set_script("task-session", parse_steps([{"type": "error", "status": 401}]))
    await check_endpoint(server.base_url, None, MODEL, "responses", 20)
    assert server.requests("task-session") == []
    assert [r.api for r in server.requests("default")] == ["responses"]
