"""Executor overhead per rollout: the same Codex task through the executor and as a bare `codex exec`.

    .venv/bin/python tests/bench/bench_overhead.py [--runs 20]

Both sides talk to the built-in scripted model playing the same two-step script (one shell call, one
answer). The direct side is exactly what a person would run: a config.toml and `codex exec`. The executor
side is a real run: Ray, a worker actor, a local sandbox, the gateway, parsing, the verifier, the Arrow
store. Prints medians and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SCRIPT = [
    {"type": "shell", "command": "printf 'hello world\\n' > hello.txt"},
    {"type": "text", "text": "Created hello.txt."},
]
PROMPT = "Create a file hello.txt containing exactly the line: hello world"


def _start_model() -> tuple[str, object, asyncio.AbstractEventLoop]:
    from harnesses.scripted_model import ScriptedModel, parse_steps

    loop = asyncio.new_event_loop()
    model = ScriptedModel(default_script=parse_steps(SCRIPT))
    threading.Thread(target=loop.run_forever, daemon=True).start()
    asyncio.run_coroutine_threadsafe(model.start(), loop).result(timeout=30)
    return model.base_url, model, loop


def direct_runs(n: int, codex_dir: Path, scratch: Path) -> list[float]:
    base_url, model, loop = _start_model()
    codex = codex_dir / "node_modules" / ".bin" / "codex"
    times = []
    for i in range(n):
        home = scratch / f"direct-{i}"
        (home / "work").mkdir(parents=True)
        (home / "codex").mkdir()
        (home / "codex" / "config.toml").write_text(
            'model = "scripted-model"\nmodel_provider = "bench"\napproval_policy = "never"\n'
            'sandbox_mode = "danger-full-access"\ncheck_for_update_on_startup = false\n'
            f'[model_providers.bench]\nname = "bench"\nbase_url = "{base_url.replace("/v1", "")}/s/d{i}/v1"\n'
            'env_key = "BENCH_KEY"\nwire_api = "responses"\n[analytics]\nenabled = false\n'
            "[feedback]\nenabled = false\n"
        )
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "CODEX_HOME": str(home / "codex"),
            "BENCH_KEY": "k",
        }
        t0 = time.perf_counter()
        proc = subprocess.run(
            [str(codex), "exec", "--json", "--skip-git-repo-check", "-C", str(home / "work"), PROMPT],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=120,
        )
        times.append(time.perf_counter() - t0)
        assert proc.returncode == 0 and (home / "work" / "hello.txt").exists(), proc.stderr[-2000:]
    asyncio.run_coroutine_threadsafe(model.stop(), loop).result(timeout=30)  # type: ignore[attr-defined]
    return times


def executor_runs(n: int, scratch: Path) -> tuple[list[float], list[float], float]:
    from executor.config import load_config
    from executor.driver import Driver
    from executor.store import read_table

    tasks = scratch / "tasks.jsonl"
    tasks.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"b{i:02d}",
                    "prompt": PROMPT,
                    "model_script": SCRIPT,
                    "verify": "grep -qx 'hello world' hello.txt",
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    cfg_path = scratch / "bench.yaml"
    cfg_path.write_text(
        f"tasks: {tasks}\nout: {scratch / 'out'}\nsandbox: {{root: {scratch / 'sb'}}}\n"
        "concurrency: {workers: 1, sessions_per_worker: 1}\n"
    )
    cfg = load_config(cfg_path)
    t0 = time.perf_counter()
    summary = Driver(cfg).run()
    wall = time.perf_counter() - t0
    assert summary.exit_code == 0, summary
    cols = read_table(Path(summary.run_dir), ["t_total_s", "t_agent_s", "reward"]).to_pydict()
    assert all(r == 1.0 for r in cols["reward"]), cols["reward"]
    return cols["t_total_s"], cols["t_agent_s"], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    from harnesses.codex import CodexHarness
    from harnesses.install import default_cache_root

    codex_dir = CodexHarness().ensure_installed(default_cache_root())
    scratch = Path(tempfile.mkdtemp(prefix="rollout-bench-", dir=str(Path.home())))
    try:
        direct = direct_runs(args.runs, codex_dir, scratch)
        total, agent, wall = executor_runs(args.runs, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    d, e, a = statistics.median(direct), statistics.median(total), statistics.median(agent)
    print(f"{'':32}{'median s':>10}{'p90 s':>10}")
    print(f"{'codex exec, direct':32}{d:>10.3f}{sorted(direct)[int(0.9 * len(direct))]:>10.3f}")
    print(f"{'executor, whole session':32}{e:>10.3f}{sorted(total)[int(0.9 * len(total))]:>10.3f}")
    print(f"{'executor, harness phase only':32}{a:>10.3f}{sorted(agent)[int(0.9 * len(agent))]:>10.3f}")
    print(f"ratio executor/direct (median session): {e / d:.3f}")
    print(
        f"executor run wall for {args.runs} sequential rollouts, Ray start included: {wall:.1f} s "
        f"({wall / args.runs:.3f} s per rollout)"
    )


if __name__ == "__main__":
    main()
