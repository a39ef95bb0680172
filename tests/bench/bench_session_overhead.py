"""The executor's own cost per rollout without Ray: hand-rolled Codex rollouts and ``run_session`` rollouts,
interleaved one by one in one process, so a drift in the machine's speed hits both sides alike.

    .venv/bin/python tests/bench/bench_session_overhead.py [--runs 16] [--pids host|isolated]

Each side: the same task and scripted model as `rollout bench` (a). The hand-rolled side makes a fresh
workspace and config, runs `codex exec` and the verifier; the executor side is a whole session (sandbox,
workspace baseline, gateway, harness, parse, diff, evidence, verifier, cleanup). `rollout bench` (a) runs
the executor side through Ray as well; the gap between the two is what Ray's processes cost on a 2-core
machine. Prints medians (the first two of each side left out as warm-up); asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from executor.session import SessionRequest, run_session  # noqa: E402
from executor.tasks import Task  # noqa: E402
from executor.testing.bench import PROMPT, SCRIPT, VERIFY, _direct_runs, _ModelThread  # noqa: E402
from harnesses.codex import CodexHarness  # noqa: E402
from harnesses.install import default_cache_root  # noqa: E402
from sandboxes.local import LocalSandboxProvider  # noqa: E402
from tests.conftest import session_context  # noqa: E402

PHASES = ("t_setup_s", "t_agent_s", "t_verify_s", "t_cleanup_s", "t_total_s")


async def _measure(runs: int, pids: str, scratch: Path) -> None:
    codex_js = (
        CodexHarness().ensure_installed(default_cache_root()) / "node_modules/@openai/codex/bin/codex.js"
    )
    task = Task.model_validate({"id": "b", "prompt": PROMPT, "model_script": SCRIPT, "verify": VERIFY})
    direct: list[float] = []
    direct_codex: list[float] = []
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    model = _ModelThread()
    provider = LocalSandboxProvider(scratch / "sandboxes", keep=False, pids=pids)  # type: ignore[arg-type]
    try:
        async with session_context(scratch / "ctx") as ctx:
            ctx = dataclasses.replace(ctx, provider=provider)
            for i in range(runs):
                await asyncio.to_thread(
                    _direct_runs, range(i, i + 1), model, codex_js, scratch, direct, direct_codex
                )
                row = await run_session(SessionRequest("bench", task, 0, i + 1), ctx)
                await provider.finish_removals()  # the deletion, off the row's path, not in the direct run's
                if row.get("reward") != 1.0:
                    raise RuntimeError(f"session {i} did not solve the task: {row.get('error_message')}")
                for name in PHASES:
                    phases[name].append(row[name])
    finally:
        await provider.aclose()
        model.stop()

    def median(values: list[float]) -> float:
        return statistics.median(values[2:] if len(values) > 4 else values)

    d, e = median(direct), median(phases["t_total_s"])
    print(
        f"pids={pids} runs={runs}: by hand {d:.3f} s (codex exec alone {median(direct_codex):.3f} s); "
        f"executor session {e:.3f} s, ratio {e / d:.2f}; phases "
        + ", ".join(f"{name[2:-2]} {median(phases[name]):.3f}" for name in PHASES[:-1])
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--pids", choices=("host", "isolated"), default="host")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    try:
        asyncio.run(_measure(args.runs, args.pids, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
