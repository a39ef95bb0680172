"""One driver per run directory: the lock in ``driver.json``, held by real processes, refused, taken over."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from executor.runs import MARKER, RunLockedError, run_lock, run_state
from executor.store import part_files
from sandboxes.owner import boot_id, start_ticks
from tests.conftest import rollout_run

REPO = Path(__file__).parents[1]

# A process that takes the lock, says so, and holds it until its stdin closes.
HOLDER = """
import sys
from pathlib import Path
from executor.runs import run_lock
with run_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""


@contextlib.contextmanager
def holder(run_dir: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"  # ends if the child dies
        yield proc
    finally:
        if proc.poll() is None:
            proc.communicate(timeout=30)  # closes stdin: the holder releases the lock and exits
        proc.wait(timeout=30)


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait(timeout=30)
    return child.pid


def _lock_of(run_dir: Path, **fields: object) -> dict[str, object]:
    record = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "pid_start": start_ticks(os.getpid()),
        "started_at": 1_700_000_000.0,
        "token": "theirs",
        **fields,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text(json.dumps(record))
    return record


def test_the_lock_names_its_owner_and_goes_however_the_block_ends(tmp_path):
    with pytest.raises(RuntimeError), run_lock(tmp_path) as mine:
        owner = json.loads((tmp_path / MARKER).read_text())
        assert owner == mine
        assert (owner["pid"], owner["host"], owner["boot_id"]) == (
            os.getpid(),
            socket.gethostname(),
            boot_id(),
        )
        assert owner["pid_start"] == start_ticks(os.getpid()) is not None
        assert run_state(tmp_path)[0] == "running"
        raise RuntimeError("boom")
    assert not (tmp_path / MARKER).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary left beside it


def test_a_live_owner_refuses_a_second_holder_with_one_line_and_nothing_touched(tmp_path):
    run_dir = tmp_path / "run"
    with holder(run_dir) as proc:
        (run_dir / "rows").mkdir()
        (run_dir / "rows" / ".part.1.ab.tmp").write_bytes(b"the holder's write in progress")
        before = _snapshot(run_dir)
        with pytest.raises(RunLockedError) as err, run_lock(run_dir):
            pytest.fail("a second holder got the lock")
        line = str(err.value)
        assert "\n" not in line and len(line) < 500
        assert str(run_dir) in line and f"pid {proc.pid} " in line and socket.gethostname() in line
        assert "since 20" in line  # the owner's start time, as a date
        assert _snapshot(run_dir) == before
        assert run_state(run_dir)[0] == "running"
    assert not (run_dir / MARKER).exists()


def test_a_killed_owner_s_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    with holder(run_dir) as proc:
        proc.kill()
        proc.wait(timeout=30)
    assert json.loads((run_dir / MARKER).read_text())["pid"] == proc.pid  # a SIGKILL leaves the lock
    assert run_state(run_dir)[0] == "interrupted"
    with run_lock(run_dir) as mine:
        assert json.loads((run_dir / MARKER).read_text())["token"] == mine["token"]
    assert not (run_dir / MARKER).exists()


@pytest.mark.parametrize(
    ("why", "fields"),
    [
        ("its pid is gone", {"pid": "dead"}),
        ("its pid now names another process", {"pid_start": -1}),
        ("this host rebooted since", {"boot_id": "another-boot"}),
        ("it is not a lock we could have written", None),
    ],
)
def test_a_dead_owner_s_lock_is_taken_over(tmp_path, why, fields):
    if fields is None:
        tmp_path.joinpath(MARKER).write_text("{not json")
    else:
        _lock_of(tmp_path, **{k: (_dead_pid() if v == "dead" else v) for k, v in fields.items()})
    with run_lock(tmp_path) as mine:
        assert json.loads((tmp_path / MARKER).read_text())["token"] == mine["token"], why
    assert not (tmp_path / MARKER).exists()


@pytest.mark.parametrize(
    ("why", "fields"),
    [
        ("a live pid of this host, same start", {}),
        ("another host's driver cannot be checked", {"host": "elsewhere.example", "pid": 1, "boot_id": "x"}),
        ("a lock without the newer fields", {"boot_id": None, "pid_start": None}),
    ],
)
def test_a_live_or_uncheckable_owner_keeps_its_lock(tmp_path, why, fields):
    theirs = _lock_of(tmp_path, **fields)
    with pytest.raises(RunLockedError, match="in use by another driver"), run_lock(tmp_path):
        pytest.fail(why)
    assert json.loads((tmp_path / MARKER).read_text()) == theirs


def test_release_leaves_a_lock_that_is_no_longer_ours(tmp_path):
    with run_lock(tmp_path):
        # Someone removed ours by hand and another driver took the run: ending must not remove theirs.
        theirs = _lock_of(tmp_path, token="another driver's")
    assert json.loads((tmp_path / MARKER).read_text()) == theirs


def _config(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "prompt": "p", "verify": "true"}) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(
        f"tasks: {tasks}\nout: {tmp_path / 'out'}\nrun_id: locked\nsandbox: {{root: {tmp_path / 'sb'}}}\n"
        "harness: {name: command}\nconcurrency: {workers: 1, sessions_per_worker: 2}\n"
    )
    return config


def _rollout_run(config: Path) -> subprocess.CompletedProcess[str]:
    return rollout_run(config, {**os.environ, "COLUMNS": "80", "RAY_TMPDIR": "/tmp/rollout-ray-tests"})


def test_a_driver_refused_the_lock_writes_nothing(tmp_path):
    from executor.api import Executor
    from executor.config import load_config

    cfg = load_config(_config(tmp_path), {})
    run_dir = tmp_path / "out" / "locked"
    with holder(run_dir):
        before = _snapshot(run_dir)
        with pytest.raises(RunLockedError, match="in use by another driver"):
            Executor(cfg).run()
        assert _snapshot(run_dir) == before and list(run_dir.iterdir()) == [run_dir / MARKER]


def test_a_second_rollout_run_exits_2_with_one_line(tmp_path):
    config = _config(tmp_path)
    run_dir = tmp_path / "out" / "locked"
    with holder(run_dir) as proc:
        before = _snapshot(run_dir)
        second = _rollout_run(config)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert (
            str(run_dir) in lines[0] and f"pid {proc.pid} " in lines[0] and socket.gethostname() in lines[0]
        )
        assert _snapshot(run_dir) == before


@pytest.mark.integration
def test_rollout_run_takes_over_a_killed_driver_s_lock(tmp_path):
    config = _config(tmp_path)
    run_dir = tmp_path / "out" / "locked"
    with holder(run_dir) as proc:
        proc.kill()
        proc.wait(timeout=30)
    assert (run_dir / MARKER).exists()
    run = _rollout_run(config)
    assert run.returncode == 0, run.stderr[-3000:]
    assert part_files(run_dir / "rows") and not (run_dir / MARKER).exists()
