"""`rollout bench` (e): a run's fixed costs, the real `rollout run` cold and attached to a warm executor,
when each phase fell (see executor/testing/bench.py).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from executor.testing.bench_common import (
    SCRIPT,
    VERIFY,
    _direct_runs,
    _ModelThread,
    _write_config,
    _write_tasks,
)

# The phases in the order a run passes them; "spawned" is 0 by definition.
PHASES = (
    "cli",
    "config",
    "ray_up",
    "preflight",
    "harness",
    "workers_created",
    "first_worker_ready",
    "first_row",
    "last_row",
    "summary",
    "exit",
)


def _one_run(config: Path, run_id: str, sandboxes: Path, env: dict[str, str]) -> dict[str, float]:
    """One `rollout run` in a fresh process: each phase's time after the spawn, and what it left."""
    from executor.store import read_table
    from sandboxes.testing.leaks import processes_under

    argv = [sys.executable, "-m", "executor", "run", str(config), "--run-id", run_id]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    spawned = time.monotonic()
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2], env=env
    )
    exited = time.monotonic()
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_dir = config.parent / "out" / run_id
    if proc.returncode != 0:
        raise RuntimeError(f"run {run_id} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    rows = read_table(run_dir, ["reward"]).to_pydict()["reward"]
    if any(r != 1.0 for r in rows):
        raise RuntimeError(f"run {run_id} did not solve every task: {rows}")
    marks = json.loads((run_dir / "summary.json").read_text()).get("phases", {})
    origin = marks.pop("origin_monotonic", None)
    out = {name: origin + at - spawned for name, at in marks.items()} if origin is not None else {}
    out["exit"] = exited - spawned
    # The command's CPU (with the Ray processes it started and reaped; not a warm executor's): on a
    # loaded machine, steadier than its wall time.
    out["cpu_s"] = sum(getattr(cpu_after, f) - getattr(cpu_before, f) for f in ("ru_utime", "ru_stime"))
    out["left_sandbox_processes"] = float(len(processes_under(str(sandboxes))))
    return out


def _rollout(env: dict[str, str], *args: str) -> None:
    argv = [sys.executable, "-m", "executor", *args]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2], env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"rollout {args[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")


def _medians(timings: list[dict[str, float]]) -> dict[str, float]:
    return {
        name: statistics.median(t[name] for t in timings)
        for name in (*PHASES, "cpu_s", "left_sandbox_processes")
        if all(name in t for t in timings)
    }


def fixed_costs(rollouts: int, runs: int, concurrency: int, scratch: Path) -> dict[str, Any]:
    """``runs`` cold runs of ``rollouts`` one-tool Codex rollouts, each followed by one attached to a warm
    executor (`rollout up`) and by the same rollouts by hand; the median of each phase's time."""
    from harnesses.codex import CodexHarness
    from harnesses.install import default_cache_root

    tasks = _write_tasks(scratch / "e.jsonl", rollouts, model_script=SCRIPT, verify=VERIFY)
    extra = f"concurrency: {{workers: 1, sessions_per_worker: {concurrency}}}\n"
    config = _write_config(scratch, "e", tasks, extra)
    cold_env = {**os.environ, "ROLLOUT_WARM_DIR": str(scratch / "no-warm")}
    warm_env = {**os.environ, "ROLLOUT_WARM_DIR": str(scratch / "warm")}
    codex_js = (
        CodexHarness().ensure_installed(default_cache_root()) / "node_modules/@openai/codex/bin/codex.js"
    )
    # Configs that differ from each other in what a worker builds once (here the gateway's retry bound),
    # so each attached run finds warm workers built for another config.
    changed_configs = [
        _write_config(
            scratch, f"e-changed{i}", tasks, f"{extra}gateway: {{max_attempts_per_request: {2 + i % 2}}}\n"
        )
        for i in range(runs)
    ]
    cold: list[dict[str, float]] = []
    warm: list[dict[str, float]] = []
    changed: list[dict[str, float]] = []
    by_hand: list[float] = []
    # A warm executor of its own for the changed series, so that the series interleave without one
    # turning the other's runs into changed ones.
    changed_env = {**os.environ, "ROLLOUT_WARM_DIR": str(scratch / "warm-changed")}
    _rollout(warm_env, "up", str(config), "--idle-timeout", "900")
    model = _ModelThread()
    try:
        _rollout(changed_env, "up", str(changed_configs[-1]), "--idle-timeout", "900")
        # Interleaved, so the VM's drift hits all three alike.
        for i in range(runs):
            cold.append(_one_run(config, f"e{i}", scratch / "sb", cold_env))
            warm.append(_one_run(config, f"w{i}", scratch / "sb", warm_env))
            changed.append(_one_run(changed_configs[i], f"c{i}", scratch / "sb", changed_env))
            t0 = time.perf_counter()
            _direct_runs(range(i * rollouts, (i + 1) * rollouts), model, codex_js, scratch, [], [])
            by_hand.append(time.perf_counter() - t0)
    finally:
        model.stop()
        _rollout(warm_env, "down")
        _rollout(changed_env, "down")  # a no-op when its `up` failed
    return {
        "rollouts": rollouts,
        "runs": runs,
        "concurrency": concurrency,
        "median_s": _medians(cold),
        "warm_median_s": _medians(warm),
        "changed_median_s": _medians(changed),
        "by_hand_median_s": statistics.median(by_hand),
        "all": cold,
        "all_warm": warm,
        "all_changed": changed,
    }


# A run handed to the warm executor's pre-imported driver (executor/driver_server.py) is a child of that
# server, not of the command: its CPU is not the command's.
WARM_CPU_NOTE = "; its driver, forked by the warm executor, not counted"


def _phase_line(e: dict[str, Any]) -> str:
    # In the order they fell: phases that run side by side (the harness check, Ray's start) may swap.
    series = (e["median_s"], e["warm_median_s"], e.get("changed_median_s", {}))
    left = max(m.get("left_sandbox_processes", 0) for m in series)

    def marks(medians: dict[str, float], whose: str = "") -> str:
        order = sorted((n for n in PHASES if n in medians), key=medians.__getitem__)
        cpu = f" (the command's CPU {medians['cpu_s']:.2f} s{whose})" if "cpu_s" in medians else ""
        return ", ".join(f"{n} {medians[n]:.2f}" for n in order) + cpu

    return (
        f"(e) fixed costs, {e['runs']} `rollout run`s of {e['rollouts']} one-tool Codex rollouts at "
        f"concurrency {e['concurrency']}, each in a fresh process; median seconds after the spawn: "
        f"cold {marks(e['median_s'])}; attached to a warm executor "
        f"{marks(e['warm_median_s'], WARM_CPU_NOTE)}; attached, each run's config changed since the run "
        f"before {marks(e.get('changed_median_s', {}), WARM_CPU_NOTE)}; "
        f"the same rollouts by hand {e['by_hand_median_s']:.2f} s; sandbox processes left "
        f"{left:.0f}"
    )
