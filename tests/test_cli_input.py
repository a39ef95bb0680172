"""Bad input: one clear line naming the file and line or key, exit code 2, nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROLLOUT = [sys.executable, "-m", "executor.cli"]


def _rollout(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ROLLOUT, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).parents[1])},
    )


def _setup(tmp_path: Path, config: str, tasks: list[str]) -> Path:
    (tmp_path / "tasks.jsonl").write_text("\n".join(tasks) + "\n")
    (tmp_path / "run.yaml").write_text(config)
    return tmp_path / "run.yaml"


GOOD = json.dumps({"id": "a", "prompt": "p"})


@pytest.mark.parametrize(
    ("config", "tasks", "expected"),
    [
        ("tasks: tasks.jsonl\nout: out\n", [GOOD, "{broken"], "tasks.jsonl:2: not valid JSON"),
        (
            "tasks: tasks.jsonl\nout: out\n",
            [GOOD, json.dumps({"id": "b"})],
            "tasks.jsonl:2: prompt: Field required",
        ),
        ("tasks: tasks.jsonl\nout: out\nharness: {name: claude}\n", [GOOD], "unknown harness 'claude'"),
        ("tasks: tasks.jsonl\nout: out\nconcurency: {workers: 2}\n", [GOOD], "concurency: Extra inputs"),
        ("tasks: missing.jsonl\nout: out\n", [GOOD], "missing.jsonl: task file not found"),
        # s3:// and gs:// are run storage (tests/test_object_store.py); another scheme is refused.
        (
            "tasks: tasks.jsonl\nout: hdfs://runs/x\n",
            [GOOD],
            "out hdfs://runs/x: hdfs:// storage is not supported",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, config, tasks, expected):
    cfg = _setup(tmp_path, config, tasks)
    proc = _rollout("run", str(cfg), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0]
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_an_unsupported_storage_out_on_the_command_line_is_refused_and_nothing_is_written(tmp_path):
    cfg = _setup(tmp_path, "tasks: tasks.jsonl\nout: out\n", [GOOD])
    proc = _rollout("run", str(cfg), "--out", "hdfs://bucket/runs", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--out hdfs://bucket/runs: hdfs:// storage is not supported" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml", "tasks.jsonl"]


def test_a_file_uri_is_a_path():
    from executor.config import local_path

    assert local_path("file:///data/runs", "out") == "/data/runs"
    assert local_path("runs/x", "out") == "runs/x"


def test_status_of_a_missing_run(tmp_path):
    proc = _rollout("status", str(tmp_path / "nope"), cwd=tmp_path)
    assert proc.returncode == 2
    assert "not a run directory" in proc.stderr
