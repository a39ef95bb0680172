"""harnesses/pi.py without the binary: the parser on captured evidence, the recognizer, the launch.

Fixtures under tests/fixtures/pi/<scenario>/ (see its README): events.jsonl is the ``--mode json`` stdout,
tool_ok/<timestamp>_<id>.jsonl the native session transcript.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from harnesses.base import HarnessReport, LaunchContext
from harnesses.evidence import MAX_MESSAGE_CHARS, MAX_TOOL_OUTPUT_CHARS, MAX_UNKNOWN_TYPES
from harnesses.install import node_runtime_binary
from harnesses.pi import (
    AGENT_MAX_RETRIES,
    NODE_VERSION,
    PiHarness,
    recognize_failure,
    render_models,
)
from policy import FailureKind
from sandboxes.base import ExecResult
from tests.test_codex_parse import FakeSandbox

FIXTURES = Path(__file__).parent / "fixtures" / "pi"
STDOUT = "/sandbox/logs/harness.stdout"
SESSIONS = "/sandbox/home/.pi/sessions"
PROMPT = "Create hello.txt, then say done."


def evidence(
    scenario: str, *, events: bytes | None = None, with_transcript: bool = True
) -> tuple[FakeSandbox, ExecResult]:
    folder = FIXTURES / scenario
    stdout = events if events is not None else (folder / "events.jsonl").read_bytes()
    files = {STDOUT: stdout}
    if with_transcript:
        for path in folder.glob("*_*.jsonl"):
            files[f"{SESSIONS}/{path.name}"] = path.read_bytes()
    result = ExecResult(exit_code=0, duration_s=1.0, stdout_path=STDOUT, stdout_bytes=len(stdout))
    return FakeSandbox(files, listing=False), result


async def parse(sandbox: FakeSandbox, result: ExecResult) -> HarnessReport:
    return await PiHarness().parse(sandbox, result)


def transcript_name() -> str:
    return next((FIXTURES / "tool_ok").glob("*_*.jsonl")).name


# --- successful runs -------------------------------------------------------------------------------------


async def test_tool_calls_usage_and_messages() -> None:
    report = await parse(*evidence("tool_ok"))
    assert [(c.name, c.status, c.exit_code) for c in report.tool_calls] == [
        ("bash", "completed", 0),
        ("bash", "completed", 0),
    ]
    assert report.tool_calls[0].arguments == '{"command": "echo hi > hello.txt"}'
    assert report.tool_calls[1].output == "hi\n"
    assert [(m.role, m.text) for m in report.messages] == [("user", PROMPT), ("assistant", "done")]
    assert report.final_text == "done"
    assert report.usage.input_tokens and report.usage.input_tokens > 1000
    assert report.usage.output_tokens and report.usage.cached_input_tokens == 0
    assert report.claimed_failure is None and report.claimed_message is None
    assert report.reconnects == 0
    assert report.evidence_gaps == []
    assert report.native_transcript_path == f"{SESSIONS}/{transcript_name()}"


async def test_transcript_stands_in_for_a_lost_stream() -> None:
    sandbox, result = evidence("tool_ok")
    first = (FIXTURES / "tool_ok" / "events.jsonl").read_bytes().split(b"\n", 1)[0]  # the session event
    sandbox.files[STDOUT] = first
    report = await parse(sandbox, result)
    assert [(c.status, c.exit_code) for c in report.tool_calls] == [("completed", 0), ("completed", 0)]
    assert [m.role for m in report.messages] == ["user", "assistant"]
    assert report.final_text == "done"


@pytest.mark.parametrize("scenario", ["tool_exit7", "tool_exit7_0.80.2"])
async def test_failed_command_is_failed_with_exit_7(scenario: str) -> None:
    # 1.6.0 reports the code in structuredContent; 0.80.2 only in its text.
    report = await parse(*evidence(scenario))
    [call] = report.tool_calls
    assert (call.status, call.exit_code) == ("failed", 7)
    assert "out" in (call.output or "")
    assert report.final_text == "done" and report.claimed_failure is None


async def test_missing_usage_is_none_not_zero() -> None:
    report = await parse(*evidence("no_usage"))
    assert report.final_text == "done"
    assert report.usage.model_dump() == dict.fromkeys(
        ("input_tokens", "output_tokens", "cached_input_tokens", "reasoning_tokens")
    )
    assert "usage_unavailable" in report.evidence_gaps


# --- failures (Pi exits 0 on all of them) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "kind", "retries"),
    [
        ("auth_401", FailureKind.PROVIDER_AUTH_ERROR, 0),
        ("rate_limit", FailureKind.RATE_LIMIT_EXCEEDED, AGENT_MAX_RETRIES),
        ("server_error", FailureKind.PROVIDER_UNAVAILABLE, AGENT_MAX_RETRIES),
        ("context_overflow", FailureKind.MODEL_CONTEXT_LIMIT, 0),
        ("stream_drop", FailureKind.TRANSPORT_ERROR, AGENT_MAX_RETRIES),
        ("stream_drop_0.80.2", FailureKind.TRANSPORT_ERROR, AGENT_MAX_RETRIES),
    ],
)
async def test_model_failures_are_claimed(scenario: str, kind: FailureKind, retries: int) -> None:
    report = await parse(*evidence(scenario))
    assert report.claimed_failure is kind, report.claimed_message
    assert report.claimed_message
    assert report.final_text is None  # a partial answer cut by the failure is no answer
    assert report.reconnects == retries


async def test_a_retry_that_succeeds_is_no_failure() -> None:
    events = (
        (FIXTURES / "rate_limit" / "events.jsonl")
        .read_bytes()
        .replace(b'"type":"auto_retry_end","success":false', b'"type":"auto_retry_end","success":true')
    )
    events += b'{"type":"message_end","message":{"role":"assistant","content":[{"type":"text","text":"ok"}],'
    events += b'"usage":{"input":3,"output":1},"stopReason":"stop"}}\n'
    report = await parse(*evidence("rate_limit", events=events, with_transcript=False))
    assert report.claimed_failure is None and report.final_text == "ok"


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("401: {}", FailureKind.PROVIDER_AUTH_ERROR),
        ("403 Forbidden", FailureKind.PROVIDER_AUTH_ERROR),
        ("429 Rate limit reached", FailureKind.RATE_LIMIT_EXCEEDED),
        ("503: overloaded", FailureKind.PROVIDER_UNAVAILABLE),
        ("400: maximum context length is 8192 tokens", FailureKind.MODEL_CONTEXT_LIMIT),
        ("400: gateway session closed", FailureKind.MODEL_REQUEST_ERROR),
        ("400: the message mentions 429 and 500", FailureKind.MODEL_REQUEST_ERROR),
        ("terminated", FailureKind.TRANSPORT_ERROR),
        ("Connection error.", FailureKind.TRANSPORT_ERROR),
        ("Too many requests, slow down", FailureKind.RATE_LIMIT_EXCEEDED),
        ("something new", None),
        ("", None),
        (None, None),
    ],
)
def test_recognizer_table(message: str | None, kind: FailureKind | None) -> None:
    assert recognize_failure(message) is kind


# --- unknown and hostile input -----------------------------------------------------------------------------


async def test_unknown_event_types_are_bounded_gaps() -> None:
    lines = [json.dumps({"type": f"new_{i}"}) for i in range(50)]
    sandbox, result = evidence("tool_ok", events="\n".join(lines).encode(), with_transcript=False)
    report = await parse(sandbox, result)
    unknown = [g for g in report.evidence_gaps if g.startswith("unknown_")]
    assert len(unknown) == MAX_UNKNOWN_TYPES and unknown[0] == "unknown_event_type:new_0"


async def test_hostile_event_stream_does_not_crash_and_stays_bounded() -> None:
    def end(message: Any) -> bytes:
        return json.dumps({"type": "message_end", "message": message}).encode()

    lines = [
        b"\xff\xfe not utf-8 \xc3\x28",
        b"x" * 1_000_000,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        b'{"type":"session","id":"../../etc/passwd","timestamp":"now"}',
        end({"role": "assistant", "content": [{"type": "toolCall", "id": "c", "name": {"x": 1}}]}),
        json.dumps(
            {
                "type": "tool_execution_end",
                "toolCallId": "c",
                "result": {"content": [{"type": "text", "text": "o" * 1_000_000}], "structuredContent": 5},
                "isError": "yes",
            }
        ).encode(),
        end({"role": "assistant", "content": "A" * 1_000_000, "usage": {"input": -1, "output": "x"}}),
        end({"role": "wizard"}),
        end("not an object"),
        b'{"type":"auto_retry_end","success":"maybe"}',
    ]
    sandbox, result = evidence("tool_ok", events=b"\n".join(lines), with_transcript=False)
    report = await parse(sandbox, result)
    assert "event_stream_unparseable_lines:4" in report.evidence_gaps
    assert "unknown_message_role:wizard" in report.evidence_gaps
    assert report.native_transcript_path is None  # the forged session id named no path
    assert sandbox.execs == []
    [call] = report.tool_calls
    assert call.exit_code is None and call.output is not None and len(call.output) <= MAX_TOOL_OUTPUT_CHARS
    assert report.final_text is not None and len(report.final_text) <= MAX_MESSAGE_CHARS
    assert report.usage.input_tokens is None
    assert len(report.model_dump_json()) < 300_000


async def test_hostile_transcript_does_not_crash() -> None:
    sandbox, result = evidence("tool_ok")
    path = f"{SESSIONS}/{transcript_name()}"
    sandbox.files[path] = b"\n".join(
        [b"\xff", b"[" * 100_000, b'{"type":"message","message":7}', b'{"type":"x"}']
    )
    sandbox.files[STDOUT] = (FIXTURES / "tool_ok" / "events.jsonl").read_bytes().split(b"\n", 1)[0]
    report = await parse(sandbox, result)
    assert "transcript_unparseable_lines:2" in report.evidence_gaps
    assert "unknown_record_type:x" in report.evidence_gaps
    assert report.final_text is None and report.tool_calls == []


# --- launch -------------------------------------------------------------------------------------------------


def context(prompt: str = PROMPT, **overrides: Any) -> LaunchContext:
    values = {
        "base_url": "http://127.0.0.1:9/s/tok/v1",
        "api_key": "sk-session",
        "model": "scripted-model",
        "prompt": prompt,
        "install_dir": Path("/cache/npm/earendil-works+pi-coding-agent@1.6.0"),
        **overrides,
    }
    return LaunchContext(**values)


async def test_prepare_writes_config_and_sends_the_prompt_on_stdin() -> None:
    sandbox = FakeSandbox()
    launch = await PiHarness().prepare(sandbox, context("@file -h $HOME\nnext", max_output_tokens=321))
    agent = "/sandbox/home/.pi/agent"
    models = json.loads(sandbox.files[f"{agent}/models.json"])
    settings = json.loads(sandbox.files[f"{agent}/settings.json"])
    assert sandbox.modes[f"{agent}/models.json"] == sandbox.modes[f"{agent}/settings.json"] == 0o600
    provider = models["providers"]["rollout"]
    assert provider["baseUrl"] == "http://127.0.0.1:9/s/tok/v1" and provider["api"] == "openai-completions"
    assert provider["apiKey"] == "$ROLLOUT_API_KEY"
    assert provider["models"] == [{"id": "scripted-model", "contextWindow": 200_000, "maxTokens": 321}]
    assert settings["retry"]["maxRetries"] == AGENT_MAX_RETRIES
    assert settings["retry"]["provider"]["maxRetries"] == 0
    assert "sk-session" not in sandbox.files[f"{agent}/models.json"].decode()
    assert launch.stdin == b"@file -h $HOME\nnext"
    assert launch.argv[0] == str(node_runtime_binary(Path("/cache"), NODE_VERSION))
    assert launch.argv[2:] == [
        "-p",
        "--mode",
        "json",
        "--offline",
        "--provider",
        "rollout",
        "--model",
        "scripted-model",
        "--session-dir",
        SESSIONS,
    ]
    assert launch.env["PI_CODING_AGENT_DIR"] == agent and launch.env["PI_OFFLINE"] == "1"
    assert launch.env["ROLLOUT_API_KEY"] == "sk-session"


def test_models_from_hostile_values_stay_json() -> None:
    models = json.loads(render_models('m"]}', 'http://h/v1"}', None))
    assert models["providers"]["rollout"]["models"][0]["id"] == 'm"]}'


def test_other_version_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="harnesses.pi"):
        PiHarness("0.0.1-parse-test")
        PiHarness("0.0.1-parse-test")
    assert len([r for r in caplog.records if "0.0.1-parse-test" in r.getMessage()]) == 1
    assert PiHarness().version == PiHarness.tested_version == "1.6.0"


def test_registry_knows_pi() -> None:
    from harnesses.registry import make_harness

    harness = make_harness("pi", "0.80.2")
    assert isinstance(harness, PiHarness) and harness.version == "0.80.2"
