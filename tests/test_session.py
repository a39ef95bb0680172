"""One rollout end to end without Ray: local sandbox, gateway, scripted model, the real Codex binary."""

from __future__ import annotations

import json

import pytest

from executor.session import SessionRequest, run_session
from executor.tasks import Task
from tests.conftest import processes_under, session_context

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("codex_installed")]

FAST_GATEWAY = {"gateway": {"max_attempts_per_request": 3, "backoff_base_s": 0.1, "backoff_cap_s": 0.5}}


def _task(**fields):
    base = {"id": "t1", "prompt": "Create hello.txt containing hello world"}
    return Task.model_validate({**base, **fields})


async def _run(tmp_path, task, config=None, **ctx_kwargs):
    async with session_context(tmp_path, config or FAST_GATEWAY, **ctx_kwargs) as ctx:
        return await run_session(SessionRequest("t", task, 0, 1), ctx)


async def test_clean_completion_is_graded(tmp_path):
    task = _task(
        model_script=[
            {"type": "shell", "command": "printf 'hello world\\n' > hello.txt"},
            {"type": "text", "text": "Created hello.txt."},
        ],
        # What the verifier writes must not show in the diff, which holds the agent's changes only.
        verify="grep -qx 'hello world' hello.txt && echo graded > verifier-was-here.txt",
    )
    row = await _run(tmp_path, task)
    assert (row["status"], row["failure_kind"], row["reward"]) == ("completed", "none", 1.0), row[
        "error_message"
    ]
    assert row["final_text"] == "Created hello.txt."
    shell = [c for c in row["tool_calls"] if c["exit_code"] is not None]
    assert shell and shell[0]["exit_code"] == 0 and shell[0]["status"] == "completed"
    assert row["input_tokens"] > 0 and row["output_tokens"] > 0
    assert [a["status"] for a in row["model_calls"]] == [200, 200]
    assert "hello.txt" in row["workspace_diff"] and "verifier-was-here" not in row["workspace_diff"]
    assert row["evidence_gaps"] == []
    assert row["cleanup_ok"] is True
    assert not processes_under(str(tmp_path / "sandboxes"))


async def test_usage_omitted_stays_unknown(tmp_path):
    task = _task(model_script=[{"type": "text", "text": "Nothing to do.", "usage": False}])
    row = await _run(tmp_path, task)
    assert row["status"] == "completed"
    assert row["input_tokens"] is None and row["output_tokens"] is None


async def test_rate_limit_that_recovers(tmp_path):
    task = _task(
        model_script=[
            {"type": "error", "status": 429, "headers": {"Retry-After": "1"}},
            {"type": "text", "text": "done"},
        ],
    )
    row = await _run(tmp_path, task)
    assert row["status"] == "completed", row["error_message"]
    first, second = row["model_calls"][:2]
    assert (first["status"], second["status"]) == (429, 200)
    assert first["request_index"] == second["request_index"]
    assert first["request_sha256"] == second["request_sha256"]
    assert second["started_at"] - first["started_at"] >= 1.0  # no sooner than Retry-After


async def test_rate_limit_forever_is_classified_from_the_gateway(tmp_path):
    task = _task(model_script=[{"type": "error", "status": 429, "headers": {"Retry-After": "0"}}])
    row = await _run(tmp_path, task)
    assert (row["status"], row["failure_kind"], row["http_status"]) == ("failed", "rate_limit_exceeded", 429)
    upstream = [a for a in row["model_calls"] if a["status"] == 429]
    assert len(upstream) == 3  # the gateway's per-request budget, and nothing after it closed
    assert row.get("reward") is None


async def test_context_overflow_is_incomplete_and_graded(tmp_path):
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


async def test_hang_ends_at_the_deadline(tmp_path):
    task = _task(model_script=[{"type": "hang", "max_s": 600}], deadline_s=4, verify="test -f hello.txt")
    row = await _run(tmp_path, task, {**FAST_GATEWAY, "limits": {"grace_s": 2}})
    # The model sat on the request when the deadline fell: its time, not the agent's, so no grade.
    assert (row["status"], row["failure_kind"]) == ("failed", "model_timeout"), row["error_message"]
    assert row["timed_out"] is True
    assert row["t_agent_s"] < 4 + 2 + 5  # the deadline, its grace, and the parse
    assert row["reward"] is None and not row.get("verified")
    assert row["t_model_wait_s"] > 1.0  # the request outstanding from its arrival to the deadline
    assert not processes_under(str(tmp_path / "sandboxes"))


async def test_api_key_never_reaches_the_sandbox(tmp_path):
    secret = "sk-rollout-test-SECRET-9f8e7d6c"
    dump = "env > env.txt; cat /proc/*/cmdline 2>/dev/null | tr '\\0' ' ' > cmdlines.txt; ls -la ~ > home.txt"
    task = _task(model_script=[{"type": "shell", "command": dump}, {"type": "text", "text": "dumped"}])
    async with session_context(tmp_path, {**FAST_GATEWAY, "sandbox": {"keep": True}}, api_key=secret) as ctx:
        row = await run_session(SessionRequest("t", task, 0, 1), ctx)
        seen = [r for r in ctx.scripted.requests(row["rollout_id"])]
    assert row["status"] == "completed", row["error_message"]
    assert seen, "the upstream saw no request"
    leaks = []
    for root in (tmp_path / "sandboxes", tmp_path / "evidence"):
        for path in root.rglob("*"):
            if path.is_file() and secret.encode() in path.read_bytes():
                leaks.append(str(path))
    assert not leaks
    assert secret not in json.dumps(row, default=str)
    assert list((tmp_path / "sandboxes").rglob("env.txt"))  # the dump really ran
