"""`rollout model serve --script` behind a real run: each session plays the script from its start (the run's
gateway names the session in ``x-rollout-session`` on every upstream request)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from executor.store import read_table
from tests.model_server import served_model

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("codex_installed")]
REPO = Path(__file__).parents[1]
SESSIONS = 4


def test_each_session_of_a_run_plays_the_script_from_its_start(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(
        json.dumps(
            [{"type": "shell", "command": "printf done > done.txt"}, {"type": "text", "text": "Done."}]
        )
    )
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "prompt": "write done.txt", "verify": "test -f done.txt"}) + "\n")
    with served_model(script) as url:
        model = {
            "provider": "openai",
            "base_url": url,
            "api_key_env": "SCRIPTED_KEY",
            "name": "scripted-model",
        }
        config = {
            "run_id": "served",
            "tasks": str(tasks),
            "out": str(tmp_path / "out"),
            "samples": SESSIONS,
            "harness": {"name": "codex"},
            "model": model,
            "concurrency": {"workers": 1, "sessions_per_worker": SESSIONS},
        }
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
        run = subprocess.run(
            [sys.executable, "-m", "executor.cli", "run", str(tmp_path / "run.yaml"), "--no-preflight"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "SCRIPTED_KEY": "sk-scripted", "RAY_TMPDIR": "/tmp/rollout-ray-tests"},
        )
    assert run.returncode in (0, 1), run.stderr[-3000:]
    rows = [r for r in read_table(tmp_path / "out" / "served").to_pylist() if r["final"]]
    assert len(rows) == SESSIONS
    # One position shared by the sessions would give the shell step to the first to ask, "Done." to the rest.
    assert [r["reward"] for r in rows] == [1.0] * SESSIONS, [(r["status"], r["error_message"]) for r in rows]
