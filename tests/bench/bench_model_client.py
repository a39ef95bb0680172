"""What the gateway forwarder's check of who opened a connection costs (sandboxes/netns.py, ModelClient):
the first connection (a scan of the sandbox's processes for its maker, which is pinned) and each later one
(the pinned process's descriptors only), in a network namespace of its own as a sandbox's forwarder has.

    .venv/bin/python tests/bench/bench_model_client.py [--connections 200] [--processes 20]

Root only: it runs itself under ``unshare --pid --fork --mount-proc --net``, so its /proc and its socket
table hold its own alone, as a sandbox's do. ``--processes`` idle processes stand for the rest of a
sandbox's tree, each holding ~10 descriptors; the pinned one holds as many as Node does (~40).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sandboxes import netns  # noqa: E402

# The harness: opens extra descriptors, then one connection at a time, each held until the next.
CLIENT = """
import os, socket, sys
held = [os.open("/dev/null", os.O_RDONLY) for _ in range(40)]
for _ in range(int(sys.argv[2])):
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    s.recv(1)
    s.close()
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--processes", type=int, default=20)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.inside:
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--net", sys.executable, __file__, "--inside"]
        argv += ["--connections", str(args.connections), "--processes", str(args.processes)]
        sys.exit(subprocess.run(argv, check=False, timeout=600).returncode)
    netns.loopback_up()
    listener = netns.listen(0, bring_up_loopback=False)
    port = listener.getsockname()[1]
    idle = [
        subprocess.Popen(
            [sys.executable, "-c", "import os, time; [os.dup(0) for _ in range(8)]; time.sleep(600)"]
        )
        for _ in range(args.processes)
    ]
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(port), str(args.connections)])
    model_client = netns.ModelClient("/proc", port)
    timings = []
    try:
        for _ in range(args.connections):
            conn, _addr = listener.accept()
            started = time.perf_counter()
            made = model_client.made(conn)
            timings.append(time.perf_counter() - started)
            assert made, "the client's connection was not found to be its"
            conn.send(b"x")
            conn.close()
    finally:
        client.wait(timeout=60)
        for proc in idle:
            proc.kill()
            proc.wait()
    later = timings[1:]
    print(
        f"first connection (its maker found among {args.processes + 2} processes): {timings[0] * 1e3:.2f} ms;"
        f" each later one (the pinned process's descriptors): median {statistics.median(later) * 1e6:.0f} us,"
        f" max {max(later) * 1e6:.0f} us over {len(later)}"
    )


if __name__ == "__main__":
    main()
