"""`rollout bench` (c): the driver's peak RSS for N and 10*N rollouts of null workers (see
executor/testing/bench.py).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from executor.testing.bench_common import _run_driver, _write_config, _write_tasks


def _null_worker_class(token_ids: int = 0) -> Any:
    """``token_ids``: each row carries two model calls with that many prompt and completion ids and
    logprobs, as a run with ``gateway.capture_tokens`` does."""
    import ray

    from executor.row import ModelCall, Row
    from executor.schema import batch_to_wire, rows_to_batch

    class NullWorker:
        """Answers every session at once with a completed row: only the driver's side is exercised."""

        def __init__(self, config_json: str, run_dir: str, worker_index: int) -> None:
            self.run_id = json.loads(config_json)["run_id"]
            ids = list(range(token_ids))
            self.calls = [
                ModelCall(
                    request_index=i,
                    status=200,
                    kind="none",
                    prompt_token_ids=ids,
                    completion_token_ids=ids,
                    completion_logprobs=[-0.5] * token_ids,
                )
                for i in range(2 if token_ids else 0)
            ]

        async def run(
            self, task_json: str, sample_index: int, attempt: int, policy: str | None = None
        ) -> Any:
            task_id = json.loads(task_json)["id"]
            row = Row(
                run_id=self.run_id,
                rollout_id=f"{task_id}.s{sample_index}.a{attempt}",
                task_id=task_id,
                sample_index=sample_index,
                attempt=attempt,
                harness="null",
                sandbox_provider="null",
                status="completed",
                failure_kind="none",
                reward=1.0,
                final_text="done",
                model_calls=self.calls,
            )
            return batch_to_wire(rows_to_batch([row.to_dict()]))

    return ray.remote(NullWorker)


def driver_memory_child(n: int, scratch: Path, token_ids: int = 0) -> dict[str, Any]:
    """Run in a fresh process: one driver, n null rollouts; report its peak RSS."""
    name = f"c{n}t{token_ids}"
    tasks = _write_tasks(scratch / f"{name}.jsonl", n)
    extra = (
        f"run_id: {name}\nharness: {{name: command}}\nconcurrency: {{workers: 2, sessions_per_worker: 128}}\n"
    )
    cfg = _write_config(scratch, name, tasks, extra)
    summary, wall = _run_driver(cfg, _null_worker_class(token_ids))
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "rollouts": n,
        "token_ids": token_ids,
        "final": summary.final,
        "wall_s": wall,
        "peak_rss_mb": peak_kb / 1024,
    }


def driver_memory(n: int, scratch: Path, token_ids: int = 0) -> list[dict[str, Any]]:
    results = []
    for size in (n, 10 * n):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "executor.testing.bench",
                "memory-child",
                str(size),
                str(scratch),
                str(token_ids),
            ],
            capture_output=True,
            text=True,
            timeout=7200,
            cwd=Path(__file__).parents[1],
        )
        if out.returncode != 0:
            raise RuntimeError(f"memory run of {size} failed: {out.stderr[-2000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results
