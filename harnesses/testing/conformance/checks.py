"""The checks particular scenarios ask for, beside the ones every scenario gets (verdict.py)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

from harnesses.testing.conformance.spec import (
    DONE,
    HANG_DEADLINE_S,
    HANG_SLACK_S,
    KILL_WINDOW_S,
    STREAM_ERROR_MESSAGE,
    Check,
    CheckContext,
    Rows,
)
from policy import FailureKind


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
