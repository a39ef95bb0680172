"""What each isolation layer of a local sandbox adds to one exec: ``exec(["true"])`` round trips.

    .venv/bin/python tests/bench/bench_isolation.py [--execs 50]

Modes: no isolation, a PID namespace (``pids: isolated``), the filesystem view (``filesystem:
readonly``: root's own mounts, or bwrap without root), the view made by bwrap even as root, and the view
with the unprivileged user (what ``isolation: auto`` gives as root, less the network); with
``--network`` each also in a loopback-only network namespace (the forwarder's Unix socket need not exist
for ``true``). A mode this host cannot run is reported as skipped. Prints medians (and p90).
"""

from __future__ import annotations

import argparse
import asyncio
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
from sandboxes.isolation import IsolationUnavailable  # noqa: E402
from sandboxes.local import LocalSandboxProvider  # noqa: E402
from sandboxes.netns import IsolationUnavailable as NetworkUnavailable  # noqa: E402
from sandboxes.netns import check_available  # noqa: E402

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


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--execs", type=int, default=50)
    parser.add_argument("--network", action="store_true", help="also a network namespace in every mode")
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


if __name__ == "__main__":
    asyncio.run(main())
