"""A cell's verdict: the checks every scenario gets, then its own, each failure one bounded line."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnesses.testing.conformance.checks import _attempts, _each_row
from harnesses.testing.conformance.spec import ANY, MAX_REASON_CHARS, Check, CheckContext, Rows, Scenario
from policy import FailureKind


def _check_status(s: Scenario) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        got = rows[-1].get("status")
        return None if got == s.status else f"status {got!r}, expected {s.status!r}"

    return check


def _check_kind(s: Scenario) -> Check:
    def check(rows: Rows, ctx: CheckContext) -> str | None:
        got = [r.get("failure_kind") for r in rows]
        # An attempt whose harness reached no model request by its deadline (a start starved of CPU by
        # the cells beside it) is a launch problem, retried and masked as one: what it proves is the
        # executor's, and the attempt after it still has to show the scenario's own kind.
        while len(got) > 1 and got[0] == FailureKind.AGENT_NO_MODEL_CALL.value != s.failure_kind.value:
            if rows[len(rows) - len(got)].get("decision") != "retry":
                break
            got = got[1:]
        want = [s.failure_kind.value] * len(got)
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
