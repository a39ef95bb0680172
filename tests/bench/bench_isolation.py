"""What each isolation layer of a local sandbox adds to one exec: ``exec(["true"])`` round trips.

    .venv/bin/python tests/bench/bench_isolation.py [--execs 50]

Modes: no isolation, a PID namespace (``pids: isolated``), the filesystem view (``filesystem:
readonly``: root's own mounts, or bwrap without root), the view made by bwrap even as root, and the view
with the unprivileged user (what ``isolation: auto`` gives as root, less the network); with
``--network`` each also in a loopback-only network namespace (the forwarder's Unix socket need not exist
for ``true``). A mode this host cannot run is reported as skipped. Prints medians (and p90), per exec
and, with ``--sandboxes N``, per sandbox (start and stop). The in-sandbox agent (Slurm's, ECS's) is
measured the same way, started as a local process with ``--isolation off`` and with ``auto`` (as root,
its every layer): per exec, and per sandbox its start to the rendezvous (the probes, the PID namespace).
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
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sandboxes import isolation  # noqa: E402
from sandboxes.base import SandboxSpec  # noqa: E402
from sandboxes.identity import SANDBOX_USER  # noqa: E402
from sandboxes.isolation import IsolationUnavailable  # noqa: E402
from sandboxes.local import LocalSandboxProvider  # noqa: E402
from sandboxes.netns import IsolationUnavailable as NetworkUnavailable  # noqa: E402
from sandboxes.netns import check_available  # noqa: E402
from sandboxes.remote import RemoteSandbox  # noqa: E402
from tests.agent_process import start_agent  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "no isolation": {},
    "pids isolated": {"pids": "isolated"},
    "filesystem view": {"filesystem": "readonly"},
    "filesystem view by bwrap": {"filesystem": "readonly", "via_bwrap": True},
    "filesystem view, sandbox user, process cap": {
        "filesystem": "readonly",
        "user": True,
        "max_processes": 2048,
    },
    "all of that and the disk bound": {
        "filesystem": "readonly",
        "user": True,
        "max_processes": 2048,
        "max_disk_mb": 16_384,
    },
}
AGENT_MODES = {
    "agent, isolation off": [],
    "agent, isolation auto": ["--isolation", "auto", "--run-as", SANDBOX_USER],
}


def _summary(label: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    median = statistics.median(ordered)
    return f"{label}: median {median * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms (n={len(ordered)})"


async def _execs(root: Path, n: int, provider_kw: dict[str, Any]) -> list[float]:
    if provider_kw.pop("via_bwrap", False):
        with mock.patch.object(isolation, "mounts_unavailable", lambda: "bwrap asked for"):
            provider = LocalSandboxProvider(root, keep=False, **provider_kw)
    else:
        provider = LocalSandboxProvider(root, keep=False, **provider_kw)
    sandbox = await provider.start(SandboxSpec(run_id="bench", session_id=uuid.uuid4().hex[:12], ttl_s=600))
    samples = []
    try:
        await sandbox.exec(["true"], timeout=30)  # warm: the first exec pays one-off start-up
        for _ in range(n):
            started = time.perf_counter()
            res = await sandbox.exec(["true"], timeout=30)
            samples.append(time.perf_counter() - started)
            assert res.exit_code == 0, res.stderr_tail
    finally:
        await sandbox.stop()
    return samples


async def _sandboxes(root: Path, n: int, provider_kw: dict[str, Any]) -> list[float]:
    """Start and stop ``n`` sandboxes one after the other, each with one exec (which makes its server's
    spare for the next, as a worker's sessions do)."""
    provider_kw.pop("via_bwrap", None)
    provider = LocalSandboxProvider(root, keep=False, **provider_kw)
    samples = []
    try:
        for _ in range(n + 1):
            started = time.perf_counter()
            sandbox = await provider.start(
                SandboxSpec(run_id="bench", session_id=uuid.uuid4().hex[:12], ttl_s=600)
            )
            await sandbox.exec(["true"], timeout=30)
            await sandbox.stop()
            samples.append(time.perf_counter() - started)
    finally:
        await provider.aclose()
    return samples[1:]  # the first has no spare server


async def _agent(root: Path, n: int, flags: list[str]) -> tuple[list[float], float]:
    started = time.perf_counter()
    agent = start_agent(root / uuid.uuid4().hex[:8], "bench-token", *flags)
    ready = time.perf_counter() - started
    sandbox = RemoteSandbox(
        sandbox_id="bench", provider_name="bench", spec=SandboxSpec(run_id="b", session_id="a", ttl_s=600),
        base_url=agent.url, token=agent.token, root=str(agent.root), teardown=_nothing, probe=_alive,
        marker_token=uuid.uuid4().hex,
    )  # fmt: skip
    samples = []
    try:
        await sandbox.exec(["true"], timeout=30)
        for _ in range(n):
            t0 = time.perf_counter()
            res = await sandbox.exec(["true"], timeout=30)
            samples.append(time.perf_counter() - t0)
            assert res.exit_code == 0, res.stderr_tail
    finally:
        await sandbox.stop()
        agent.kill()
    return samples, ready


async def _nothing() -> None:
    return None


async def _alive() -> str | None:
    return None


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--execs", type=int, default=50)
    parser.add_argument("--network", action="store_true", help="also a network namespace in every mode")
    parser.add_argument("--sandboxes", type=int, default=0, help="also start and stop this many per mode")
    args = parser.parse_args()
    forward = None
    if args.network:
        check_available()
        forward = (18_999, "/nonexistent/gw.sock")
    with tempfile.TemporaryDirectory(prefix="bench-isolation-") as tmp:
        for label, kw in MODES.items():
            try:
                samples = await _execs(Path(tmp), args.execs, {**kw, "network_forward": forward})
            except (IsolationUnavailable, NetworkUnavailable) as exc:
                print(f"{label}: skipped ({exc})")
                continue
            print(_summary(f"exec(['true']), {label}" + (", network isolated" if forward else ""), samples))
            if args.sandboxes:
                kw = {**kw, "network_forward": forward}
                print(
                    _summary(
                        f"  a sandbox started and stopped, {label}",
                        await _sandboxes(Path(tmp), args.sandboxes, kw),
                    )
                )
        # Under /tmp with a traversable parent: the agent's user must reach its workspace without a view.
        base = Path(tempfile.mkdtemp(prefix="bench-agent-", dir="/tmp"))
        base.chmod(0o711)
        try:
            for label, flags in AGENT_MODES.items():
                samples, ready = await _agent(base, args.execs, flags)
                print(_summary(f"exec(['true']), {label}", samples) + f"; its start {ready * 1000:.0f} ms")
        finally:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
