"""The `command` harness: a shell command as the agent, through the real session path."""

from __future__ import annotations

import json

import pytest

from executor.session import SessionRequest, run_session
from executor.tasks import Task
from harnesses.command import CommandHarness
from harnesses.registry import make_harness
from tests.conftest import processes_under, session_context

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


# A hostile agent: raw requests to its own gateway session, asking for what the run did not set.
HOSTILE = """python3 - <<'PY'
import json, os, urllib.error, urllib.request
def call(body, headers=None):
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions?api-version=x",
        data=json.dumps(body).encode(), headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        "Content-Type": "application/json", **(headers or {})})
    try:
        return urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as exc:
        return exc.code
messages = [{"role": "user", "content": "hi"}]
first = call({"model": "o3-pro-2025", "messages": messages, "n": 128, "max_tokens": 1000000,
              "service_tier": "priority", "user": "me", "logit_bias": {"1": 100}},
             {"OpenAI-Organization": "org-other", "X-Route": "fast"})
flood = [call({"model": "gpt-5", "messages": messages}) for _ in range(40)]
open("statuses.txt", "w").write(json.dumps([first] + flood))
PY"""


async def test_a_hostile_agent_gets_the_runs_model_and_bounded_requests(tmp_path):
    task = Task.model_validate(
        {
            "id": "cmd",
            "prompt": "p",
            "model_script": [{"type": "text", "text": "hi"}],
            "verify": "test -f statuses.txt",
        }
    )
    config = {"model": {"max_output_tokens": 256}, "gateway": {"max_requests_per_session": 5}}
    async with session_context(tmp_path, config) as ctx:
        ctx.harness = CommandHarness(command=HOSTILE)
        row = await run_session(SessionRequest("t", task, 0, 1), ctx)
        upstream = ctx.scripted.requests(row["rollout_id"])
    assert (row["status"], row["failure_kind"], row["reward"]) == ("incomplete", "agent_request_limit", 1.0)
    assert len(upstream) == 5  # the other 36 were answered at the gateway
    first = upstream[0].body
    assert first["model"] == "scripted-model" and first["max_tokens"] == 256
    assert not {"n", "service_tier", "user", "logit_bias"} & set(first)
    assert all(entry.body["model"] == "scripted-model" for entry in upstream)
    pinned = json.loads(row["error_detail"])["gateway"]["pinned_fields"]  # the row says what was changed
    assert pinned["model"] == 5 and {"n", "service_tier", "max_tokens"} <= set(pinned)


# An agent that asks once, is refused (the endpoint answers 503 to every attempt, so the gateway closes
# the session), then either ends at once or, like a harness sitting out its own reconnect backoff, waits.
_ASK_THEN = """python3 - <<'PY'
import json, os, urllib.error, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": os.environ["ROLLOUT_MODEL"], "messages": [{"role": "user", "content": "hi"}]}
    ).encode(), headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
try:
    urllib.request.urlopen(req, timeout=30)
except urllib.error.HTTPError as exc:
    print("refused", exc.code, flush=True)
PY
"""


@pytest.mark.parametrize("then", ["exit 1", "exec sleep 600"])
async def test_a_harness_whose_session_the_gateway_closed_is_stopped_and_classified_as_one_that_quit(
    tmp_path, then
):
    task = Task.model_validate(
        {
            "id": "cmd",
            "prompt": "p",
            "model_script": [{"type": "error", "status": 503}],
            "verify": "true",
            "deadline_s": 300,  # far past the pytest timeout: only the stop can end the waiting agent
        }
    )
    config = {"gateway": {"max_attempts_per_request": 2, "backoff_base_s": 0.1, "backoff_cap_s": 0.2}}
    async with session_context(tmp_path, config) as ctx:
        ctx.harness = CommandHarness(command=_ASK_THEN + then)
        row = await run_session(SessionRequest("t", task, 0, 1), ctx)
    # The gateway's cause classifies the row whether the harness quit or was stopped.
    assert (row["status"], row["failure_kind"]) == ("failed", "provider_unavailable"), row["error_message"]
    assert row["error_message"].startswith("gateway gave up on request 0"), row["error_message"]
    assert row["reward"] is None and row["timed_out"] is False
    assert "refused 400" in row["stdout_tail"]  # the closing answer reached the agent before any stop
    signal = json.loads(row["error_detail"])["signal"]
    # The agent that waited was stopped (a signal of ours, not its deadline); the other exited itself.
    assert (row["exit_code"], signal) == ((1, None) if then == "exit 1" else (None, 15))
    assert not processes_under(str(tmp_path / "sandboxes"))
