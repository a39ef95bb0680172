"""Wall time and peak memory of one tool_success session of a harness, through ``run_session``.

    .venv/bin/python tests/bench/bench_harness_session.py --harness hermes [--runs 5]

Each run is a real session (local sandbox, gateway, scripted model, verifier): two shell tool calls,
then an answer. The install happens once before the first run and is not timed. Memory is sampled from
/proc every 50 ms for the processes running in the session's sandbox: the peak of their summed RSS, and
the largest single process's own high-water mark (VmHWM). Prints medians; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from executor.session import SessionRequest, run_session  # noqa: E402
from executor.tasks import Task  # noqa: E402
from harnesses.install import default_cache_root  # noqa: E402
from harnesses.registry import make_harness  # noqa: E402
from tests.conftest import session_context  # noqa: E402

SCRIPT = [
    {"type": "shell", "command": "printf 'hello world\\n' > hello.txt"},
    {"type": "shell", "command": "cat hello.txt"},
    {"type": "text", "text": "Created hello.txt."},
]
SAMPLE_S = 0.05


class _MemorySampler(threading.Thread):
    """Peak summed RSS and peak single-process VmHWM of the processes under ``marker`` (cwd or argv)."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker = marker
        self.peak_sum_kb = 0
        self.peak_hwm_kb = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(SAMPLE_S):
            total = 0
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    cwd = os.readlink(f"/proc/{pid}/cwd")
                    if not cwd.startswith(self.marker):
                        continue
                    fields = dict(
                        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    )
                except (OSError, ValueError):
                    continue
                rss = int(fields.get("VmRSS", "0 kB").split()[0])
                hwm = int(fields.get("VmHWM", "0 kB").split()[0])
                total += rss
                self.peak_hwm_kb = max(self.peak_hwm_kb, hwm)
            self.peak_sum_kb = max(self.peak_sum_kb, total)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)


async def _one(harness_name: str, root: Path) -> tuple[float, dict, _MemorySampler]:
    task = Task.model_validate(
        {
            "id": "bench",
            "prompt": "Create hello.txt containing hello world.",
            "model_script": SCRIPT,
            "verify": "grep -qx 'hello world' hello.txt",
        }
    )
    sampler = _MemorySampler(str(root / "sandboxes"))
    async with session_context(root, harness=make_harness(harness_name)) as ctx:
        sampler.start()
        started = time.monotonic()
        row = await run_session(SessionRequest("bench", task, 0, 1), ctx)
        wall = time.monotonic() - started
        sampler.stop()
    return wall, row, sampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--harness", default="hermes")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    harness = make_harness(args.harness)
    harness.ensure_installed(default_cache_root())
    walls, agents, sums, hwms = [], [], [], []
    for index in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="bench-session-") as tmp:
            wall, row, sampler = asyncio.run(_one(args.harness, Path(tmp)))
        ok = (row["status"], row.get("reward")) == ("completed", 1.0)
        print(
            f"run {index + 1}: {wall:.2f} s (agent {row.get('t_agent_s')} s), "
            f"RSS peak {sampler.peak_sum_kb / 1024:.0f} MB, "
            f"largest process {sampler.peak_hwm_kb / 1024:.0f} MB"
            + (
                ""
                if ok
                else f"  NOT COMPLETED: {row['status']} {row['failure_kind']} {row.get('error_message')}"
            )
        )
        walls.append(wall)
        agents.append(row.get("t_agent_s") or 0.0)
        sums.append(sampler.peak_sum_kb / 1024)
        hwms.append(sampler.peak_hwm_kb / 1024)
    print(
        f"{args.harness} {harness.version}, tool_success through run_session, {args.runs} runs: "
        f"median wall {statistics.median(walls):.2f} s (agent phase {statistics.median(agents):.2f} s), "
        f"peak RSS of the session's processes {max(sums):.0f} MB (median {statistics.median(sums):.0f}), "
        f"largest single process {max(hwms):.0f} MB"
    )


if __name__ == "__main__":
    main()
