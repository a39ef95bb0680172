"""The chaos suite's shared parts: real `rollout run` processes (Ray, Codex, local sandboxes), a task
file per scenario, and the figures each test prints: load held, faults survived, lost, duplicates, leaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from executor.store import part_files, read_table
from tests.conftest import processes_under

REPO = Path(__file__).parents[2]
FAST_INFRA_RETRY = {"retry": True, "max_attempts": 2, "backoff_base_s": 0.1, "backoff_cap_s": 0.3}
OK_SCRIPT = [{"type": "shell", "command": "echo ok > out.txt"}, {"type": "text", "text": "done"}]


def write_tasks(path: Path, n: int, script: Callable[[int], list[dict[str, Any]]], **extra: Any) -> Path:
    with path.open("w") as fh:
        for i in range(n):
            task = {"id": f"t{i:03d}", "prompt": "write out.txt", "model_script": script(i)}
            task.update({"verify": "test -f out.txt"} | extra)
            fh.write(json.dumps(task) + "\n")
    return path


def write_config(
    tmp_path: Path, run_id: str, tasks: Path, *, gates: Path | None = None, **sections: Any
) -> Path:
    """A run config with fast retries; ``sections`` replace or extend the top-level keys. ``gates``: a
    directory of gate files the sandboxes must see (their view shows the host by allow-list)."""
    cfg: dict[str, Any] = {
        "tasks": str(tasks),
        "out": str(tmp_path / "out"),
        "run_id": run_id,
        "sandbox": {"root": str(tmp_path / "sandboxes")},
        "gateway": {"max_attempts_per_request": 2, "backoff_base_s": 0.05, "backoff_cap_s": 0.2},
        "policy": {
            "retry_budget": 50,
            "rules": {
                kind: FAST_INFRA_RETRY
                for kind in (
                    "rate_limit_exceeded",
                    "transport_error",
                    "provider_unavailable",
                    "model_timeout",
                    "sandbox_start_failed",
                    "sandbox_lost",
                )
            },
        },
        "limits": {"deadline_s": 60, "grace_s": 3},
        "concurrency": {"workers": 1, "sessions_per_worker": 4},
    }
    if gates is not None:
        cfg["sandbox"]["mounts"] = [{"path": str(gates)}]
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = cfg[key] | value
        else:
            cfg[key] = value
    path = tmp_path / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def env() -> dict[str, str]:
    out = dict(os.environ)
    out["RAY_TMPDIR"] = "/tmp/rollout-ray-tests"
    return out


def rollout(*args: str) -> list[str]:
    return [sys.executable, "-m", "executor.cli", *args]


def run(cfg: Path, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        rollout("run", str(cfg)), capture_output=True, text=True, timeout=timeout, env=env(), cwd=REPO
    )


def rows_of(tmp_path: Path, run_id: str) -> list[dict[str, Any]]:
    run_dir = tmp_path / "out" / run_id
    for part in part_files(run_dir / "rows"):
        import pyarrow.parquet as pq

        pq.read_table(part)  # every part reads whole: none is torn
    return read_table(run_dir).to_pylist()


def figures(rows: list[dict[str, Any]], expected: set[tuple[str, int]]) -> dict[str, int]:
    """Lost: expected samples with no final row. Duplicates: an identity or a final sample twice."""
    identities = Counter((r["task_id"], r["sample_index"], r["attempt"]) for r in rows)
    finals = Counter((r["task_id"], r["sample_index"]) for r in rows if r["final"])
    return {
        "lost": len(expected - set(finals)),
        "dup": sum(c - 1 for c in identities.values()) + sum(c - 1 for c in finals.values()),
    }


def wait_until(
    condition: Callable[[], bool], bound_s: float, proc: subprocess.Popen[bytes] | None = None
) -> bool:
    """Whether ``condition`` came true within ``bound_s`` (or by the time ``proc`` ended, if given)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc is not None and proc.poll() is not None:
            return condition()
        time.sleep(0.2)  # polling a condition, bounded
    return False


def wait_no_leaks(marker: str, bound_s: float = 60) -> int:
    """Sandbox processes still alive after the bound (they may take a moment to notice a dead parent):
    0 once two looks in a row find none. One empty look is not enough: a worker outlives its driver's
    SIGKILL for a moment (until Ray ends it), and a process it started then can appear just after a look
    that found nothing (seen once, in CI under load: a git `sh` of a workspace's lay-out, found by the
    look after an empty one, which the bound was then never spent waiting for)."""
    deadline = time.monotonic() + bound_s
    found, empty_looks = [], 0
    while time.monotonic() < deadline:
        found = processes_under(marker)
        empty_looks = 0 if found else empty_looks + 1
        if empty_looks == 2:
            return 0
        time.sleep(0.2)  # waiting for a condition, bounded
    return len(found)


def report(fault: str, load: str, survived: int, lost: int, dup: int, leaks: int, **more: Any) -> None:
    extra = "".join(f" {k}={v}" for k, v in more.items())
    print(f"CHAOS fault={fault} load={load} survived={survived} lost={lost} dup={dup} leaks={leaks}{extra}")
