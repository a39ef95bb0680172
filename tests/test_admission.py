from executor.admission import OBSERVED_FIELDS, Admission, AdmissionConfig
from executor.schema import model_call_fields, rows_to_batch

OK = [{"kind": "none"}]
PUSHED = [{"kind": "rate_limit_exceeded", "retry_after_s": None}, {"kind": "none"}]


def test_starts_at_the_ceiling_and_halves_on_push_back():
    a = Admission(32, AdmissionConfig(cooldown_s=0))
    assert a.cap == 32
    a.observe(PUSHED)
    assert a.cap == 16
    a.observe(PUSHED)
    assert a.cap == 8


def test_never_below_the_floor_and_recovers_additively():
    a = Admission(8, AdmissionConfig(floor=2, cooldown_s=0))
    for _ in range(10):
        a.observe(PUSHED)
    assert a.cap == 2
    caps = []
    for _ in range(40):
        a.observe(OK)
        caps.append(a.cap)
    assert caps == sorted(caps)  # grows monotonically
    assert caps[0] <= 3 and caps[-1] == 8  # additive, then capped at the ceiling


def test_a_stalled_model_call_is_push_back_and_a_transport_error_is_not():
    stalled = Admission(8, AdmissionConfig(cooldown_s=0))
    stalled.observe([{"kind": "model_timeout", "retry_after_s": None}, {"kind": "none"}])
    assert stalled.cap == 4
    broken = Admission(8, AdmissionConfig(cooldown_s=0))
    broken.observe([{"kind": "transport_error"}, {"kind": "provider_unavailable"}, {"kind": "none"}])
    assert broken.cap == 8


def test_retry_after_holds_new_admissions():
    a = Admission(8)
    a.observe([{"kind": "rate_limit_exceeded", "retry_after_s": 30.0}])
    assert a.cap == 0


def test_retry_after_hold_is_bounded():
    a = Admission(8, AdmissionConfig(max_hold_s=0, cooldown_s=0))
    a.observe([{"kind": "rate_limit_exceeded", "retry_after_s": 3600.0}])
    assert a.cap == 4


def test_fixed_when_not_adaptive():
    a = Admission(8, AdmissionConfig(adaptive=False))
    a.observe(PUSHED)
    assert a.cap == 8


def test_one_overload_seen_by_many_sessions_counts_once():
    a = Admission(32, AdmissionConfig(cooldown_s=3600))
    for _ in range(10):
        a.observe(PUSHED)
    assert a.cap == 16 and a.decreases == 1


def test_the_driver_reads_only_the_push_back_fields_of_a_row_with_token_ids():
    ids = list(range(5_000))
    call = {"prompt_token_ids": ids, "completion_token_ids": ids, "completion_logprobs": [-0.1] * 5_000}
    pushed = dict(call, status=429, kind="rate_limit_exceeded", retry_after_s=2.0)
    batch = rows_to_batch([{"model_calls": [pushed, dict(call, status=200, kind="none")]}])
    seen = model_call_fields(batch, OBSERVED_FIELDS)
    assert seen == [
        {"kind": "rate_limit_exceeded", "retry_after_s": 2.0},
        {"kind": "none", "retry_after_s": None},
    ]
    a = Admission(8, AdmissionConfig(cooldown_s=0))
    a.observe(seen)
    assert a.cap == 0  # held by the Retry-After hint
