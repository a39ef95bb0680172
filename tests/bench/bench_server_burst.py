"""What a fresh sandbox's server and its fork server cost in a burst of starts: N local sandboxes with the
run's layers (``LocalSandboxConfig()``, as a run builds its provider) started at once, one ``true`` each,
then stopped. A burst is where a forked interpreter costs most: each page it writes is copied, shared as
it is with the fork server and every server alive (docs/performance.md, "Pages copied after a fork").

    .venv/bin/python tests/bench/bench_server_burst.py [--n 150] [--repeat 2]

Prints, per server: the fork server's page faults and CPU for its fork (its own counters before and
after the starts), and the server's main thread's faults and CPU to the end of its first command
(/proc/PID/stat, /proc/PID/schedstat: the relay's threads and the children, the view's builder and the
command, are not in it). Each repetition runs in a fresh process. Root only; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _counters(pid: int) -> tuple[int, float]:
    """The page faults and CPU (ms) of ``pid``'s main thread."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    with open(f"/proc/{pid}/schedstat") as f:
        on_cpu_ns = int(f.read().split()[0])
    return int(stat[stat.rindex(")") + 2 :].split()[7]), on_cpu_ns / 1e6


async def _burst(n: int, scratch: Path) -> dict[str, float]:
    from sandboxes.base import SandboxSpec
    from sandboxes.local_config import LocalSandboxConfig

    gateway = scratch / "gateway.sock"  # a listening socket; `true` never connects
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(gateway))
    listener.listen()
    config = LocalSandboxConfig()
    provider = config.build(scratch / "sb", (8, str(gateway)) if config.needs_gateway_socket else None)

    def spec() -> SandboxSpec:
        return SandboxSpec(run_id="burst", session_id=uuid.uuid4().hex[:12], ttl_s=600)

    first = await provider.start(spec())  # the fork server started, its imports done
    boxes = [first]
    try:
        zygote = provider._zygote
        assert zygote is not None, "no fork server: not root, or no mount API"
        faults, cpu = _counters(zygote.pid)
        started = await asyncio.gather(*(provider.start(spec()) for _ in range(n)))
        boxes += started
        faults_after, cpu_after = _counters(zygote.pid)
        done = await asyncio.gather(*(box.exec(["true"], timeout=120) for box in started))
        assert all(result.exit_code == 0 for result in done)
        servers = [_counters(box._server.pid) for box in started]
    finally:
        await asyncio.gather(*(box.stop() for box in boxes))
        await provider.aclose()
        listener.close()
    return {
        "fork_server_faults": (faults_after - faults) / n,
        "fork_server_ms": (cpu_after - cpu) / n,
        "server_faults": sum(f for f, _ in servers) / n,
        "server_ms": sum(c for _, c in servers) / n,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=150)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        with tempfile.TemporaryDirectory(prefix="bench-server-burst-") as scratch:
            print(json.dumps(asyncio.run(_burst(args.n, Path(scratch)))))
        return
    for _ in range(args.repeat):
        argv = [sys.executable, __file__, "--once", "--n", str(args.n)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            sys.exit(f"probe failed: {done.stderr[-2000:]}")
        got = json.loads(done.stdout.splitlines()[-1])
        print(
            f"{args.n} sandboxes started at once: the fork server {got['fork_server_faults']:.0f} faults and "
            f"{got['fork_server_ms']:.2f} ms a server; each server's main thread to the end of its first "
            f"command {got['server_faults']:.0f} faults and {got['server_ms']:.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
