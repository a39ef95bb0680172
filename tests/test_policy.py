import random
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from pydantic import ValidationError

from policy import (
    DEFAULT_RULES,
    KIND_INFO,
    MAX_ERROR_MESSAGE_CHARS,
    Decision,
    FailureKind,
    Outcome,
    PolicyConfig,
    Rule,
    Status,
    backoff_delay,
    bound_text,
    decide,
    error_message_of,
    kind_for_http,
    parse_retry_after,
)


def test_every_kind_has_info_and_a_default_rule():
    assert set(KIND_INFO) == set(FailureKind)
    assert set(DEFAULT_RULES) == set(FailureKind)


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (None, None, FailureKind.TRANSPORT_ERROR),
        (200, None, FailureKind.NONE),
        (429, None, FailureKind.RATE_LIMIT_EXCEEDED),
        (401, None, FailureKind.PROVIDER_AUTH_ERROR),
        (403, None, FailureKind.PROVIDER_AUTH_ERROR),
        (500, None, FailureKind.PROVIDER_UNAVAILABLE),
        (503, None, FailureKind.PROVIDER_UNAVAILABLE),
        (408, None, FailureKind.PROVIDER_UNAVAILABLE),
        (400, '{"error":{"code":"context_length_exceeded"}}', FailureKind.MODEL_CONTEXT_LIMIT),
        (400, '{"error":{"message":"bad tool schema"}}', FailureKind.MODEL_REQUEST_ERROR),
        (413, "This model's maximum context length is 8192 tokens", FailureKind.MODEL_CONTEXT_LIMIT),
        (422, None, FailureKind.MODEL_REQUEST_ERROR),
        (413, None, FailureKind.MODEL_REQUEST_ERROR),
        (404, '{"error":{"message":"The model `gpt-x` does not exist"}}', FailureKind.ENDPOINT_CONFIG_ERROR),
        (402, None, FailureKind.ENDPOINT_CONFIG_ERROR),
        (405, None, FailureKind.ENDPOINT_CONFIG_ERROR),
        (418, None, FailureKind.ENDPOINT_CONFIG_ERROR),
    ],
)
def test_kind_for_http(status, body, kind):
    assert kind_for_http(status, body) is kind


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", 1.0),
        ("0", 0.0),
        (" 2.5 ", 2.5),
        ("NaN", None),
        ("inf", None),
        ("-3", None),
        ("soon", None),
        ("", None),
        (None, None),
    ],
)
def test_retry_after_seconds(value, expected):
    assert parse_retry_after(value) == expected


def test_retry_after_http_date():
    now = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
    header = format_datetime(now + timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(header, now=now) == pytest.approx(30.0)
    past = format_datetime(now - timedelta(seconds=30), usegmt=True)
    assert parse_retry_after(past, now=now) == 0.0


def test_error_message_of_openai_body():
    assert error_message_of('{"error":{"message":"slow down"}}') == "slow down"
    assert error_message_of("not json at all") == "not json at all"
    assert error_message_of(None) is None


def test_error_message_is_bounded():
    outcome = Outcome.of(FailureKind.AGENT_CRASH, "x" * 100_000)
    assert len(outcome.error_message) == MAX_ERROR_MESSAGE_CHARS
    assert outcome.error_message.endswith("chars cut]")
    assert bound_text("short") == "short"


def test_outcome_status_follows_kind():
    assert Outcome.of(FailureKind.AGENT_TIMEOUT).status is Status.INCOMPLETE
    assert Outcome.of(FailureKind.RATE_LIMIT_EXCEEDED).status is Status.FAILED
    assert Outcome.of(FailureKind.MODEL_CONTEXT_LIMIT).status is Status.INCOMPLETE


def _decide(kind, attempt=1, budget=10, policy=None, retry_after=None):
    outcome = Outcome.of(kind, retry_after_s=retry_after)
    return decide(outcome, attempt, policy or PolicyConfig(), budget_left=budget, rng=random.Random(0))


def test_completed_is_accepted():
    assert _decide(FailureKind.NONE).decision is Decision.ACCEPT


@pytest.mark.parametrize(
    "kind",
    [
        FailureKind.RATE_LIMIT_EXCEEDED,
        FailureKind.PROVIDER_UNAVAILABLE,
        FailureKind.TRANSPORT_ERROR,
        FailureKind.SANDBOX_LOST,
        FailureKind.SANDBOX_START_FAILED,
        FailureKind.SETUP_FAILED,
        FailureKind.AGENT_CRASH,
    ],
)
def test_infrastructure_failures_retry_then_mask(kind):
    assert _decide(kind, attempt=1).decision is Decision.RETRY
    last = DEFAULT_RULES[kind].max_attempts
    verdict = _decide(kind, attempt=last)
    assert verdict.decision is Decision.MASK
    assert "attempts used" in verdict.reason


def test_retry_budget_spent_masks_at_once():
    verdict = _decide(FailureKind.RATE_LIMIT_EXCEEDED, attempt=1, budget=0)
    assert verdict.decision is Decision.MASK
    assert "budget" in verdict.reason


@pytest.mark.parametrize(
    "kind",
    [
        FailureKind.MODEL_CONTEXT_LIMIT,
        FailureKind.MODEL_OUTPUT_LIMIT,
        FailureKind.AGENT_TIMEOUT,
        FailureKind.MODEL_REQUEST_ERROR,
    ],
)
def test_model_side_limits_are_graded_and_accepted(kind):
    assert DEFAULT_RULES[kind].grade
    assert _decide(kind).decision is Decision.ACCEPT


def test_model_request_error_can_be_masked_by_config():
    policy = PolicyConfig(rules={FailureKind.MODEL_REQUEST_ERROR: Rule(final="mask")})
    assert _decide(FailureKind.MODEL_REQUEST_ERROR, policy=policy).decision is Decision.MASK


def test_auth_error_stops_the_run_and_masks():
    rule = DEFAULT_RULES[FailureKind.PROVIDER_AUTH_ERROR]
    assert rule.stop_run and not rule.retry
    assert _decide(FailureKind.PROVIDER_AUTH_ERROR).decision is Decision.MASK


def test_infrastructure_failure_can_never_be_accepted_ungraded():
    with pytest.raises(ValidationError, match="rate_limit_exceeded"):
        PolicyConfig.model_validate({"rules": {"rate_limit_exceeded": {"final": "accept"}}})


def test_unknown_policy_key_is_rejected():
    with pytest.raises(ValidationError):
        PolicyConfig.model_validate({"rules": {"rate_limit_exceeded": {"retries": 3}}})
    with pytest.raises(ValidationError):
        PolicyConfig.model_validate({"rules": {"no_such_kind": {}}})


def test_backoff_is_capped_jittered_and_floored_by_retry_after():
    rule = Rule(retry=True, backoff_base_s=1.0, backoff_cap_s=4.0)
    rng = random.Random(1)
    delays = [backoff_delay(rule, attempt, None, rng) for attempt in range(1, 50)]
    assert all(0 <= d <= 4.0 for d in delays)
    assert len(set(delays)) > 10  # jittered, not a constant
    assert all(backoff_delay(rule, 5, 30.0, rng) >= 30.0 for _ in range(20))


def test_retry_verdict_carries_the_retry_after_floor():
    verdict = _decide(FailureKind.RATE_LIMIT_EXCEEDED, retry_after=7.0)
    assert verdict.decision is Decision.RETRY
    assert verdict.retry_delay_s >= 7.0


@pytest.mark.parametrize(
    "kind",
    [
        FailureKind.ENDPOINT_CONFIG_ERROR,
        FailureKind.MODEL_TIMEOUT,
        FailureKind.AGENT_NO_MODEL_CALL,
    ],
)
def test_new_infrastructure_kinds_are_never_graded_and_end_masked(kind):
    policy = PolicyConfig()
    rule = policy.rule_for(kind)
    assert KIND_INFO[kind].infrastructure
    assert not rule.grade
    last = decide(Outcome.of(kind), rule.max_attempts, policy, budget_left=10)
    assert last.decision is Decision.MASK


def test_an_endpoint_config_error_stops_the_run_and_a_stall_is_retried():
    policy = PolicyConfig()
    assert policy.rule_for(FailureKind.ENDPOINT_CONFIG_ERROR).stop_run
    assert (
        decide(Outcome.of(FailureKind.ENDPOINT_CONFIG_ERROR), 1, policy, budget_left=10).decision
        is Decision.MASK
    )
    assert decide(Outcome.of(FailureKind.MODEL_TIMEOUT), 1, policy, budget_left=10).decision is Decision.RETRY


def test_a_retry_after_past_the_policy_bound_masks_at_once_and_a_shorter_one_waits():
    policy = PolicyConfig(max_retry_after_s=300)
    huge = Outcome.of(FailureKind.RATE_LIMIT_EXCEEDED, retry_after_s=86_400.0)
    verdict = decide(huge, 1, policy, budget_left=10)
    assert verdict.decision is Decision.MASK
    assert "86400s" in verdict.reason and "300s" in verdict.reason
    short = Outcome.of(FailureKind.RATE_LIMIT_EXCEEDED, retry_after_s=120.0)
    verdict = decide(short, 1, policy, budget_left=10)
    assert verdict.decision is Decision.RETRY and verdict.retry_delay_s >= 120.0
