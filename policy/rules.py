"""The retry / grade / mask policy: a table from failure kind to rule, overridable per run."""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policy.breaker import BreakerConfig
from policy.groups import GroupMode
from policy.outcome import KIND_INFO, Decision, FailureKind, Outcome
from policy.staleness import StalenessConfig


class FinalAs(StrEnum):
    """What a final unsuccessful row becomes."""

    MASK = "mask"
    ACCEPT = "accept"  # a real zero (or the verifier's reward when graded)


class Rule(BaseModel):
    """How the policy treats one failure kind."""

    model_config = ConfigDict(extra="forbid")

    retry: bool = False
    max_attempts: int = Field(default=3, ge=1, le=100)  # attempts in all, the first one included
    backoff_base_s: float = Field(default=2.0, ge=0)
    backoff_cap_s: float = Field(default=60.0, ge=0)
    grade: bool = False
    final: FinalAs = FinalAs.MASK
    stop_run: bool = False  # every other session would fail the same way


def _infra(**overrides: object) -> Rule:
    return Rule(retry=True, grade=False, final=FinalAs.MASK, **overrides)


DEFAULT_RULES: dict[FailureKind, Rule] = {
    FailureKind.NONE: Rule(grade=True, final=FinalAs.ACCEPT),
    FailureKind.MODEL_CONTEXT_LIMIT: Rule(grade=True, final=FinalAs.ACCEPT),
    FailureKind.MODEL_OUTPUT_LIMIT: Rule(grade=True, final=FinalAs.ACCEPT),
    FailureKind.AGENT_TIMEOUT: Rule(grade=True, final=FinalAs.ACCEPT),
    FailureKind.MODEL_REQUEST_ERROR: Rule(grade=True, final=FinalAs.ACCEPT),
    FailureKind.AGENT_NO_RESULT: Rule(grade=True, final=FinalAs.ACCEPT),
    FailureKind.AGENT_REQUEST_LIMIT: Rule(grade=True, final=FinalAs.ACCEPT),
    # A failure the agent caused from inside its sandbox is its own: graded, never its way out of a 0.
    FailureKind.AGENT_SELF_INFLICTED: Rule(grade=True, final=FinalAs.ACCEPT),
    FailureKind.AGENT_NO_MODEL_CALL: _infra(),
    FailureKind.MODEL_TIMEOUT: _infra(),
    FailureKind.RATE_LIMIT_EXCEEDED: _infra(),
    FailureKind.PROVIDER_UNAVAILABLE: _infra(),
    FailureKind.TRANSPORT_ERROR: _infra(),
    FailureKind.SANDBOX_START_FAILED: _infra(),
    FailureKind.SANDBOX_LOST: _infra(),
    FailureKind.SETUP_FAILED: _infra(),
    # Another attempt would fail the same way: masked at once, never the agent's rerun.
    FailureKind.TASK_INVALID: Rule(retry=False, final=FinalAs.MASK),
    FailureKind.AGENT_CRASH: _infra(),
    FailureKind.VERIFIER_ERROR: _infra(),
    FailureKind.VERIFIER_TIMEOUT: _infra(),
    FailureKind.CANCELLED: _infra(max_attempts=100),
    FailureKind.CLEANUP_FAILED: Rule(grade=True, final=FinalAs.ACCEPT),
    FailureKind.PROVIDER_AUTH_ERROR: Rule(retry=False, final=FinalAs.MASK, stop_run=True),
    FailureKind.ENDPOINT_CONFIG_ERROR: Rule(retry=False, final=FinalAs.MASK, stop_run=True),
}


class PolicyConfig(BaseModel):
    """The run's policy: the default table with per-kind overrides from YAML."""

    model_config = ConfigDict(extra="forbid")

    rules: dict[FailureKind, Rule] = Field(default_factory=dict)
    retry_budget: int = Field(default=1_000, ge=0)  # extra attempts for the whole run
    group: GroupMode = GroupMode.NONE
    group_resubmits: int = Field(default=1, ge=0, le=10)  # resubmit_group: whole-group reruns per task
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    # A Retry-After past this is not waited for: the attempt is masked at once (and the breaker counts it),
    # so no hint, however large, holds a sample or the run for a day.
    max_retry_after_s: float = Field(default=300.0, ge=0)
    # A trainer's policy versions (executor/api.py): how far behind a delivered row may have started.
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)

    @model_validator(mode="after")
    def _no_graded_infrastructure_zero(self) -> PolicyConfig:
        for kind, rule in self.rules.items():
            if KIND_INFO[kind].infrastructure and rule.final is FinalAs.ACCEPT and not rule.grade:
                raise ValueError(
                    f"policy.rules.{kind.value}: final 'accept' without grading would train an "
                    "infrastructure failure as reward 0; use final: mask or grade: true"
                )
        return self

    def rule_for(self, kind: FailureKind) -> Rule:
        return self.rules.get(kind) or DEFAULT_RULES[kind]


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str
    retry_delay_s: float = 0.0


def backoff_delay(rule: Rule, attempt: int, retry_after_s: float | None, rng: random.Random) -> float:
    """Exponential backoff with full jitter, capped, never shorter than the endpoint's Retry-After."""
    ceiling = min(rule.backoff_cap_s, rule.backoff_base_s * (2 ** max(attempt - 1, 0)))
    delay = rng.uniform(0, ceiling)
    if retry_after_s is not None:
        delay = max(delay, retry_after_s)
    return delay


def decide(
    outcome: Outcome,
    attempt: int,
    policy: PolicyConfig,
    *,
    budget_left: int,
    rng: random.Random | None = None,
) -> Verdict:
    """The decision for one attempt (1-based ``attempt``) given the run's remaining retry budget."""
    kind = outcome.failure_kind
    rule = policy.rule_for(kind)
    hint = outcome.retry_after_s
    if rule.retry and hint is not None and hint > policy.max_retry_after_s:
        reason = f"{kind.value}: Retry-After {hint:.0f}s is past the policy's {policy.max_retry_after_s:.0f}s"
        return Verdict(_final(rule), reason)
    if rule.retry and attempt < rule.max_attempts:
        if budget_left > 0:
            delay = backoff_delay(rule, attempt, outcome.retry_after_s, rng or random.Random())
            return Verdict(Decision.RETRY, f"{kind.value}: attempt {attempt} of {rule.max_attempts}", delay)
        return Verdict(_final(rule), f"{kind.value}: run retry budget spent")
    if kind is FailureKind.NONE:
        return Verdict(Decision.ACCEPT, "completed")
    if rule.retry:
        return Verdict(_final(rule), f"{kind.value}: {attempt} attempts used")
    return Verdict(_final(rule), f"{kind.value}: final as {rule.final.value}")


def _final(rule: Rule) -> Decision:
    return Decision.ACCEPT if rule.final is FinalAs.ACCEPT else Decision.MASK
