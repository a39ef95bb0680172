"""What Ray's actor call alone costs a session: N calls of an async actor method that waits ``--sleep``
seconds and returns a row's worth of bytes, ``--at-once`` in flight, on a local cluster of our own (as a
run's driver calls ``SandboxWorker.run`` once a session). Prints the actor's and the driver's CPU per
call: what sending several sessions in one call could save at most. Asserts nothing.

    .venv/bin/python tests/bench/bench_actor_call.py [--calls 1000] [--at-once 125] [--sleep 1]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import ray  # noqa: E402

from executor.local_ray import start_local_ray  # noqa: E402
from executor.testing.bench_scale import _own_cpu_s  # noqa: E402

ROW_BYTES = 3000  # a null session's row on the wire (executor.schema.batch_to_wire), about
TASK_JSON = '{"id": "b000001", "prompt": "' + "p" * 200 + '"}'


@ray.remote
class Echo:
    async def run(self, task_json: str, sample_index: int, attempt: int, sleep_s: float) -> bytes:
        await asyncio.sleep(sleep_s)
        return b"x" * ROW_BYTES

    def cpu(self) -> tuple[float, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime, usage.ru_stime


def measure(calls: int, at_once: int, sleep_s: float) -> dict[str, float]:
    actor = Echo.options(max_concurrency=at_once).remote()  # type: ignore[attr-defined]
    ray.get([actor.run.remote(TASK_JSON, i, 1, 0.0) for i in range(20)])  # its first calls' imports
    user0, system0 = ray.get(actor.cpu.remote())
    own0, wall = _own_cpu_s(), time.monotonic()
    pending: list[ray.ObjectRef] = []
    for i in range(calls):
        if len(pending) >= at_once:
            _done, pending = ray.wait(pending, num_returns=1)
        pending.append(actor.run.remote(TASK_JSON, i, 1, sleep_s))
    ray.get(pending)
    own, wall = _own_cpu_s() - own0, time.monotonic() - wall
    user1, system1 = ray.get(actor.cpu.remote())
    return {
        "actor_user_ms": (user1 - user0) / calls * 1000,
        "actor_system_ms": (system1 - system0) / calls * 1000,
        "driver_ms": own / calls * 1000,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--at-once", type=int, default=125)
    parser.add_argument("--sleep", type=float, default=1.0)
    args = parser.parse_args()
    start_local_ray()
    try:
        f = measure(args.calls, args.at_once, args.sleep)
    finally:
        ray.shutdown()
    print(
        f"{args.calls} actor calls, {args.at_once} in flight, each waiting {args.sleep:g} s: the actor's CPU "
        f"{f['actor_user_ms'] + f['actor_system_ms']:.2f} ms a call ({f['actor_system_ms']:.2f} in the "
        f"kernel), the driver's {f['driver_ms']:.2f} ms; wall {f['wall_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
