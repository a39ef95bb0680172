"""harnesses/opencode.py without the binary: the parser on captured evidence, the recognizer, the launch.

Fixtures under tests/fixtures/opencode/<scenario>/ (see its README): events.jsonl is the
``run --format json`` stdout, tool_ok/rollout.db the native SQLite transcript.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from harnesses.base import HarnessReport, LaunchContext
from harnesses.evidence import MAX_MESSAGE_CHARS, MAX_TOOL_OUTPUT_CHARS, MAX_UNKNOWN_TYPES
from harnesses.opencode import (
    QUIET_ENV,
    OpenCodeHarness,
    recognize_failure,
    render_config,
)
from policy import FailureKind
from sandboxes.base import ExecResult
from tests.test_codex_parse import FakeSandbox

FIXTURES = Path(__file__).parent / "fixtures" / "opencode"
STDOUT = "/sandbox/logs/harness.stdout"
DB = "/sandbox/home/.local/share/opencode/rollout.db"
MERGED_DB = "/sandbox/home/.local/share/opencode/rollout-transcript.db"
PROMPT = "Create hello.txt, then say done."


def evidence(
    scenario: str, *, events: bytes | None = None, db: bytes | None = None, with_db: bool = True
) -> tuple[FakeSandbox, ExecResult]:
    folder = FIXTURES / scenario
    stdout = events if events is not None else (folder / "events.jsonl").read_bytes()
    files = {STDOUT: stdout}
    if db is not None:
        files[DB] = db
    elif with_db and (folder / "rollout.db").exists():
        files[DB] = (folder / "rollout.db").read_bytes()
    result = ExecResult(exit_code=0, duration_s=1.0, stdout_path=STDOUT, stdout_bytes=len(stdout))
    return FakeSandbox(files, listing=False), result


async def parse(sandbox: FakeSandbox, result: ExecResult) -> HarnessReport:
    return await OpenCodeHarness().parse(sandbox, result)


# --- successful runs -------------------------------------------------------------------------------------


async def test_tool_calls_usage_and_prompt_from_stream_and_database() -> None:
    report = await parse(*evidence("tool_ok"))
    assert [(c.name, c.status, c.exit_code) for c in report.tool_calls] == [
        ("bash", "completed", 0),
        ("bash", "completed", 0),
    ]
    assert report.tool_calls[0].arguments == '{"command": "echo hi > hello.txt"}'
    assert report.tool_calls[1].output == "hi\n"
    assert [(m.role, m.text) for m in report.messages] == [("user", PROMPT), ("assistant", "done")]
    assert report.final_text == "done"
    # Three steps: 7362 + 7422 + 7479 in, 9 + 8 + 2 out.
    assert (report.usage.input_tokens, report.usage.output_tokens) == (22263, 19)
    assert report.usage.cached_input_tokens == 0 and report.usage.reasoning_tokens == 0
    assert report.claimed_failure is None and report.claimed_message is None
    assert report.evidence_gaps == []
    assert report.native_transcript_path == DB


async def test_stream_alone_still_gives_tools_and_usage() -> None:
    report = await parse(*evidence("tool_ok", with_db=False))
    assert "transcript_unavailable" in report.evidence_gaps
    assert [c.exit_code for c in report.tool_calls] == [0, 0]
    assert report.usage.input_tokens == 22263 and report.final_text == "done"
    assert report.messages[0].role == "assistant"  # only the database holds the prompt


async def test_write_ahead_log_is_read_and_merged_into_the_kept_transcript(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    db.write_bytes((FIXTURES / "tool_ok" / "rollout.db").read_bytes())
    with sqlite3.connect(db) as conn:  # move one more user part into a write-ahead log
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute(
            "INSERT INTO part (id, message_id, session_id, time_created, time_updated, data) "
            "SELECT 'prt_zzz', message_id, session_id, time_created, time_updated, "
            '\'{"type":"text","text":"from the log"}\' FROM part WHERE data LIKE \'%Create hello%\''
        )
        conn.commit()
        sandbox, result = evidence("tool_ok", db=db.read_bytes())
        sandbox.files[DB + "-wal"] = (tmp_path / "t.db-wal").read_bytes()
    assert sandbox.files[DB + "-wal"]
    report = await parse(sandbox, result)
    assert [m.text for m in report.messages if m.role == "user"] == [PROMPT, "from the log"]
    assert report.native_transcript_path == MERGED_DB
    merged = tmp_path / "merged.db"
    merged.write_bytes(sandbox.files[MERGED_DB])
    with sqlite3.connect(merged) as conn:
        assert conn.execute("SELECT count(*) FROM part WHERE id = 'prt_zzz'").fetchone() == (1,)


async def test_failed_command_is_failed_with_exit_7() -> None:
    report = await parse(*evidence("tool_exit7"))
    [call] = report.tool_calls
    assert (call.status, call.exit_code) == ("failed", 7)  # OpenCode itself says "completed"
    assert call.output == "out\nerr\n"
    assert report.final_text == "done" and report.claimed_failure is None


async def test_missing_usage_is_none_not_zero() -> None:
    report = await parse(*evidence("no_usage"))
    assert report.final_text == "done"
    assert report.usage.model_dump() == dict.fromkeys(
        ("input_tokens", "output_tokens", "cached_input_tokens", "reasoning_tokens")
    )
    assert "usage_unavailable" in report.evidence_gaps


# --- failures ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "kind", "words"),
    [
        ("auth_401", FailureKind.PROVIDER_AUTH_ERROR, "refused by the test script"),
        ("rate_limit", FailureKind.RATE_LIMIT_EXCEEDED, "Rate limit reached"),
        ("gateway_closed", FailureKind.MODEL_REQUEST_ERROR, "session closed by gateway policy"),
        ("stream_drop", FailureKind.TRANSPORT_ERROR, "Connection reset by server"),
        ("context_overflow", FailureKind.MODEL_CONTEXT_LIMIT, "maximum context length"),
    ],
)
async def test_error_events_are_recognized(scenario: str, kind: FailureKind, words: str) -> None:
    report = await parse(*evidence(scenario))
    assert report.claimed_failure is kind
    assert words in (report.claimed_message or "")


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ({"name": "ContextOverflowError", "data": {"message": "too long"}}, FailureKind.MODEL_CONTEXT_LIMIT),
        ({"name": "ProviderAuthError", "data": {"message": "no key"}}, FailureKind.PROVIDER_AUTH_ERROR),
        ({"name": "APIError", "data": {"message": "x", "statusCode": 403}}, FailureKind.PROVIDER_AUTH_ERROR),
        ({"name": "APIError", "data": {"message": "x", "statusCode": 503}}, FailureKind.PROVIDER_UNAVAILABLE),
        ({"name": "APIError", "data": {"message": "x", "statusCode": 408}}, FailureKind.PROVIDER_UNAVAILABLE),
        # The status outranks the words: a 400 whose message mentions 429 is still a request error.
        (
            {"name": "APIError", "data": {"message": "429 Too Many Requests", "statusCode": 400}},
            FailureKind.MODEL_REQUEST_ERROR,
        ),
        (
            {"name": "APIError", "data": {"message": "x", "metadata": {"code": "ECONNREFUSED"}}},
            FailureKind.TRANSPORT_ERROR,
        ),
        ({"name": "UnknownError", "data": {"message": "fetch failed"}}, FailureKind.TRANSPORT_ERROR),
        ({"name": "UnknownError", "data": {"message": "something new"}}, None),
    ],
)
def test_recognizer_table(error: dict[str, Any], kind: FailureKind | None) -> None:
    assert recognize_failure(error)[0] is kind


def test_recognizer_without_an_error() -> None:
    assert recognize_failure(None) == (None, None)
    assert recognize_failure("text") == (None, None)
    assert recognize_failure({"name": 7, "data": "x"}) == (None, "7")


# --- unknown and hostile input -----------------------------------------------------------------------------


async def test_unknown_event_and_part_types_are_bounded_gaps() -> None:
    lines = [json.dumps({"type": f"new_{i}"}) for i in range(50)]
    lines.append(json.dumps({"type": "text", "part": {"type": "hologram"}}))
    sandbox, result = evidence("tool_ok", events="\n".join(lines).encode(), with_db=False)
    report = await parse(sandbox, result)
    unknown = [g for g in report.evidence_gaps if g.startswith("unknown_")]
    assert len(unknown) == MAX_UNKNOWN_TYPES and unknown[0] == "unknown_event_type:new_0"


async def test_hostile_event_stream_does_not_crash_and_stays_bounded() -> None:
    tool = {
        "type": "tool_use",
        "part": {
            "type": "tool",
            "tool": {"not": "a string"},
            "callID": "c",
            "state": {
                "status": ["weird"],
                "input": "x" * 1_000_000,
                "output": "o" * 1_000_000,
                "metadata": 7,
            },
        },
    }
    lines = [
        b"\xff\xfe not utf-8 \xc3\x28",
        b'{"type":"text","part":{"type":"text","text":"caf\xe9 \xff"}}',
        b"x" * 1_000_000,
        json.dumps({"type": "text", "part": {"type": "text", "text": "A" * 1_000_000}}).encode(),
        json.dumps(tool).encode(),
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        b'{"type":"step_finish","part":{"type":"step-finish","tokens":{"input":-5,"output":"many"}}}',
        b'{"type":"step_finish","part":{"type":"step-finish","tokens":[1,2]}}',
        b'{"type":"error","error":"not an object"}',
        b'{"type":"tool_use","part":"nope"}',
        b"null",
    ]
    sandbox, result = evidence("tool_ok", events=b"\n".join(lines), with_db=False)
    report = await parse(sandbox, result)
    assert "event_stream_unparseable_lines:5" in report.evidence_gaps
    assert report.final_text is not None and len(report.final_text) <= MAX_MESSAGE_CHARS
    [call] = report.tool_calls
    assert call.status == "unknown" and call.exit_code is None
    assert call.output is not None and len(call.output) <= MAX_TOOL_OUTPUT_CHARS
    assert report.usage.input_tokens is None
    assert len(report.model_dump_json()) < 300_000


async def test_a_database_that_is_not_one_is_a_gap() -> None:
    report = await parse(*evidence("tool_ok", db=b"\xff" * 5000 + b"not sqlite"))
    assert "transcript_unparseable" in report.evidence_gaps
    assert report.final_text == "done"  # the stream still answers


async def test_hostile_rows_in_the_database_are_counted(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    db.write_bytes((FIXTURES / "tool_ok" / "rollout.db").read_bytes())
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE part SET data = '[[[[' WHERE data LIKE '%step-start%'")
        conn.execute("UPDATE message SET data = x'ff00' WHERE data LIKE '%\"role\":\"user\"%'")
    report = await parse(*evidence("tool_ok", db=db.read_bytes()))
    assert "transcript_unparseable_rows:4" in report.evidence_gaps
    assert len(report.tool_calls) == 2


# --- launch -------------------------------------------------------------------------------------------------


def context(prompt: str = PROMPT, **overrides: Any) -> LaunchContext:
    values = {
        "base_url": "http://127.0.0.1:9/s/tok/v1",
        "api_key": "sk-session",
        "model": "scripted-model",
        "prompt": prompt,
        "install_dir": Path("/cache/npm/opencode-ai@1.18.33"),
        **overrides,
    }
    return LaunchContext(**values)


async def test_prepare_writes_config_and_sends_the_prompt_on_stdin() -> None:
    sandbox = FakeSandbox()
    launch = await OpenCodeHarness().prepare(sandbox, context('-h "q" $HOME\nnext', max_output_tokens=123))
    path = "/sandbox/home/.config/opencode/opencode.json"
    config = json.loads(sandbox.files[path])
    assert sandbox.modes[path] == 0o600
    assert config["model"] == "rollout/scripted-model" and config["autoupdate"] is False
    provider = config["provider"]["rollout"]
    assert provider["options"] == {
        "baseURL": "http://127.0.0.1:9/s/tok/v1",
        "apiKey": "{env:ROLLOUT_API_KEY}",
    }
    assert provider["models"]["scripted-model"]["limit"]["output"] == 123
    assert "sk-session" not in sandbox.files[path].decode()
    assert launch.stdin == b'-h "q" $HOME\nnext'
    assert launch.argv[0] == "/cache/npm/opencode-ai@1.18.33/node_modules/.bin/opencode"
    assert launch.argv[1:] == [
        "run",
        "--format",
        "json",
        "-m",
        "rollout/scripted-model",
        "--title",
        "rollout",
    ]
    assert launch.env["ROLLOUT_API_KEY"] == "sk-session"
    assert launch.env["OPENCODE_CONFIG"] == path and launch.env["OPENCODE_DB"] == DB
    assert QUIET_ENV.items() <= launch.env.items()


def test_config_from_hostile_values_stays_json() -> None:
    config = json.loads(render_config('m"}\n,"evil":{', 'http://h/v1"', None))
    assert set(config["provider"]["rollout"]["models"]) == {'m"}\n,"evil":{'}
    assert "evil" not in config


def test_other_version_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="harnesses.opencode"):
        OpenCodeHarness("0.0.1-parse-test")
        OpenCodeHarness("0.0.1-parse-test")
    assert len([r for r in caplog.records if "0.0.1-parse-test" in r.getMessage()]) == 1
    assert OpenCodeHarness().version == OpenCodeHarness.tested_version == "1.18.33"


def test_registry_knows_opencode() -> None:
    from harnesses.registry import make_harness

    harness = make_harness("opencode", "1.17.11")
    assert isinstance(harness, OpenCodeHarness) and harness.version == "1.17.11"
