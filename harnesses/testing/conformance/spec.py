"""What a scenario is, what a check sees, and the settings and bounds every cell shares."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harnesses.gateway import GatewayConfig
from policy import FailureKind, PolicyConfig

PROMPT = "Run the requested shell checks, then report CONFORMANCE_DONE."
DONE = "CONFORMANCE_DONE"
MAX_REASON_CHARS = 300
ANY = "any"  # an expectation that accepts whatever the row holds

STALL_S = 3.0
# The run settings every cell starts from (RunConfig keys): fast retries, so the matrix stays short, and
# the infrastructure kinds retried once by the driver, so "retried, then masked" shows in two attempts.
# A session budget of 4 failed upstream attempts leaves room for the recoveries (a 429 twice, a stall, a
# page) within one session, and ends a harness's own reconnect loop after its fourth failure, as the
# gateway is meant to.
_FAST_RETRY = {"retry": True, "max_attempts": 2, "backoff_base_s": 0.2, "backoff_cap_s": 1.0}
BASE_CONFIG: dict[str, Any] = {
    "gateway": {
        "max_attempts_per_request": 3,
        "max_attempts_per_session": 4,
        "backoff_base_s": 0.1,
        "backoff_cap_s": 0.5,
        # The scripted model answers in milliseconds: a request without a byte for 3 s has stalled.
        "first_byte_timeout_s": STALL_S,
        "chunk_timeout_s": STALL_S,
    },
    "policy": {
        "rules": {
            "rate_limit_exceeded": _FAST_RETRY,
            "provider_unavailable": _FAST_RETRY,
            "transport_error": _FAST_RETRY,
            "model_timeout": _FAST_RETRY,
            "agent_no_model_call": _FAST_RETRY,
            "verifier_error": _FAST_RETRY,
        }
    },
    "limits": {"deadline_s": 180, "grace_s": 2},
}
# The cells whose stream fails after bytes reached the harness, every time: the harness re-asks on its
# own (OpenCode re-sends a cut stream 5 times, waiting about 2.5, 4, 10 s between them) and only the
# session's budget ends that. A budget of 2 proves the same bound after one re-ask and spares the
# waits after it, at every pin and harness; the recovering cells keep BASE_CONFIG's 4.
STREAM_FAILS_CONFIG: dict[str, Any] = {"gateway": {"max_attempts_per_session": 2}}
# The cells whose every attempt stalls: each attempt waits out the stall bound, and the gateway closes the
# session once a request's attempts are spent. Two attempts prove the stall retried, then given up, a
# stall bound sooner than three; model_slow_first_byte, answered on its retry, keeps BASE_CONFIG's 3.
STALLS_CONFIG: dict[str, Any] = {"gateway": {"max_attempts_per_request": 2}}
# The agent_hang deadline, and how far past deadline + grace the session may end (supervisor start-up, kill
# rounds, the parse of what the harness left). Long enough for a harness to reach its first model request
# on a loaded machine (OpenCode and Hermes took more than 8 s with four cells at once on two cores): a
# deadline before it is a launch problem (agent_no_model_call), not the agent's time.
HANG_DEADLINE_S = 30.0
HANG_SLACK_S = 8.0
# late_start: the harness never reaches the model, so any deadline will do; a short one keeps the cell short.
LATE_START_DEADLINE_S = 3.0
# agent_hang: a request unanswered when the harness was stopped counts against the model unless it was
# sent within this long before the stop (or after it): cut by the stop, not left waiting by the model.
KILL_WINDOW_S = 1.0

# A plain 400 that is no context overflow and holds none of the words that make a harness retry
# (reference/harnesses.md section 9).
MODEL_ERROR_BODY = json.dumps(
    {
        "error": {
            "message": "controlled model failure: the request was refused for conformance",
            "type": "invalid_request_error",
            "code": "conformance_refusal",
        }
    }
)
AUTH_ERROR_BODY = json.dumps(
    {
        "error": {
            "message": "Incorrect API key provided.",
            "type": "invalid_request_error",
            "code": "invalid_api_key",
        }
    }
)

# An unknown model and an account out of credits, as OpenAI-compatible servers word them.
MODEL_NOT_FOUND_BODY = json.dumps(
    {
        "error": {
            "message": "The model `no-such-model` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "code": "model_not_found",
        }
    }
)
BILLING_BODY = json.dumps(
    {
        "error": {
            "message": "Insufficient credits on this account. Add a payment method to continue.",
            "type": "billing_error",
            "code": "insufficient_credits",
        }
    }
)
STREAM_ERROR_MESSAGE = "The server had an error while processing your request."


@dataclass(frozen=True)
class CheckContext:
    """What a check may consult besides the rows: the run's policy and gateway bounds, and what the
    runner saw of the sandbox after the session (processes left behind)."""

    policy: PolicyConfig
    gateway: GatewayConfig
    grace_s: float
    leftover_processes: tuple[str, ...] = ()


Rows = list[dict[str, Any]]
Check = Callable[[Rows, CheckContext], str | None]  # None: pass; else why not, one bounded line


@dataclass(frozen=True)
class Scenario:
    name: str
    does: str  # what the scripted model does
    demands: str  # what the rows must show
    script: list[dict[str, Any]]
    verify: str
    status: str
    failure_kind: FailureKind
    decisions: tuple[str, ...]  # the driver's decision on each attempt, in order
    reward: float | str | None  # of the final row; ANY to leave it to the extra checks
    deadline_s: float | None = None
    config: dict[str, Any] = field(default_factory=dict)  # merged over BASE_CONFIG
    checks: tuple[tuple[str, Check], ...] = ()
    # The harness is prepared as usual (its config files written), then this command runs in its place:
    # the adapter's parse and the classification meet a harness that never reached the model.
    launch_argv: tuple[str, ...] | None = None
    # The models the scripted model serves, refusing any other with a 404 as vLLM does; None: it serves
    # the run's model and answers any name.
    served_models: tuple[str, ...] | None = None
    # Every request to the endpoint, the gateway's own probe of the run's config included, gets this
    # status: the run's key, account or model is what is wrong (the script is never reached).
    endpoint_refuses: int | None = None
