"""`rollout status` on a real demo run, on a run still going, and on one whose driver died."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from executor.status import status_data
from executor.store import read_table

pytestmark = pytest.mark.integration
REPO = Path(__file__).parents[1]


def _rollout(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "COLUMNS": "160"},
    )


def test_status_of_the_demo_run(demo_run):
    proc = _rollout("status", str(demo_run), "--json", "--slowest", "3")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    rows = read_table(demo_run).to_pylist()
    assert data["state"] == "complete" and data["pending"] == 0
    assert data["rows"] == len(rows)
    assert data["mask"] == sum(r["decision"] == "mask" for r in rows) == 2
    assert data["retry"] == sum(r["decision"] == "retry" for r in rows) == 2
    assert data["pairs_retried"] == 2
    expected = Counter((r["status"], r["failure_kind"], r["decision"]) for r in rows)
    assert {
        (g["status"], g["failure_kind"], g["decision"]): g["rows"] for g in data["by_outcome"]
    } == expected
    assert [(g["harness"], g["provider"], g["rows"]) for g in data["by_placement"]] == [
        ("codex", "local", len(rows))
    ]
    slow = [r["t_total_s"] for r in data["slowest"]]
    assert len(slow) == 3 and slow == sorted(slow, reverse=True)
    assert slow[0] == max(r["t_total_s"] for r in rows)
    assert data["slowest"][0]["rollout_id"].startswith("model-hangs.s0.a")  # each attempt ran to its deadline
    kinds = {f["failure_kind"]: f for f in data["failures"]}
    assert kinds["rate_limit_exceeded"]["rows"] == 2 and "429" in kinds["rate_limit_exceeded"]["example"]

    human = _rollout("status", str(demo_run))
    assert human.returncode == 0
    for text in ("by harness and provider", "slowest rollouts", "model-hangs.s0.a", "model_timeout"):
        assert text in human.stdout, text


def test_status_while_the_run_is_going(partial_run):
    data = status_data(partial_run)
    assert data["state"] == "running"
    assert data["rows"] == 3 and data["pending"] is None
    human = _rollout("status", str(partial_run))
    assert human.returncode == 0, human.stderr
    assert "running" in human.stdout and "3 rows" in human.stdout


def test_status_after_the_driver_died(partial_run):
    (partial_run / "driver.json").write_text(json.dumps({"pid": 2**22 + 12345, "host": _host()}))
    assert status_data(partial_run)["state"] == "interrupted"


def test_status_of_a_non_run(tmp_path):
    proc = _rollout("status", str(tmp_path))
    assert proc.returncode == 2
    assert "not a run directory" in proc.stderr


def _host() -> str:
    import socket

    return socket.gethostname()
