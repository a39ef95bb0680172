"""Operating a run: a stop by signal is orderly, a killed worker or driver leaves nothing behind and no
row without what was known of its session, a request for resources no node has is refused at once.

Each run here is a real `rollout run` (or an Executor in this process) on a local Ray cluster of its own,
with the `command` harness waiting on a gate file, so that sessions are certainly mid-run when the test
acts on them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from executor.api import Executor
from executor.config import load_config
from executor.runs import list_runs
from executor.store import read_table
from sandboxes.testing.leaks import ended
from tests.conftest import REPO, processes_under, rollout_run, sandbox_yaml, stopped_by

pytestmark = pytest.mark.integration

BOUND_S = 180.0
GATED = "while"  # what a gated session's process shows on its command line


def _wait(what: str, ready: Callable[[], bool], bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while not ready():
        assert time.monotonic() < deadline, f"no {what} within {bound_s:.0f} s"
        time.sleep(0.1)  # waiting for a condition, bounded


def _gated(root: Path) -> int:
    return sum(GATED in p for p in processes_under(str(root)))


def _setup(tmp_path: Path, gate: Path, tasks: int, extra: str = "") -> Path:
    (tmp_path / "tasks.jsonl").write_text(
        "".join(
            json.dumps({"id": f"t{i}", "prompt": "p", "verify": "test -f done.txt"}) + "\n"
            for i in range(tasks)
        )
    )
    agent = f"while [ ! -e {gate} ]; do sleep 0.1; done; touch done.txt; echo done"
    config = tmp_path / "run.yaml"
    config.write_text(
        f"tasks: {tmp_path / 'tasks.jsonl'}\nout: {tmp_path / 'out'}\nrun_id: r\n"
        f"sandbox: {sandbox_yaml(tmp_path / 'sb', gate)}\n"
        f"harness: {{name: command, command: {json.dumps(agent)}}}\n"
        "concurrency: {workers: 1, sessions_per_worker: 2}\n" + extra
    )
    return config


def _sessions_left(root: Path) -> list[str]:
    """Session directories under the sandbox root: ``<root>/<run>/<launch>``."""
    return [
        str(p.relative_to(root))
        for p in root.glob("*/*")
        if p.is_dir() and p.parent.name != "owners" and p.name != "prepared-workspaces"
    ]


def _driver(config: Path, ray_tmp: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "executor.cli", "run", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "RAY_TMPDIR": str(ray_tmp), "COLUMNS": "200"},
    )


def _resume(config: Path) -> subprocess.CompletedProcess[str]:
    return rollout_run(config, {**os.environ, "RAY_TMPDIR": "/tmp/rollout-ray-tests"}, BOUND_S)


def _each_final_once(rows: list[dict], tasks: int) -> None:
    identities = Counter((r["task_id"], r["sample_index"], r["attempt"]) for r in rows)
    assert max(identities.values()) == 1, identities
    finals = sorted(r["task_id"] for r in rows if r["final"])
    assert finals == [f"t{i}" for i in range(tasks)], rows


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_in_order_and_a_resume_finishes_it(tmp_path, gate_dir, signum):
    gate = gate_dir / "gate"
    config = _setup(tmp_path, gate, tasks=3)  # two run, the third waits for a place
    # Short, under /tmp: Ray's socket paths must fit in 107 bytes. The run's own cluster lives under it.
    ray_tmp = Path(tempfile.mkdtemp(prefix="rr-stop-", dir="/tmp"))
    driver = _driver(config, ray_tmp)
    try:
        _wait("two sessions mid-run", lambda: _gated(tmp_path / "sb") >= 2 or driver.poll() is not None)
        assert driver.poll() is None, driver.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
        signalled_at = time.time()
        code = stopped_by(driver, signum, BOUND_S)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
    stderr = driver.stderr.read().decode()  # type: ignore[union-attr]
    assert code == 128 + signum, stderr[-3000:]
    assert f"run stopped: stopped by {signal.Signals(signum).name}" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr[-3000:]

    run_dir = tmp_path / "out" / "r"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["stopped_by"], summary["exit_code"], summary["pending"]) == ("signal", 128 + signum, 3)
    assert [r.state for r in list_runs(tmp_path / "out")] == ["stopped"]
    rows = read_table(run_dir).to_pylist()
    assert sorted(r["task_id"] for r in rows) == ["t0", "t1"], rows  # the sessions that had started
    for r in rows:
        assert (r["failure_kind"], r["decision"], r["final"], r["attempt"]) == (
            "cancelled",
            "retry",
            False,
            1,
        )
        assert r["started_at"].timestamp() <= signalled_at and r["evidence_gaps"] == ["run_stopped"]
        # Asked of the worker at the stop: where the session ran, and how far it got.
        assert r["node_id"] and r["worker_id"] and r["sandbox_id"] and r["t_setup_s"] is not None, r
        assert Path(r["evidence_dir"]).parent == run_dir / "evidence"
    # Their sandboxes stopped and removed, the run's own cluster stopped, nothing of either left.
    assert processes_under(str(tmp_path / "sb")) == []
    assert _sessions_left(tmp_path / "sb") == []
    _wait("the run's own cluster to end", lambda: not processes_under(str(ray_tmp)), 30)
    shutil.rmtree(ray_tmp, ignore_errors=True)

    gate.touch()
    resumed = _resume(config)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_table(run_dir).to_pylist()
    _each_final_once(rows, 3)
    assert sorted((r["task_id"], r["attempt"]) for r in rows if r["final"]) == [
        ("t0", 2),
        ("t1", 2),
        ("t2", 1),
    ]
    assert processes_under(str(tmp_path / "sb")) == []


def test_a_killed_worker_leaves_nothing_and_its_rows_say_where_its_sessions_ran(tmp_path, gate_dir):
    gate = gate_dir / "gate"
    config = _setup(
        tmp_path,
        gate,
        tasks=2,
        extra="policy: {rules: {sandbox_lost: {retry: true, max_attempts: 3, backoff_base_s: 0.1}}}\n",
    )
    executor = Executor(load_config(config))
    driver = executor.driver
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.setdefault("summary", executor.run()), daemon=True)
    thread.start()
    try:
        # The driver has heard from the worker about both sessions, set up and running their harness.
        def both_placed() -> bool:
            running = driver.placements.running()
            return len(running) == 2 and all(s.get("t_setup_s") is not None for s in running.values())

        _wait("the worker's word on both sessions", lambda: both_placed() or not thread.is_alive())
        running = driver.placements.running()
        _wait("both sessions mid-run", lambda: _gated(tmp_path / "sb") >= 2)
        worker_ids = {s["worker_id"] for s in running.values()}
        assert len(worker_ids) == 1
        worker_id = worker_ids.pop()
        pid = int(worker_id.rsplit("-", 1)[1])
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        assert ended(pid, 30)
        gate.touch()  # the sessions sent again, to the worker Ray starts anew, finish
        thread.join(timeout=BOUND_S)
        assert not thread.is_alive()
    finally:
        gate.touch()
        thread.join(timeout=BOUND_S)
        ray.shutdown()
    summary = result["summary"]
    assert summary.exit_code == 0, summary  # type: ignore[attr-defined]
    rows = read_table(tmp_path / "out" / "r").to_pylist()
    _each_final_once(rows, 2)
    lost = [r for r in rows if r["failure_kind"] == "sandbox_lost"]
    assert sorted(r["rollout_id"] for r in lost) == ["t0.s0.a1", "t1.s0.a1"], rows
    for r in lost:
        said = running[r["rollout_id"]]
        assert r["worker_id"] == worker_id and r["node_id"] == said["node_id"]
        assert r["sandbox_id"] == said["sandbox_id"] and r["evidence_dir"] == said["evidence_dir"]
        assert r["started_at"].timestamp() <= killed_at and r["t_setup_s"] is not None
        assert r["t_total_s"] > 0 and r["evidence_gaps"] == ["worker_lost"]
    # Nothing of the killed worker's sessions, after the run and after `rollout gc`.
    assert processes_under(str(tmp_path / "sb")) == []
    assert _sessions_left(tmp_path / "sb") == []
    gc = subprocess.run(
        [sys.executable, "-m", "executor.cli", "gc", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert gc.returncode == 0 and "local: 0 sandboxes ended" in gc.stdout, gc.stderr
    assert processes_under(str(tmp_path / "sb")) == [] and _sessions_left(tmp_path / "sb") == []


def test_a_killed_driver_s_launches_get_their_rows_on_resume(tmp_path, gate_dir):
    gate = gate_dir / "gate"
    config = _setup(tmp_path, gate, tasks=2)
    driver = _driver(config, Path("/tmp/rollout-ray-tests"))
    try:
        _wait("two sessions mid-run", lambda: _gated(tmp_path / "sb") >= 2 or driver.poll() is not None)
        assert driver.poll() is None
        driver.kill()
        driver.wait(30)
    finally:
        if driver.poll() is None:
            driver.kill()
    evidence = tmp_path / "out" / "r" / "evidence"
    launches = sorted(p.name for p in evidence.iterdir())
    assert len(launches) == 2
    gate.touch()
    resumed = _resume(config)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_table(tmp_path / "out" / "r").to_pylist()
    _each_final_once(rows, 2)
    adopted = [r for r in rows if r["attempt"] == 1]
    assert all(r["failure_kind"] == "cancelled" and r["decision"] == "retry" for r in adopted), adopted
    assert sorted(Path(r["evidence_dir"]).name for r in adopted) == launches
    named = {Path(r["evidence_dir"]).name for r in rows}
    assert named == {p.name for p in evidence.iterdir()}, "an evidence directory no row names"
    assert processes_under(str(tmp_path / "sb")) == []


def test_worker_resources_no_node_offers_is_one_line_and_exit_2(tmp_path):
    config = tmp_path / "run.yaml"
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t0", "prompt": "p"}) + "\n")
    config.write_text(
        f"tasks: {tmp_path / 'tasks.jsonl'}\nout: {tmp_path / 'out'}\nsandbox: {{root: {tmp_path / 'sb'}}}\n"
        "harness: {name: command, command: 'echo done'}\n"
        "concurrency: {workers: 2, worker_resources: {sandbox_slot: 1}}\n"
    )
    proc = _resume(config)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        "concurrency.worker_resources {sandbox_slot: 1}: no node of the cluster can host a worker"
        in errors[0]
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "sb").exists()
