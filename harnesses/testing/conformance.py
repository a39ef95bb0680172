"""The conformance scenarios as data, and the checks a cell (one harness x one scenario) must pass.

Each scenario is a script for the scripted model, a verifier, and what the rows of the session's attempts
must show: status, failure kind, the driver's decisions attempt by attempt, reward, the gateway's attempt
records and the evidence kept on disk. The runner (``executor/testing/conformance.py``) plays a scenario
through the real executor path and hands the stored rows to ``check_cell``; a failed check names itself
and says what it saw, in a bounded line.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from harnesses.gateway import GatewayConfig
from policy import FailureKind, PolicyConfig

PROMPT = "Run the requested shell checks, then report CONFORMANCE_DONE."
DONE = "CONFORMANCE_DONE"
MAX_REASON_CHARS = 300
ANY = "any"  # an expectation that accepts whatever the row holds

STALL_S = 3.0
# The run settings every cell starts from (RunConfig keys): fast retries, so the matrix stays short, and
# the infrastructure kinds retried once by the driver, so "retried, then masked" shows in two attempts.
# A session budget of 4 failed upstream attempts ends a harness's own reconnect loop (OpenCode re-sends a
# cut stream 5 times over about a minute of backoff) after its fourth cut, as the gateway is meant to.
_FAST_RETRY = {"retry": True, "max_attempts": 2, "backoff_base_s": 0.2, "backoff_cap_s": 1.0}
BASE_CONFIG: dict[str, Any] = {
    "gateway": {
        "max_attempts_per_request": 3,
        "max_attempts_per_session": 4,
        "backoff_base_s": 0.1,
        "backoff_cap_s": 0.5,
        # The scripted model answers in milliseconds: a request without a byte for 3 s has stalled.
        "first_byte_timeout_s": STALL_S,
        "chunk_timeout_s": STALL_S,
    },
    "policy": {
        "rules": {
            "rate_limit_exceeded": _FAST_RETRY,
            "provider_unavailable": _FAST_RETRY,
            "transport_error": _FAST_RETRY,
            "model_timeout": _FAST_RETRY,
            "agent_no_model_call": _FAST_RETRY,
            "verifier_error": _FAST_RETRY,
        }
    },
    "limits": {"deadline_s": 180, "grace_s": 2},
}
# The agent_hang deadline, and how far past deadline + grace the session may end (supervisor start-up, kill
# rounds, the parse of what the harness left). Long enough for a harness to reach its first model request
# on a loaded machine (OpenCode and Hermes took more than 8 s with four cells at once on two cores): a
# deadline before it is a launch problem (agent_no_model_call), not the agent's time.
HANG_DEADLINE_S = 30.0
HANG_SLACK_S = 8.0
# late_start: the harness never reaches the model, so any deadline will do; a short one keeps the cell short.
LATE_START_DEADLINE_S = 8.0
# agent_hang: a request unanswered when the harness was stopped counts against the model unless it was
# sent within this long before the stop (or after it): cut by the stop, not left waiting by the model.
KILL_WINDOW_S = 1.0

# A plain 400 that is no context overflow and holds none of the words that make a harness retry
# (reference/harnesses.md section 9).
MODEL_ERROR_BODY = json.dumps(
    {
        "error": {
            "message": "controlled model failure: the request was refused for conformance",
            "type": "invalid_request_error",
            "code": "conformance_refusal",
        }
    }
)
AUTH_ERROR_BODY = json.dumps(
    {
        "error": {
            "message": "Incorrect API key provided.",
            "type": "invalid_request_error",
            "code": "invalid_api_key",
        }
    }
)

# An unknown model and an account out of credits, as OpenAI-compatible servers word them.
MODEL_NOT_FOUND_BODY = json.dumps(
    {
        "error": {
            "message": "The model `no-such-model` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "code": "model_not_found",
        }
    }
)
BILLING_BODY = json.dumps(
    {
        "error": {
            "message": "Insufficient credits on this account. Add a payment method to continue.",
            "type": "billing_error",
            "code": "insufficient_credits",
        }
    }
)
STREAM_ERROR_MESSAGE = "The server had an error while processing your request."


@dataclass(frozen=True)
class CheckContext:
    """What a check may consult besides the rows: the run's policy and gateway bounds, and what the
    runner saw of the sandbox after the session (processes left behind)."""

    policy: PolicyConfig
    gateway: GatewayConfig
    grace_s: float
    leftover_processes: tuple[str, ...] = ()


Rows = list[dict[str, Any]]
Check = Callable[[Rows, CheckContext], str | None]  # None: pass; else why not, one bounded line


@dataclass(frozen=True)
class Scenario:
    name: str
    does: str  # what the scripted model does
    demands: str  # what the rows must show
    script: list[dict[str, Any]]
    verify: str
    status: str
    failure_kind: FailureKind
    decisions: tuple[str, ...]  # the driver's decision on each attempt, in order
    reward: float | str | None  # of the final row; ANY to leave it to the extra checks
    deadline_s: float | None = None
    config: dict[str, Any] = field(default_factory=dict)  # merged over BASE_CONFIG
    checks: tuple[tuple[str, Check], ...] = ()
    # The harness is prepared as usual (its config files written), then this command runs in its place:
    # the adapter's parse and the classification meet a harness that never reached the model.
    launch_argv: tuple[str, ...] | None = None
    # The models the scripted model serves, refusing any other with a 404 as vLLM does; None: it serves
    # the run's model and answers any name.
    served_models: tuple[str, ...] | None = None
    # Every request to the endpoint, the gateway's own probe of the run's config included, gets this
    # status: the run's key, account or model is what is wrong (the script is never reached).
    endpoint_refuses: int | None = None


# ---------------------------------------------------------------------------------------------------------
# Helpers for checks


def _attempts(row: dict[str, Any]) -> list[dict[str, Any]]:
    return list(row.get("model_calls") or [])


def _statuses(row: dict[str, Any]) -> list[int | None]:
    return [a["status"] for a in _attempts(row)]


def _shell_calls(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in row.get("tool_calls") or [] if c.get("exit_code") is not None]


def _each_row(rows: Rows, fn: Callable[[dict[str, Any]], str | None]) -> str | None:
    for row in rows:
        why = fn(row)
        if why:
            return f"attempt {row.get('attempt')}: {why}"
    return None


# ---------------------------------------------------------------------------------------------------------
# Scenario-specific checks


def _tools_ok(rows: Rows, ctx: CheckContext) -> str | None:
    calls = _shell_calls(rows[-1])
    if len(calls) < 2:
        return f"expected 2 shell tool calls with exit codes, saw {len(calls)}: {calls}"
    bad = [
        (c["name"], c["status"], c["exit_code"])
        for c in calls
        if c["exit_code"] != 0 or c["status"] != "completed"
    ]
    return f"tool calls not completed with exit 0: {bad}" if bad else None


def _usage_known(rows: Rows, ctx: CheckContext) -> str | None:
    row = rows[-1]
    counts = (row.get("input_tokens"), row.get("output_tokens"))
    return None if all(isinstance(c, int) and c > 0 for c in counts) else f"token counts {counts}"


def _final_text(rows: Rows, ctx: CheckContext) -> str | None:
    text = rows[-1].get("final_text") or ""
    return None if DONE in text else f"final text {text[:80]!r} lacks {DONE}"


def _tool_failed_7(rows: Rows, ctx: CheckContext) -> str | None:
    calls = _shell_calls(rows[-1])
    failed = [c for c in calls if c["exit_code"] == 7 and c["status"] == "failed"]
    ok = [c for c in calls if c["exit_code"] == 0 and c["status"] == "completed"]
    if not failed:
        return (
            f"no tool call recorded as failed with exit 7: {[(c['status'], c['exit_code']) for c in calls]}"
        )
    return None if ok else "the second (successful) tool call is missing"


def _usage_unknown(rows: Rows, ctx: CheckContext) -> str | None:
    row = rows[-1]
    counts = (row.get("input_tokens"), row.get("output_tokens"))
    if counts != (None, None):
        return f"token counts {counts}, expected unknown (null)"
    return None if "usage_unavailable" in (row.get("evidence_gaps") or []) else "no usage_unavailable gap"


def _retried_same_bytes(status: int, failures: int, *, honour_retry_after: bool) -> Check:
    """The first request failed ``failures`` times with ``status``, then succeeded: same body each time."""

    def check(rows: Rows, ctx: CheckContext) -> str | None:
        first = [a for a in _attempts(rows[-1]) if a["request_index"] == 0]
        want = [status] * failures + [200]
        if [a["status"] for a in first] != want:
            return f"request 0 attempts {[a['status'] for a in first]}, expected {want}"
        if len({a["request_sha256"] for a in first}) != 1:
            return "retries did not send identical request bodies"
        for before, after in pairwise(first):
            gap = after["started_at"] - before["started_at"]
            if honour_retry_after and gap < (before["retry_after_s"] or 0.0):
                return f"retried after {gap:.2f}s, before Retry-After {before['retry_after_s']}s"
        return None

    return check


def _only_status(status: int) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        def one(row: dict[str, Any]) -> str | None:
            seen = _statuses(row)
            if not seen:
                return "no upstream attempt recorded"
            return None if set(seen) == {status} else f"upstream statuses {seen}, expected only {status}"

        return _each_row(rows, one)

    return check


def _overflow_recorded(rows: Rows, ctx: CheckContext) -> str | None:
    kinds = [(a["status"], a["kind"]) for a in _attempts(rows[-1])]
    if (400, FailureKind.MODEL_CONTEXT_LIMIT.value) not in kinds:
        return f"no 400 context overflow among the attempts {kinds}"
    return None if rows[-1].get("verified") else "the partial work was not graded"


def _output_limit_recorded(rows: Rows, ctx: CheckContext) -> str | None:
    reasons = [a["finish_reason"] for a in _attempts(rows[-1]) if a["status"] == 200]
    if not reasons or reasons[-1] not in ("length", "max_output_tokens"):
        return f"last answered finish reasons {reasons}, expected length / max_output_tokens"
    return None


def _stream_cuts(rows: Rows, ctx: CheckContext) -> str | None:
    def one(row: dict[str, Any]) -> str | None:
        cuts = [a for a in _attempts(row) if a["kind"] == FailureKind.TRANSPORT_ERROR.value]
        return (
            None if cuts else f"no stream cut recorded: {[(a['status'], a['kind']) for a in _attempts(row)]}"
        )

    return _each_row(rows, one)


def _cut_then_answered(rows: Rows, ctx: CheckContext) -> str | None:
    attempts = _attempts(rows[-1])
    cut = next((a for a in attempts if a["kind"] == FailureKind.TRANSPORT_ERROR.value), None)
    if cut is None:
        return "no stream cut recorded"
    later = [a for a in attempts if a["request_index"] > cut["request_index"] and a["kind"] == "none"]
    return None if later else "no answered request after the cut"


def _hang_bounded(rows: Rows, ctx: CheckContext) -> str | None:
    row = rows[-1]
    if not row.get("timed_out"):
        return "the harness was not killed at its deadline"
    bound = HANG_DEADLINE_S + ctx.grace_s + HANG_SLACK_S
    took = row.get("t_agent_s")
    if took is None or took > bound:
        return f"agent phase took {took}s, past deadline + grace + slack = {bound}s"
    return None


def _agent_spent_the_time(rows: Rows, ctx: CheckContext) -> str | None:
    row = rows[-1]
    started = row.get("started_at")
    start_s = started.timestamp() if hasattr(started, "timestamp") else float(started or 0.0)
    # The deadline cannot fall before this; the model answers within milliseconds here.
    killed_at = start_s + float(row.get("t_setup_s") or 0.0) + HANG_DEADLINE_S

    def cut_by_the_kill(a: dict[str, Any]) -> bool:
        # Sent in the last second before the harness was stopped, or as it was being stopped (a harness
        # may answer the end of its killed tool with one more request), and left by the harness as it
        # ended: not a call the model sat on.
        return float(a.get("started_at") or 0.0) >= killed_at - KILL_WINDOW_S

    if not _attempts(row):
        return "no model call: the deadline fell before the harness reached the model"
    waiting = [a for a in _attempts(row) if a["kind"] != FailureKind.NONE.value and not cut_by_the_kill(a)]
    if waiting:
        return f"model calls that did not answer: {[(a['status'], a['kind']) for a in waiting]}"
    return _hang_bounded(rows, ctx)


def _stall_recorded(rows: Rows, ctx: CheckContext) -> str | None:
    def one(row: dict[str, Any]) -> str | None:
        kinds = [(a["status"], a["kind"]) for a in _attempts(row)]
        if (None, FailureKind.MODEL_TIMEOUT.value) not in kinds:
            return f"no stalled attempt (no status, model_timeout) among {kinds}"
        # The gateway's stall bounds ended the session, not the deadline killing the harness.
        return "the harness ran into its deadline" if row.get("timed_out") else None

    return _each_row(rows, one)


def _stalled_then_answered(rows: Rows, ctx: CheckContext) -> str | None:
    first = [a for a in _attempts(rows[-1]) if a["request_index"] == 0]
    got = [(a["status"], a["kind"]) for a in first]
    if got != [(None, FailureKind.MODEL_TIMEOUT.value), (200, FailureKind.NONE.value)]:
        return f"request 0 attempts {got}, expected a stall (model_timeout) then 200"
    return None if first[0]["request_sha256"] == first[1]["request_sha256"] else "the retry sent other bytes"


def _never_graded(rows: Rows, ctx: CheckContext) -> str | None:
    graded = [r.get("attempt") for r in rows if r.get("verified") or r.get("reward") is not None]
    if graded:
        return f"attempts {graded} were graded: the stall was the endpoint's, not the agent's"
    return None if _shell_calls(rows[0]) else "the work before the stall (a shell call) is missing"


def _config_error_stops_run(status: int) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        if not ctx.policy.rule_for(FailureKind.ENDPOINT_CONFIG_ERROR).stop_run:
            return "the policy rule for endpoint_config_error does not stop the run"
        seen = _statuses(rows[-1])
        return None if seen == [status] else f"upstream statuses {seen}, expected one {status} and no more"

    return check


def _in_stream_error_recorded(rows: Rows, ctx: CheckContext) -> str | None:
    def one(row: dict[str, Any]) -> str | None:
        failed = [a for a in _attempts(row) if a["status"] == 200 and a["kind"] != FailureKind.NONE.value]
        if not failed:
            return f"no 200 attempt recorded as failed: {[(a['status'], a['kind']) for a in _attempts(row)]}"
        message = failed[0].get("error_message") or ""
        return None if STREAM_ERROR_MESSAGE in message else f"the endpoint's message is missing: {message!r}"

    return _each_row(rows, one)


def _no_model_calls(rows: Rows, ctx: CheckContext) -> str | None:
    return _each_row(rows, lambda r: f"model calls {_statuses(r)}" if _attempts(r) else None)


def _verifier_ran(times: int) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        return _each_row(
            rows,
            lambda r: (
                None
                if r.get("verifier_runs") == times
                else f"verifier_runs {r.get('verifier_runs')}, expected {times}"
            ),
        )

    return check


def _masked_at_once_for_retry_after(rows: Rows, ctx: CheckContext) -> str | None:
    seen = _statuses(rows[-1])
    if seen != [429]:
        return f"upstream statuses {seen}: a day-long Retry-After must end the request at its first answer"
    reason = rows[-1].get("decision_reason") or ""
    return None if "Retry-After" in reason else f"decision reason {reason!r} does not name the Retry-After"


def _verified_zero(rows: Rows, ctx: CheckContext) -> str | None:
    row = rows[-1]
    if not row.get("verified") or row.get("masked"):
        return f"verified={row.get('verified')} masked={row.get('masked')}, expected verified and not masked"
    return None


def _sessions_own_4xx(status: int) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        if ctx.policy.rule_for(FailureKind.MODEL_REQUEST_ERROR).stop_run:
            return "the policy rule for model_request_error stops the run"
        seen = _statuses(rows[-1])
        if seen != [status]:
            return f"upstream statuses {seen}, expected one {status} and no more"
        message = _attempts(rows[-1])[0].get("error_message") or ""
        return None if "this request drew the error" in message else f"no probe verdict in {message!r}"

    return check


def _at_most_calls(limit: int) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        def one(row: dict[str, Any]) -> str | None:
            calls = {a["request_index"] for a in _attempts(row)}
            return None if len(calls) <= limit else f"{len(calls)} model calls went upstream, past {limit}"

        return _each_row(rows, one)

    return check


def _gap_said(code: str) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        gaps = rows[-1].get("evidence_gaps") or []
        return None if any(g.startswith(code) for g in gaps) else f"evidence gaps {gaps} lack {code}"

    return check


def _bad_answers_recorded(words: str, kind: FailureKind) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        def one(row: dict[str, Any]) -> str | None:
            judged = [a for a in _attempts(row) if a["status"] == 200 and a["kind"] == kind.value]
            if not judged or words not in (judged[0].get("error_message") or ""):
                seen = [(a["status"], a["kind"], (a.get("error_message") or "")[:60]) for a in _attempts(row)]
                return f"no 200 attempt recorded as {kind.value} ({words!r}): {seen}"
            return None

        return _each_row(rows, one)

    return check


def _not_graded(rows: Rows, ctx: CheckContext) -> str | None:
    graded = [r.get("attempt") for r in rows if r.get("verified") or r.get("reward") is not None]
    return f"attempts {graded} were graded" if graded else None


def _judged_then_answered(rows: Rows, ctx: CheckContext) -> str | None:
    first = [(a["status"], a["kind"]) for a in _attempts(rows[-1]) if a["request_index"] == 0]
    want = [(200, FailureKind.PROVIDER_UNAVAILABLE.value), (200, FailureKind.NONE.value)]
    return None if first == want else f"request 0 attempts {first}, expected {want}"


def _stops_run(rows: Rows, ctx: CheckContext) -> str | None:
    rule = ctx.policy.rule_for(FailureKind.PROVIDER_AUTH_ERROR)
    if not rule.stop_run:
        return "the policy rule for provider_auth_error does not stop the run"
    seen = _statuses(rows[-1])
    return None if seen == [401] else f"upstream statuses {seen}, expected one 401 and nothing after it"


# ---------------------------------------------------------------------------------------------------------
# The scenarios

_TWO_SHELLS = [
    {"type": "shell", "command": "printf one > a.txt && cat a.txt"},
    {"type": "shell", "command": "printf two > b.txt && cat b.txt"},
    {"type": "text", "text": f"Both checks ran. {DONE}"},
]
_BOTH_FILES = "test -f a.txt && test -f b.txt"
_NOTHING_DONE = "test -f a.txt"  # fails when the model never got to run a command
_INFRA = ("retry", "mask")

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "tool_success",
        "two shell tool calls, then a final answer",
        "completed, reward 1, both tool calls with exit 0, usage",
        _TWO_SHELLS,
        _BOTH_FILES,
        "completed",
        FailureKind.NONE,
        ("accept",),
        1.0,
        checks=(("tool_calls", _tools_ok), ("usage", _usage_known), ("final_text", _final_text)),
    ),
    Scenario(
        "tool_failure",
        "first command exits 7, second succeeds",
        "the failed tool call recorded as failed with exit 7; reward 1",
        [
            {"type": "shell", "command": "printf one > a.txt; exit 7"},
            {"type": "shell", "command": "printf two > b.txt"},
            {"type": "text", "text": f"The first check failed, the second passed. {DONE}"},
        ],
        _BOTH_FILES,
        "completed",
        FailureKind.NONE,
        ("accept",),
        1.0,
        checks=(("tool_failed", _tool_failed_7),),
    ),
    Scenario(
        "usage_omitted",
        "a successful run with no usage",
        "token counts unknown (null), not 0",
        [{"type": "text", "text": f"Nothing to run. {DONE}", "usage": False}],
        "true",
        "completed",
        FailureKind.NONE,
        ("accept",),
        1.0,
        checks=(("usage_unknown", _usage_unknown),),
    ),
    Scenario(
        "retry_429",
        "two 429s with Retry-After 1, then success",
        "completed; 3 attempts, identical request bodies, spacing >= Retry-After",
        [
            {"type": "error", "status": 429, "headers": {"Retry-After": "1"}},
            {"type": "error", "status": 429, "headers": {"Retry-After": "1"}},
            *_TWO_SHELLS,
        ],
        _BOTH_FILES,
        "completed",
        FailureKind.NONE,
        ("accept",),
        1.0,
        checks=(("retried_429", _retried_same_bytes(429, 2, honour_retry_after=True)),),
    ),
    Scenario(
        "rate_limit_exhausted",
        "429 forever (Retry-After 1)",
        "rate_limit_exceeded; upstream attempts within budget; retried, then masked",
        [{"type": "error", "status": 429, "headers": {"Retry-After": "1"}}],
        _NOTHING_DONE,
        "failed",
        FailureKind.RATE_LIMIT_EXCEEDED,
        _INFRA,
        None,
        checks=(("only_429", _only_status(429)),),
    ),
    Scenario(
        "retry_500",
        "one 500, then success",
        "completed; the 500 kept in the attempt records",
        [{"type": "error", "status": 500}, *_TWO_SHELLS],
        _BOTH_FILES,
        "completed",
        FailureKind.NONE,
        ("accept",),
        1.0,
        checks=(("retried_500", _retried_same_bytes(500, 1, honour_retry_after=False)),),
    ),
    Scenario(
        "provider_unavailable",
        "503 forever",
        "provider_unavailable; masked after retries",
        [{"type": "error", "status": 503}],
        _NOTHING_DONE,
        "failed",
        FailureKind.PROVIDER_UNAVAILABLE,
        _INFRA,
        None,
        checks=(("only_503", _only_status(503)),),
    ),
    Scenario(
        "model_error",
        "persistent 400 (not context)",
        "model_request_error; graded as a real 0 by default",
        [{"type": "error", "status": 400, "body": MODEL_ERROR_BODY}],
        _NOTHING_DONE,
        "failed",
        FailureKind.MODEL_REQUEST_ERROR,
        ("accept",),
        0.0,
        checks=(("only_400", _only_status(400)),),
    ),
    Scenario(
        "model_error_masked",
        "persistent 400 (not context), with model_request_error configured to mask",
        "model_request_error; masked, no reward",
        [{"type": "error", "status": 400, "body": MODEL_ERROR_BODY}],
        _NOTHING_DONE,
        "failed",
        FailureKind.MODEL_REQUEST_ERROR,
        ("mask",),
        None,
        config={"policy": {"rules": {"model_request_error": {"grade": False, "final": "mask"}}}},
        checks=(("only_400", _only_status(400)),),
    ),
    Scenario(
        "context_overflow",
        "a shell call, then 400 context_length_exceeded",
        "incomplete, model_context_limit, partial work graded",
        [{"type": "shell", "command": "echo partial > part.txt"}, {"type": "error", "status": 400}],
        "grep -qx partial part.txt",
        "incomplete",
        FailureKind.MODEL_CONTEXT_LIMIT,
        ("accept",),
        1.0,
        checks=(("overflow", _overflow_recorded),),
    ),
    Scenario(
        "output_limit",
        "a shell call, then an answer that stops with finish_reason length",
        "incomplete, model_output_limit",
        [
            {"type": "shell", "command": "printf one > a.txt"},
            {"type": "text", "text": "The answer was cut", "finish_reason": "length"},
        ],
        _NOTHING_DONE,
        "incomplete",
        FailureKind.MODEL_OUTPUT_LIMIT,
        ("accept",),
        1.0,
        checks=(("finish_length", _output_limit_recorded),),
    ),
    Scenario(
        "transport_drop",
        "stream cut mid-way, forever",
        "transport_error; retried, then masked",
        [{"type": "drop", "after_chunks": 2}],
        _NOTHING_DONE,
        "failed",
        FailureKind.TRANSPORT_ERROR,
        _INFRA,
        None,
        checks=(("stream_cut", _stream_cuts),),
    ),
    Scenario(
        "transport_recovers",
        "stream cut once, then success",
        "completed",
        [{"type": "drop", "after_chunks": 2}, *_TWO_SHELLS],
        _BOTH_FILES,
        "completed",
        FailureKind.NONE,
        ("accept",),
        1.0,
        checks=(("cut_then_answered", _cut_then_answered),),
    ),
    Scenario(
        "agent_hang",
        f"asks for a command that runs past the deadline ({HANG_DEADLINE_S:g}s), answering promptly",
        "agent_timeout within deadline plus grace (the time was the agent's); graded; no process left",
        [{"type": "shell", "command": "sleep 600"}],
        _NOTHING_DONE,
        "incomplete",
        FailureKind.AGENT_TIMEOUT,
        ("accept",),
        0.0,
        deadline_s=HANG_DEADLINE_S,
        checks=(("agent_time", _agent_spent_the_time),),
    ),
    Scenario(
        "model_stall",
        "accepts every request and never answers",
        "model_timeout through the gateway's stall bounds, not the deadline; retried, then masked",
        [{"type": "hang", "max_s": 600}],
        _NOTHING_DONE,
        "failed",
        FailureKind.MODEL_TIMEOUT,
        _INFRA,
        None,
        checks=(("stall", _stall_recorded),),
    ),
    Scenario(
        "model_slow_first_byte",
        "stalls on the first request once, then answers promptly",
        "completed; request 0 recorded as a stall, then answered with the same bytes",
        [{"type": "hang", "max_s": 600}, *_TWO_SHELLS],
        _BOTH_FILES,
        "completed",
        FailureKind.NONE,
        ("accept",),
        1.0,
        checks=(("stall_then_answer", _stalled_then_answered),),
    ),
    Scenario(
        "stall_after_tools",
        "a shell call does the work, then every request stalls",
        "model_timeout; never graded though the verifier would pass; retried, then masked",
        [{"type": "shell", "command": "printf one > a.txt && cat a.txt"}, {"type": "hang", "max_s": 600}],
        "test -f a.txt",
        "failed",
        FailureKind.MODEL_TIMEOUT,
        _INFRA,
        None,
        checks=(("never_graded", _never_graded), ("stall", _stall_recorded)),
    ),
    Scenario(
        "unknown_model_404",
        "the run names a model the endpoint does not serve: 404, the run's own probe too",
        "endpoint_config_error; masked, never graded; the run stops (rule stop_run)",
        [{"type": "error", "status": 404, "body": MODEL_NOT_FOUND_BODY}],
        _NOTHING_DONE,
        "failed",
        FailureKind.ENDPOINT_CONFIG_ERROR,
        ("mask",),
        None,
        config={"model": {"name": "no-such-model"}},
        checks=(("stops_run", _config_error_stops_run(404)),),
        served_models=("scripted-model",),
    ),
    Scenario(
        "billing_402",
        "402 to every request, the run's own probe too: the account is out of credits",
        "endpoint_config_error; masked, never graded; the run stops (rule stop_run)",
        [{"type": "error", "status": 402, "body": BILLING_BODY}],
        _NOTHING_DONE,
        "failed",
        FailureKind.ENDPOINT_CONFIG_ERROR,
        ("mask",),
        None,
        checks=(("stops_run", _config_error_stops_run(402)),),
        endpoint_refuses=402,
    ),
    Scenario(
        "in_stream_error",
        "HTTP 200, a few deltas, then an error event in the stream, every time",
        "provider_unavailable from the gateway's record of the 200 attempt; retried, then masked",
        [{"type": "stream_error", "message": STREAM_ERROR_MESSAGE, "code": "server_error"}],
        _NOTHING_DONE,
        "failed",
        FailureKind.PROVIDER_UNAVAILABLE,
        _INFRA,
        None,
        checks=(("in_stream_error", _in_stream_error_recorded),),
    ),
    Scenario(
        "no_model_call",
        "the harness is prepared, then exits 0 without a request (`true` runs in its place)",
        "agent_no_model_call, not agent_no_result; retried, then masked",
        _TWO_SHELLS,
        _NOTHING_DONE,
        "failed",
        FailureKind.AGENT_NO_MODEL_CALL,
        _INFRA,
        None,
        checks=(("no_model_calls", _no_model_calls),),
        launch_argv=("true",),
    ),
    Scenario(
        "verifier_killed",
        "completes; the verifier is killed by SIGKILL every time",
        "verifier_error, no reward; the verifier re-run in the sandbox; retried, then masked",
        _TWO_SHELLS,
        "kill -KILL $$",
        "completed",
        FailureKind.VERIFIER_ERROR,
        _INFRA,
        None,
        checks=(("verifier_reran", _verifier_ran(2)),),
    ),
    Scenario(
        "verifier_flaky",
        "completes; the verifier cannot start once (exit 127), then grades",
        "completed, reward 1, accepted at the first attempt: the verifier re-ran, not the agent",
        _TWO_SHELLS,
        f"if [ -e .graded-once ]; then {_BOTH_FILES}; else touch .graded-once; exit 127; fi",
        "completed",
        FailureKind.NONE,
        ("accept",),
        1.0,
        checks=(("verifier_reran", _verifier_ran(2)),),
    ),
    Scenario(
        "retry_after_huge",
        "429 with Retry-After of a day",
        "rate_limit_exceeded; masked at once (policy.max_retry_after_s), nothing waits a day",
        [{"type": "error", "status": 429, "headers": {"Retry-After": "86400"}}],
        _NOTHING_DONE,
        "failed",
        FailureKind.RATE_LIMIT_EXCEEDED,
        ("mask",),
        None,
        checks=(("retry_after_bounded", _masked_at_once_for_retry_after),),
    ),
    Scenario(
        "verifier_failure",
        "completes, but the check fails",
        "completed, reward 0, not masked",
        _TWO_SHELLS,
        "test -f never-created.txt",
        "completed",
        FailureKind.NONE,
        ("accept",),
        0.0,
        checks=(("verified_zero", _verified_zero),),
    ),
    Scenario(
        "auth_error",
        "401 to every request, the run's own probe too",
        "provider_auth_error; the run stops early (rule stop_run)",
        [{"type": "error", "status": 401, "body": AUTH_ERROR_BODY}],
        _NOTHING_DONE,
        "failed",
        FailureKind.PROVIDER_AUTH_ERROR,
        ("mask",),
        None,
        checks=(("stops_run", _stops_run),),
        endpoint_refuses=401,
    ),
    # -- the gateway as the policy's boundary (issue 26) -------------------------------------------------
    Scenario(
        "request_404_session",
        "404 to this session's request only; the run's own probe to the same URL is answered",
        "model_request_error: the session's, graded as a real 0; the run goes on (no stop_run)",
        [{"type": "error", "status": 404, "body": MODEL_NOT_FOUND_BODY}],
        _NOTHING_DONE,
        "failed",
        FailureKind.MODEL_REQUEST_ERROR,
        ("accept",),
        0.0,
        checks=(("sessions_own", _sessions_own_4xx(404)),),
    ),
    Scenario(
        "request_count_limit",
        "shell calls without end; the session may make 3 model calls",
        "agent_request_limit: incomplete, graded; no more than 3 model calls upstream",
        [{"type": "shell", "command": "printf one >> a.txt"}],
        "test -f a.txt",
        "incomplete",
        FailureKind.AGENT_REQUEST_LIMIT,
        ("accept",),
        ANY,
        config={"gateway": {"max_requests_per_session": 3}},
        checks=(("at_most_3_calls", _at_most_calls(3)),),
    ),
    Scenario(
        "request_too_large",
        "any request; the gateway takes bodies of at most 1 KiB",
        "agent_request_limit; the body never read whole, nothing sent upstream; graded",
        _TWO_SHELLS,
        _NOTHING_DONE,
        "incomplete",
        FailureKind.AGENT_REQUEST_LIMIT,
        ("accept",),
        0.0,
        config={"gateway": {"max_request_bytes": 1024}},
        checks=(("nothing_upstream", _no_model_calls),),
    ),
    Scenario(
        "bodies_not_kept",
        "two shell calls and an answer; the session may keep 1 byte of bodies",
        "completed, reward 1; the bodies past the bound not kept, and the row says so",
        _TWO_SHELLS,
        _BOTH_FILES,
        "completed",
        FailureKind.NONE,
        ("accept",),
        1.0,
        config={"gateway": {"max_kept_bytes_per_session": 1}},
        checks=(("gap_said", _gap_said("model_bodies_not_kept")),),
    ),
    Scenario(
        "keepalive_stall",
        "200, then only `: keep-alive` comments every 0.5 s, never a token",
        "model_timeout through the stall bounds (comments are no progress); retried, then masked",
        [{"type": "keepalive", "interval_s": 0.5, "max_s": 600}],
        _NOTHING_DONE,
        "failed",
        FailureKind.MODEL_TIMEOUT,
        _INFRA,
        None,
        checks=(("keepalives_no_progress", _bad_answers_recorded("no content", FailureKind.MODEL_TIMEOUT)),),
    ),
    Scenario(
        "html_200",
        "200 with an HTML page (a proxy's), every time",
        "provider_unavailable from the gateway's judgement of the 200; retried, then masked",
        [{"type": "bad_answer", "form": "html"}],
        _NOTHING_DONE,
        "failed",
        FailureKind.PROVIDER_UNAVAILABLE,
        _INFRA,
        None,
        checks=(("judged", _bad_answers_recorded("not an answer", FailureKind.PROVIDER_UNAVAILABLE)),),
    ),
    Scenario(
        "html_200_recovers",
        "200 with an HTML page once, then the work",
        "completed, reward 1: the page retried by the gateway, never seen by the harness",
        [{"type": "bad_answer", "form": "html"}, *_TWO_SHELLS],
        _BOTH_FILES,
        "completed",
        FailureKind.NONE,
        ("accept",),
        1.0,
        checks=(("judged_then_answered", _judged_then_answered),),
    ),
    Scenario(
        "stream_truncated",
        "a stream that ends cleanly without its terminal event, every time",
        "transport_error (a cut, recorded as one); the harness's re-asks bounded; retried, then masked",
        [{"type": "drop", "after_chunks": 2, "clean": True}],
        _NOTHING_DONE,
        "failed",
        FailureKind.TRANSPORT_ERROR,
        _INFRA,
        None,
        checks=(("cut", _bad_answers_recorded("terminal event", FailureKind.TRANSPORT_ERROR)),),
    ),
    Scenario(
        "late_start",
        "the harness is prepared, then sits past its deadline before any request (`sleep` in its place)",
        "agent_no_model_call, not agent_timeout: nothing of the policy's to grade; retried, then masked",
        _TWO_SHELLS,
        _NOTHING_DONE,
        "failed",
        FailureKind.AGENT_NO_MODEL_CALL,
        _INFRA,
        None,
        deadline_s=LATE_START_DEADLINE_S,
        checks=(("no_model_calls", _no_model_calls), ("never_graded", _not_graded)),
        launch_argv=("sleep", "600"),
    ),
)

SCENARIOS_BY_NAME = {s.name: s for s in SCENARIOS}

# The versions NeMo Gym validated, so its users can move over; ``--version nemo-gym`` picks them.
NEMO_GYM_VERSIONS = {"codex": "0.144.4", "opencode": "1.17.11", "pi": "0.80.2"}

# Registered harnesses that ``--harness all`` leaves out, and why: they have no agent loop to drive.
NOT_AGENTS = {"command": "runs any shell command as the agent; no model loop for the scenarios to drive"}


def agent_harnesses(registered: list[str]) -> list[str]:
    """The harnesses ``--harness all`` means: every registered coding agent."""
    return sorted(name for name in registered if name not in NOT_AGENTS)


def merged_config(scenario: Scenario) -> dict[str, Any]:
    """BASE_CONFIG with the scenario's overrides merged in, key by key."""

    def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
        out = dict(base)
        for key, value in over.items():
            out[key] = (
                merge(out[key], value)
                if isinstance(value, dict) and isinstance(out.get(key), dict)
                else value
            )
        return out

    return merge(BASE_CONFIG, scenario.config)


# ---------------------------------------------------------------------------------------------------------
# Checks every scenario gets


def _check_status(s: Scenario) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        got = rows[-1].get("status")
        return None if got == s.status else f"status {got!r}, expected {s.status!r}"

    return check


def _check_kind(s: Scenario) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        got = [r.get("failure_kind") for r in rows]
        want = [s.failure_kind.value] * len(rows)
        if got == want:
            return None
        message = (rows[-1].get("error_message") or "").replace("\n", " ")[:150]
        return f"failure kinds {got}, expected {s.failure_kind.value!r} (last error: {message})"

    return check


def _check_decisions(s: Scenario) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        got = tuple(r.get("decision") for r in rows)
        if got != s.decisions:
            return f"decisions {list(got)}, expected {list(s.decisions)}"
        finals = [bool(r.get("final")) for r in rows]
        if finals != [False] * (len(rows) - 1) + [True]:
            return f"final flags {finals}: only the last attempt may be final"
        masked = [bool(r.get("masked")) for r in rows]
        if masked != [d == "mask" for d in got]:
            return f"masked flags {masked} disagree with decisions {list(got)}"
        return None

    return check


def _check_reward(s: Scenario) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        if s.reward == ANY:
            return None
        got = rows[-1].get("reward")
        return None if got == s.reward else f"reward {got!r}, expected {s.reward!r}"

    return check


_RETRYABLE = frozenset(
    k.value
    for k in (
        FailureKind.RATE_LIMIT_EXCEEDED,
        FailureKind.PROVIDER_UNAVAILABLE,
        FailureKind.TRANSPORT_ERROR,
        FailureKind.MODEL_TIMEOUT,
    )
)


def _check_budget(rows: Rows, ctx: CheckContext) -> str | None:
    """The gateway stayed within its bounds: per request and per session, and nothing after it closed."""
    per_request = ctx.gateway.max_attempts_per_request

    def one(row: dict[str, Any]) -> str | None:
        attempts = _attempts(row)
        counts: dict[int, int] = {}
        for a in attempts:
            counts[a["request_index"]] = counts.get(a["request_index"], 0) + 1
        over = {i: n for i, n in counts.items() if n > per_request}
        if over:
            return f"requests over the {per_request}-attempt budget: {over}"
        # A stream the harness itself abandoned (the hang killed at its deadline) is not the endpoint's.
        failed = sum(a["kind"] in _RETRYABLE for a in attempts)
        if failed > ctx.gateway.max_attempts_per_session + 1:
            return f"{failed} failed upstream attempts, past the session's budget"
        return None

    return _each_row(rows, one)


def _check_evidence(rows: Rows, ctx: CheckContext) -> str | None:
    """Every attempt's evidence is on disk: the gateway's records and bodies, the harness's streams."""

    def one(row: dict[str, Any]) -> str | None:
        root = Path(row.get("evidence_dir") or "/nonexistent")
        model = root / "model"
        records_file = model / "attempts.jsonl"
        if not records_file.is_file():
            return f"missing {records_file}"
        records = [json.loads(line) for line in records_file.read_text().splitlines() if line.strip()]
        gaps = row.get("evidence_gaps") or []
        unkept = any(g.startswith("model_bodies_not_kept") for g in gaps)
        if len(records) != len(_attempts(row)):
            return f"attempts.jsonl has {len(records)} records, the row {len(_attempts(row))}"
        for record in records:
            for key in ("request_file", "response_file"):
                name = record.get(key)
                if name and not (model / name).is_file():
                    return f"{key} {name} of request {record['request_index']} is missing"
            if ctx.gateway.keep_bodies and record.get("response_bytes") and not record.get("response_file"):
                if not unkept:  # past the session's kept-bytes bound the row says so, and that is all
                    return f"the response body of request {record['request_index']} was not kept"
        if not (root / "harness.stdout.gz").is_file():
            return "harness.stdout.gz is missing"
        if not (root / "native_transcript.gz").is_file() and not any(
            g.startswith("transcript") for g in gaps
        ):
            return "no native transcript and no evidence gap saying so"
        try:
            gzip.decompress((root / "harness.stdout.gz").read_bytes())
        except (OSError, EOFError) as exc:
            return f"harness.stdout.gz does not decompress: {exc}"
        return None

    return _each_row(rows, one)


def _check_no_leftovers(rows: Rows, ctx: CheckContext) -> str | None:
    if ctx.leftover_processes:
        return f"processes left after the session: {list(ctx.leftover_processes)[:3]}"
    return None


def _check_cleanup(rows: Rows, ctx: CheckContext) -> str | None:
    return _each_row(rows, lambda r: None if r.get("cleanup_ok") else "the sandbox was not confirmed stopped")


def checks_for(scenario: Scenario) -> list[tuple[str, Check]]:
    """The common checks, then the scenario's own, in the order a reader wants the first failure."""
    return [
        ("status", _check_status(scenario)),
        ("failure_kind", _check_kind(scenario)),
        ("decision", _check_decisions(scenario)),
        ("reward", _check_reward(scenario)),
        ("attempt_budget", _check_budget),
        ("evidence", _check_evidence),
        ("cleanup", _check_cleanup),
        ("no_processes_left", _check_no_leftovers),
        *scenario.checks,
    ]


@dataclass(frozen=True)
class CheckResult:
    name: str
    passed: bool
    reason: str | None = None


def check_cell(scenario: Scenario, rows: Rows, ctx: CheckContext) -> list[CheckResult]:
    """Run every check on the rows of one cell (attempts in order); a check that raises fails, bounded."""
    if not rows:
        return [CheckResult("rows", False, "the session produced no row")]
    results = []
    for name, check in checks_for(scenario):
        try:
            why = check(rows, ctx)
        except Exception as exc:  # a malformed row must fail its cell, not the whole matrix
            why = f"check raised {type(exc).__name__}: {exc}"
        reason = None if why is None else why[:MAX_REASON_CHARS]
        results.append(CheckResult(name, why is None, reason))
    return results
