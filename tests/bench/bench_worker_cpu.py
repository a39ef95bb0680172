"""The worker's own CPU per session, without Ray: N sessions of a null harness (``sleep S; echo done``)
run by ``run_session`` in this one process, ``--at-once`` of them at a time, as a worker actor runs its
share of a run (its provider, gateway and scripted model included; the sandboxes' processes not).

    .venv/bin/python tests/bench/bench_worker_cpu.py [--sessions 400] [--at-once 125] [--sleep 5]
        [--files 0] [--no-verify] [--scratch DIR]

Set against the workers' part of `python -m executor.testing.bench_scale` (f), what is left is Ray's
task path and the cores the workers share. Prints its figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from executor.session import SessionRequest, run_session  # noqa: E402
from executor.tasks import Task  # noqa: E402
from harnesses.command import CommandHarness  # noqa: E402
from tests.conftest import session_context  # noqa: E402

WARM_UP = 8  # sessions run first and left out: the provider's fork server, the imports of first use


async def measure(
    sessions: int, at_once: int, sleep_s: float, scratch: Path, files: int = 0, verify: bool = True
) -> dict[str, float]:
    workspace: dict[str, str] = {}
    if files:  # a repository of the task's: that many small files in a few directories
        repo = scratch / "repo"
        for i in range(files):
            path = repo / f"d{i % 10}" / f"f{i}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"x = {i}\n")
        workspace = {"copy_from": str(repo)}
    verifier = {"verify": "true"} if verify else {}
    task = Task.model_validate({"id": "null", "prompt": "p", **verifier, "workspace": workspace})
    harness = CommandHarness(command=f"sleep {sleep_s:g}; echo done")
    async with session_context(scratch, harness=harness) as ctx:
        slots = asyncio.Semaphore(at_once)

        async def one(index: int) -> str:
            async with slots:
                # One run, as a worker serves: the sessions differ by sample, not by run (a directory each).
                row = await run_session(SessionRequest("bench", task, index, 1), ctx)
            return str(row["failure_kind"])

        await asyncio.gather(*(one(i) for i in range(WARM_UP)))
        before, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        kinds = await asyncio.gather(*(one(i) for i in range(WARM_UP, WARM_UP + sessions)))
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - wall
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    switches = after.ru_nvcsw + after.ru_nivcsw - before.ru_nvcsw - before.ru_nivcsw
    return {
        "cpu_ms_per_session": 1000 * (user + system) / sessions,
        "system_ms_per_session": 1000 * system / sessions,
        "faults_per_session": (after.ru_minflt - before.ru_minflt) / sessions,
        "switches_per_session": switches / sessions,
        "wall_s": wall,
        "not_completed": sum(kind != "none" for kind in kinds),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=400)
    parser.add_argument("--at-once", type=int, default=125)
    parser.add_argument("--sleep", type=float, default=5.0)
    parser.add_argument("--files", type=int, default=0, help="the task's workspace: this many small files")
    parser.add_argument(
        "--no-verify", action="store_true", help="no verifier: the diff alone, as the (f) bench's tasks"
    )
    # The disk's filesystem matters: an ext4 without a journal searches past every inode freed lately.
    parser.add_argument("--scratch", default=str(Path.home()), help="where the sessions' files go")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-worker-cpu-", dir=args.scratch))
    try:
        figures = asyncio.run(
            measure(args.sessions, args.at_once, args.sleep, scratch, args.files, not args.no_verify)
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"{args.sessions} sessions of `sleep {args.sleep:g}`, {args.at_once} at once, "
        f"workspace of {args.files} files, in one process: "
        f"{figures['cpu_ms_per_session']:.1f} ms of its CPU per session "
        f"({figures['system_ms_per_session']:.1f} ms of it in the kernel; "
        f"{figures['faults_per_session']:.0f} page faults, {figures['switches_per_session']:.0f} context "
        f"switches), wall {figures['wall_s']:.1f} s, "
        f"{figures['not_completed']} not completed"
    )


if __name__ == "__main__":
    main()
