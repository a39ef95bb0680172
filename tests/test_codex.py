"""harnesses/codex.py against the real Codex binary, the scripted model and a local sandbox (no gateway).

Codex is installed through harnesses.install into ``$ROLLOUT_CACHE`` (else the default cache), so CI pays
for the download once. The generated config turns off Codex's plugin sync, which is what otherwise makes
it look up chatgpt.com and github.com: these runs talk to 127.0.0.1 only.
"""

from __future__ import annotations

import json
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from harnesses.base import HarnessReport, LaunchContext
from harnesses.codex import STREAM_MAX_RETRIES, CodexHarness
from harnesses.testing.scripted_model import ScriptedModel, parse_steps
from policy import FailureKind
from sandboxes.base import ExecResult
from sandboxes.local import LocalSandbox
from tests.session_scenarios import PROMPT_CASES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = "scripted-model"


async def run_codex(
    sandbox: LocalSandbox,
    install_dir: Path,
    base_url: str,
    prompt: str = "Create hello.txt, then say done.",
) -> tuple[ExecResult, HarnessReport]:
    harness = CodexHarness()
    ctx = LaunchContext(
        base_url=base_url, api_key="sk-session-token", model=MODEL, prompt=prompt, install_dir=install_dir
    )
    launch = await harness.prepare(sandbox, ctx)
    result = await sandbox.exec(launch.argv, env=launch.env, stdin=launch.stdin, timeout=60, name="harness")
    return result, await harness.parse(sandbox, result)


def script(model: ScriptedModel, steps: list[dict[str, Any]]) -> None:
    model.set_script("default", parse_steps(steps))


def main_requests(model: ScriptedModel) -> list[Any]:
    return [r for r in model.requests("default") if not r.aux]


def user_texts(body: dict[str, Any]) -> list[str]:
    texts = []
    for item in body.get("input", []):
        if item.get("role") == "user":
            texts += [part.get("text", "") for part in item.get("content", []) if isinstance(part, dict)]
    return texts


async def test_shell_tool_then_text(
    sandbox: LocalSandbox, model: ScriptedModel, codex_installed: Path
) -> None:
    script(model, [{"type": "shell", "command": "echo hi > hello.txt"}, {"type": "text", "text": "done"}])
    result, report = await run_codex(sandbox, codex_installed, model.base_url)

    assert result.exit_code == 0, result.stderr_tail
    [call] = report.tool_calls
    assert call.name == "shell" and "echo hi > hello.txt" in (call.arguments or "")
    assert call.status == "completed" and call.exit_code == 0
    assert await sandbox.read_file("hello.txt", 100) == b"hi\n"
    assert report.usage.input_tokens and report.usage.input_tokens > 0
    assert report.usage.output_tokens and report.usage.output_tokens > 0
    assert report.final_text == "done"
    assert report.claimed_failure is None and report.claimed_message is None
    assert report.reconnects == 0
    assert report.evidence_gaps == []
    assert report.messages[0].role == "user" and report.messages[0].text.startswith("Create hello.txt")
    assert report.messages[-1].role == "assistant" and report.messages[-1].text == "done"
    assert report.native_transcript_path and report.native_transcript_path.endswith(".jsonl")
    assert await sandbox.read_file(report.native_transcript_path, 10)

    config = Path(sandbox.home) / ".codex" / "config.toml"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert "sk-session-token" not in config.read_text()  # the token travels in the environment only
    [first, *_] = main_requests(model)
    assert first.api == "responses" and first.body["model"] == MODEL


async def test_failed_command_keeps_exit_code(
    sandbox: LocalSandbox, model: ScriptedModel, codex_installed: Path
) -> None:
    script(
        model,
        [{"type": "shell", "command": "echo out; echo err >&2; exit 7"}, {"type": "text", "text": "done"}],
    )
    result, report = await run_codex(sandbox, codex_installed, model.base_url)
    assert result.exit_code == 0
    [call] = report.tool_calls
    assert call.status == "failed" and call.exit_code == 7
    assert "out" in (call.output or "") and "err" in (call.output or "")


async def test_context_overflow(sandbox: LocalSandbox, model: ScriptedModel, codex_installed: Path) -> None:
    script(model, [{"type": "error", "status": 400}])  # the scripted model's default 400 is an overflow
    result, report = await run_codex(sandbox, codex_installed, model.base_url)
    assert result.exit_code == 1
    assert report.claimed_failure is FailureKind.MODEL_CONTEXT_LIMIT
    assert "context window" in (report.claimed_message or "")
    assert report.usage.input_tokens is None and "usage_unavailable" in report.evidence_gaps
    assert len(main_requests(model)) == 1


async def test_missing_usage_is_none_not_zero(
    sandbox: LocalSandbox, model: ScriptedModel, codex_installed: Path
) -> None:
    script(model, [{"type": "text", "text": "done", "usage": False}])
    result, report = await run_codex(sandbox, codex_installed, model.base_url)
    assert result.exit_code == 0 and report.final_text == "done"
    assert report.usage.model_dump() == {
        "input_tokens": None,
        "output_tokens": None,
        "cached_input_tokens": None,
        "reasoning_tokens": None,
    }
    assert "usage_unavailable" in report.evidence_gaps
    assert "transcript_unavailable" not in report.evidence_gaps


@pytest.mark.parametrize(
    ("step", "kind"),
    [
        ({"type": "error", "status": 500}, FailureKind.PROVIDER_UNAVAILABLE),
        ({"type": "error", "status": 401}, FailureKind.PROVIDER_AUTH_ERROR),
        ({"type": "error", "status": 429, "headers": {"Retry-After": "0"}}, FailureKind.RATE_LIMIT_EXCEEDED),
        ({"type": "drop", "after_chunks": 1}, FailureKind.TRANSPORT_ERROR),
    ],
)
async def test_retried_failures_stop_after_our_retry_budget(
    sandbox: LocalSandbox,
    model: ScriptedModel,
    codex_installed: Path,
    step: dict[str, Any],
    kind: FailureKind,
) -> None:
    script(model, [step])
    result, report = await run_codex(sandbox, codex_installed, model.base_url)
    assert result.exit_code == 1
    assert report.claimed_failure is kind, report.claimed_message
    # request_max_retries = 0 and stream_max_retries = 2 took effect: 1 + 2 requests, 2 reconnects.
    assert report.reconnects == STREAM_MAX_RETRIES
    assert len(main_requests(model)) == 1 + STREAM_MAX_RETRIES


async def test_refused_connection_ends_instead_of_waiting_for_network(
    sandbox: LocalSandbox, codex_installed: Path
) -> None:
    with socket.socket() as probe:  # a port nobody listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result, report = await run_codex(sandbox, codex_installed, f"http://127.0.0.1:{port}/v1")
    assert not result.timed_out and result.exit_code == 1
    assert report.claimed_failure is FailureKind.TRANSPORT_ERROR
    assert report.reconnects == STREAM_MAX_RETRIES


@pytest.mark.parametrize("prompt", PROMPT_CASES.values(), ids=PROMPT_CASES.keys())
async def test_prompt_arrives_intact(
    sandbox: LocalSandbox, model: ScriptedModel, codex_installed: Path, prompt: str
) -> None:
    script(model, [{"type": "text", "text": "done"}])
    result, report = await run_codex(sandbox, codex_installed, model.base_url, prompt=prompt)
    assert result.exit_code == 0, result.stderr_tail
    [request] = main_requests(model)
    assert prompt in user_texts(request.body)
    assert report.messages[0].text.startswith(prompt[:1000])


async def test_native_transcript_records_are_all_known(
    sandbox: LocalSandbox, model: ScriptedModel, codex_installed: Path
) -> None:
    """A new Codex record type would show up here as an evidence gap before it shows up in a run."""
    script(model, [{"type": "shell", "command": "true"}, {"type": "text", "text": "done"}])
    _result, report = await run_codex(sandbox, codex_installed, model.base_url)
    assert not [gap for gap in report.evidence_gaps if gap.startswith("unknown_")]
    assert report.native_transcript_path
    lines = (await sandbox.read_file(report.native_transcript_path, 1 << 24)).splitlines()
    assert {json.loads(line)["type"] for line in lines} >= {"session_meta", "response_item", "event_msg"}
