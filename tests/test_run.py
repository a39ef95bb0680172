"""A full run through Ray with the real Codex CLI: the demo tasks, then a SIGKILL of the driver and resume."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from executor.store import part_files, read_table
from tests.conftest import processes_under

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("codex_installed")]

REPO = Path(__file__).parents[1]
CONFIG = """\
tasks: {tasks}
out: {out}
run_id: {run_id}
sandbox: {{root: {sandboxes}}}
gateway: {{max_attempts_per_request: 3, backoff_base_s: 0.1}}
policy:
  rules:
    rate_limit_exceeded: {{retry: true, max_attempts: 2, backoff_base_s: 0.2, backoff_cap_s: 0.5}}
    model_timeout: {{retry: true, max_attempts: 2, backoff_base_s: 0.2, backoff_cap_s: 0.5}}
limits: {{deadline_s: 60, grace_s: 3}}
concurrency: {{workers: 1, sessions_per_worker: 4}}
"""


def _config(tmp_path: Path, run_id: str, tasks: Path) -> Path:
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(
        CONFIG.format(tasks=tasks, out=tmp_path / "out", run_id=run_id, sandboxes=tmp_path / "sandboxes")
    )
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["RAY_TMPDIR"] = "/tmp/rollout-ray-tests"
    return env


def _rollout(*args: str) -> list[str]:
    return [sys.executable, "-m", "executor.cli", *args]


def test_demo_tasks_through_ray(demo_run):
    # The session's one `rollout run` of the demo tasks (tests/conftest.py demo_run, this module's CONFIG
    # less its run id), which the operator commands' tests read too: a second run would assert the same.
    assert_demo_outcomes(read_table(demo_run).to_pylist())

    status = subprocess.run(
        _rollout("status", str(demo_run)),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert status.returncode == 0
    assert "rate_limit_exceeded" in status.stdout and "model_timeout" in status.stdout
    assert not processes_under(str(demo_run.parents[1] / "sandboxes"))


def assert_demo_outcomes(rows: list[dict]) -> None:
    """What the demo tasks come to, on any provider."""
    final = {r["task_id"]: r for r in rows if r["final"]}
    assert len(final) == 7
    for task in ("hello-file", "fix-add", "word-count", "rate-limit-recovers"):
        r = final[task]
        assert (r["status"], r["failure_kind"], r["reward"], r["decision"]) == (
            "completed",
            "none",
            1.0,
            "accept",
        ), (task, r["error_message"])
    recovered = final["rate-limit-recovers"]["model_calls"]
    assert recovered[0]["status"] == 429 and recovered[1]["status"] == 200
    assert recovered[1]["started_at"] - recovered[0]["started_at"] >= 1.0

    forever = [r for r in rows if r["task_id"] == "rate-limit-forever"]
    assert [r["attempt"] for r in forever] == [1, 2]
    assert [r["decision"] for r in forever] == ["retry", "mask"]
    assert all(r["failure_kind"] == "rate_limit_exceeded" and r["reward"] is None for r in forever)

    overflow = final["context-overflow"]
    assert (overflow["status"], overflow["failure_kind"], overflow["verified"]) == (
        "incomplete",
        "model_context_limit",
        True,
    )
    # A model that never answers: the deadline falls while it sits on the request, so the time was the
    # model's: retried, then masked, never graded.
    hangs = [r for r in rows if r["task_id"] == "model-hangs"]
    assert [(r["failure_kind"], r["decision"], r["reward"]) for r in hangs] == [
        ("model_timeout", "retry", None),
        ("model_timeout", "mask", None),
    ], [r["error_message"] for r in hangs]
    assert all(r["t_agent_s"] < 10 + 3 + 5 for r in hangs)


def _many_tasks(tmp_path: Path, n: int) -> Path:
    import json

    path = tmp_path / "many.jsonl"
    with path.open("w") as fh:
        for i in range(n):
            script = [{"type": "shell", "command": f"echo {i} > out.txt"}, {"type": "text", "text": "ok"}]
            if i % 5 == 0:  # some sessions outlive the kill
                script = [{"type": "hang", "max_s": 600}]
            fh.write(
                json.dumps(
                    {
                        "id": f"t{i:03d}",
                        "prompt": "write out.txt",
                        "model_script": script,
                        "deadline_s": 4 if i % 5 == 0 else 60,
                        "verify": "test -f out.txt",
                    }
                )
                + "\n"
            )
    return path


def test_sigkill_of_the_driver_then_resume(tmp_path):
    tasks = _many_tasks(tmp_path, 16)
    cfg = _config(tmp_path, "killed", tasks)
    rows_dir = tmp_path / "out" / "killed" / "rows"
    driver = subprocess.Popen(
        _rollout("run", str(cfg)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=REPO,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not part_files(rows_dir) and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # waiting for a condition, bounded; not synchronisation by sleeping
    assert driver.poll() is None, "the run ended before it could be killed"
    assert part_files(rows_dir), "no part file within the bound"
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait(timeout=60)
    _wait_gone(str(tmp_path / "sandboxes"))

    again = subprocess.run(
        _rollout("run", str(cfg)), capture_output=True, text=True, timeout=600, env=_env(), cwd=REPO
    )
    assert again.returncode == 0, again.stderr[-3000:]
    for part in part_files(rows_dir):
        pq.read_table(part)  # every part file reads whole
    rows = read_table(tmp_path / "out" / "killed").to_pylist()
    identities = Counter((r["task_id"], r["sample_index"], r["attempt"]) for r in rows)
    assert max(identities.values()) == 1
    finals = Counter((r["task_id"], r["sample_index"]) for r in rows if r["final"])
    assert set(finals) == {(f"t{i:03d}", 0) for i in range(16)}
    assert set(finals.values()) == {1}
    assert not processes_under(str(tmp_path / "sandboxes"))
    shutil.rmtree(tmp_path / "sandboxes", ignore_errors=True)


def _wait_gone(marker: str, bound_s: float = 60) -> None:
    """Sandbox trees of a killed driver must die on their own (their supervisors lose their parent)."""
    deadline = time.monotonic() + bound_s
    while processes_under(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_under(marker), processes_under(marker)
