"""What the parts of `rollout bench` share: the task they run, its configs, the scripted model on a thread
of its own, and the same rollouts done by hand (a fresh workspace and config, `codex exec`, the verifier).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = "Create a file hello.txt containing exactly the line: hello world"
SCRIPT = [
    {"type": "shell", "command": "printf 'hello world\\n' > hello.txt"},
    {"type": "text", "text": "Created hello.txt."},
]
VERIFY = "grep -qx 'hello world' hello.txt"
NULL_COMMAND = "echo done"


def _median_p90(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _write_config(scratch: Path, name: str, tasks: Path, extra: str, isolation: str | None = None) -> Path:
    path = scratch / f"{name}.yaml"
    sandbox = f"root: {scratch / 'sb'}" + (f", isolation: {isolation}" if isolation else "")
    path.write_text(f"tasks: {tasks}\nout: {scratch / 'out'}\nsandbox: {{{sandbox}}}\n{extra}")
    return path


def _write_tasks(path: Path, n: int, **fields: Any) -> Path:
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"b{i:06d}", "prompt": PROMPT, **fields}) + "\n")
    return path


def _run_driver(cfg_path: Path, worker_class: Any = None) -> tuple[Any, float]:
    import ray

    from executor.api import Executor
    from executor.config import load_config

    cfg = load_config(cfg_path)
    kind = {} if worker_class is None else {"worker_class": worker_class}
    executor = Executor(cfg, progress=True, **kind)
    t0 = time.perf_counter()
    try:
        summary = executor.run()
    finally:
        ray.shutdown()
    return summary, time.perf_counter() - t0


class _ModelThread:
    """The scripted model on its own event loop thread, for runs that are not asyncio themselves."""

    def __init__(self) -> None:
        from harnesses.testing.scripted_model import ScriptedModel, parse_steps

        self.loop = asyncio.new_event_loop()
        self.model = ScriptedModel(default_script=parse_steps(SCRIPT))
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.model.start(), self.loop).result(timeout=30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.model.stop(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _direct_runs(
    indices: range,
    model: Any,
    codex_js: Path,
    scratch: Path,
    direct: list[float],
    direct_codex: list[float],
    in_container: Callable[[list[str], dict[str, str], Path], list[str]] | None = None,
) -> None:
    """Hand-rolled rollouts: the same Codex task against the same scripted model, without the executor.
    ``in_container`` turns the command into one that runs it in a container, as one would by hand."""
    for i in indices:
        # Timed from here: what a hand-rolled loop does for one rollout too (a fresh workspace and
        # config, the harness, the grade), so the difference is what the executor adds.
        t0 = time.perf_counter()
        home = scratch / f"direct-{i}"
        (home / "work").mkdir(parents=True)
        (home / "codex").mkdir()
        base = model.model.base_url.removesuffix("/v1")
        (home / "codex" / "config.toml").write_text(
            'model = "scripted-model"\nmodel_provider = "bench"\napproval_policy = "never"\n'
            'sandbox_mode = "danger-full-access"\ncheck_for_update_on_startup = false\n'
            f'[model_providers.bench]\nname = "bench"\nbase_url = "{base}/s/d{i}/v1"\n'
            'env_key = "BENCH_KEY"\nwire_api = "responses"\n[analytics]\nenabled = false\n'
            "[feedback]\nenabled = false\n"
        )
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": str(home),
            "CODEX_HOME": str(home / "codex"),
            "BENCH_KEY": "k",
        }
        argv = [
            shutil.which("node") or "node",
            str(codex_js),
            "exec",
            "--json",
            "--skip-git-repo-check",
            "-C",
            str(home / "work"),
            PROMPT,
        ]
        if in_container is not None:
            argv = in_container(argv[2:], env, home)
        t1 = time.perf_counter()
        proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
        direct_codex.append(time.perf_counter() - t1)
        graded = subprocess.run(["bash", "-c", VERIFY], cwd=home / "work", capture_output=True, timeout=9)
        direct.append(time.perf_counter() - t0)
        if proc.returncode != 0 or graded.returncode != 0:
            raise RuntimeError(f"direct codex run failed: {proc.stderr[-2000:]!r}")
