"""Classification from a session's evidence: the gateway's record outranks what the harness printed."""

from pathlib import Path

import pytest

from harnesses.base import HarnessReport
from harnesses.classify import classify
from harnesses.gateway import AttemptRecord, GatewaySession
from policy import FailureKind, Status
from policy.outcome import KIND_INFO
from sandboxes.base import ExecResult


def _session(*kinds: tuple[int | None, FailureKind], **fields: object) -> GatewaySession:
    session = GatewaySession("s", "token", "http://127.0.0.1:1/s/token/v1", Path("/nonexistent"))
    for index, (status, kind) in enumerate(kinds):
        session.attempts.append(
            AttemptRecord(
                request_index=index,
                attempt=1,
                method="POST",
                path="/responses",
                started_at=0.0,
                status=status,
                kind=kind,
                latency_s=0.1,
                request_sha256="0" * 64,
                client_aborted=bool(fields.get("client_aborted")),
            )
        )
    session.stalled_at_close = bool(fields.get("stalled_at_close"))
    return session


def _exited(code: int | None = 0, *, timed_out: bool = False, signal: int | None = None) -> ExecResult:
    return ExecResult(exit_code=code, timed_out=timed_out, signal=signal, duration_s=1.0, stderr_tail="boom")


ANSWERED = (200, FailureKind.NONE)


def test_an_exit_without_a_single_model_request_is_no_model_call_not_no_result():
    outcome = classify(_exited(0), HarnessReport(), _session())
    assert outcome.failure_kind is FailureKind.AGENT_NO_MODEL_CALL
    assert "without a single model request" in (outcome.error_message or "")
    assert "boom" in (outcome.error_message or "")  # the harness's own words, for the reader
    assert (
        classify(_exited(0), HarnessReport(), _session(ANSWERED)).failure_kind is FailureKind.AGENT_NO_RESULT
    )
    assert classify(_exited(3), HarnessReport(), _session()).failure_kind is FailureKind.AGENT_CRASH


def test_a_harness_that_answers_without_the_model_still_completes():
    outcome = classify(_exited(0), HarnessReport(final_text="done"), _session())
    assert outcome.status is Status.COMPLETED


@pytest.mark.parametrize(
    ("stalled", "kind"), [(True, FailureKind.MODEL_TIMEOUT), (False, FailureKind.AGENT_TIMEOUT)]
)
def test_a_deadline_is_the_models_when_a_request_had_stalled(stalled, kind):
    outcome = classify(
        _exited(None, timed_out=True, signal=9), HarnessReport(), _session(ANSWERED, stalled_at_close=stalled)
    )
    assert outcome.failure_kind is kind


def test_a_last_model_call_that_failed_outranks_a_claimed_answer():
    in_stream = (200, FailureKind.PROVIDER_UNAVAILABLE)
    outcome = classify(
        _exited(0), HarnessReport(final_text="an error occurred"), _session(ANSWERED, in_stream)
    )
    assert (outcome.status, outcome.failure_kind) == (Status.FAILED, FailureKind.PROVIDER_UNAVAILABLE)


def test_a_harness_hanging_up_on_its_last_call_does_not_undo_its_answer():
    hung_up = _session((None, FailureKind.TRANSPORT_ERROR), client_aborted=True)
    assert classify(_exited(0), HarnessReport(final_text="done"), hung_up).status is Status.COMPLETED


def test_a_sandbox_that_filled_its_disk_bound_is_the_agents_doing():
    """Stopped by a bound of its sandbox, as by its deadline: partial work, graded, never infrastructure."""
    stopped = _exited(None, timed_out=True, signal=9).model_copy(update={"limit": "files past 32 MiB"})
    outcome = classify(stopped, HarnessReport(), _session(ANSWERED))
    assert outcome.failure_kind is FailureKind.AGENT_TIMEOUT and "files past 32 MiB" in outcome.error_message
    assert not KIND_INFO[FailureKind.AGENT_TIMEOUT].infrastructure


def test_a_deadline_before_the_first_model_request_is_a_launch_problem_not_the_agents_time():
    """Under load a harness may start late and be killed before it asked the model anything: nothing of
    the policy's is there to grade, so it is not agent_timeout (graded, accepted) but a masked retry."""
    killed = _exited(None, timed_out=True, signal=9)
    outcome = classify(killed, HarnessReport(), _session())
    assert outcome.failure_kind is FailureKind.AGENT_NO_MODEL_CALL
    assert "before the harness's first model request" in (outcome.error_message or "")
    assert KIND_INFO[FailureKind.AGENT_NO_MODEL_CALL].infrastructure
    # A bound of the sandbox's is still the agent's doing, with or without a model request.
    stopped = killed.model_copy(update={"limit": "files past 32 MiB"})
    assert classify(stopped, HarnessReport(), _session()).failure_kind is FailureKind.AGENT_TIMEOUT
