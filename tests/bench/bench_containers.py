"""Container sandboxes: start to a ready agent, one exec, and stop, sequentially, through the provider.

    .venv/bin/python tests/bench/bench_containers.py [--runs 20] [--execs 20] [--image IMG]

Default image: the tests' Debian base (built first if missing, sandboxes/testing/images.py). Each run
starts a sandbox (podman run, the agent's rendezvous, its /health), runs ``--execs`` commands (`true`)
one after another, then stops it (the agent's /stop, podman rm). Also times `podman run --rm IMG true`
and `podman exec` for the engine's own floor. Prints medians; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sandboxes.base import SandboxSpec  # noqa: E402
from sandboxes.container import ContainerSandboxConfig  # noqa: E402
from sandboxes.testing.images import ensure_test_images  # noqa: E402

HOST = {"runtime": "runc", "ulimits": ["nofile=1024:1024", "nproc=1024:1024"]}


def _timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True, timeout=120)
    return time.perf_counter() - t0


async def main(runs: int, execs: int, image: str) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-ctr-") as tmp:
        await _sandboxes(Path(tmp), runs, execs, image)


async def _sandboxes(scratch: Path, runs: int, execs: int, image: str) -> None:
    """Every figure, printed; the sandboxes' root and the gateway's socket under ``scratch``, which the
    caller removes."""
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(scratch / "gw.sock"))
        listener.listen()
        cfg = ContainerSandboxConfig(image=image, root=str(scratch / "root"), **HOST)
        provider = cfg.build(scratch / "root", (4999, str(scratch / "gw.sock")))
        starts, exec_times, stops = [], [], []
        for _ in range(runs):
            t0 = time.perf_counter()
            sb = await provider.start(
                SandboxSpec(run_id="bench", session_id=uuid.uuid4().hex[:12], ttl_s=600)
            )
            starts.append(time.perf_counter() - t0)
            for _ in range(execs):
                t1 = time.perf_counter()
                await sb.exec(["true"], timeout=30)
                exec_times.append(time.perf_counter() - t1)
            t2 = time.perf_counter()
            await sb.stop()
            stops.append(time.perf_counter() - t2)
        # Its spares and removals: a spare left behind would outlive this process until its TTL, when
        # any reaper on the host (a test's among them) removes it as expired.
        await provider.aclose()
    limits = [arg for ulimit in HOST["ulimits"] for arg in ("--ulimit", ulimit)]
    flags = ["--runtime", "runc", *limits, "--network", "none"]
    runs_alone = [_timed(["podman", "run", "--rm", *flags, image, "true"]) for _ in range(runs)]
    name = f"bench-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["podman", "run", "-d", *flags, "--name", name, image, "sleep", "600"],
        check=True,
        timeout=60,
        capture_output=True,
    )
    try:
        podman_exec = [_timed(["podman", "exec", name, "true"]) for _ in range(runs)]
    finally:
        subprocess.run(["podman", "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)
    med = statistics.median
    print(f"image {image}, {runs} sandboxes x {execs} execs")
    print(f"start to ready agent: median {med(starts):.3f} s (max {max(starts):.3f})")
    print(f"exec of `true` through the agent: median {med(exec_times) * 1000:.1f} ms")
    print(f"stop (agent /stop + rm): median {med(stops):.3f} s")
    print(f"podman run --rm IMG true: median {med(runs_alone):.3f} s; podman exec: {med(podman_exec):.3f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--execs", type=int, default=20)
    parser.add_argument("--image", default=None)
    args = parser.parse_args()
    asyncio.run(main(args.runs, args.execs, args.image or ensure_test_images().base))
