"""examples/train_loop.py, run as a user runs it: three policy versions that overlap, the real Codex CLI,
rows delivered, masked and too stale, and nothing left running at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from executor.store import read_table
from tests.conftest import processes_under

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("codex_installed")]

REPO = Path(__file__).parents[1]


def test_the_example_training_loop(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "train_loop.py"),
            "--out",
            str(tmp_path / "out"),
            "--sandboxes",
            str(tmp_path / "sb"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env={**os.environ, "RAY_TMPDIR": "/tmp/rollout-ray-tests"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    first, second = result["endpoints"]
    rows = read_table(tmp_path / "out" / "train-loop").to_pylist()
    final = {r["rollout_id"]: r for r in rows if r["final"]}
    # Every final row was handed to the trainer, once; nothing is pending.
    assert result["delivered"] == len(final) == len(rows) == 14 and result["pending"] == 0

    def outcome(task: str) -> set[tuple[object, ...]]:
        return {
            (r["policy_version"], r["staleness"], r["decision"], r["reward"])
            for r in rows
            if r["task_id"] == task
        }

    for task, version in (("add", 1), ("mul", 2), ("sub", 2), ("div", 3), ("mod", 3)):
        assert outcome(task) == {(version, 0, "accept", 1.0)}, task
    assert outcome("broken") == {(1, 0, "mask", None)}  # the endpoint's 429: masked, never a zero
    assert outcome("late") == {(1, 2, "mask", None)}  # started under 1, decided at 3: too stale
    late = [r for r in rows if r["task_id"] == "late"]
    assert all(r["decision_reason"].startswith("group: stale: started under policy version 1") for r in late)
    # Version 2 was an update in place: the late sessions' calls after it were answered by it.
    assert all([c["policy_version"] for c in r["model_calls"]] == [1, 2] for r in late)
    assert all(c["replica"] == first for r in late for c in r["model_calls"])
    # Version 3 moved to the second endpoint, with its own model name.
    moved = [c for r in rows if r["policy_version"] == 3 for c in r["model_calls"]]
    assert moved and all((c["policy_version"], c["replica"]) == (3, second) for c in moved)
    assert result["versions"]["stale_masked"] == 2 and result["too_stale"] == 2
    assert "trained version 3 on 4 rows" in proc.stdout
    assert not processes_under(str(tmp_path / "sb"))
