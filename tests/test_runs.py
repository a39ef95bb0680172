"""`rollout runs`: every run under an output root with its state, including one really still going."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor.runs import MARKER, list_runs, run_lock
from executor.store import part_files
from tests.conftest import processes_under, stopped_by

REPO = Path(__file__).parents[1]


def _rollout(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "executor.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200", "RAY_TMPDIR": "/tmp/rollout-ray-tests"},
    )


def _copy_run(src: Path, dst: Path, summary: dict | None) -> None:
    shutil.copytree(src / "rows", dst / "rows")
    shutil.copy(src / "config.yaml", dst / "config.yaml")
    if summary is not None:
        (dst / "summary.json").write_text(json.dumps(summary))


def test_the_run_lock_is_removed_however_the_block_ends(tmp_path):
    with pytest.raises(RuntimeError), run_lock(tmp_path):
        assert json.loads((tmp_path / MARKER).read_text())["pid"] == os.getpid()
        raise RuntimeError("boom")
    assert not (tmp_path / MARKER).exists()


@pytest.mark.integration
def test_states_of_runs_in_an_output_root(tmp_path, demo_run, partial_run):
    root = partial_run.parent  # holds "partial" (running)
    summary = json.loads((demo_run / "summary.json").read_text())
    _copy_run(demo_run, root / "complete", summary)
    _copy_run(demo_run, root / "stopped", {**summary, "stopped": "provider_auth_error: 401"})
    _copy_run(demo_run, root / "incomplete", {**summary, "pending": 3})
    _copy_run(demo_run, root / "killed", None)
    (root / "not-a-run").mkdir()

    states = {r.run_id: r for r in list_runs(root)}
    assert {k: v.state for k, v in states.items()} == {
        "partial": "running",
        "complete": "complete",
        "stopped": "stopped",
        "incomplete": "incomplete",
        "killed": "interrupted",
    }
    assert states["complete"].final == 7 and states["complete"].by_decision["mask"] == 2
    assert states["partial"].rows == 3 and states["partial"].pending is None
    assert states["incomplete"].pending == 3

    proc = _rollout("runs", str(root))
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.strip()}
    assert lines["complete"][1:3] == ["complete", str(summary["rows"])]
    assert lines["partial"][1] == "running" and lines["killed"][1] == "interrupted"
    assert "not-a-run" not in lines

    missing = _rollout("runs", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr


@pytest.mark.integration
@pytest.mark.usefixtures("codex_installed")
def test_a_real_run_while_it_is_going_then_interrupted(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    quick = [{"type": "shell", "command": "echo ok > ok.txt"}, {"type": "text", "text": "done"}]
    with tasks.open("w") as fh:
        for i in range(2):
            fh.write(
                json.dumps(
                    {"id": f"quick{i}", "prompt": "p", "model_script": quick, "verify": "test -f ok.txt"}
                )
            )
            fh.write("\n")
        hang = {
            "id": "slow",
            "prompt": "p",
            "deadline_s": 300,
            "model_script": [{"type": "hang", "max_s": 600}],
        }
        fh.write(json.dumps(hang) + "\n")
    config = tmp_path / "live.yaml"
    config.write_text(
        f"tasks: {tasks}\nout: {tmp_path / 'out'}\nsandbox: {{root: {tmp_path / 'sandboxes'}}}\n"
        "concurrency: {workers: 1, sessions_per_worker: 3}\n"
    )
    run_dir = tmp_path / "out" / "live"
    driver = subprocess.Popen(
        [sys.executable, "-m", "executor.cli", "run", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
        env={**os.environ, "RAY_TMPDIR": "/tmp/rollout-ray-tests"},
    )
    try:
        deadline = time.monotonic() + 240
        while not part_files(run_dir / "rows") and driver.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # waiting for a condition, bounded
        assert part_files(run_dir / "rows"), "no part file within the bound"
        assert driver.poll() is None

        listed = _rollout("runs", str(tmp_path / "out"))
        assert listed.returncode == 0 and "live" in listed.stdout and "running" in listed.stdout
        status = _rollout("status", str(run_dir), "--json")
        assert status.returncode == 0, status.stderr
        data = json.loads(status.stdout)
        assert data["state"] == "running" and data["accept"] >= 1 and data["pending"] is None
        report = _rollout("report", str(run_dir), "--out", str(tmp_path / "live.html"))
        assert report.returncode == 0, report.stderr
        export = _rollout("export", str(run_dir), "--train", str(tmp_path / "live.parquet"))
        assert export.returncode == 0, export.stderr

        # A second driver on the live run: refused in one line, the first one's lock left as it was.
        lock = (run_dir / MARKER).read_bytes()
        second = _rollout("run", str(config))
        assert second.returncode == 2, second.stderr
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
        assert str(run_dir) in second.stderr and f"pid {driver.pid} " in second.stderr
        assert (run_dir / MARKER).read_bytes() == lock and driver.poll() is None
    finally:
        stopped_by(driver, signal.SIGINT, 180)  # the driver stops, cleans up and writes its summary
    assert not (run_dir / MARKER).exists()
    assert [r.state for r in list_runs(tmp_path / "out")] == ["stopped"]
    assert not processes_under(str(tmp_path / "sandboxes"))
