"""The `command` harness: a shell command as the agent, through the real session path."""

from __future__ import annotations

import pytest

from executor.session import SessionRequest, run_session
from executor.tasks import Task
from harnesses.command import CommandHarness
from harnesses.registry import make_harness
from tests.conftest import session_context

# A tiny agent: one Chat Completions call through the gateway with the session's own URL and token.
AGENT = """python3 - <<'PY'
import json, os, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": os.environ["ROLLOUT_MODEL"], "messages": [
        {"role": "user", "content": os.environ["ROLLOUT_PROMPT"]}]}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(req, timeout=30))["choices"][0]["message"]["content"]
open("answer.txt", "w").write(answer)
print(answer)
PY"""


async def test_command_agent_calls_the_model_through_the_gateway(tmp_path):
    task = Task.model_validate(
        {
            "id": "cmd",
            "prompt": "say hi",
            "model_script": [{"type": "text", "text": "hi there"}],
            "verify": "grep -q 'hi there' answer.txt",
        }
    )
    async with session_context(tmp_path) as ctx:
        ctx.harness = CommandHarness(command=AGENT)
        row = await run_session(SessionRequest("t", task, 0, 1), ctx)
    outcome = (row["status"], row["failure_kind"], row["reward"])
    assert outcome == ("completed", "none", 1.0), row["error_message"]
    assert row["final_text"] == "hi there"
    assert [a["status"] for a in row["model_calls"]] == [200]
    assert row["input_tokens"] is not None  # from the gateway's record


async def test_command_that_fails_is_a_crash(tmp_path):
    task = Task.model_validate({"id": "cmd", "prompt": "p", "verify": "true"})
    async with session_context(tmp_path) as ctx:
        ctx.harness = CommandHarness(command="echo oops >&2; exit 3")
        row = await run_session(SessionRequest("t", task, 0, 1), ctx)
    assert (row["status"], row["failure_kind"], row["exit_code"]) == ("failed", "agent_crash", 3)
    assert "oops" in row["error_message"]
    assert row.get("reward") is None  # an infrastructure-side crash is not graded


def test_command_option_only_for_the_command_harness():
    assert make_harness("command", None, "true").command == "true"
    with pytest.raises(ValueError, match="applies to the 'command' harness"):
        make_harness("codex", None, "true")
