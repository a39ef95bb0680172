"""An endpoint answering 429 to half of all requests: the run completes, within its budgets."""

from __future__ import annotations

import json

import pytest
import ray

from executor.api import Executor
from executor.config import load_config
from executor.store import read_table
from tests.test_command_harness import AGENT

pytestmark = pytest.mark.integration

CALLS = 3
TASKS = 12


def test_half_of_requests_rate_limited(tmp_path):
    script = []
    for i in range(CALLS):
        script += [
            {"type": "error", "status": 429, "headers": {"Retry-After": "0"}},
            {"type": "text", "text": f"answer {i}"},
        ]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps(
                {"id": f"t{i:02d}", "prompt": "p", "model_script": script, "verify": "test -s answer.txt"}
            )
            + "\n"
            for i in range(TASKS)
        )
    )
    agent = f"for i in $(seq {CALLS}); do\n{AGENT}\ndone"
    cfg_path = tmp_path / "half429.yaml"
    cfg_path.write_text(
        f"tasks: {tasks}\nout: {tmp_path / 'out'}\nsandbox: {{root: {tmp_path / 'sb'}}}\n"
        f"harness: {{name: command, command: {json.dumps(agent)}}}\n"
        "gateway: {max_attempts_per_request: 3, max_attempts_per_session: 6, backoff_base_s: 0.05}\n"
        "policy: {retry_budget: 5}\n"
        "concurrency: {workers: 1, sessions_per_worker: 4, admission: {cooldown_s: 0}}\n"
    )
    executor = Executor(load_config(cfg_path), progress=True)
    driver = executor.driver
    try:
        summary = executor.run()
    finally:
        ray.shutdown()
    assert summary.exit_code == 0, summary
    rows = read_table(tmp_path / "out" / "half429").to_pylist()
    assert len(rows) == TASKS and all(r["final"] and r["decision"] == "accept" for r in rows)
    upstream = [a for r in rows for a in r["model_calls"]]
    limited = sum(a["status"] == 429 for a in upstream)
    print(
        f"HALF429 sessions={TASKS} upstream={len(upstream)} limited={limited} "
        f"cap_decreases={driver.admission.decreases} final_cap={driver.admission.cap}"
    )
    assert limited == len(upstream) // 2 == TASKS * CALLS  # every 429 was retried once, and only once
    assert len(upstream) <= TASKS * 6  # the gateway's per-session budget
    assert driver.admission.decreases == TASKS  # every pushed-back session slowed admission
