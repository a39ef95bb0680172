"""The scripted model server over real HTTP on 127.0.0.1, parsed the way a client would parse it."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnesses.testing.scripted_model import SESSION_HEADER, ScriptedModel, parse_steps

pytestmark = pytest.mark.timeout(30)

# Tool schemas as the real harnesses send them (trimmed to what matters for argument filling).
CODEX_EXEC = {
    "type": "function",
    "name": "exec_command",
    "parameters": {
        "type": "object",
        "properties": {
            "cmd": {"type": "string"},
            "login": {"type": "boolean"},
            "workdir": {"type": "string"},
            "yield_time_ms": {"type": "number"},
        },
        "required": ["cmd"],
    },
}
BASH_STRING = {
    "type": "function",
    "function": {
        "name": "bash",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string"},
                "description": {"type": "string"},
                "timeout": {"type": "number"},
            },
            "required": ["command", "description"],
        },
    },
}
SHELL_ARRAY = {
    "type": "function",
    "function": {
        "name": "shell",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string"}},
                "with_escalated_permissions": {"type": "boolean"},
                "timeout_ms": {"type": "integer"},
            },
            "required": ["command", "with_escalated_permissions", "timeout_ms"],
        },
    },
}
OPENCODE_WRITE = {
    "type": "function",
    "function": {
        "name": "write",
        "parameters": {
            "type": "object",
            "properties": {"filePath": {"type": "string"}, "content": {"type": "string"}},
            "required": ["filePath", "content"],
        },
    },
}
USER = [{"role": "user", "content": "do the task"}]


@pytest.fixture
async def client(model: ScriptedModel) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=model.base_url, timeout=10) as http:
        yield http


def root_url(model: ScriptedModel) -> str:
    return model.base_url.removesuffix("/v1")


def chat_body(stream: bool, tools: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake-model", "messages": USER, "stream": stream, **extra}
    if tools:
        body["tools"] = tools
    return body


def responses_body(stream: bool, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "input": [{"role": "user", "content": "do it"}],
        "stream": stream,
        "tools": tools or [],
    }


def chat_sse(text: str) -> list[dict[str, Any]]:
    """Chat chunks in order; asserts the stream ends with [DONE] and nothing follows it."""
    data = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def responses_sse(text: str) -> list[dict[str, Any]]:
    """Responses events in order; checks each `event:` line names the type its data carries."""
    events = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines())
        event = json.loads(fields["data"])
        assert fields["event"] == event["type"]
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


async def chat(client: httpx.AsyncClient, session: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post("/chat/completions", json=body, headers={SESSION_HEADER: session})


async def responses(client: httpx.AsyncClient, session: str, body: dict[str, Any]) -> httpx.Response:
    return await client.post("/responses", json=body, headers={SESSION_HEADER: session})


def streamed_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


# --------------------------------------------------------------------------------------------------------
# Chat Completions


async def test_chat_stream_text_deltas_and_usage(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    text = "Hello from the scripted model; this answer spans several deltas."
    model.set_script("s", parse_steps([{"type": "text", "text": text}]))
    response = await chat(client, "s", chat_body(True, stream_options={"include_usage": True}))

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = chat_sse(response.text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert streamed_text(chunks) == text
    deltas = [d for c in chunks[1:-1] if (d := c["choices"][0]["delta"].get("content"))]
    assert len(deltas) > 1 and all(len(d) <= 16 for d in deltas)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_chat_usage_chunk_needs_include_usage(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    model.set_script("s", parse_steps([{"type": "text", "text": "hi"}]))
    chunks = chat_sse((await chat(client, "s", chat_body(True))).text)
    assert streamed_text(chunks) == "hi"
    assert not any("usage" in c for c in chunks)


async def test_chat_usage_omitted_when_step_says_so(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    model.set_script("s", parse_steps([{"type": "text", "text": "no counts", "usage": False}]))

    streamed = chat_sse(
        (await chat(client, "s", chat_body(True, stream_options={"include_usage": True}))).text
    )
    assert streamed_text(streamed) == "no counts"
    assert not any("usage" in c for c in streamed)

    whole = (await chat(client, "s", chat_body(False))).json()
    assert whole["choices"][0]["message"]["content"] == "no counts"
    assert "usage" not in whole


async def test_chat_non_streaming(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    model.set_script("s", parse_steps([{"type": "text", "text": "plain answer"}]))
    response = await chat(client, "s", chat_body(False))

    assert response.headers["content-type"].startswith("application/json")
    completion = response.json()
    assert completion["object"] == "chat.completion"
    assert completion["model"] == "fake-model"
    choice = completion["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "plain answer"}
    assert choice["finish_reason"] == "stop"
    usage = completion["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_chat_tool_call_for_bash_with_string_command(
    model: ScriptedModel, client: httpx.AsyncClient
) -> None:
    model.set_script("s", parse_steps([{"type": "shell", "command": "echo hi > hello.txt"}]))
    chunks = chat_sse((await chat(client, "s", chat_body(True, [BASH_STRING]))).text)

    opening = chunks[1]["choices"][0]["delta"]["tool_calls"][0]
    assert opening["index"] == 0 and opening["type"] == "function"
    assert opening["id"].startswith("call_")
    assert opening["function"] == {"name": "bash", "arguments": ""}
    rest = chunks[2]["choices"][0]["delta"]["tool_calls"][0]
    assert rest["index"] == 0 and "id" not in rest
    assert json.loads(rest["function"]["arguments"]) == {
        "command": "echo hi > hello.txt",
        "description": "run command",
    }
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_chat_tool_call_for_array_command(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    model.set_script("s", parse_steps([{"type": "shell", "command": "ls -la"}]))
    completion = (await chat(client, "s", chat_body(False, [SHELL_ARRAY]))).json()

    choice = completion["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "shell"
    arguments = json.loads(call["function"]["arguments"])
    assert arguments["command"] == ["bash", "-lc", "ls -la"]
    assert arguments["with_escalated_permissions"] is False
    assert isinstance(arguments["timeout_ms"], int) and arguments["timeout_ms"] > 0


async def test_write_prefers_a_write_tool(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    model.set_script("s", parse_steps([{"type": "write", "path": "a/b.txt", "content": "x"}]))
    completion = (await chat(client, "s", chat_body(False, [BASH_STRING, OPENCODE_WRITE]))).json()

    call = completion["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "write"
    assert json.loads(call["arguments"]) == {"filePath": "a/b.txt", "content": "x"}


async def test_write_falls_back_to_a_safe_shell_command(
    model: ScriptedModel, client: httpx.AsyncClient, tmp_path: Path
) -> None:
    content = "line 1\n$HOME `id` 'single' \"double\" \\n EOF\n"
    model.set_script("s", parse_steps([{"type": "write", "path": "sub dir/it's.txt", "content": content}]))
    completion = (await chat(client, "s", chat_body(False, [BASH_STRING]))).json()

    call = completion["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "bash"
    command = json.loads(call["arguments"])["command"]
    # Run it the way a harness would, to prove the quoting survives a real shell.
    subprocess.run(["bash", "-lc", command], cwd=tmp_path, check=True, timeout=20)
    assert (tmp_path / "sub dir" / "it's.txt").read_text() == content


async def test_explicit_tool_step_and_unique_call_ids(
    model: ScriptedModel, client: httpx.AsyncClient
) -> None:
    step = {"type": "tool", "name": "todo_write", "arguments": {"items": ["a"]}}
    model.set_script("s", parse_steps([step]))
    calls = []
    for _ in range(3):
        completion = (await chat(client, "s", chat_body(False, [BASH_STRING]))).json()
        calls.append(completion["choices"][0]["message"]["tool_calls"][0])
    assert all(c["function"]["name"] == "todo_write" for c in calls)
    assert all(json.loads(c["function"]["arguments"]) == {"items": ["a"]} for c in calls)
    assert len({c["id"] for c in calls}) == 3


async def test_shell_step_without_shell_tool_answers_text(
    model: ScriptedModel, client: httpx.AsyncClient
) -> None:
    model.set_script("s", parse_steps([{"type": "shell", "command": "ls"}]))
    completion = (await chat(client, "s", chat_body(False, [OPENCODE_WRITE]))).json()
    message = completion["choices"][0]["message"]
    assert "tool_calls" not in message
    assert "no tool for a shell step" in message["content"]


# --------------------------------------------------------------------------------------------------------
# Responses API


async def test_responses_stream_text(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    text = "A Responses API answer that is longer than one delta."
    model.set_script("s", parse_steps([{"type": "text", "text": text}]))
    response = await responses(client, "s", responses_body(True, [CODEX_EXEC]))

    assert response.headers["content-type"].startswith("text/event-stream")
    events = responses_sse(response.text)
    kinds = [event["type"] for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text
    final = events[-1]["response"]
    assert final["object"] == "response" and final["status"] == "completed"
    assert final["tools"] == [CODEX_EXEC]
    assert final["tool_choice"] == "auto" and "parallel_tool_calls" in final
    message = final["output"][0]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0] == {"type": "output_text", "text": text, "annotations": []}
    usage = final["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_tokens_details"] == {"cached_tokens": 0}
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


async def test_responses_tool_call_for_codex_exec_command(
    model: ScriptedModel, client: httpx.AsyncClient
) -> None:
    model.set_script("s", parse_steps([{"type": "shell", "command": "echo hi > hello.txt"}]))
    events = responses_sse((await responses(client, "s", responses_body(True, [CODEX_EXEC]))).text)

    kinds = [event["type"] for event in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    item = events[-2]["item"]
    assert item["type"] == "function_call" and item["name"] == "exec_command"
    assert item["status"] == "completed" and item["call_id"].startswith("call_")
    # Only the required argument is filled: optional ones like workdir keep Codex's own defaults.
    assert json.loads(item["arguments"]) == {"cmd": "echo hi > hello.txt"}
    assert events[4]["arguments"] == item["arguments"]
    assert events[-1]["response"]["output"] == [item]


async def test_responses_non_streaming(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    model.set_script("s", parse_steps([{"type": "text", "text": "whole", "usage": False}]))
    body = (await responses(client, "s", responses_body(False))).json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["output"][0]["content"][0]["text"] == "whole"
    assert "usage" not in body


async def test_finish_reason_length(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    model.set_script("s", parse_steps([{"type": "text", "text": "truncated", "finish_reason": "length"}]))

    events = responses_sse((await responses(client, "s", responses_body(True))).text)
    assert events[-1]["type"] == "response.incomplete"
    assert "response.completed" not in [event["type"] for event in events]
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}

    completion = (await chat(client, "s", chat_body(False))).json()
    assert completion["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------------------------------------
# Scripts, sessions, auxiliary requests


@pytest.mark.parametrize(
    ("status", "code"),
    [(429, "rate_limit_exceeded"), (400, "context_length_exceeded"), (500, None), (403, "scripted_error")],
)
async def test_error_default_bodies(
    model: ScriptedModel, client: httpx.AsyncClient, status: int, code: str | None
) -> None:
    model.set_script("s", parse_steps([{"type": "error", "status": status}]))
    response = await chat(client, "s", chat_body(True))
    assert response.status_code == status
    assert response.json()["error"]["code"] == code


async def test_error_with_retry_after_then_last_step_repeats(
    model: ScriptedModel, client: httpx.AsyncClient
) -> None:
    script = [
        {"type": "text", "text": "first"},
        {"type": "error", "status": 429, "headers": {"Retry-After": "7"}},
    ]
    model.set_script("s", parse_steps(script))

    first = await chat(client, "s", chat_body(False))
    assert first.json()["choices"][0]["message"]["content"] == "first"
    for _ in range(3):
        limited = await chat(client, "s", chat_body(False))
        assert limited.status_code == 429
        assert limited.headers["retry-after"] == "7"
        error = limited.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
    log = model.requests("s")
    assert [entry.step_index for entry in log] == [0, 1, 1, 1]
    assert [entry.step_type for entry in log] == ["text", "error", "error", "error"]


async def test_error_custom_body_and_content_type(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    step = {"type": "error", "status": 503, "headers": {"content-type": "text/plain"}, "body": "busy"}
    model.set_script("s", parse_steps([step]))
    response = await chat(client, "s", chat_body(False))
    assert response.status_code == 503
    assert response.text == "busy"
    assert response.headers.get_list("content-type") == ["text/plain"]


async def test_sessions_keep_their_own_positions_concurrently(model: ScriptedModel) -> None:
    for key in ("a", "b"):
        model.set_script(key, parse_steps([{"type": "text", "text": f"{key}{n}"} for n in range(4)]))

    async def run(http: httpx.AsyncClient, path: str, headers: dict[str, str]) -> list[str]:
        answers = []
        for _ in range(4):
            response = await http.post(path, json=chat_body(False), headers=headers)
            answers.append(response.json()["choices"][0]["message"]["content"])
        return answers

    async with httpx.AsyncClient(base_url=root_url(model), timeout=10) as http:
        # One session keyed by URL prefix, the other by header, so both routes are exercised.
        got_a, got_b = await asyncio.gather(
            run(http, "/s/a/v1/chat/completions", {}),
            run(http, "/v1/chat/completions", {SESSION_HEADER: "b"}),
        )
    assert got_a == ["a0", "a1", "a2", "a3"]
    assert got_b == ["b0", "b1", "b2", "b3"]
    assert [entry.path for entry in model.requests("a")] == ["/s/a/v1/chat/completions"] * 4


async def test_many_sessions_at_once(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    keys = [f"rollout-{n}" for n in range(20)]
    for key in keys:
        model.set_script(key, parse_steps([{"type": "text", "text": f"{key}/{n}"} for n in range(3)]))

    async def run(key: str) -> list[str]:
        return [
            (await chat(client, key, chat_body(False))).json()["choices"][0]["message"]["content"]
            for _ in range(3)
        ]

    results = await asyncio.gather(*(run(key) for key in keys))
    assert results == [[f"{key}/{n}" for n in range(3)] for key in keys]


async def test_set_script_resets_the_position(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    script = parse_steps([{"type": "text", "text": "one"}, {"type": "text", "text": "two"}])
    model.set_script("s", script)
    await chat(client, "s", chat_body(False))
    model.set_script("s", script)
    again = await chat(client, "s", chat_body(False))
    assert again.json()["choices"][0]["message"]["content"] == "one"
    assert [entry.step_index for entry in model.requests("s")] == [0, 0]


async def test_aux_requests_do_not_take_a_step(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    model.set_script(
        "s", parse_steps([{"type": "text", "text": "main answer"}, {"type": "error", "status": 500}])
    )
    title = {
        "model": "fake-model",
        "stream": False,
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "You are a title generator."}]},
            *USER,
        ],
    }
    small = chat_body(False, [BASH_STRING], model="fake-small")

    for body in (title, small):
        answer = (await chat(client, "s", body)).json()["choices"][0]["message"]["content"]
        assert answer == "Scripted test session"
    summary = {
        "model": "fake-model",
        "instructions": "Summarize the conversation.",
        "input": "x",
        "stream": True,
    }
    events = responses_sse((await responses(client, "s", summary)).text)
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Scripted test session"

    main = (await chat(client, "s", chat_body(False, [BASH_STRING]))).json()
    assert main["choices"][0]["message"]["content"] == "main answer"
    log = model.requests("s")
    assert [(entry.aux, entry.step_index) for entry in log] == [(True, None)] * 3 + [(False, 0)]


async def test_unscripted_sessions_use_default_script_or_ok() -> None:
    plain = ScriptedModel()
    scripted = ScriptedModel(
        default_script=parse_steps([{"type": "text", "text": "d0"}, {"type": "text", "text": "d1"}])
    )
    await plain.start()
    await scripted.start()
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            ok = await http.post(plain.base_url + "/chat/completions", json=chat_body(False))
            assert ok.json()["choices"][0]["message"]["content"] == "ok"
            assert plain.requests("default")[0].step_index is None

            for key in ("x", "y"):  # every session starts at the top of the default script
                for expected in ("d0", "d1", "d1"):
                    got = await http.post(
                        scripted.base_url + "/chat/completions",
                        json=chat_body(False),
                        headers={SESSION_HEADER: key},
                    )
                    assert got.json()["choices"][0]["message"]["content"] == expected
    finally:
        await plain.stop()
        await scripted.stop()


# --------------------------------------------------------------------------------------------------------
# Broken connections


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_drop_cuts_the_stream_after_some_chunks(
    model: ScriptedModel, client: httpx.AsyncClient, api: str
) -> None:
    model.set_script(
        "s", parse_steps([{"type": "drop", "after_chunks": 2}, {"type": "text", "text": "recovered"}])
    )
    path, body = (
        ("/chat/completions", chat_body(True)) if api == "chat" else ("/responses", responses_body(True))
    )

    lines: list[str] = []
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        async with client.stream("POST", path, json=body, headers={SESSION_HEADER: "s"}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                lines.append(line)
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    # The preamble (role chunk / created..content_part.added) and two content chunks, then the cut.
    assert len(data) == (1 if api == "chat" else 4) + 2
    assert "data: [DONE]" not in lines
    assert all(item.get("type") not in ("response.completed", "response.incomplete") for item in data)

    # The client's reconnect gets the next step.
    retry = await chat(client, "s", chat_body(False))
    assert retry.json()["choices"][0]["message"]["content"] == "recovered"


async def test_hang_until_the_client_gives_up(model: ScriptedModel) -> None:
    model.set_script("s", parse_steps([{"type": "hang"}]))
    async with httpx.AsyncClient(base_url=model.base_url, timeout=httpx.Timeout(10, read=0.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            await chat(http, "s", chat_body(True))
    assert [entry.step_type for entry in model.requests("s")] == ["hang"]
    # stop() in the fixture must not wait for the hang's 600 s: the test timeout would catch that.


async def test_hang_ends_by_cutting_the_connection_after_max_s(
    model: ScriptedModel, client: httpx.AsyncClient
) -> None:
    model.set_script("s", parse_steps([{"type": "hang", "max_s": 0.2}]))
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await responses(client, "s", responses_body(True))


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_hang_after_chunks_streams_then_says_nothing(model: ScriptedModel, api: str) -> None:
    model.set_script("s", parse_steps([{"type": "hang", "after_chunks": 2}]))
    path, body = (
        ("/chat/completions", chat_body(True)) if api == "chat" else ("/responses", responses_body(True))
    )
    lines: list[str] = []
    async with httpx.AsyncClient(base_url=model.base_url, timeout=httpx.Timeout(10, read=0.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            async with http.stream("POST", path, json=body, headers={SESSION_HEADER: "s"}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    lines.append(line)
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert len(data) == (1 if api == "chat" else 4) + 2  # the preamble and two chunks, then silence


async def test_hang_after_chunks_without_a_stream_sends_headers_and_part_of_the_json(
    model: ScriptedModel,
) -> None:
    model.set_script(
        "s", parse_steps([{"type": "hang", "after_chunks": 0}, {"type": "hang", "after_chunks": 1}])
    )
    async with httpx.AsyncClient(base_url=model.base_url, timeout=httpx.Timeout(10, read=0.5)) as http:
        for expected in (b"", b'{"id": "chatcmpl'):
            received = b""
            with pytest.raises(httpx.ReadTimeout):
                async with http.stream(
                    "POST", "/chat/completions", json=chat_body(False), headers={SESSION_HEADER: "s"}
                ) as response:
                    assert response.status_code == 200
                    async for chunk in response.aiter_raw():
                        received += chunk
            assert received == expected


async def test_stream_error_in_chat_forms(model: ScriptedModel, client: httpx.AsyncClient) -> None:
    steps = [
        {"type": "stream_error", "message": "upstream broke", "code": "server_error", "after_chunks": 1},
        {"type": "stream_error", "message": "slow down", "code": 429, "form": "event", "after_chunks": 0},
    ]
    model.set_script("s", parse_steps(steps))
    native = (await chat(client, "s", chat_body(True))).text
    chunks = chat_sse(native)
    assert streamed_text(chunks) == "partial answer p"  # one 16-character delta
    assert chunks[-1]["error"] == {"message": "upstream broke", "code": "server_error"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "error"

    event = (await chat(client, "s", chat_body(True))).text
    assert "event: error\ndata: " + json.dumps({"message": "slow down", "code": 429}) in event
    assert chat_sse(event)[0]["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize(
    ("form", "last"),
    [("native", "response.failed"), ("incomplete", "response.incomplete"), ("event", "error")],
)
async def test_stream_error_in_responses_forms(
    model: ScriptedModel, client: httpx.AsyncClient, form: str, last: str
) -> None:
    step = {"type": "stream_error", "message": "it broke", "code": "server_error", "form": form}
    model.set_script("s", parse_steps([step]))
    response = await responses(client, "s", responses_body(True))
    assert response.status_code == 200
    events = responses_sse(response.text)
    assert [e["type"] for e in events[-3:]] == ["response.output_text.delta"] * 2 + [last]
    error = events[-1] if form == "event" else events[-1]["response"]["error"]
    assert (error["code"], error["message"]) == ("server_error", "it broke")
    if form == "incomplete":
        assert events[-1]["response"]["status"] == "incomplete"


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_stream_error_without_a_stream_is_a_200_with_an_error(
    model: ScriptedModel, client: httpx.AsyncClient, api: str
) -> None:
    model.set_script("s", parse_steps([{"type": "stream_error", "message": "it broke"}]))
    send = chat if api == "chat" else responses
    response = await send(client, "s", chat_body(False) if api == "chat" else responses_body(False))
    assert response.status_code == 200
    assert response.json()["error"]["message"] == "it broke"


async def test_every_route_reached_is_seen_and_arrivals_can_be_awaited(
    model: ScriptedModel, client: httpx.AsyncClient
) -> None:
    model.set_script("s", parse_steps([{"type": "hang"}]))
    call = asyncio.create_task(chat(client, "s", chat_body(True)))
    [entry] = await model.wait_requests("s", 1)
    assert entry.step_type == "hang"
    call.cancel()
    await client.get("/models")
    await client.delete("/files/x")
    assert model.requests_seen() == [
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("DELETE", "/v1/files/x"),
    ]
    with pytest.raises(TimeoutError):
        await model.wait_requests("s", 2, timeout_s=0.05)


# --------------------------------------------------------------------------------------------------------
# Script parsing, control endpoints, models


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([{"type": "text", "text": "ok"}, {"type": "shell"}], "step 1: command: Field required"),
        ([{"type": "dance"}], "step 0: "),
        ([{"text": "no type"}], "step 0: "),
        ([{"type": "text", "text": "a"}, {"type": "text", "text": "b", "colour": 1}], "step 1: colour"),
        ([{"type": "drop", "after_chunks": -1}], "step 0: after_chunks"),
        ([{"type": "hang", "after_chunks": -1}], "step 0: after_chunks"),
        ([{"type": "stream_error", "form": "shout"}], "step 0: form"),
        ([{"type": "text", "text": "a"}, "text"], "step 1: "),
        ([], "a script must have at least one step"),
        ({"steps": []}, "a script must be a list"),
    ],
)
def test_parse_steps_rejects_bad_scripts(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)) as caught:
        parse_steps(data)
    assert "\n" not in str(caught.value)


def test_parse_steps_fills_defaults() -> None:
    text, error, drop, hang, failing = parse_steps(
        [
            {"type": "text", "text": "t"},
            {"type": "error", "status": 429},
            {"type": "drop"},
            {"type": "hang"},
            {"type": "stream_error"},
        ]
    )
    assert (text.finish_reason, text.usage) == ("stop", True)
    assert (error.headers, error.body) == ({}, None)
    assert drop.after_chunks == 2 and (hang.max_s, hang.after_chunks) == (600, None)
    assert (failing.after_chunks, failing.form, failing.code) == (2, "native", "server_error")


async def test_ctl_script_round_trip(model: ScriptedModel) -> None:
    async with httpx.AsyncClient(base_url=root_url(model), timeout=10) as http:
        assert (await http.get("/_ctl/health")).json()["ok"] is True

        bad = await http.post("/_ctl/scripts/k", json={"steps": [{"type": "text"}]})
        assert bad.status_code == 400
        assert "step 0" in bad.json()["error"]["message"]

        good = await http.post("/_ctl/scripts/k", json={"steps": [{"type": "text", "text": "from ctl"}]})
        assert good.status_code == 200
        answer = await http.post("/s/k/v1/chat/completions", json=chat_body(False))
        assert answer.json()["choices"][0]["message"]["content"] == "from ctl"

        log = (await http.get("/_ctl/log/k")).json()["requests"]
        assert len(log) == 1
        assert log[0]["api"] == "chat" and log[0]["step_index"] == 0 and log[0]["stream"] is False
        assert log[0]["body"]["messages"] == USER


async def test_models_and_unknown_routes() -> None:
    server = ScriptedModel(model_names=("fake-model", "fake-small"))
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=root_url(server), timeout=10) as http:
            listing = (await http.get("/v1/models")).json()
            assert [m["id"] for m in listing["data"]] == ["fake-model", "fake-small"]
            assert (await http.get("/s/k/v1/models/fake-small")).json()["id"] == "fake-small"
            for missing in (
                await http.get("/v1/models/nope"),
                await http.get("/api/show"),
                await http.delete("/v1/responses"),
            ):
                assert missing.status_code == 404
                assert "message" in missing.json()["error"]
    finally:
        await server.stop()
