"""harnesses/hermes.py without the binary: the parser on captured evidence, the recognizer, the launch.

Fixtures under tests/fixtures/hermes/<scenario>/ were captured from Hermes 0.19.0 through run_session
(gateway, scripted model): stdout.txt and stderr.txt of ``hermes -z``, usage.json (its ``--usage-file``),
result.json (the exit code), and state.sql, the ``sessions`` and ``messages`` tables of its state.db
dumped as SQL with the system prompt trimmed and sandbox paths replaced by /sandbox.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import stat
from pathlib import Path

import pytest
import yaml

from harnesses.base import HarnessReport, LaunchContext
from harnesses.evidence import MAX_TOOL_OUTPUT_CHARS
from harnesses.hermes import (
    API_MAX_RETRIES,
    NO_ANSWER_MESSAGE,
    TOOLSETS,
    HermesHarness,
    recognize_failure,
    render_config,
)
from policy import FailureKind
from sandboxes.base import ExecResult
from tests.test_codex_parse import FakeSandbox

FIXTURES = Path(__file__).parent / "fixtures" / "hermes"
STDOUT = "/sandbox/logs/harness.stdout"
USAGE = "/sandbox/home/hermes-usage.json"
DB = "/sandbox/home/.hermes/state.db"
PROMPT = "Create hello.txt, then say done."


def db_bytes(tmp_path: Path, sql: str) -> bytes:
    path = tmp_path / "built.db"
    path.unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.executescript(sql)
    return path.read_bytes()


def evidence(
    tmp_path: Path,
    scenario: str,
    *,
    usage: bytes | None = None,
    db: bytes | None = None,
    stdout: bytes | None = None,
    stderr: str | None = None,
) -> tuple[FakeSandbox, ExecResult]:
    folder = FIXTURES / scenario
    out = stdout if stdout is not None else (folder / "stdout.txt").read_bytes()
    files = {
        STDOUT: out,
        USAGE: usage if usage is not None else (folder / "usage.json").read_bytes(),
        DB: db if db is not None else db_bytes(tmp_path, (folder / "state.sql").read_text()),
    }
    result = ExecResult(
        exit_code=json.loads((folder / "result.json").read_text())["exit_code"],
        duration_s=1.0,
        stdout_path=STDOUT,
        stdout_bytes=len(out),
        stderr_tail=stderr if stderr is not None else (folder / "stderr.txt").read_text(),
    )
    return FakeSandbox(files), result


async def parse(sandbox: FakeSandbox, result: ExecResult) -> HarnessReport:
    return await HermesHarness().parse(sandbox, result)


# --- successful runs -------------------------------------------------------------------------------------


async def test_tool_calls_and_answer(tmp_path: Path) -> None:
    report = await parse(*evidence(tmp_path, "tool_ok"))
    first, second = report.tool_calls
    assert (first.name, first.status, first.exit_code, first.output) == ("terminal", "completed", 0, "hi")
    assert json.loads(first.arguments or "") == {"command": "echo hi > hello.txt && cat hello.txt"}
    assert (second.status, second.exit_code, second.output) == ("completed", 0, "hello.txt")
    assert first.call_id and first.call_id != second.call_id
    assert report.final_text == "done"
    assert [(m.role, m.text) for m in report.messages] == [("user", PROMPT), ("assistant", "done")]
    # The usage file's counts; its zeros for cache and reasoning are real counts beside real ones.
    assert report.usage.model_dump() == {
        "input_tokens": 13449,
        "output_tokens": 20,
        "cached_input_tokens": 0,
        "reasoning_tokens": 0,
    }
    assert report.claimed_failure is None and report.claimed_message is None
    assert report.evidence_gaps == []
    assert report.native_transcript_path == DB


async def test_failed_command_keeps_exit_code(tmp_path: Path) -> None:
    report = await parse(*evidence(tmp_path, "tool_exit7"))
    [call] = report.tool_calls
    assert (call.status, call.exit_code, call.output) == ("failed", 7, "out\nerr")
    assert report.final_text == "done" and report.claimed_failure is None


async def test_usage_zeros_without_reported_usage_are_unknown(tmp_path: Path) -> None:
    report = await parse(*evidence(tmp_path, "no_usage"))
    assert report.final_text == "done"
    assert report.usage.model_dump() == dict.fromkeys(
        ("input_tokens", "output_tokens", "cached_input_tokens", "reasoning_tokens")
    )
    assert report.evidence_gaps == ["usage_unavailable"]


# --- failures Hermes reports with exit code 0 ------------------------------------------------------------


async def test_error_sentence_is_a_claim_not_an_answer(tmp_path: Path) -> None:
    sandbox, result = evidence(tmp_path, "rate_limit")
    assert result.exit_code == 0
    report = await parse(sandbox, result)
    assert report.final_text is None
    assert report.claimed_message == (
        "HTTP 400: gateway: session closed by gateway policy; no further model calls allowed"
    )
    assert report.claimed_failure is FailureKind.MODEL_REQUEST_ERROR  # the gateway's record outranks it
    assert [m.role for m in report.messages] == ["user"]
    assert "usage_unavailable" in report.evidence_gaps


async def test_context_overflow_keeps_partial_work_and_usage(tmp_path: Path) -> None:
    report = await parse(*evidence(tmp_path, "context_overflow"))
    assert report.claimed_failure is FailureKind.MODEL_CONTEXT_LIMIT
    assert report.claimed_message == "Context length exceeded (154 tokens). Cannot compress further."
    assert report.final_text is None
    [call] = report.tool_calls
    assert (call.status, call.exit_code) == ("completed", 0)
    # The usage file has nulls after a failure; the session row still counts the answered call.
    assert (report.usage.input_tokens, report.usage.output_tokens) == (4401, 10)


async def test_dropped_stream_exit_2_without_text(tmp_path: Path) -> None:
    report = await parse(*evidence(tmp_path, "stream_drop"))
    assert report.claimed_message == NO_ANSWER_MESSAGE
    assert report.claimed_failure is FailureKind.TRANSPORT_ERROR
    assert report.final_text is None
    roles = [m.role for m in report.messages]
    assert roles == ["user", "system", "system", "system"]  # Hermes's requests to continue the cut answer


async def test_agent_exception_exit_1(tmp_path: Path) -> None:
    sandbox, result = evidence(tmp_path, "rate_limit", stdout=b"")
    result = result.model_copy(
        update={"exit_code": 1, "stderr_tail": "hermes -z: agent failed: Connection error.\n"}
    )
    report = await parse(sandbox, result)
    assert report.claimed_message == "agent failed: Connection error."
    assert report.claimed_failure is FailureKind.TRANSPORT_ERROR


# --- hostile or missing evidence -------------------------------------------------------------------------


async def test_missing_files_are_gaps(tmp_path: Path) -> None:
    sandbox, result = evidence(tmp_path, "tool_ok")
    del sandbox.files[DB], sandbox.files[USAGE]
    report = await parse(sandbox, result)
    assert report.final_text == "done"  # stdout alone, and it is no error sentence
    assert report.tool_calls == [] and report.native_transcript_path is None
    assert report.evidence_gaps == ["usage_file_unavailable", "transcript_unavailable", "usage_unavailable"]


@pytest.mark.parametrize(
    "usage", [b"not json {", b"[1, 2]", b"\xff\xfe" * 100, b'{"failed": "yes", "input_tokens": -5}']
)
async def test_unreadable_usage_file(tmp_path: Path, usage: bytes) -> None:
    report = await parse(*evidence(tmp_path, "tool_ok", usage=usage))
    assert report.final_text == "done"
    assert report.usage.input_tokens == 13449  # from the sessions row instead
    if usage.startswith(b"{"):
        assert report.evidence_gaps == []
    else:
        assert report.evidence_gaps == ["usage_file_unparseable"]


async def test_error_sentence_without_usage_file_is_still_a_claim(tmp_path: Path) -> None:
    sandbox, result = evidence(tmp_path, "rate_limit", usage=b"garbage")
    report = await parse(sandbox, result)
    assert (
        report.final_text is None and report.claimed_message and report.claimed_message.startswith("HTTP 400")
    )


@pytest.mark.parametrize(
    "db",
    [
        b"",
        b"SQLite format 3\x00" + b"\x00" * 84 + b"garbage" * 100,
        b"\x00\x01\x02 not a database at all" * 200,
    ],
    ids=["empty", "corrupt-header", "random"],
)
async def test_corrupt_database_is_a_gap(tmp_path: Path, db: bytes) -> None:
    report = await parse(*evidence(tmp_path, "tool_ok", db=db))
    assert report.final_text == "done" and report.tool_calls == []
    assert report.usage.input_tokens == 13449  # the usage file still counts
    gap = "transcript_unavailable" if not db else "transcript_unparseable"
    assert gap in report.evidence_gaps


async def test_foreign_schema_is_a_gap(tmp_path: Path) -> None:
    db = db_bytes(tmp_path, "CREATE TABLE sessions (id TEXT); CREATE TABLE messages (x INTEGER);")
    report = await parse(*evidence(tmp_path, "tool_ok", db=db))
    assert "transcript_unparseable" in report.evidence_gaps and report.final_text == "done"


async def test_endless_view_is_interrupted(tmp_path: Path) -> None:
    """A planted database cannot keep the parser busy: a never-ending query is cut off."""
    sql = (FIXTURES / "tool_ok" / "state.sql").read_text().replace("CREATE TABLE messages", "CREATE TABLE m0")
    sql = sql.replace('INSERT INTO "messages"', 'INSERT INTO "m0"')
    sql += (
        "CREATE VIEW messages AS WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) "
        "SELECT i AS id, (SELECT id FROM sessions) AS session_id, 'user' AS role, 'x' AS content, "
        "NULL AS tool_call_id, NULL AS tool_calls FROM r;"
    )
    report = await parse(*evidence(tmp_path, "tool_ok", db=db_bytes(tmp_path, sql)))
    assert "transcript_unparseable" in report.evidence_gaps


async def test_hostile_rows_are_bounded_and_counted(tmp_path: Path) -> None:
    sql = (FIXTURES / "tool_ok" / "state.sql").read_text()
    session = sql.split('INSERT INTO "sessions" VALUES(\'', 1)[1].split("'", 1)[0]
    huge = "y" * 200_000
    sql += (
        f"INSERT INTO messages (session_id, role, content, tool_calls, timestamp) VALUES "
        f"('{session}', 'assistant', '', '{{not json', 1), "
        f'(\'{session}\', \'assistant\', \'\', \'[{{"id": "c9", "function": {{"name": "terminal", '
        f'"arguments": "{{}}"}}}}, 7, {{"function": 3}}]\', 1), '
        f"('{session}', 'tool', '{huge}', NULL, 1), "
        f"('{session}', 'moderator', 'who?', NULL, 1);"
        f"INSERT INTO messages (session_id, role, content, tool_call_id, timestamp) VALUES "
        f"('{session}', 'tool', '{huge}', 'c9', 1);"
    )
    report = await parse(*evidence(tmp_path, "tool_ok", db=db_bytes(tmp_path, sql)))
    extra = report.tool_calls[-1]
    assert extra.call_id == "c9" and extra.status == "completed" and extra.exit_code is None
    assert extra.output is not None and len(extra.output) <= MAX_TOOL_OUTPUT_CHARS
    # {not json, 7, {"function": 3}, a result for no call, the unknown role
    assert "transcript_unparseable_rows:5" in report.evidence_gaps


async def test_rows_still_in_the_write_ahead_log_are_read(tmp_path: Path) -> None:
    """A killed Hermes leaves its last rows in state.db-wal; the copy takes both files."""
    path = tmp_path / "live.db"
    sql = (FIXTURES / "tool_exit7" / "state.sql").read_text()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.executescript(sql)
        sandbox, result = evidence(tmp_path, "tool_exit7", db=path.read_bytes())
        wal = Path(str(path) + "-wal").read_bytes()
    assert wal
    sandbox.files[DB + "-wal"] = wal
    report = await parse(sandbox, result)
    [call] = report.tool_calls
    assert call.exit_code == 7 and report.evidence_gaps == []


# --- the recognizer --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("API call failed after 1 retries: HTTP 429: Rate limit reached", FailureKind.RATE_LIMIT_EXCEEDED),
        (
            "API call failed after 3 retries: HTTP 500: The server had an error",
            FailureKind.PROVIDER_UNAVAILABLE,
        ),
        ("HTTP 401: Incorrect API key provided", FailureKind.PROVIDER_AUTH_ERROR),
        ("HTTP 400: This model's maximum context length is 8192 tokens", FailureKind.MODEL_CONTEXT_LIMIT),
        ("Context length exceeded (154 tokens). Cannot compress further.", FailureKind.MODEL_CONTEXT_LIMIT),
        ("Request payload too large (413). Cannot compress further.", FailureKind.MODEL_CONTEXT_LIMIT),
        ("HTTP 422: unprocessable", FailureKind.MODEL_REQUEST_ERROR),
        ("Response truncated due to output length limit", FailureKind.MODEL_OUTPUT_LIMIT),
        ("Response remained truncated after 4 continuation attempts", FailureKind.TRANSPORT_ERROR),
        ("agent failed: Connection error.", FailureKind.TRANSPORT_ERROR),
        (NO_ANSWER_MESSAGE, FailureKind.TRANSPORT_ERROR),
        ("I created hello.txt as asked.", None),
        ("", None),
        (None, None),
    ],
)
def test_recognizer(message: str | None, kind: FailureKind | None) -> None:
    assert recognize_failure(message) is kind


# --- the launch ------------------------------------------------------------------------------------------


def test_config_points_at_the_gateway_and_turns_things_off() -> None:
    config = yaml.safe_load(render_config('m "odd"\n', "http://127.0.0.1:1/s/tok/v1", "tok: #x"))
    model = config["model"]
    assert (model["default"], model["provider"]) == ('m "odd"\n', "custom")
    assert (model["base_url"], model["api_key"]) == ("http://127.0.0.1:1/s/tok/v1", "tok: #x")
    assert model["supports_vision"] is False and model["context_length"] == model["ollama_num_ctx"] > 0
    assert config["agent"]["api_max_retries"] == API_MAX_RETRIES == 1
    assert config["security"]["allow_lazy_installs"] is False


@pytest.mark.parametrize(
    "prompt", ["-h --version; echo $HOME `id` \"q\" 'single' \\\nline\tünï", "-", "x" * 200_000]
)
async def test_prepare_passes_the_prompt_through_a_file(prompt: str) -> None:
    sandbox = FakeSandbox()
    ctx = LaunchContext(
        base_url="http://gw/v1", api_key="tok", model="m", prompt=prompt, install_dir=Path("/cache/venv/h")
    )
    launch = await HermesHarness().prepare(sandbox, ctx)
    assert launch.argv[:2] == ["/cache/venv/h/bin/python", "-c"]
    prompt_file = launch.argv[3]
    assert sandbox.files[prompt_file].decode("utf-8") == prompt
    assert launch.argv[4:] == ["--usage-file", USAGE, "--toolsets", TOOLSETS]
    assert prompt not in launch.argv  # never in argv: length limits, and a leading "-"
    assert launch.env["HERMES_HOME"] == "/sandbox/home/.hermes"
    assert launch.env["HERMES_DISABLE_LAZY_INSTALLS"] == "1" and launch.env["HERMES_NONINTERACTIVE"] == "1"
    config_path = "/sandbox/home/.hermes/config.yaml"
    assert stat.S_IMODE(sandbox.modes[config_path]) == 0o600 and sandbox.modes[prompt_file] == 0o600
    assert launch.stdin is None


def test_other_version_warns_but_runs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        harness = HermesHarness("0.18.2")
    assert harness.version == "0.18.2"
    assert "0.18.2" in caplog.text and "tested" in caplog.text


async def test_killed_run_has_no_answer_from_the_database(tmp_path: Path) -> None:
    sandbox, result = evidence(tmp_path, "tool_ok", stdout=b"")
    del sandbox.files[USAGE]  # killed before it was written
    result = result.model_copy(update={"exit_code": None, "signal": 9, "timed_out": True})
    report = await parse(sandbox, result)
    assert report.final_text is None and report.claimed_message is None
    assert len(report.tool_calls) == 2  # the work done before the kill is still reported
