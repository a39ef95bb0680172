"""From a session's evidence to one Outcome. The gateway's record outranks what the harness printed."""

from __future__ import annotations

from typing import Any

from harnesses.base import HarnessReport
from harnesses.gateway import GatewaySession
from policy import KIND_INFO, FailureKind, Outcome, Status
from sandboxes.base import ExecResult

_OUTPUT_LIMIT_REASONS = frozenset({"length", "max_output_tokens", "max_tokens"})


def classify(result: ExecResult, report: HarnessReport, gateway: GatewaySession) -> Outcome:
    last_failure = gateway.last_failure()
    detail: dict[str, Any] = {"exit_code": result.exit_code, "signal": result.signal}
    if report.claimed_failure is not None:
        detail["harness_claimed"] = report.claimed_failure.value
    if report.claimed_message:
        detail["harness_message"] = report.claimed_message[:2000]
    http = {
        "http_status": last_failure.status if last_failure else None,
        "retry_after_s": last_failure.retry_after_s if last_failure else None,
        "error_detail": detail,
    }

    # The gateway gave up on the session (budget, auth, overflow cap): that is the authoritative cause,
    # whatever the harness made of the neutral 400 it got afterwards.
    if gateway.closed_kind is not None:
        return Outcome.of(gateway.closed_kind, gateway.closed_message, **http)
    if result.timed_out and gateway.stalled_at_close:
        # The deadline fell while the endpoint sat on a request past the gateway's stall bound: the time
        # was the model's, not the agent's, and the partial work must not be graded as the agent's best.
        return Outcome.of(
            FailureKind.MODEL_TIMEOUT,
            f"deadline of {result.duration_s:.1f}s fell while a model request had stalled "
            f"({gateway.model_wait_s:.1f}s of the session spent waiting on the model)",
            **http,
        )
    if result.timed_out:
        # A bound of the sandbox's (its disk) ends it as its deadline would: stopped by a limit, its doing.
        why = f"harness stopped after {result.duration_s:.1f}s: {result.limit}" if result.limit else None
        return Outcome.of(
            FailureKind.AGENT_TIMEOUT,
            why or f"harness killed at its deadline after {result.duration_s:.1f}s",
            **http,
        )

    last = gateway.attempts[-1] if gateway.attempts else None
    if last is not None and last.kind is FailureKind.NONE and last.finish_reason in _OUTPUT_LIMIT_REASONS:
        # Codex fails the turn on a truncated answer, others carry on: either way the model hit its limit.
        return Outcome.of(FailureKind.MODEL_OUTPUT_LIMIT, "the model stopped on its output limit", **http)
    # A harness may print an endpoint's error as its answer and exit 0 (an error event inside a 200
    # stream, say): the session's last model call failing outranks that.
    ended_on_failure = (
        last is not None
        and last.kind not in (FailureKind.NONE, FailureKind.CANCELLED)
        and not last.client_aborted
    )
    if (
        report.claimed_failure is None
        and result.exit_code == 0
        and report.final_text
        and not ended_on_failure
    ):
        return Outcome(status=Status.COMPLETED, error_detail=detail)
    if not gateway.attempts and not report.final_text and result.exit_code == 0:
        # Not one model request, and no error either: the harness never started its loop (launch,
        # environment, config). A harness that died instead is a crash, below.
        message = "the harness exited cleanly without a single model request"
        tail = result.stderr_tail[-2000:]
        return Outcome.of(
            FailureKind.AGENT_NO_MODEL_CALL, f"{message}; stderr: {tail}" if tail else message, **http
        )

    # The harness failed. Prefer what the endpoint actually answered on the session's last request.
    if last_failure is not None and _on_last_request(gateway, last_failure.request_index):
        return Outcome.of(last_failure.kind, last_failure.error_message, **http)
    if (why := _self_inflicted(result, report, gateway)) is not None:
        return Outcome.of(FailureKind.AGENT_SELF_INFLICTED, why, **http)
    if report.claimed_failure is not None:
        return Outcome.of(report.claimed_failure, report.claimed_message, **http)
    if result.exit_code != 0:
        how = f"signal {result.signal}" if result.signal else f"exit code {result.exit_code}"
        message = f"harness died ({how}); stderr: {result.stderr_tail[-2000:]}"
        return Outcome.of(FailureKind.AGENT_CRASH, message, **http)
    if report.claimed_message:  # it said it failed, in words no recognizer knows
        return Outcome.of(FailureKind.AGENT_CRASH, report.claimed_message, **http)
    return Outcome.of(FailureKind.AGENT_NO_RESULT, "the harness exited without a final answer", **http)


def _on_last_request(gateway: GatewaySession, request_index: int) -> bool:
    return not gateway.attempts or request_index >= max(a.request_index for a in gateway.attempts)


def _self_inflicted(result: ExecResult, report: HarnessReport, gateway: GatewaySession) -> str | None:
    """Why the harness's failure is the agent's own doing, or None when it may not be.

    Once the model has answered, what runs in the sandbox is the policy's: its tool commands run as the
    harness's own user, in its PID namespace, beside its files, and nothing of the executor's shares
    that identity (the gateway's forwarder and every supervisor are root's). So after a model answer,
    a harness killed by a signal that no timeout or bound of ours sent, stopped by its sandbox's own
    bound (memory), dead of a non-zero exit, or claiming an endpoint failure that the gateway, which sees
    every request, never saw, was brought down from inside the sandbox: by a process the agent ran, a
    file or config it changed, or an answer that broke its harness. That is graded, or the policy could
    escape a reward of 0 by killing its harness. Before the first answer the agent has done nothing,
    and a session in which the gateway saw an infrastructure failure keeps the doubt: both stay the
    infrastructure's (docs/failures.md)."""
    if result.timed_out or not any(a.kind is FailureKind.NONE for a in gateway.attempts):
        return None
    if any(a.kind is not FailureKind.NONE and KIND_INFO[a.kind].infrastructure for a in gateway.attempts):
        return None
    claimed = report.claimed_failure
    if claimed is not None and not KIND_INFO[claimed].infrastructure:
        return None  # the harness's own word on the model's part (an overflow, say) decides
    if result.limit:
        return f"the harness was stopped by its sandbox's {result.limit} bound after the model had acted"
    if result.signal:
        return f"the harness was killed by signal {result.signal} (none of ours) after the model had acted"
    if result.exit_code not in (0, None):
        return (
            f"the harness died (exit code {result.exit_code}) after the model had acted; stderr: "
            + (result.stderr_tail[-1500:])
        )
    if claimed is not None and KIND_INFO[claimed].infrastructure:
        return f"the harness reported {claimed.value}, which the gateway never saw, after the model had acted"
    return None
