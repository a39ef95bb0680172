"""How `rollout run` starts and ends its Ray: its own local cluster is stopped with nothing left behind
once the work is safe; a cluster it joined stays up. Speed is `rollout bench --parts e`'s to measure."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from executor.store import read_table
from tests.conftest import processes_under, rollout_run

pytestmark = pytest.mark.integration

SCRIPT = [
    {"type": "shell", "command": "cat greeting.txt > hello.txt"},
    {"type": "text", "text": "Copied it."},
]
# The endpoint and harness checks run beside Ray's start; the preflight is marked once both are done.
PHASES_IN_ORDER = ("cli", "config", "ray_up", "preflight", "first_row", "last_row", "summary")


@pytest.fixture
def ray_tmp() -> Iterator[Path]:
    """A Ray temp dir of this test's own, short (Ray's socket paths must fit in 107 bytes): every Ray
    process the run starts names it on its command line, so what is left of that cluster can be found."""
    path = Path(tempfile.mkdtemp(prefix="rr-exit-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tasks(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "tasks.jsonl"
    with path.open("w") as fh:
        for i in range(n):
            task = {
                "id": f"t{i}",
                "prompt": "Copy greeting.txt to hello.txt",
                "model_script": SCRIPT,
                # Inline files: the worker lays the workspace out once, in a directory of its own.
                "workspace": {"files": {"greeting.txt": "hello\n"}},
                "verify": "grep -qx hello hello.txt",
            }
            fh.write(json.dumps(task) + "\n")
    return path


def _config(tmp_path: Path, run_id: str, n: int, extra: str = "") -> Path:
    """A run of ``n`` tasks with its output and sandboxes under ``tmp_path``; ``extra`` adds keys."""
    config = tmp_path / "run.yaml"
    config.write_text(
        f"tasks: {_tasks(tmp_path, n)}\nout: {tmp_path / 'out'}\nrun_id: {run_id}\n"
        f"sandbox: {{root: {tmp_path / 'sandboxes'}}}\nconcurrency: {{workers: 1, sessions_per_worker: 2}}\n"
        + extra
    )
    return config


def _gone(marker: str, bound_s: float = 30.0) -> list[str]:
    """What is still running under ``marker`` once the processes on their way out had time to go."""
    deadline = time.monotonic() + bound_s
    while (left := processes_under(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)  # waiting for a condition, bounded; not synchronisation by sleeping
    return left


@pytest.mark.usefixtures("codex_installed")
def test_its_own_cluster_is_stopped_once_the_work_is_safe(tmp_path, ray_tmp):
    sandboxes = tmp_path / "sandboxes"
    config = _config(tmp_path, "own", 3)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = rollout_run(config, {**env, "RAY_TMPDIR": str(ray_tmp)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rows: 3  final: 3  pending: 0" in proc.stdout, proc.stdout  # printed whole before the exit

    run_dir = tmp_path / "out" / "own"
    rows = read_table(run_dir).to_pylist()
    assert sorted((r["task_id"], r["reward"], r["final"]) for r in rows) == [
        (f"t{i}", 1.0, True) for i in range(3)
    ], [r["error_message"] for r in rows]
    phases = json.loads((run_dir / "summary.json").read_text())["phases"]
    assert [phases[name] for name in PHASES_IN_ORDER] == sorted(phases[name] for name in PHASES_IN_ORDER)
    # The worker closed what it held: its laid-out workspaces went with it, not with the next run's reaper.
    prepared = sandboxes / "own" / "prepared-workspaces"
    assert not (list(prepared.iterdir()) if prepared.is_dir() else []), list(prepared.iterdir())
    assert not processes_under(str(sandboxes)), processes_under(str(sandboxes))
    assert not _gone(str(ray_tmp)), "Ray processes of the run's own cluster outlived it"


@pytest.fixture
def joined_cluster() -> Iterator[Cluster]:
    """A one-node cluster this test started (and ends, by its own processes); the run only joins it."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.wait_for_nodes()
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def test_a_cluster_it_joined_stays_up(tmp_path, joined_cluster):
    sandboxes = tmp_path / "sandboxes"
    config = _config(
        tmp_path,
        "joined",
        2,
        f"ray_address: '{joined_cluster.address}'\n"
        "harness: {name: command, command: 'cat greeting.txt > hello.txt; echo done'}\n",
    )
    proc = rollout_run(config, dict(os.environ), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_table(tmp_path / "out" / "joined").num_rows == 2

    head = joined_cluster.head_node
    assert head.remaining_processes_alive(), "the run stopped a cluster it did not start"
    ray.init(address=joined_cluster.address)
    assert ray.get(ray.remote(lambda: "still up").remote(), timeout=60) == "still up"
    assert not _gone(str(sandboxes))
