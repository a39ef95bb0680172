"""Where one default local Codex rollout's time goes beyond `codex exec` by hand, part by part.

    .venv/bin/python tests/bench/bench_rollout_parts.py [--runs 10] [--variants]

Without Ray, in one process (the worker's side of a session: a provider as `isolation: auto` builds it, the
gateway on its Unix socket, the scripted model), interleaved round by round so the machine's drift hits
every side alike. Each round:

- by hand: a fresh workspace and config, `codex exec` (node, the entry script), the verifier
  (`rollout bench` (a)'s other side);
- the session's own steps, each timed: the agent's sandbox started, the workspace laid out, the
  harness (its config written, then `codex exec` under every default layer, its model requests through
  the sandbox's forwarder and the gateway), its output parsed, what is left to wait for of the grading
  sandbox (started, and the task laid out in it with its baseline, beside the harness), the agent's
  workspace carried over, the diff and the verifier (one exec), the evidence copied, both sandboxes
  stopped;
- ``exec(["true"])`` in the agent's sandbox, and in a sandbox without the filesystem view and user;
- with ``--variants``, the harness alone (`codex exec` through the gateway) in sandboxes with one layer
  off each: network (the host's loopback, no forwarder), filesystem view and user, and all of them.

Prints medians (the first two rounds left out as warm-up); asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from executor import grading  # noqa: E402
from executor.row import Row  # noqa: E402
from executor.session import SessionContext  # noqa: E402
from executor.tasks import Task  # noqa: E402
from executor.testing.bench import PROMPT, SCRIPT, VERIFY, _direct_runs, _ModelThread  # noqa: E402
from harnesses.base import LaunchContext  # noqa: E402
from harnesses.codex import CodexHarness  # noqa: E402
from harnesses.install import default_cache_root  # noqa: E402
from harnesses.testing.scripted_model import parse_steps  # noqa: E402
from policy import FailureKind, Outcome  # noqa: E402
from sandboxes.base import SandboxSpec  # noqa: E402
from sandboxes.local_config import LocalSandboxConfig  # noqa: E402
from sandboxes.workspace import lay_out  # noqa: E402
from tests.conftest import session_context  # noqa: E402

WARM_UP = 2
VARIANTS = {
    "network host": {"network": "host"},
    "no view, no user": {"filesystem": "host"},
    "isolation off": {"isolation": "off"},
}


class Parts:
    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    async def timed(self, name: str, step: Awaitable[Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return await step
        finally:
            self.times.setdefault(name, []).append(time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds)

    def median_ms(self, name: str) -> float:
        values = self.times.get(name, [])
        values = values[WARM_UP:] if len(values) > WARM_UP + 2 else values
        return statistics.median(values) * 1000 if values else float("nan")


def _spec(session: str) -> SandboxSpec:
    return SandboxSpec(run_id="bench", session_id=session, ttl_s=600)


async def _harness_in(ctx: SessionContext, sandbox: Any, rollout_id: str, parts: Parts, name: str) -> Any:
    """Codex in ``sandbox`` against the scripted model through the gateway, as a session runs it."""
    assert ctx.scripted is not None
    ctx.scripted.set_script(rollout_id, parse_steps(SCRIPT))
    gw = ctx.gateway.open_session(rollout_id, ctx.evidence_root / rollout_id / "model")
    try:
        launch_ctx = LaunchContext(
            base_url=gw.base_url,
            api_key=gw.token,
            model=ctx.config.model.name,
            prompt=PROMPT,
            install_dir=await ctx.ensure_installed(),
        )
        launch = await ctx.harness.prepare(sandbox, launch_ctx)
        result = await parts.timed(
            name, sandbox.exec(launch.argv, timeout=120, env=launch.env, stdin=launch.stdin, name="harness")
        )
    finally:
        ctx.gateway.close_session(gw)
    if result.exit_code != 0:
        raise RuntimeError(f"codex in the sandbox failed: {result.stderr_tail[-1000:]}")
    return result


async def _session(ctx: SessionContext, task: Task, round_: int, parts: Parts) -> None:
    """The steps of executor/session.py's _run for one rollout, each timed on its own."""
    t0 = time.perf_counter()
    launch_id = f"s{round_}-{uuid.uuid4().hex[:6]}"
    spec = _spec(launch_id).model_copy(update={"workspace": task.workspace})
    review = grading.Review(ctx.provider, spec, task, ctx.workspaces)
    sandbox = await parts.timed("start (agent)", ctx.provider.start(spec))
    try:
        await parts.timed("lay out", lay_out(sandbox, task.workspace, ctx.workspaces, baseline=False))
        review.begin()  # as the session does: the grading sandbox starts beside the harness
        result = await _harness_in(ctx, sandbox, launch_id, parts, "harness (codex exec)")
        report = await parts.timed("parse", ctx.harness.parse(sandbox, result))
        row = Row(run_id="bench", rollout_id=launch_id, task_id=task.id, sample_index=0, attempt=1)
        assert review._ready is not None
        checker = await parts.timed("grading sandbox, left to wait for", asyncio.shield(review._ready))
        await parts.timed("carry", grading._take_over(sandbox, checker, task, row))
        assert task.verify is not None
        graded, _ = await parts.timed(
            "diff + verifier",
            grading._diff_and_grade(checker, task.verify, Outcome.of(FailureKind.NONE), row),
        )
        if row.reward != 1.0:
            raise RuntimeError(f"not graded 1.0: {graded}")
        evidence = ctx.evidence_root / launch_id
        evidence.mkdir(parents=True, exist_ok=True)
        from executor.session import _keep_evidence

        await parts.timed("evidence", _keep_evidence(sandbox, result, report, evidence, row))
    finally:
        t1 = time.perf_counter()
        await asyncio.gather(grading.stop_sandbox(sandbox), review.close())
        parts.add("stop (both)", time.perf_counter() - t1)
    parts.add("session", time.perf_counter() - t0)
    await ctx.provider.finish_removals()  # type: ignore[attr-defined]


async def _execs(provider: Any, parts: Parts, name: str, n: int = 5) -> None:
    sandbox = await provider.start(_spec(uuid.uuid4().hex[:12]))
    try:
        for _ in range(n):
            await parts.timed(name, sandbox.exec(["true"], timeout=30))
    finally:
        await sandbox.stop()


async def _variant(ctx: SessionContext, provider: Any, name: str, parts: Parts) -> None:
    sandbox = await provider.start(_spec(uuid.uuid4().hex[:12]))
    try:
        await _harness_in(ctx, sandbox, f"v-{uuid.uuid4().hex[:8]}", parts, name)
    finally:
        await sandbox.stop()
    await provider.finish_removals()


def _provider(ctx: SessionContext, scratch: Path, **layers: Any) -> Any:
    cfg = LocalSandboxConfig(root=str(scratch), keep=False, **layers)
    forward = (urlsplit(ctx.gateway.url).port or 0, ctx.gateway.unix_path or "")
    return cfg.build(scratch, forward if cfg.needs_gateway_socket else None)


async def measure(runs: int, variants: bool, scratch: Path) -> Parts:
    parts = Parts()
    install = CodexHarness().ensure_installed(default_cache_root())
    codex_js = install / "node_modules/@openai/codex/bin/codex.js"
    task = Task.model_validate({"id": "b", "prompt": PROMPT, "model_script": SCRIPT, "verify": VERIFY})
    model = _ModelThread()
    async with session_context(scratch / "ctx", {"sandbox": {"keep": False}}) as ctx:
        others = {
            name: _provider(ctx, scratch / f"v{i}", **layers)
            for i, (name, layers) in enumerate(VARIANTS.items())
        }
        try:
            for i in range(runs):
                direct: list[float] = []
                codex: list[float] = []
                await asyncio.to_thread(
                    _direct_runs, range(i, i + 1), model, codex_js, scratch, direct, codex
                )
                parts.add("by hand", direct[0])
                parts.add("by hand: codex exec", codex[0])
                await _session(ctx, task, i, parts)
                await _execs(ctx.provider, parts, "exec true (default)")
                await _execs(others["no view, no user"], parts, "exec true (no view, no user)")
                if variants:
                    for name, provider in others.items():
                        await _variant(ctx, provider, f"harness, {name}", parts)
        finally:
            for provider in others.values():
                await provider.aclose()
            model.stop()
    return parts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--variants", action="store_true")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-parts-", dir=str(Path.home())))
    try:
        parts = asyncio.run(measure(args.runs, args.variants, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{args.runs} rounds, medians after {WARM_UP} warm-up rounds (ms):")
    for name in parts.times:
        print(f"  {name:34s} {parts.median_ms(name):8.1f}")


if __name__ == "__main__":
    main()
