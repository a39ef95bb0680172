"""The driver's CPU and memory per delivered row: a trainer's API path against the `rollout run` path.

    .venv/bin/python tests/bench/bench_api_driver.py [--rollouts 5000] [--token-ids 0]

bench (c)'s null workers (every session answers at once with a completed row), so what is measured is
the driver: its loop, Ray transport, the Arrow store, the policy; and for the API, the hand-over of each
part's final rows to a reading thread and that thread's iteration. Each side runs in a fresh process:
`cli` is ``Executor.run()`` (what the command runs); `api` is ``start`` + ``submit`` + ``batches`` +
``close``; `api+versions` also has a policy version and an announcement per 500 rows taken. CPU is the
driver process's user+system time from Ray being up (started first, as `rollout run` does) to the run's
summary, the workers' processes excluded; RSS is the process's peak. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(mode: str, n: int, scratch: Path, token_ids: int) -> dict[str, object]:
    import ray

    from executor.api import Executor
    from executor.config import load_config
    from executor.driver import connect_ray
    from executor.testing.bench import _null_worker_class, _write_config, _write_tasks

    name = f"{mode.replace('+', '-')}-{n}"
    tasks = _write_tasks(scratch / f"{name}.jsonl", n)
    extra = (
        f"run_id: {name}\nharness: {{name: command}}\nconcurrency: {{workers: 2, sessions_per_worker: 128}}\n"
    )
    cfg = _write_config(scratch, name, tasks, extra)
    worker = _null_worker_class(token_ids)
    taken = 0
    connect_ray(load_config(cfg))  # as `rollout run` does before its driver: Ray's start is not measured
    wall0 = time.perf_counter()
    cpu0 = _cpu()
    try:
        if mode == "cli":
            summary = Executor(cfg, worker_class=worker).run()
        else:
            versions = mode == "api+versions"
            ex = Executor(cfg, worker_class=worker, policy_version=0 if versions else None).start()
            ex.submit(tasks)
            for batch in ex.batches(timeout_s=600):
                before = taken
                taken += batch.num_rows
                if versions and taken // 500 > before // 500:
                    ex.update_policy(taken // 500)
            summary = ex.close()
        cpu, wall = _cpu() - cpu0, time.perf_counter() - wall0
    finally:
        ray.shutdown()
    return {
        "mode": mode,
        "rollouts": n,
        "final": summary.final,
        "delivered": taken if mode != "cli" else None,
        "driver_cpu_s": round(cpu, 2),
        "cpu_ms_per_row": round(1000 * cpu / max(summary.final, 1), 3),
        "wall_s": round(wall, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=5000)
    parser.add_argument("--token-ids", type=int, default=0)
    parser.add_argument("--modes", default="cli,api,api+versions")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-api-") as scratch:
        for mode in args.modes.split(","):
            out = subprocess.run(
                [sys.executable, __file__, "child", mode, str(args.rollouts), scratch, str(args.token_ids)],
                capture_output=True,
                text=True,
                timeout=7200,
                cwd=REPO,
            )
            if out.returncode != 0:
                raise SystemExit(f"{mode} failed: {out.stderr[-2000:]}")
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))))
    else:
        main()
