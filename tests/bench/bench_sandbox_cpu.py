"""CPU per local sandbox (start, ``--execs`` commands of ``true``, stop), all at once, as a run's defaults
make them; two runs with different ``--execs`` give what one more command costs.

    .venv/bin/python tests/bench/bench_sandbox_cpu.py [--n 50] [--execs 1] [--isolation auto|strict|off]
        [--repeat 3] [--sleep S] [--rounds R]

What it counts and leaves out: executor/testing/bench_scale.py (``sandbox_cpu``). Each repetition runs in
a fresh process, so that one's children are not the next one's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from executor.testing.bench_scale import sandbox_cpu, sandbox_line  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--isolation", default="auto", choices=["auto", "strict", "off"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--execs", type=int, default=1)
    parser.add_argument("--sleep", type=float, default=0.0, help="the last command sleeps this long")
    parser.add_argument("--rounds", type=int, default=1, help="--n at once, this many times over")
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        with tempfile.TemporaryDirectory(prefix="bench-sandbox-cpu-") as scratch:
            figures = sandbox_cpu(args.n, Path(scratch), args.isolation, args.execs, args.sleep, args.rounds)
            print(json.dumps(figures))
        return
    for _ in range(args.repeat):
        argv = [sys.executable, __file__, "--once", "--n", str(args.n), "--isolation", args.isolation]
        argv += ["--execs", str(args.execs), "--sleep", str(args.sleep), "--rounds", str(args.rounds)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600 + args.sleep, check=False)
        if done.returncode != 0:
            sys.exit(f"probe failed: {done.stderr[-2000:]}")
        print(sandbox_line(json.loads(done.stdout.splitlines()[-1])), flush=True)


if __name__ == "__main__":
    main()
