"""The conformance scenarios as data, and the checks a cell (one harness x one scenario) must pass.

Each scenario is a script for the scripted model, a verifier, and what the rows of the session's attempts
must show: status, failure kind, the driver's decisions attempt by attempt, reward, the gateway's attempt
records and the evidence kept on disk. The runner (``executor/testing/conformance.py``) plays a scenario
through the real executor path and hands the stored rows to ``check_cell``; a failed check names itself
and says what it saw, in a bounded line.

What a scenario is sits in ``spec``, the table in ``scenarios``, the checks particular scenarios ask for in
``checks``, and the verdict (the checks every scenario gets, ``check_cell``) in ``verdict``.
"""

from harnesses.testing.conformance.scenarios import (
    NEMO_GYM_VERSIONS,
    NOT_AGENTS,
    SCENARIOS,
    SCENARIOS_BY_NAME,
    agent_harnesses,
    merged_config,
)
from harnesses.testing.conformance.spec import (
    ANY,
    AUTH_ERROR_BODY,
    BASE_CONFIG,
    BILLING_BODY,
    DONE,
    HANG_DEADLINE_S,
    HANG_SLACK_S,
    KILL_WINDOW_S,
    LATE_START_DEADLINE_S,
    MAX_REASON_CHARS,
    MODEL_ERROR_BODY,
    MODEL_NOT_FOUND_BODY,
    PROMPT,
    STALL_S,
    STREAM_ERROR_MESSAGE,
    Check,
    CheckContext,
    Rows,
    Scenario,
)
from harnesses.testing.conformance.verdict import (
    CheckResult,
    check_cell,
    checks_for,
)

__all__ = [
    "ANY",
    "AUTH_ERROR_BODY",
    "BASE_CONFIG",
    "BILLING_BODY",
    "DONE",
    "HANG_DEADLINE_S",
    "HANG_SLACK_S",
    "KILL_WINDOW_S",
    "LATE_START_DEADLINE_S",
    "MAX_REASON_CHARS",
    "MODEL_ERROR_BODY",
    "MODEL_NOT_FOUND_BODY",
    "NEMO_GYM_VERSIONS",
    "NOT_AGENTS",
    "PROMPT",
    "SCENARIOS",
    "SCENARIOS_BY_NAME",
    "STALL_S",
    "STREAM_ERROR_MESSAGE",
    "Check",
    "CheckContext",
    "CheckResult",
    "Rows",
    "Scenario",
    "agent_harnesses",
    "check_cell",
    "checks_for",
    "merged_config",
]
