"""Sandbox start-to-ready time (local and Slurm) and the exec round trip (local, agent, agent via Slurm).

    .venv/bin/python tests/bench/bench_sandboxes.py [--n 20] [--execs 50] [--no-slurm]

Start-to-ready: from ``provider.start`` to a sandbox that answers an exec, i.e. ``start`` plus one
``true``. Exec round trip: ``exec(["true"])`` on a ready sandbox, which for the agent is an HTTP request,
a supervisor process and the command. Slurm needs cluster/slurm/ci-start.sh. Prints medians (and p90).
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sandboxes.base import SandboxSpec  # noqa: E402
from sandboxes.local import LocalSandboxProvider  # noqa: E402
from sandboxes.remote import RemoteSandbox  # noqa: E402
from sandboxes.slurm import SlurmSandboxConfig  # noqa: E402
from tests.agent_process import start_agent  # noqa: E402


def _spec(run_id: str) -> SandboxSpec:
    return SandboxSpec(run_id=run_id, session_id=uuid.uuid4().hex[:12], ttl_s=600)


def _summary(label: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    median = statistics.median(ordered)
    return f"{label}: median {median * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms (n={len(ordered)})"


async def _start_to_ready(provider: object, n: int, run_id: str) -> tuple[list[float], list[object]]:
    times, sandboxes = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sandbox = await provider.start(_spec(run_id))  # type: ignore[attr-defined]
        await sandbox.exec(["true"], timeout=30)
        times.append(time.perf_counter() - t0)
        sandboxes.append(sandbox)
    return times, sandboxes


async def _round_trips(sandbox: object, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await sandbox.exec(["true"], timeout=30)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - t0)
    return times


async def main(n: int, execs: int, slurm: bool) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="bench-sandboxes-"))
    run_id = f"bench-{uuid.uuid4().hex[:6]}"
    try:
        local = LocalSandboxProvider(scratch / "local", keep=False)
        ready, boxes = await _start_to_ready(local, n, run_id)
        print(_summary("local start-to-ready", ready))
        print(_summary("local exec round trip", await _round_trips(boxes[0], execs)))
        for box in boxes:
            await box.stop()  # type: ignore[attr-defined]

        agent = start_agent(scratch / "agent" / "sb", "bench-token")

        async def teardown() -> None:
            agent.kill()

        async def probe() -> str | None:
            return None

        remote = RemoteSandbox(
            sandbox_id="bench",
            provider_name="bench",
            spec=_spec(run_id),
            base_url=agent.url,
            token="bench-token",
            root=str(agent.root),
            teardown=teardown,
            probe=probe,
            marker_token=uuid.uuid4().hex,
        )
        print(_summary("agent exec round trip (local process)", await _round_trips(remote, execs)))
        health = []
        for _ in range(execs):  # the HTTP part alone: what the agent adds over a local exec
            t0 = time.perf_counter()
            await remote.health()
            health.append(time.perf_counter() - t0)
        print(_summary("agent /health round trip (HTTP only)", health))
        await remote.stop()

        if slurm:
            provider = SlurmSandboxConfig().build(scratch / "slurm")
            ready, boxes = [], []
            for _ in range(n):  # one at a time, each stopped before the next: start-to-ready alone
                t, b = await _start_to_ready(provider, 1, run_id)
                ready += t
                if boxes:
                    await b[0].stop()  # type: ignore[attr-defined]
                else:
                    boxes = b
            print(_summary("slurm start-to-ready (sbatch -> agent answers)", ready))
            print(_summary("slurm agent exec round trip", await _round_trips(boxes[0], execs)))
            await boxes[0].stop()  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--execs", type=int, default=50)
    parser.add_argument("--no-slurm", action="store_true")
    args = parser.parse_args()
    asyncio.run(main(args.n, args.execs, not args.no_slurm))
