"""harnesses/codex.py without the binary: the parser on captured evidence, the recognizer, the launch.

Fixtures under tests/fixtures/codex/<scenario>/ were captured from Codex 0.171.0 against the scripted
model (events.jsonl is the ``exec --json`` stdout, rollout-*.jsonl the native transcript), with long
instruction texts trimmed and sandbox paths replaced by /sandbox.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import posixpath
import threading
import tomllib
from pathlib import Path
from typing import Any

import pytest

from harnesses import codex
from harnesses.base import HarnessReport, LaunchContext
from harnesses.codex import (
    FAILURE_PATTERNS,
    MAX_ARGV_PROMPT_BYTES,
    REQUEST_MAX_RETRIES,
    STREAM_MAX_RETRIES,
    CodexHarness,
    recognize_failure,
    render_config,
    toml_string,
)
from harnesses.evidence import MAX_MESSAGE_CHARS, MAX_TOOL_OUTPUT_CHARS, MAX_UNKNOWN_TYPES
from policy import FailureKind
from sandboxes.base import ExecResult, SandboxError
from sandboxes.inline import INLINE_BYTES

FIXTURES = Path(__file__).parent / "fixtures" / "codex"
STDOUT = "/sandbox/logs/harness.stdout"
PROMPT = "Create hello.txt, then say done."


class FakeSandbox:
    """Files in a dict; ``find`` answered from them unless listing is off (then exec fails)."""

    id = "fake"
    workdir = "/sandbox/work"
    home = "/sandbox/home"
    shares_host_userland = True  # as a local sandbox: the harness starts with the worker's node

    def __init__(self, files: dict[str, bytes] | None = None, *, listing: bool = True) -> None:
        self.files = dict(files or {})
        self.listing = listing
        self.execs: list[list[str]] = []
        self.modes: dict[str, int] = {}

    async def exec(
        self,
        argv: list[str],
        *,
        timeout: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        name: str = "exec",
    ) -> ExecResult:
        self.execs.append(argv)
        if not self.listing or argv[0] != "find":
            raise SandboxError("exec is not available here")
        root, pattern = argv[1], argv[argv.index("-name") + 1]
        hits = [
            p
            for p in self.files
            if p.startswith(root + "/") and fnmatch.fnmatch(posixpath.basename(p), pattern)
        ]
        return ExecResult(exit_code=0, duration_s=0.0, stdout_tail="".join(h + "\n" for h in hits))

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.files[path] = data
        self.modes[path] = mode

    async def read_file(self, path: str, limit: int) -> bytes:
        if path not in self.files:
            raise FileNotFoundError(path)
        return self.files[path][:limit]

    async def stop(self) -> None:
        return None

    def descriptor(self) -> dict[str, Any]:
        return {"id": self.id}


def transcript_home_path(name: str) -> str:
    """Where Codex put a transcript with this file name: sessions/YYYY/MM/DD/ from its timestamp."""
    date = name.removeprefix("rollout-")[:10]
    return f"/sandbox/home/.codex/sessions/{date.replace('-', '/')}/{name}"


def evidence(
    scenario: str,
    *,
    events: bytes | None = None,
    with_transcript: bool = True,
    listing: bool = True,
    exit_code: int = 0,
) -> tuple[FakeSandbox, ExecResult]:
    folder = FIXTURES / scenario
    stdout = events if events is not None else (folder / "events.jsonl").read_bytes()
    files = {STDOUT: stdout}
    if with_transcript:
        for path in folder.glob("rollout-*.jsonl"):
            files[transcript_home_path(path.name)] = path.read_bytes()
    result = ExecResult(
        exit_code=exit_code, duration_s=1.0, stdout_path=STDOUT, stdout_bytes=len(stdout), stdout_tail=""
    )
    return FakeSandbox(files, listing=listing), result


async def parse(sandbox: FakeSandbox, result: ExecResult) -> HarnessReport:
    return await CodexHarness().parse(sandbox, result)


def fixture_events(scenario: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (FIXTURES / scenario / "events.jsonl").read_text().splitlines()]


async def test_a_long_stream_is_parsed_in_a_thread_and_a_short_one_on_the_loop(monkeypatch) -> None:
    """The worker's event loop serves every session's model requests: a stream of megabytes must not
    hold it up while it is parsed, and the report is the same wherever the parse ran."""
    threads: list[int] = []
    parse_events = codex._parse_events

    def spy(raw: bytes, state: Any) -> None:
        threads.append(threading.get_ident())
        parse_events(raw, state)

    monkeypatch.setattr(codex, "_parse_events", spy)
    events = (FIXTURES / "tool_ok" / "events.jsonl").read_bytes()
    short = await parse(*evidence("tool_ok"))
    long = await parse(*evidence("tool_ok", events=events + b"\n" * INLINE_BYTES))
    assert threads[0] == threading.get_ident() != threads[1]
    assert long == short and short.tool_calls


# --- successful runs -------------------------------------------------------------------------------------


async def test_tool_call_success() -> None:
    sandbox, result = evidence("tool_ok")
    report = await parse(sandbox, result)
    [call] = report.tool_calls
    assert call.name == "shell" and call.status == "completed" and call.exit_code == 0
    assert call.arguments == "/bin/bash -lc 'echo hi > hello.txt'"
    assert report.final_text == "done"
    assert [(m.role, m.text) for m in report.messages] == [("user", PROMPT), ("assistant", "done")]
    assert report.usage.input_tokens == 20348 and report.usage.output_tokens == 10
    assert report.usage.cached_input_tokens == 0 and report.usage.reasoning_tokens == 0
    assert report.claimed_failure is None and report.claimed_message is None
    assert report.reconnects == 0
    assert report.evidence_gaps == []
    assert report.native_transcript_path == transcript_home_path(
        next((FIXTURES / "tool_ok").glob("rollout-*")).name
    )
    assert sandbox.execs == []  # found from the thread id alone, no listing needed


async def test_failed_command_exit_7() -> None:
    sandbox, result = evidence("tool_exit7")
    report = await parse(sandbox, result)
    [call] = report.tool_calls
    assert call.status == "failed" and call.exit_code == 7
    assert call.output == "err\nout\n"
    assert report.final_text == "done" and report.claimed_failure is None


async def test_command_started_but_never_completed_is_unknown() -> None:
    lines = (FIXTURES / "tool_ok" / "events.jsonl").read_bytes().splitlines()
    cut = b"\n".join(line for line in lines if b'"item.completed"' not in line or b"item_0" in line)
    sandbox, result = evidence("tool_ok", events=cut, with_transcript=False)
    report = await parse(sandbox, result)
    [call] = report.tool_calls
    assert call.status == "unknown" and call.exit_code is None


# --- failures ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "kind", "reconnects"),
    [
        ("context_overflow", FailureKind.MODEL_CONTEXT_LIMIT, 0),
        ("rate_limit", FailureKind.RATE_LIMIT_EXCEEDED, 2),
        ("server_error", FailureKind.PROVIDER_UNAVAILABLE, 2),
        ("auth_401", FailureKind.PROVIDER_AUTH_ERROR, 2),
        ("forbidden_403", FailureKind.PROVIDER_AUTH_ERROR, 2),
        ("plain_400", FailureKind.MODEL_REQUEST_ERROR, 0),
        ("bad_422", FailureKind.MODEL_REQUEST_ERROR, 2),
        ("stream_drop", FailureKind.TRANSPORT_ERROR, 2),
        ("refused", FailureKind.TRANSPORT_ERROR, 2),
    ],
)
async def test_turn_failed_of_each_kind(scenario: str, kind: FailureKind, reconnects: int) -> None:
    sandbox, result = evidence(scenario, exit_code=1)
    report = await parse(sandbox, result)
    failed = [e for e in fixture_events(scenario) if e["type"] == "turn.failed"]
    assert report.claimed_failure is kind
    assert report.claimed_message == failed[-1]["error"]["message"]
    assert report.reconnects == reconnects
    assert report.usage.input_tokens is None and report.usage.output_tokens is None
    assert "usage_unavailable" in report.evidence_gaps
    assert report.final_text is None and report.tool_calls == []


async def test_context_overflow_zero_counts_are_not_usage() -> None:
    # Codex's token_count for an overflow is all zeros except total_tokens = the context window.
    sandbox, result = evidence("context_overflow", exit_code=1)
    report = await parse(sandbox, result)
    assert report.usage.model_dump() == dict.fromkeys(report.usage.model_dump())
    assert report.native_transcript_path is not None
    assert report.messages[0].text == PROMPT


async def test_unrecognized_turn_failed_keeps_message_without_kind() -> None:
    events = b"\n".join(
        [
            b'{"type":"thread.started","thread_id":"01a228b6-0000-7000-8000-000000000000"}',
            b'{"type":"turn.started"}',
            b'{"type":"turn.failed","error":{"message":"something nobody has seen before"}}',
        ]
    )
    sandbox, result = evidence("tool_ok", events=events, with_transcript=False, exit_code=1)
    report = await parse(sandbox, result)
    assert report.claimed_failure is None
    assert report.claimed_message == "something nobody has seen before"


async def test_error_then_recovery_claims_nothing() -> None:
    events = b"\n".join(
        [
            b'{"type":"turn.started"}',
            b'{"type":"error","message":"Reconnecting... 1/2 (stream disconnected before completion: x)"}',
            b'{"type":"error","message":"some transient complaint"}',
            b'{"type":"item.completed","item":{"id":"i","type":"agent_message","text":"done"}}',
            b'{"type":"turn.completed","usage":{"input_tokens":5,"output_tokens":1}}',
        ]
    )
    sandbox, result = evidence("tool_ok", events=events, with_transcript=False)
    report = await parse(sandbox, result)
    assert report.claimed_failure is None and report.claimed_message is None
    assert report.reconnects == 1 and report.final_text == "done"


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        (
            "Codex ran out of room in the model's context window. Start a new thread.",
            FailureKind.MODEL_CONTEXT_LIMIT,
        ),
        ("exceeded retry limit, last status: 429 Too Many Requests", FailureKind.RATE_LIMIT_EXCEEDED),
        ("exceeded retry limit, last status: 503 Service Unavailable", FailureKind.PROVIDER_UNAVAILABLE),
        (
            "We’re currently experiencing high demand, which may cause temporary errors.",
            FailureKind.PROVIDER_UNAVAILABLE,
        ),
        (
            "unexpected status 502 Bad Gateway: nope, url: http://127.0.0.1:1/v1/responses",
            FailureKind.PROVIDER_UNAVAILABLE,
        ),
        ("unexpected status 408 Request Timeout: nope", FailureKind.PROVIDER_UNAVAILABLE),
        ("unexpected status 401 Unauthorized: nope", FailureKind.PROVIDER_AUTH_ERROR),
        ("unexpected status 403 Forbidden: nope", FailureKind.PROVIDER_AUTH_ERROR),
        ("unexpected status 404 Not Found: nope", FailureKind.MODEL_REQUEST_ERROR),
        # The status Codex names outranks words in the body it quotes.
        (
            "unexpected status 403 Forbidden: high demand, 429 Too Many Requests",
            FailureKind.PROVIDER_AUTH_ERROR,
        ),
        ("unexpected status 422 Unprocessable Entity: Unauthorized tool", FailureKind.MODEL_REQUEST_ERROR),
        ("stream disconnected before completion: idle timeout waiting for SSE", FailureKind.TRANSPORT_ERROR),
        ("Connection failed: error sending request", FailureKind.TRANSPORT_ERROR),
        (
            "stream disconnected before completion: Transport error: network error: x",
            FailureKind.TRANSPORT_ERROR,
        ),
        (
            '{"error":{"message":"maximum context length is 8192","code":"context_length_exceeded"}}',
            FailureKind.MODEL_CONTEXT_LIMIT,
        ),
        ('{"error":{"message":"bad","type":"invalid_request_error"}}', FailureKind.MODEL_REQUEST_ERROR),
        ("400 Bad Request", FailureKind.MODEL_REQUEST_ERROR),
        ("Unauthorized", FailureKind.PROVIDER_AUTH_ERROR),
        ("the model refused", None),
        ("", None),
    ],
)
def test_recognizer_table(message: str, kind: FailureKind | None) -> None:
    assert recognize_failure(message) is kind


def test_recognizer_is_one_table_of_patterns_and_kinds() -> None:
    assert all(isinstance(kind, FailureKind) for _pattern, kind in FAILURE_PATTERNS)


# --- usage ---------------------------------------------------------------------------------------------


async def test_usage_absent_is_none_even_though_codex_prints_zeros() -> None:
    [completed] = [e for e in fixture_events("no_usage") if e["type"] == "turn.completed"]
    assert set(completed["usage"].values()) == {0}  # what Codex really prints when the endpoint sent none
    sandbox, result = evidence("no_usage")
    report = await parse(sandbox, result)
    assert report.usage.model_dump() == {
        "input_tokens": None,
        "output_tokens": None,
        "cached_input_tokens": None,
        "reasoning_tokens": None,
    }
    assert "usage_unavailable" in report.evidence_gaps
    assert report.final_text == "done"


async def test_usage_falls_back_to_the_transcript() -> None:
    lines = (FIXTURES / "tool_ok" / "events.jsonl").read_bytes().splitlines()
    events = b"\n".join(line for line in lines if b"turn.completed" not in line)
    sandbox, result = evidence("tool_ok", events=events)
    report = await parse(sandbox, result)
    assert report.usage.input_tokens == 20348 and report.usage.output_tokens == 10
    assert "usage_unavailable" not in report.evidence_gaps


async def test_no_transcript_and_no_usage_are_gaps() -> None:
    sandbox, result = evidence("no_usage", with_transcript=False, listing=False)
    report = await parse(sandbox, result)
    assert {"transcript_unavailable", "usage_unavailable"} <= set(report.evidence_gaps)
    assert report.native_transcript_path is None
    assert report.final_text == "done"  # the event stream alone still gives the answer


# --- finding the transcript --------------------------------------------------------------------------------


async def test_transcript_found_by_listing_when_not_where_expected() -> None:
    sandbox, result = evidence("tool_ok", with_transcript=False)
    name = next((FIXTURES / "tool_ok").glob("rollout-*")).name
    elsewhere = f"/sandbox/home/.codex/sessions/1999/01/01/{name}"
    sandbox.files[elsewhere] = (FIXTURES / "tool_ok" / name).read_bytes()
    report = await parse(sandbox, result)
    assert report.native_transcript_path == elsewhere
    assert sandbox.execs and sandbox.execs[0][0] == "find"
    assert report.messages[0].text == PROMPT


async def test_thread_id_that_is_not_a_uuid_is_not_used_as_a_path() -> None:
    events = b'{"type":"thread.started","thread_id":"../../../etc/passwd"}\n'
    sandbox, result = evidence("tool_ok", events=events, with_transcript=False)
    await parse(sandbox, result)
    assert all("passwd" not in arg for argv in sandbox.execs for arg in argv)


@pytest.mark.parametrize(
    "thread_id", ["ffffffff-ffff-7fff-bfff-ffffffffffff", "00000000-0000-7000-8000-000000000000", "0" * 32]
)
async def test_thread_ids_naming_impossible_times_do_not_crash(thread_id: str) -> None:
    events = json.dumps({"type": "thread.started", "thread_id": thread_id}).encode()
    sandbox, result = evidence("tool_ok", events=events, with_transcript=False)
    report = await parse(sandbox, result)
    assert "transcript_unavailable" in report.evidence_gaps


async def test_final_text_from_the_last_message_file() -> None:
    events = (
        b'{"type":"turn.started"}\n{"type":"turn.completed","usage":{"input_tokens":3,"output_tokens":1}}\n'
    )
    sandbox, result = evidence("tool_ok", events=events, with_transcript=False, listing=False)
    sandbox.files["/sandbox/home/codex-last-message.txt"] = b"from -o"
    report = await parse(sandbox, result)
    assert report.final_text == "from -o"


# --- unknown and hostile input -----------------------------------------------------------------------------


async def test_unknown_record_types_are_gaps_and_bounded() -> None:
    sandbox, result = evidence("tool_ok")
    path = next(p for p in sandbox.files if "/sessions/" in p)
    extra = [json.dumps({"type": f"new_thing_{i}", "payload": {}}) for i in range(100)]
    extra.append(json.dumps({"type": "x" * 5000 + "/../\n", "payload": {}}))
    sandbox.files[path] += ("\n".join(extra) + "\n").encode()
    report = await parse(sandbox, result)
    unknown = [g for g in report.evidence_gaps if g.startswith("unknown_record_type:")]
    assert unknown[0] == "unknown_record_type:new_thing_0"
    assert len(unknown) == MAX_UNKNOWN_TYPES
    assert all(len(g) < 100 and "/" not in g for g in report.evidence_gaps)


async def test_unknown_event_and_item_types_are_gaps() -> None:
    events = b"\n".join(
        [
            b'{"type":"turn.something_new"}',
            b'{"type":"item.completed","item":{"id":"i","type":"hologram"}}',
            b'{"type":"item.completed","item":{"id":"j","type":"agent_message","text":"done"}}',
        ]
    )
    sandbox, result = evidence("tool_ok", events=events, with_transcript=False, listing=False)
    report = await parse(sandbox, result)
    assert "unknown_event_type:turn.something_new" in report.evidence_gaps
    assert "unknown_item_type:hologram" in report.evidence_gaps
    assert report.final_text == "done"


async def test_hostile_event_stream_does_not_crash_and_stays_bounded() -> None:
    huge_text = "A" * 1_000_000
    lines = [
        b"\xff\xfe not utf-8 \xc3\x28",
        b'{"type":"item.completed","item":{"id":"bad","type":"agent_message","text":"caf\xe9 \xff"}}',
        b"x" * 1_000_000,  # a 1 MB line that is not JSON
        json.dumps(
            {"type": "item.completed", "item": {"id": "big", "type": "agent_message", "text": huge_text}}
        ).encode(),
        json.dumps(
            {
                "type": "item.completed",
                "item": {
                    "id": "cmd",
                    "type": "command_execution",
                    "command": {"not": "a string"},
                    "aggregated_output": "head" + "o" * 1_000_000 + "tail",
                    "exit_code": True,
                    "status": ["weird"],
                },
            }
        ).encode(),
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        b"42",
        b"null",
        b'"just a string"',
        b"\x00\x00\x00",
        b'{"type":"thread.started","thread_id":{"nested":true}}',
        b'{"type":"turn.failed","error":"not an object"}',
        b'{"type":"turn.completed","usage":{"input_tokens":-5,"output_tokens":"many"}}',
        b'{"type":"item.completed","item":"not an object"}',
        b'{"type":7}',
    ]
    sandbox, result = evidence("tool_ok", events=b"\n".join(lines), with_transcript=False, listing=False)
    report = await parse(sandbox, result)
    unparseable = [g for g in report.evidence_gaps if g.startswith("event_stream_unparseable_lines:")]
    assert unparseable == ["event_stream_unparseable_lines:8"]
    assert report.final_text is not None and len(report.final_text) <= MAX_MESSAGE_CHARS
    assert report.final_text.startswith("AAAA")
    [call] = report.tool_calls
    assert call.exit_code is None and call.status == "unknown"
    assert call.output is not None and len(call.output) <= MAX_TOOL_OUTPUT_CHARS
    assert call.output.startswith("head") and call.output.endswith("tail")
    assert report.claimed_message == "turn failed without a message"
    assert report.usage.input_tokens is None and report.usage.output_tokens is None
    assert len(report.model_dump_json()) < 200_000


async def test_hostile_transcript_does_not_crash() -> None:
    sandbox, result = evidence("tool_ok")
    path = next(p for p in sandbox.files if "/sessions/" in p)
    sandbox.files[path] = b"\n".join(
        [
            b"\xff\xfe",
            b"[" * 100_000,
            b'{"type":"event_msg","payload":{"type":"token_count","info":{"total_token_usage":[1,2]}}}',
            b'{"type":"event_msg","payload":{"type":"item_completed","item":{"type":"UserMessage","content":7}}}',
            b'{"type":"event_msg","payload":"nope"}',
            sandbox.files[path],
        ]
    )
    report = await parse(sandbox, result)
    assert "transcript_unparseable_lines:2" in report.evidence_gaps
    assert report.usage.input_tokens == 20348


async def test_missing_stdout_file_falls_back_to_the_tail() -> None:
    tail = (FIXTURES / "tool_ok" / "events.jsonl").read_text()[40:]  # starts mid-line, as a tail does
    sandbox = FakeSandbox(listing=False)
    result = ExecResult(exit_code=0, duration_s=1.0, stdout_path=STDOUT, stdout_tail=tail)
    report = await parse(sandbox, result)
    assert "event_stream_partial" in report.evidence_gaps
    assert report.final_text == "done" and report.tool_calls[0].exit_code == 0


# --- launch -------------------------------------------------------------------------------------------------


def context(prompt: str = PROMPT, **overrides: Any) -> LaunchContext:
    values = {
        "base_url": "http://127.0.0.1:9/s/tok/v1",
        "api_key": "sk-session",
        "model": "scripted-model",
        "prompt": prompt,
        "install_dir": Path("/cache/npm/openai+codex@0.171.0"),
        **overrides,
    }
    return LaunchContext(**values)


async def test_prepare_writes_config_and_passes_the_prompt_as_one_argument() -> None:
    sandbox = FakeSandbox()
    launch = await CodexHarness().prepare(sandbox, context('-h; rm -rf / "$HOME"\nnext'))
    config = tomllib.loads(sandbox.files["/sandbox/home/.codex/config.toml"].decode())
    assert sandbox.modes["/sandbox/home/.codex/config.toml"] == 0o600
    assert config["model"] == "scripted-model" and config["model_provider"] == "rollout"
    assert config["approval_policy"] == "never" and config["check_for_update_on_startup"] is False
    provider = config["model_providers"]["rollout"]
    assert provider["base_url"] == "http://127.0.0.1:9/s/tok/v1" and provider["wire_api"] == "responses"
    assert provider["env_key"] == "ROLLOUT_API_KEY"
    assert (provider["request_max_retries"], provider["stream_max_retries"]) == (
        REQUEST_MAX_RETRIES,
        STREAM_MAX_RETRIES,
    )
    assert config["features"] == {"unbounded_connection_retries": False, "plugins": False, "undo": False}
    assert config["analytics"]["enabled"] is False and config["feedback"]["enabled"] is False
    assert "sk-session" not in sandbox.files["/sandbox/home/.codex/config.toml"].decode()

    argv = launch.argv
    assert argv[argv.index("exec") :][:3] == ["exec", "--json", "--skip-git-repo-check"]
    assert argv[argv.index("-C") + 1] == "/sandbox/work"
    assert argv[argv.index("-o") + 1] == "/sandbox/home/codex-last-message.txt"
    assert argv[-2:] == ["--", '-h; rm -rf / "$HOME"\nnext']
    assert launch.stdin is None
    assert launch.env["CODEX_HOME"] == "/sandbox/home/.codex"
    assert launch.env["ROLLOUT_API_KEY"] == "sk-session"


@pytest.mark.parametrize("prompt", ["-", "with\0nul", "x" * (MAX_ARGV_PROMPT_BYTES + 1)])
async def test_prompts_argv_cannot_carry_go_through_stdin(prompt: str) -> None:
    launch = await CodexHarness().prepare(FakeSandbox(), context(prompt))
    assert launch.argv[-2:] == ["--", "-"]
    assert launch.stdin == prompt.encode()


async def test_paths_are_normalized_for_codex() -> None:
    sandbox = FakeSandbox()
    sandbox.home = "/sandbox//home/"
    sandbox.workdir = "/sandbox/x/../work/"
    launch = await CodexHarness().prepare(sandbox, context())
    assert launch.argv[launch.argv.index("-C") + 1] == "/sandbox/work"
    assert launch.argv[launch.argv.index("-o") + 1] == "/sandbox/home/codex-last-message.txt"
    assert "/sandbox/home/.codex/config.toml" in sandbox.files


@pytest.mark.parametrize(
    "value",
    [
        "plain",
        'quo"te',
        "back\\slash",
        "new\nline",
        "tab\t",
        "\x00\x01\x1f\x7f",
        "ünï €",
        '"]\n[evil]\nx = "',
    ],
)
def test_toml_string_round_trips(value: str) -> None:
    assert tomllib.loads(f"v = {toml_string(value)}") == {"v": value}


def test_config_from_hostile_values_has_no_extra_tables() -> None:
    config = tomllib.loads(render_config('m"\n[evil]\nx=1', 'http://h/v1"\n[analytics]\nenabled = true'))
    assert config["model"] == 'm"\n[evil]\nx=1'
    assert "evil" not in config and config["analytics"] == {"enabled": False}


def test_other_version_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="harnesses.codex"):
        CodexHarness("0.0.1-parse-test")
        CodexHarness("0.0.1-parse-test")
        CodexHarness()
    warnings = [r for r in caplog.records if "0.0.1-parse-test" in r.getMessage()]
    assert len(warnings) == 1
    assert CodexHarness("0.0.1-parse-test").version == "0.0.1-parse-test"
    assert CodexHarness().version == CodexHarness.tested_version == "0.171.0"
