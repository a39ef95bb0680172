"""Admission that listens to the endpoint: the in-flight cap backs off when the endpoint pushes back.

Additive increase, multiplicative decrease on the number of sessions outstanding. A session whose
model calls met rate limits (attempts the gateway classed ``rate_limit_exceeded``, from a 429 or an
error event saying so) or stalls (``model_timeout``: accepted, then no answer within the gateway's
bounds, as a saturated server does) is a signal the endpoint is overloaded; more sessions would only
spend every session's retry budget faster. The cap never drops below ``floor`` (the run keeps moving)
and never rises above the configured cap. A Retry-After hint also holds new admissions until it has
passed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from policy import FailureKind

# What ``Admission.observe`` reads of each model attempt: the endpoint's push-back and its hint.
OBSERVED_FIELDS = ("kind", "retry_after_s")
# The attempt kinds that say the endpoint has more than it can serve. A transport error or a 5xx says
# it is broken rather than busy: the breaker's concern, not admission's.
PUSH_BACK_KINDS = frozenset({FailureKind.RATE_LIMIT_EXCEEDED.value, FailureKind.MODEL_TIMEOUT.value})


class AdmissionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    adaptive: bool = True
    floor: int = Field(default=1, ge=1)
    increase: float = Field(default=1.0, gt=0)  # added to the cap per clean session
    decrease: float = Field(default=0.5, gt=0, lt=1)  # the cap is multiplied by this per pushed-back session
    max_hold_s: float = Field(default=60.0, ge=0)  # a longer Retry-After hint holds admissions this long
    # One overload is often seen by many sessions at once; count it once, as TCP counts one loss per RTT.
    cooldown_s: float = Field(default=5.0, ge=0)


class Admission:
    def __init__(self, ceiling: int, config: AdmissionConfig | None = None) -> None:
        self.config = config or AdmissionConfig()
        self.ceiling = ceiling
        self._cap = float(ceiling)
        self._hold_until = 0.0
        self._last_decrease = -float("inf")
        self.decreases = 0

    @property
    def cap(self) -> int:
        """How many sessions may be outstanding now."""
        if not self.config.adaptive:
            return self.ceiling
        if time.monotonic() < self._hold_until:
            return 0
        return max(self.config.floor, min(self.ceiling, int(self._cap)))

    def observe(self, model_calls: Iterable[dict[str, Any]] | None) -> None:
        """Feed one finished session's model calls (the row's ``model_calls``, at least the
        ``OBSERVED_FIELDS`` of each)."""
        if not self.config.adaptive:
            return
        pushed_back = [a for a in model_calls or () if a.get("kind") in PUSH_BACK_KINDS]
        if not pushed_back:
            self._cap = min(float(self.ceiling), self._cap + self.config.increase / max(self._cap, 1.0))
            return
        now = time.monotonic()
        if now - self._last_decrease >= self.config.cooldown_s:
            self._last_decrease = now
            self.decreases += 1
            self._cap = max(float(self.config.floor), self._cap * self.config.decrease)
        hints = [a["retry_after_s"] for a in pushed_back if a.get("retry_after_s")]
        if hints:
            hold = min(max(hints), self.config.max_hold_s)
            self._hold_until = max(self._hold_until, now + hold)
