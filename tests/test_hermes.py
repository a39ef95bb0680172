"""harnesses/hermes.py against the real Hermes: one rollout each through run_session (local sandbox,
gateway, scripted model, verifier).

Hermes is installed through harnesses.install into its own venv in ``$ROLLOUT_CACHE`` (else the default
cache), so CI pays for the download once. It exits 0 when the model failed, so every failure case here
also checks that no exit 0 reads as success.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from executor.session import SessionRequest, run_session
from executor.tasks import Task
from harnesses.hermes import HermesHarness
from harnesses.install import MARKER_NAME, OUTPUT_TAIL_CHARS, InstallError, venv_install
from tests.conftest import processes_under, session_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180), pytest.mark.usefixtures("hermes_installed")]

FAST_GATEWAY = {"gateway": {"max_attempts_per_request": 3, "backoff_base_s": 0.1, "backoff_cap_s": 0.5}}


def _task(**fields: Any) -> Task:
    base = {"id": "t1", "prompt": "Create hello.txt containing hello world, then check it."}
    return Task.model_validate({**base, **fields})


async def _run(tmp_path: Path, task: Task, config: dict[str, Any] | None = None) -> dict[str, Any]:
    async with session_context(tmp_path, config or FAST_GATEWAY, harness=HermesHarness()) as ctx:
        return await run_session(SessionRequest("t", task, 0, 1), ctx)


def _chat_attempts(row: dict[str, Any]) -> list[dict[str, Any]]:
    # Hermes also looks up prices (GET /props, /models); only the model calls matter here.
    return [a for a in row["model_calls"] if a["path"] == "/chat/completions"]


async def test_two_shell_calls_then_answer(tmp_path: Path) -> None:
    task = _task(
        model_script=[
            {"type": "shell", "command": "printf 'hello world\\n' > hello.txt"},
            {"type": "shell", "command": "cat hello.txt"},
            {"type": "text", "text": "Created hello.txt."},
        ],
        verify="grep -qx 'hello world' hello.txt",
    )
    row = await _run(tmp_path, task)
    assert (row["status"], row["failure_kind"], row["reward"]) == ("completed", "none", 1.0), row[
        "error_message"
    ]
    assert row["final_text"] == "Created hello.txt."
    first, second = row["tool_calls"]
    assert first["name"] == second["name"] == "terminal"
    assert "hello.txt" in first["arguments"] and "cat hello.txt" in second["arguments"]
    assert [(c["status"], c["exit_code"]) for c in row["tool_calls"]] == [("completed", 0)] * 2
    assert second["output"] == "hello world"
    assert row["input_tokens"] > 0 and row["output_tokens"] > 0
    assert [a["status"] for a in _chat_attempts(row)] == [200, 200, 200]
    assert row["messages"][0]["role"] == "user" and row["messages"][0]["text"] == task.prompt
    assert row["messages"][-1] == {"role": "assistant", "text": "Created hello.txt."}
    assert not row["evidence_gaps"]
    assert row["cleanup_ok"] is True
    assert not processes_under(str(tmp_path / "sandboxes"))


async def test_failing_command_keeps_exit_code(tmp_path: Path) -> None:
    task = _task(
        model_script=[
            {"type": "shell", "command": "echo out; exit 7"},
            {"type": "shell", "command": "echo hello world > hello.txt"},
            {"type": "text", "text": "done"},
        ],
        verify="test -f hello.txt",
    )
    row = await _run(tmp_path, task)
    assert (row["status"], row["reward"]) == ("completed", 1.0), row["error_message"]
    failed, ok = row["tool_calls"]
    assert (failed["status"], failed["exit_code"]) == ("failed", 7)
    assert "out" in failed["output"]
    assert (ok["status"], ok["exit_code"]) == ("completed", 0)


async def test_usage_omitted_stays_unknown(tmp_path: Path) -> None:
    task = _task(model_script=[{"type": "text", "text": "Nothing to do.", "usage": False}])
    row = await _run(tmp_path, task)
    assert row["status"] == "completed" and row["final_text"] == "Nothing to do."
    assert row["input_tokens"] is None and row["output_tokens"] is None
    assert "usage_unavailable" in row["evidence_gaps"]


async def test_rate_limit_that_recovers(tmp_path: Path) -> None:
    task = _task(
        model_script=[
            {"type": "error", "status": 429, "headers": {"Retry-After": "1"}},
            {"type": "text", "text": "done"},
        ],
    )
    row = await _run(tmp_path, task)
    assert (row["status"], row["final_text"]) == ("completed", "done"), row["error_message"]
    first, second = _chat_attempts(row)[:2]
    assert (first["status"], second["status"]) == (429, 200)
    assert first["request_index"] == second["request_index"]  # retried by the gateway, not by Hermes


async def test_rate_limit_forever_is_not_success(tmp_path: Path) -> None:
    task = _task(model_script=[{"type": "error", "status": 429, "headers": {"Retry-After": "0"}}])
    row = await _run(tmp_path, task)
    assert row["exit_code"] == 0  # Hermes says nothing went wrong ...
    assert (row["status"], row["failure_kind"], row["http_status"]) == ("failed", "rate_limit_exceeded", 429)
    assert row["final_text"] is None  # ... and its error sentence is not taken for an answer
    assert len([a for a in row["model_calls"] if a["status"] == 429]) == 3
    assert row.get("reward") is None


async def test_context_overflow_is_incomplete_and_graded(tmp_path: Path) -> None:
    task = _task(
        model_script=[
            {"type": "shell", "command": "echo partial > part.txt"},
            {"type": "error", "status": 400},
        ],
        verify="grep -qx partial part.txt",
    )
    row = await _run(tmp_path, task)
    assert (row["status"], row["failure_kind"]) == ("incomplete", "model_context_limit"), row["error_message"]
    assert row["reward"] == 1.0  # partial work is graded
    [call] = row["tool_calls"]
    assert call["exit_code"] == 0


async def test_hang_ends_at_the_deadline(tmp_path: Path) -> None:
    task = _task(model_script=[{"type": "hang", "max_s": 600}], deadline_s=8, verify="test -f hello.txt")
    row = await _run(tmp_path, task, {**FAST_GATEWAY, "limits": {"grace_s": 2}})
    # The model sat on the request when the deadline fell: its time, not the agent's, so no grade.
    assert (row["status"], row["failure_kind"]) == ("failed", "model_timeout"), row["error_message"]
    assert row["timed_out"] is True and row["reward"] is None
    assert not processes_under(str(tmp_path / "sandboxes"))


async def test_prompt_arrives_intact(tmp_path: Path) -> None:
    # A leading "-", shell and YAML specials, and more than one argv string may hold (128 KiB). Hermes
    # itself strips whitespace around a prompt, so this one has none there.
    prompt = (
        "-h --version; echo $HOME `id` \"q\" 'single' \\ back\nkey: #no comment\tünïcödé\n"
        + "word " * 30_000
        + "end"
    )
    task = _task(prompt=prompt, model_script=[{"type": "text", "text": "done"}])
    async with session_context(tmp_path, FAST_GATEWAY, harness=HermesHarness()) as ctx:
        row = await run_session(SessionRequest("t", task, 0, 1), ctx)
        [request] = [r for r in ctx.scripted.requests(row["rollout_id"]) if not r.aux]
    assert row["status"] == "completed", row["error_message"]
    users = [m["content"] for m in request.body["messages"] if m["role"] == "user"]
    assert users == [prompt]


def test_installed_venv_is_whole_and_isolated(hermes_installed: Path) -> None:
    assert (hermes_installed / MARKER_NAME).is_file()
    # pip wrote the staging path into the scripts; they must point at the venv's final place.
    assert (hermes_installed / "bin" / "hermes").read_text().splitlines()[0] == (
        f"#!{hermes_installed / 'bin' / 'python'}"
    )
    probe = "import sys, hermes_cli, importlib.util as u; print(sys.prefix, u.find_spec('pytest') is None)"
    ran = subprocess.run(
        [hermes_installed / "bin" / "python", "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert ran.stdout.split() == [str(hermes_installed), "True"]  # none of our own site-packages


def test_missing_version_is_one_clear_install_error(tmp_path: Path) -> None:
    with pytest.raises(InstallError) as info:
        venv_install(tmp_path, "hermes-agent", "0.0.0", "hermes", timeout_s=300)
    message = info.value.message
    assert "\n" not in message and message.startswith("pip install of hermes-agent==0.0.0 failed")
    assert "ERROR:" in message and 0 < len(info.value.output_tail) <= OUTPUT_TAIL_CHARS
    assert [
        p.name for p in (tmp_path / "venv").iterdir() if p.name != ".locks" and p.name != ".pip-cache"
    ] == []
