"""Three nodes on one machine (ray.cluster_utils.Cluster): placement by sandbox slots, and node loss."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from executor.api import Executor
from executor.config import load_config
from executor.store import part_files, read_table
from tests.conftest import processes_under

pytestmark = pytest.mark.integration

N_TASKS = 24


@pytest.fixture
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    workers = [c.add_node(num_cpus=1, resources={"sandbox_slot": 2}) for _ in range(2)]
    c.wait_for_nodes()
    yield c, workers
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def _config(tmp_path: Path, address: str) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"id": f"t{i:02d}", "prompt": "p", "verify": "test -f done.txt"}) + "\n"
            for i in range(N_TASKS)
        )
    )
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(
        f"tasks: {tasks}\nout: {tmp_path / 'out'}\nray_address: '{address}'\n"
        f"sandbox: {{root: {tmp_path / 'sandboxes'}}}\n"
        "harness: {name: command, command: 'sleep 1; touch done.txt; echo done'}\n"
        "concurrency: {workers: 2, sessions_per_worker: 3, worker_resources: {sandbox_slot: 1}}\n"
        "policy: {rules: {sandbox_lost: {retry: true, max_attempts: 3, backoff_base_s: 0.1}}}\n"
    )
    return cfg


def test_spread_over_nodes_and_survive_losing_one(tmp_path, cluster):
    c, workers = cluster
    cfg = load_config(_config(tmp_path, c.address))
    head_id = c.head_node.node_id
    worker_ids = {n.node_id for n in workers}
    executor = Executor(cfg, progress=True)
    driver = executor.driver
    driver.store._flush_rows = 1  # every row visible at once, so the test can see placement mid-run
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.setdefault("summary", executor.run()), daemon=True)
    thread.start()

    rows_dir = tmp_path / "out" / "cluster" / "rows"
    deadline = time.monotonic() + 180

    def nodes_seen() -> set[str]:
        if not part_files(rows_dir):
            return set()
        return set(read_table(tmp_path / "out" / "cluster", ["node_id"]).column("node_id").to_pylist())

    while nodes_seen() != worker_ids and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.2)  # waiting for a condition, bounded
    assert nodes_seen() == worker_ids, "rollouts did not land on every worker node"
    victim = workers[0]
    c.remove_node(victim)  # the node dies mid-run with sessions on it

    thread.join(timeout=300)
    assert not thread.is_alive()
    summary = result["summary"]
    assert summary.exit_code == 0, summary
    rows = read_table(tmp_path / "out" / "cluster").to_pylist()
    assert head_id not in {r["node_id"] for r in rows}  # the head never hosts sandboxes
    identities = Counter((r["task_id"], r["sample_index"], r["attempt"]) for r in rows)
    assert max(identities.values()) == 1, "duplicate identity"
    finals = Counter(r["task_id"] for r in rows if r["final"])
    assert set(finals) == {f"t{i:02d}" for i in range(N_TASKS)} and set(finals.values()) == {1}
    lost = [r for r in rows if r["failure_kind"] == "sandbox_lost"]
    print(f"CLUSTER nodes=3 tasks={N_TASKS} lost_then_resubmitted={len(lost)} rows={len(rows)}")
    assert all(r["decision"] == "retry" for r in lost)
    assert all(r["decision"] == "accept" and r["reward"] == 1.0 for r in rows if r["final"])
    assert not processes_under(str(tmp_path / "sandboxes"))
