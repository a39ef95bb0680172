"""`rollout replay`: a recorded demo row re-run here reproduces its outcome; another endpoint differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_server import served_model

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("codex_installed")]
REPO = Path(__file__).parents[1]


def _rollout(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
    )


def _replayed_row(run_dir: Path, rollout_id: str) -> dict:
    replay_dir = max((run_dir / "replays").glob(f"{rollout_id}.*"), key=lambda p: p.stat().st_mtime_ns)
    return json.loads((replay_dir / "row.json").read_text())


@pytest.mark.parametrize("rollout_id", ["fix-add.s0.a1", "rate-limit-forever.s0.a2"])
def test_replay_reproduces_status_and_reward(demo_run, rollout_id):
    from executor.store import read_table

    proc = _rollout("replay", str(demo_run), rollout_id)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "same outcome" in proc.stdout
    recorded = next(r for r in read_table(demo_run).to_pylist() if r["rollout_id"] == rollout_id)
    replayed = _replayed_row(demo_run, rollout_id)
    for name in ("status", "failure_kind", "reward", "decision"):
        assert replayed[name] == recorded[name], name
    assert [t["exit_code"] for t in replayed["tool_calls"]] == [
        t["exit_code"] for t in recorded["tool_calls"]
    ]
    assert replayed["run_id"] != recorded["run_id"]  # its own sandbox directory, never the run's


def test_replay_against_another_endpoint_shows_what_differs(demo_run, tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps([{"type": "text", "text": "I did nothing."}]))
    with served_model(script) as url:
        proc = _rollout("replay", str(demo_run), "fix-add.s0.a1", "--model-url", url)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DIFFERS" in proc.stdout and "differs in: reward" in proc.stdout
    replayed = _replayed_row(demo_run, "fix-add.s0.a1")
    assert (replayed["status"], replayed["reward"], replayed["tool_calls"]) == ("completed", 0.0, [])


def test_replay_of_an_unknown_row(demo_run):
    proc = _rollout("replay", str(demo_run), "no-such-task.s0.a1")
    assert proc.returncode == 2
    assert "no row with rollout id 'no-such-task.s0.a1'" in proc.stderr
