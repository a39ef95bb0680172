"""The driver's decision on one row: the policy's verdict on a session's outcome, the decision columns
written with it, and the training-facing reward statistics over the decided rows."""

from __future__ import annotations

import random
from typing import Any

from policy import Decision, FailureKind, Outcome, PolicyConfig, Status, Verdict, decide


def decide_row(
    row: dict[str, Any], attempt: int, policy: PolicyConfig, *, budget_left: int, rng: random.Random
) -> tuple[Verdict, dict[str, list[Any]]]:
    """The policy's verdict on one session's row, and the decision columns the driver writes for it."""
    outcome = Outcome(
        status=Status(row["status"]),
        failure_kind=FailureKind(row["failure_kind"]),
        retry_after_s=row.get("retry_after_s"),
    )
    verdict = decide(outcome, attempt, policy, budget_left=budget_left, rng=rng)
    return verdict, decision_columns(verdict)


def decision_columns(verdict: Verdict) -> dict[str, list[Any]]:
    """The decision columns of one row from its verdict."""
    final = verdict.decision is not Decision.RETRY
    masked = verdict.decision is Decision.MASK
    decisions: dict[str, list[Any]] = {
        "decision": [verdict.decision.value],
        "decision_reason": [verdict.reason[:1000]],
        "masked": [masked],
        "final": [final],
        "retry_delay_s": [verdict.retry_delay_s if not final else None],
    }
    if masked:
        decisions["reward"] = [None]  # a masked row is never a reward, not even a verified one
    return decisions


def training_reward_stats(
    decisions: list[str | None], rewards: list[float | None], finals: list[bool | None]
) -> dict[str, float | int | None]:
    """Reward statistics over final accepted rows only: a masked row is never a training signal."""
    values = [
        r
        for d, r, f in zip(decisions, rewards, finals, strict=True)
        if f and d == Decision.ACCEPT.value and r is not None
    ]
    mean = sum(values) / len(values) if values else None
    return {
        "count": len(values),
        "mean": mean,
        "min": min(values, default=None),
        "max": max(values, default=None),
    }


# What the driver reads of a row to decide on it; the rest travels on to the store unconverted.
VERDICT_COLUMNS = ("status", "failure_kind", "retry_after_s", "error_message")
