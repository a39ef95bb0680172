"""Errors a person can act on: a config typo lists the allowed keys; a failed install says what it was
doing and shows the installer's last words; nothing of the run is written."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import rollout_run

REPO = Path(__file__).parents[1]
TASKS = REPO / "examples" / "tasks.jsonl"


def _run(config: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return rollout_run(config, {**os.environ, "COLUMNS": "300", **(env or {})})


def test_a_mistyped_key_lists_the_allowed_ones(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"tasks: {TASKS}\nout: {tmp_path / 'out'}\nlimits: {{deadline: 30}}\n")
    proc = _run(config)
    assert proc.returncode == 2
    assert "limits.deadline: Extra inputs are not permitted" in proc.stderr
    assert "allowed here: deadline_s, grace_s" in proc.stderr


@pytest.mark.integration
def test_a_failed_install_shows_what_npm_said(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        f"tasks: {TASKS}\nout: {tmp_path / 'out'}\nharness: {{name: codex, version: 0.0.0-nope}}\n"
    )
    proc = _run(config, {"ROLLOUT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 1
    err = " ".join(proc.stderr.split())
    assert "harness codex 0.0.0-nope could not be installed: npm install of @openai/codex@0.0.0-nope" in err
    assert "--- installer output (tail) ---" in proc.stderr and "npm error" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
