"""Session scenarios every harness adapter must pass, through ``run_session`` with the real binary.

Used by the per-harness integration tests (tests/test_opencode.py, tests/test_pi.py): each scenario is a
scripted model, a task and what the row must show. Gateway backoff and deadlines are small so a scenario
costs little more than the harness's own start-up. The error scenarios (a failed tool, usage left out, 429s)
are the conformance matrix's (harnesses/testing/conformance/, every harness at both pins), and so is the
agent's own command running past the deadline (its agent_hang: agent_timeout, timed out, graded 0, no
process left); these are what it does not hold: the transcript's detail, graded partial work under the
overflow cap, and a deadline that falls while the model sits on a request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executor.session import SessionRequest, run_session
from executor.tasks import Task
from harnesses.base import HarnessReport, LaunchContext
from harnesses.testing.scripted_model import ScriptedModel, parse_steps
from sandboxes.base import ExecResult
from sandboxes.local import LocalSandbox
from tests.conftest import processes_under, session_context

FAST_GATEWAY = {"gateway": {"max_attempts_per_request": 3, "backoff_base_s": 0.1, "backoff_cap_s": 0.5}}
MODEL = "scripted-model"


@dataclass(frozen=True)
class Scenario:
    script: list[dict[str, Any]]
    check: Callable[[dict[str, Any]], None]
    verify: str | None = "grep -qx 'hello world' hello.txt"
    task: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


def _shell_calls(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in row["tool_calls"] if c["name"] in ("bash", "shell")]


def _tool_success(row: dict[str, Any]) -> None:
    assert (row["status"], row["failure_kind"], row["reward"]) == ("completed", "none", 1.0), row
    assert row["final_text"] == "Created hello.txt."
    calls = _shell_calls(row)
    assert len(calls) == 2, row["tool_calls"]
    assert [(c["status"], c["exit_code"]) for c in calls] == [("completed", 0), ("completed", 0)]
    assert "hello world" in (calls[1]["output"] or "")
    assert row["input_tokens"] > 0 and row["output_tokens"] > 0
    assert row["messages"][0]["role"] == "user" and row["messages"][-1]["text"] == "Created hello.txt."
    assert "transcript_unavailable" not in row["evidence_gaps"]
    assert [a["status"] for a in row["model_calls"]] == [200, 200, 200]


def _context_overflow(row: dict[str, Any]) -> None:
    assert (row["status"], row["failure_kind"]) == ("incomplete", "model_context_limit"), row["error_message"]
    assert row["reward"] == 1.0  # the partial work is graded
    assert len(row["model_calls"]) <= 12  # the gateway's overflow cap ended any compaction loop


def _model_stall_at_deadline(row: dict[str, Any]) -> None:
    # The deadline fell while the model sat on a request: the time was not the agent's, so no grade.
    assert (row["status"], row["failure_kind"]) == ("failed", "model_timeout"), row["error_message"]
    assert row["timed_out"] is True and row["reward"] is None and not row.get("verified")


_HELLO = "printf 'hello world\\n' > hello.txt"
SCENARIOS: dict[str, Scenario] = {
    "tool_success": Scenario(
        [
            {"type": "shell", "command": _HELLO},
            {"type": "shell", "command": "cat hello.txt"},
            {"type": "text", "text": "Created hello.txt."},
        ],
        _tool_success,
    ),
    "context_overflow": Scenario(
        [{"type": "shell", "command": "echo partial > part.txt"}, {"type": "error", "status": 400}],
        _context_overflow,
        "grep -qx partial part.txt",
    ),
    "model_stall_at_deadline": Scenario(
        [{"type": "hang", "max_s": 600}],
        _model_stall_at_deadline,
        "test -f hello.txt",
        # The harness's first request must have been in flight for a quarter of the deadline when it
        # falls (executor/session.py DEADLINE_STALL_SHARE): OpenCode sends it 3.5 s after its start on
        # this 2-core machine at load 4, 7 s at load 8, and missed 6 s's 4.5 there.
        task={"deadline_s": 12},
        config={"limits": {"grace_s": 2}},
    ),
}


async def run_scenario(tmp_path: Path, harness: Any, name: str) -> dict[str, Any]:
    """Run one scenario through ``run_session``; check the row and that no process outlived it."""
    scenario = SCENARIOS[name]
    fields: dict[str, Any] = {
        "id": f"{harness.name}-{name}".replace("_", "-"),
        "prompt": "Create hello.txt containing hello world",
        "model_script": scenario.script,
        **scenario.task,
    }
    if scenario.verify:
        fields["verify"] = scenario.verify
    config = {**FAST_GATEWAY, **scenario.config}
    async with session_context(tmp_path, config, harness=harness) as ctx:
        row = await run_session(SessionRequest("t", Task.model_validate(fields), 0, 1), ctx)
    scenario.check(row)
    assert row["harness"] == harness.name and row["cleanup_ok"] is True
    assert not processes_under(str(tmp_path / "sandboxes"))
    return row


async def run_direct(
    harness: Any, sandbox: LocalSandbox, model: ScriptedModel, install_dir: Path, prompt: str, steps: list
) -> tuple[ExecResult, HarnessReport]:
    """One harness run against the scripted model without the gateway (its requests are logged by key)."""
    model.set_script("direct", parse_steps(steps))
    base_url = model.base_url.removesuffix("/v1") + "/s/direct/v1"
    ctx = LaunchContext(
        base_url=base_url, api_key="sk-session-token", model=MODEL, prompt=prompt, install_dir=install_dir
    )
    launch = await harness.prepare(sandbox, ctx)
    result = await sandbox.exec(launch.argv, env=launch.env, stdin=launch.stdin, timeout=120, name="harness")
    return result, await harness.parse(sandbox, result)


def user_texts(body: dict[str, Any]) -> list[str]:
    """The user messages' texts of a Chat Completions request body."""
    texts = []
    for message in body.get("messages", []):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.append("".join(p.get("text", "") for p in content if isinstance(p, dict)))
    return texts


# Prompts that must reach a harness intact: a leading "-" and shell syntax, "-" alone, "@file" syntax, and
# one too long for a single argv string.
PROMPT_CASES = {
    "special-characters": (
        "-h --version; echo $HOME `id` \"quoted\" 'single' \\ back\nsecond line\ttab ünïcödé -x --help"
    ),
    "dash": "-",
    "at-sign": "@not-a-file please",
    "long": "long prompt " * 12_000,  # over 128 KiB: more than one argv string may hold
}
