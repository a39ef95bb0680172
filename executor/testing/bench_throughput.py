"""`rollout bench` (b): a null harness through the executor against a plain asyncio runner doing the same
sessions (see executor/testing/bench.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from executor.testing.bench_common import NULL_COMMAND, _run_driver, _write_config, _write_tasks


async def _plain_runner(n: int, concurrency: int, scratch: Path) -> tuple[float, list[float]]:
    """The same sessions as the executor runs, in one asyncio process: no Ray, no Arrow, no policy.
    Its wall time and when each session ended."""
    from executor.config import load_config
    from executor.session import SessionContext, SessionRequest, run_session
    from executor.tasks import load_tasks
    from harnesses.command import CommandHarness
    from harnesses.gateway import Gateway
    from harnesses.install import default_cache_root
    from harnesses.testing.scripted_model import ScriptedModel
    from sandboxes.local import LocalSandboxProvider

    tasks_path = _write_tasks(scratch / f"plain-{concurrency}.jsonl", n)
    cfg = load_config(_write_config(scratch, f"plain{concurrency}", tasks_path, ""))
    model = ScriptedModel()
    await model.start()
    gateway = Gateway(model.base_url, None, cfg.gateway, **cfg.model.pins())
    await gateway.start()
    ctx = SessionContext(
        config=cfg,
        provider=(provider := LocalSandboxProvider(scratch / "plain-sb", keep=False)),
        harness=CommandHarness(command=NULL_COMMAND),
        gateway=gateway,
        scripted=model,
        evidence_root=scratch / "plain-evidence",
        cache_root=default_cache_root(),
    )
    gate = asyncio.Semaphore(concurrency)

    rows: list[dict[str, Any]] = []

    async def one(task: Any) -> None:
        async with gate:
            rows.append(await run_session(SessionRequest("plain", task, 0, 1), ctx))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(t) for t in load_tasks(tasks_path)))
    wall = time.perf_counter() - t0
    await provider.aclose()
    await gateway.stop()
    await model.stop()
    return wall, [r["started_at"].timestamp() + r["t_total_s"] for r in rows]


def _steady_rate(ends: list[float]) -> float:
    """Rollouts per second while every slot is busy: those finishing between the 10th and the 90th
    percentile of the end times, over that span. The first tenth ends while workers still start (Ray's
    actors come up one after another), the last while the final wave drains with slots idle; a run of
    100,000 rollouts is neither, so both are left out."""
    ends = sorted(ends)
    lo, hi = len(ends) // 10, len(ends) - 1 - len(ends) // 10
    return (hi - lo) / (ends[hi] - ends[lo]) if hi > lo and ends[hi] > ends[lo] else 0.0


def _end_to_end_rate(ends: list[float]) -> float:
    """Rollouts per second between the first and the last to finish: Ray's start-up left out, the
    first ramp and the drain kept."""
    ends = sorted(ends)
    return (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 1 and ends[-1] > ends[0] else 0.0


def throughput(n: int, levels: tuple[int, ...], scratch: Path) -> list[dict[str, Any]]:
    results = []
    for c in levels:
        tasks = _write_tasks(scratch / f"b{c}.jsonl", n)
        workers = 2
        extra = (
            f"run_id: b{c}\nharness: {{name: command, command: {NULL_COMMAND!r}}}\n"
            f"concurrency: {{workers: {workers}, sessions_per_worker: {c // workers}}}\n"
        )
        summary, wall = _run_driver(_write_config(scratch, f"b{c}", tasks, extra))
        from executor.store import read_table

        cols = read_table(Path(summary.run_dir), ["started_at", "t_total_s"]).to_pydict()
        ends = [s.timestamp() + t for s, t in zip(cols["started_at"], cols["t_total_s"], strict=True)]
        plain_wall, plain_ends = asyncio.run(_plain_runner(n, c, scratch))
        steady, plain_steady = _steady_rate(ends), _steady_rate(plain_ends)
        results.append(
            {
                "concurrency": c,
                "rollouts": n,
                "executor_per_s": n / wall,
                "plain_per_s": n / plain_wall,
                "executor_steady_per_s": steady,
                "plain_steady_per_s": plain_steady,
                "ratio": steady / plain_steady if plain_steady else 0.0,
                "executor_end_to_end_per_s": _end_to_end_rate(ends),
                "plain_end_to_end_per_s": _end_to_end_rate(plain_ends),
                "executor_final": summary.final,
            }
        )
    return results
