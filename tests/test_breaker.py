"""The circuit breaker: the masked-fraction window and the consecutive-infrastructure bound."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from policy import BreakerConfig, CircuitBreaker, PolicyConfig


def test_masked_fraction_trips_only_once_the_window_holds_enough_rows():
    breaker = CircuitBreaker(BreakerConfig(window=10, min_rows=4, max_masked_fraction=0.5))
    assert breaker.record_final(True) is None  # 1 of 1 masked, but the window is not yet full enough
    assert breaker.record_final(True) is None
    assert breaker.record_final(False) is None
    reason = breaker.record_final(True)  # 3 of 4
    assert reason and "3 of the last 4 final rows masked" in reason and "50%" in reason


def test_the_window_slides_so_old_masks_age_out():
    breaker = CircuitBreaker(BreakerConfig(window=4, min_rows=4, max_masked_fraction=0.5))
    for masked in (True, True, False, False, False, False, True, True):
        assert breaker.record_final(masked) is None  # never more than 2 of the last 4
    assert breaker.masked_fraction == 0.5
    assert breaker.record_final(True) is not None  # now 3 of the last 4


def test_consecutive_infrastructure_failures_trip_and_a_success_resets_the_count():
    breaker = CircuitBreaker(BreakerConfig(max_consecutive_infra=3))
    breaker.record_attempt(True, "transport_error")
    breaker.record_attempt(True, "transport_error")
    breaker.record_attempt(False, "none")
    assert breaker.consecutive_infra == 0
    breaker.record_attempt(True, "rate_limit_exceeded")
    breaker.record_attempt(True, "rate_limit_exceeded")
    reason = breaker.record_attempt(True, "rate_limit_exceeded")
    assert reason and "3 consecutive infrastructure failures (last: rate_limit_exceeded)" in reason
    assert breaker.report()["tripped"] == reason


def test_null_bounds_turn_the_breaker_off():
    breaker = CircuitBreaker(
        BreakerConfig(window=2, min_rows=1, max_masked_fraction=None, max_consecutive_infra=None)
    )
    for _ in range(1000):
        breaker.record_attempt(True, "transport_error")
        breaker.record_final(True)
    assert breaker.tripped is None


def test_breaker_config_from_yaml_shape_and_its_errors():
    policy = PolicyConfig.model_validate(
        {"breaker": {"window": 50, "min_rows": 10, "max_masked_fraction": 0.2}, "group": "mask_group"}
    )
    assert policy.breaker.window == 50 and policy.group.value == "mask_group"
    with pytest.raises(ValidationError, match="min_rows"):
        BreakerConfig(window=5, min_rows=6)
    with pytest.raises(ValidationError, match="extra"):
        PolicyConfig.model_validate({"breaker": {"windw": 5}})
    with pytest.raises(ValidationError):
        PolicyConfig.model_validate({"group": "mask_all"})
