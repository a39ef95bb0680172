"""gateway.capture_tokens: the gateway asks the endpoint for token ids and logprobs with vLLM's parameters,
records them per model call, and `rollout export --train` carries them. The scripted model answers those
parameters where vLLM puts its answers; the gateway's record is checked against the bytes the harness got.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from aiohttp import web

import harnesses.gateway.capture as capture_module
from harnesses.gateway import AttemptRecord, Gateway, GatewayConfig, GatewaySession
from harnesses.testing.scripted_model import parse_steps

REPO = Path(__file__).parents[1]
CHAT_PATH, RESPONSES_PATH = "/chat/completions", "/responses"
CHAT = {"model": "scripted-model", "messages": [{"role": "user", "content": "say hi"}]}
RESPONSES = {"model": "scripted-model", "input": "say hi"}
TEXT = "hi there, this is a scripted answer"  # six whitespace-separated pieces: six fake tokens
SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
CAPTURE = {"capture_tokens": True}
CAPTURE_PARAMS = ("logprobs", "top_logprobs", "return_token_ids", "return_tokens_as_token_ids")


@contextlib.asynccontextmanager
async def gateway_to(upstream: str, **config: Any) -> AsyncIterator[Gateway]:
    gateway = Gateway(upstream, None, GatewayConfig(backoff_base_s=0.01, backoff_cap_s=0.05, **config))
    await gateway.start()
    try:
        yield gateway
    finally:
        await gateway.stop()


async def ask(
    harness: httpx.AsyncClient, session: GatewaySession, body: dict[str, Any], path: str
) -> httpx.Response:
    return await harness.post(
        session.base_url + path,
        content=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {session.token}", "Content-Type": "application/json"},
    )


def sse_data(raw: bytes) -> list[dict[str, Any]]:
    lines = raw.decode().splitlines()
    return [json.loads(line[5:]) for line in lines if line.startswith("data:") and "[DONE]" not in line]


def answered_tokens(path: str, stream: bool, raw: bytes) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, completion ids, logprobs) as the harness received them, read independently of the
    gateway's parser."""
    if path == CHAT_PATH:
        objects = sse_data(raw) if stream else [json.loads(raw)]
        prompt = next(o["prompt_token_ids"] for o in objects if "prompt_token_ids" in o)
        choices = [c for o in objects for c in o["choices"]]
        ids = [i for c in choices for i in c.get("token_ids") or []]
        logprobs = [e["logprob"] for c in choices for e in (c.get("logprobs") or {}).get("content") or []]
        return prompt, ids, logprobs
    final = sse_data(raw)[-1]["response"] if stream else json.loads(raw)
    prompt = final["input_messages"][0]["tokens"]
    ids = final["output_messages"][0]["tokens"]
    parts = [p for item in final["output"] for p in item.get("content") or []]
    logprobs = [e["logprob"] for p in parts for e in p.get("logprobs") or []]
    return prompt, ids, logprobs


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [CHAT_PATH, RESPONSES_PATH])
async def test_text_answer_tokens_are_recorded(model, harness, tmp_path, path: str, stream: bool) -> None:
    model.set_script("s1", parse_steps([{"type": "text", "text": TEXT}]))
    body = {**(CHAT if path == CHAT_PATH else RESPONSES), "stream": stream}
    async with gateway_to(model.base_url, **CAPTURE) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, body, path)

    assert response.status_code == 200
    [record] = session.attempts
    prompt, ids, logprobs = answered_tokens(path, stream, response.content)
    assert len(ids) == len(logprobs) == len(TEXT.split())
    assert prompt and all(lp < 0 for lp in logprobs)
    assert record.prompt_token_ids == prompt
    assert record.completion_token_ids == ids
    assert record.completion_logprobs == logprobs
    assert record.tokens_truncated is False
    # The text the harness sees is the same with capture on: it streams one token a chunk instead.
    if path == CHAT_PATH and stream:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_data(response.content))
        assert text == TEXT
    elif path == CHAT_PATH:
        assert response.json()["choices"][0]["message"]["content"] == TEXT
    else:
        final = sse_data(response.content)[-1]["response"] if stream else response.json()
        assert final["output"][0]["content"][0]["text"] == TEXT


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [CHAT_PATH, RESPONSES_PATH])
async def test_upstream_sees_the_parameters_only_when_enabled(
    model, harness, tmp_path, path: str, stream: bool
) -> None:
    body = {**(CHAT if path == CHAT_PATH else RESPONSES), "stream": stream}
    if path == RESPONSES_PATH:
        body["include"] = ["reasoning.encrypted_content"]  # Codex's own include survives
    sent: dict[bool, dict[str, Any]] = {}
    for capture in (False, True):
        key = f"s-{capture}"
        model.set_script(key, parse_steps([{"type": "text", "text": TEXT}]))
        async with gateway_to(model.base_url, capture_tokens=capture, top_logprobs=2) as gateway:
            session = gateway.open_session(key, tmp_path / key)
            assert (await ask(harness, session, body, path)).status_code == 200
        [logged] = model.requests(key)
        sent[capture] = logged.body
        [record] = session.attempts
        if not capture:  # byte for byte, and nothing recorded
            assert record.request_sha256 == hashlib.sha256(json.dumps(body).encode()).hexdigest()
            assert (record.prompt_token_ids, record.completion_token_ids, record.completion_logprobs) == (
                None,
                None,
                None,
            )

    assert sent[False] == body
    on = sent[True]
    added = (*CAPTURE_PARAMS, "include", "enable_response_messages")
    assert {k: v for k, v in on.items() if k not in added} == {
        k: v for k, v in body.items() if k != "include"
    }
    assert on["top_logprobs"] == 2 and on["return_token_ids"] is True
    assert on["return_tokens_as_token_ids"] is True
    if path == CHAT_PATH:
        assert on["logprobs"] is True and "include" not in on
    else:
        assert on["include"] == ["reasoning.encrypted_content", "message.output_text.logprobs"]
        assert on["enable_response_messages"] is True and "logprobs" not in on


async def test_top_logprobs_is_left_out_unless_configured(model, harness, tmp_path) -> None:
    model.set_script("s1", parse_steps([{"type": "text", "text": TEXT}]))
    async with gateway_to(model.base_url, **CAPTURE) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, CHAT, CHAT_PATH)
    [logged] = model.requests("s1")
    assert "top_logprobs" not in logged.body and logged.body["logprobs"] is True
    # Asked as token ids, the logprob tokens name the same ids as token_ids.
    choice = response.json()["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        f"token_id:{i}" for i in choice["token_ids"]
    ]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", [CHAT_PATH, RESPONSES_PATH])
async def test_tool_call_tokens(model, harness, tmp_path, path: str, stream: bool) -> None:
    model.set_script("s1", parse_steps([{"type": "shell", "command": "echo hi"}]))
    if path == CHAT_PATH:
        tool = {"type": "function", "function": {k: v for k, v in SHELL_TOOL.items() if k != "type"}}
        body = {**CHAT, "tools": [tool], "stream": stream}
    else:
        body = {**RESPONSES, "tools": [SHELL_TOOL], "stream": stream}
    async with gateway_to(model.base_url, **CAPTURE) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, body, path)

    [record] = session.attempts
    prompt, ids, logprobs = answered_tokens(path, stream, response.content)
    assert ids and record.completion_token_ids == ids and record.prompt_token_ids == prompt
    if path == CHAT_PATH:  # chat logprobs cover every generated token, the call's included
        assert record.completion_logprobs == logprobs and len(logprobs) == len(ids)
    else:  # the Responses API gives logprobs for output text only: a function call has none
        assert logprobs == [] and record.completion_logprobs is None


async def test_retries_send_the_same_rewritten_bytes(model, harness, tmp_path) -> None:
    steps = [
        {"type": "error", "status": 429, "headers": {"Retry-After": "0"}},
        {"type": "text", "text": TEXT},
    ]
    model.set_script("s1", parse_steps(steps))
    async with gateway_to(model.base_url, **CAPTURE) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, {**CHAT, "stream": True}, CHAT_PATH)

    assert response.status_code == 200
    failed, answered = session.attempts
    kept = gzip.decompress((session.evidence_dir / "req-0.json.gz").read_bytes())
    assert json.loads(kept)["return_token_ids"] is True  # the evidence is what went upstream
    assert failed.request_sha256 == answered.request_sha256 == hashlib.sha256(kept).hexdigest()
    assert [entry.body for entry in model.requests("s1")] == [json.loads(kept)] * 2
    assert failed.completion_token_ids is None and failed.completion_logprobs is None
    assert answered.completion_token_ids and len(answered.completion_token_ids) == len(TEXT.split())


async def test_capture_is_bounded(model, harness, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(capture_module, "MAX_CAPTURED_TOKENS", 4)
    model.set_script("s1", parse_steps([{"type": "text", "text": TEXT}]))
    async with gateway_to(model.base_url, **CAPTURE) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, {**CHAT, "stream": True}, CHAT_PATH)

    [record] = session.attempts
    _, ids, logprobs = answered_tokens(CHAT_PATH, True, response.content)
    assert record.completion_token_ids == ids[:4] and record.completion_logprobs == logprobs[:4]
    assert record.prompt_token_ids is not None and len(record.prompt_token_ids) <= 4
    assert record.tokens_truncated is True
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in sse_data(response.content))
    assert text == TEXT  # the cap bounds the record, never the answer


async def test_ids_that_do_not_fit_the_row_are_dropped(harness, tmp_path) -> None:
    answer = {
        "object": "chat.completion",
        "prompt_token_ids": [1, "two", 3],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x"},
                "token_ids": [2**40],
                "logprobs": {"content": [{"token": "x", "logprob": -0.25}]},
                "finish_reason": "stop",
            }
        ],
    }

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(answer)

    async with upstream_server(handler) as upstream, gateway_to(upstream, **CAPTURE) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, CHAT, CHAT_PATH)

    assert response.json() == answer
    [record] = session.attempts
    assert record.prompt_token_ids is None and record.completion_token_ids is None
    assert record.completion_logprobs == [-0.25]


@contextlib.asynccontextmanager
async def upstream_server(answer: Any) -> AsyncIterator[str]:
    """An upstream that answers every request with ``answer(request)``; yields its base URL (…/v1)."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("line_bytes", "parsed"), [(6 * 2**20, True), (50 * 2**20, False)])
async def test_a_long_event_line_in_small_chunks(harness, tmp_path, line_bytes: int, parsed: bool) -> None:
    # A final event carrying a long prompt's ids, cut into many small writes: parsed up to the capture
    # line limit (past the 4 MiB one of plain usage sniffing), dropped whole past it, never half-read.
    ids = list(range(line_bytes // 8))
    first = {"object": "chat.completion.chunk", "prompt_token_ids": ids, "choices": []}
    last = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {}, "token_ids": [7], "finish_reason": "stop"}],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": 1},
    }
    body = b"data: " + json.dumps(first).encode() + b"\n\ndata: " + json.dumps(last).encode() + b"\n\n"

    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for at in range(0, len(body), 256 * 1024):
            await response.write(body[at : at + 256 * 1024])
        await response.write_eof()
        return response

    async with upstream_server(answer) as upstream, gateway_to(upstream, **CAPTURE) as gateway:
        session = gateway.open_session("s1", tmp_path / "s1")
        response = await ask(harness, session, {**CHAT, "stream": True}, CHAT_PATH)

    assert response.content == body
    [record] = session.attempts
    assert record.prompt_token_ids == (ids if parsed else None)
    assert record.completion_token_ids == [7] and record.input_tokens == len(ids)


def test_config_bounds_top_logprobs() -> None:
    assert GatewayConfig().capture_tokens is False and GatewayConfig().top_logprobs is None
    for bad in ({"top_logprobs": 21}, {"top_logprobs": -1}, {"capture_token": True}):
        with pytest.raises(ValueError):
            GatewayConfig(**bad)


def test_records_round_trip_through_attempts_jsonl() -> None:
    record = AttemptRecord(
        request_index=0,
        attempt=1,
        method="POST",
        path=CHAT_PATH,
        started_at=0.0,
        status=200,
        kind="none",
        latency_s=0.1,
        request_sha256="0" * 64,
        prompt_token_ids=[1, 2],
        completion_token_ids=[3],
        completion_logprobs=[-0.5],
    )
    assert AttemptRecord.model_validate_json(record.model_dump_json()) == record


# -- end to end: a real `rollout run` with Codex, then `rollout export --train` ---------------------------

RUN_CONFIG = """\
tasks: {tasks}
out: {out}
run_id: {run_id}
sandbox: {{root: {sandboxes}}}
gateway: {{capture_tokens: {capture}, max_attempts_per_request: 3, backoff_base_s: 0.1}}
limits: {{deadline_s: 60, grace_s: 3}}
concurrency: {{workers: 1, sessions_per_worker: 1}}
"""
TASK = {
    "id": "hello-file",
    "prompt": "Create a file hello.txt containing exactly the line: hello world",
    "model_script": [
        {"type": "shell", "command": "printf 'hello world\\n' > hello.txt"},
        {"type": "text", "text": "Created hello.txt with the line hello world."},
    ],
    "verify": "grep -qx 'hello world' hello.txt",
}


def _rollout(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_TMPDIR": "/tmp/rollout-ray-tests"}
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
    )


def _run_and_export(root: Path, capture: bool) -> list[dict[str, Any]]:
    tasks = root / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n")
    run_id = f"capture-{str(capture).lower()}"
    config = root / f"{run_id}.yaml"
    config.write_text(
        RUN_CONFIG.format(
            tasks=tasks,
            out=root / "out",
            run_id=run_id,
            sandboxes=root / "sandboxes",
            capture=str(capture).lower(),
        )
    )
    for _ in range(2):  # a second try only when Ray itself could not start (an overloaded machine)
        proc = _rollout("run", str(config))
        if "timed out during startup" not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = root / "train.parquet"
    proc = _rollout("export", str(root / "out" / run_id), "--train", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pq.read_table(out)
    assert table.schema.metadata[b"rollout_executor_train_schema"] == b"2"
    return table.to_pylist()


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_codex_run_exports_token_ids(tmp_path: Path, codex_installed: Path) -> None:
    [row] = _run_and_export(tmp_path, capture=True)
    assert row["reward"] == 1.0 and row["schema_version"] == "2"
    calls = [c for c in row["model_calls"] if c["path"] == RESPONSES_PATH and c["status"] == 200]
    assert len(calls) >= 2  # the shell call, then the answer
    for call in calls:
        assert call["prompt_token_ids"] and call["completion_token_ids"]
        assert call["tokens_truncated"] is False
    # The answer's text has logprobs, one per token id; the function call's ids come without them.
    text_calls = [c for c in calls if c["completion_logprobs"] is not None]
    assert text_calls and all(c["finish_reason"] == "completed" for c in text_calls)
    for call in text_calls:
        assert len(call["completion_logprobs"]) == len(call["completion_token_ids"]) > 0
        assert all(lp < 0 for lp in call["completion_logprobs"])
    last = calls[-1]
    assert len(last["completion_token_ids"]) == len("Created hello.txt with the line hello world.".split())


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_codex_run_without_capture_exports_nulls(tmp_path: Path, codex_installed: Path) -> None:
    [row] = _run_and_export(tmp_path, capture=False)
    assert row["reward"] == 1.0
    calls = [c for c in row["model_calls"] if c["path"] == RESPONSES_PATH]
    assert calls
    for call in calls:
        assert call["prompt_token_ids"] is None and call["completion_token_ids"] is None
        assert call["completion_logprobs"] is None and call["tokens_truncated"] is False
