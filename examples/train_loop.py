"""A toy asynchronous trainer driving the executor from Python: three policy versions that overlap.

    .venv/bin/python examples/train_loop.py            # rows under runs/train-loop; prints what it got

It runs the real Codex CLI in local sandboxes against the scripted model, which this script serves
itself at two endpoints (version 3 moves to the second, as a trainer serving a new version from fresh
servers would). The trainer submits GRPO groups of 2 samples, "trains" on each wave's accepted rows,
announces the next version, and submits the next wave while older sessions still run:

- version 1: the ``late`` task starts and is held at the model (a ``wait`` step) while the trainer moves
  on; the ``broken`` task's endpoint answers 429, which this run's policy masks at once;
- version 2: announced in place (same endpoint): calls of sessions still running are answered by it;
- version 3: a new endpoint and model name; then ``late`` is let go of. It started under version 1 and is
  decided at 3, past ``policy.staleness.max_versions: 1``: masked as too stale, never trained on.

Every row is handed on once its part file is written, accepted and masked alike, groups whole. At the end
the run is closed: no session, sandbox or worker is left, and the rows stay in the run directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from executor import Executor
from harnesses.testing.scripted_model import ScriptedModel, parse_steps

SOLVE = [{"type": "shell", "command": "echo 42 > answer.txt"}, {"type": "text", "text": "Wrote answer.txt."}]
WAVES = {1: ["add", "broken"], 2: ["mul", "sub"], 3: ["div", "mod"]}
SAMPLES = 2


def config(out: Path, sandboxes: Path | None, base_url: str) -> dict[str, Any]:
    return {
        "run_id": "train-loop",
        "out": str(out),
        "samples": SAMPLES,
        "harness": {"name": "codex"},
        "model": {"provider": "openai", "base_url": base_url, "name": "toy-policy"},
        "sandbox": {"root": str(sandboxes)} if sandboxes else {},
        # One upstream attempt: the broken endpoint's 429 ends its session at once.
        "gateway": {"max_attempts_per_request": 1},
        "policy": {
            "group": "mask_group",
            "rules": {"rate_limit_exceeded": {"retry": False}},
            "staleness": {"max_versions": 1, "action": "mask", "in_flight": "finish"},
        },
        "limits": {"deadline_s": 120},
        "concurrency": {"workers": 2, "sessions_per_worker": 3},
    }


def task(name: str) -> dict[str, Any]:
    return {
        "id": name,
        "prompt": f"Write the answer of '{name}' to answer.txt",
        "verify": "test -s answer.txt",
    }


class Models:
    """Two scripted endpoints, served from a thread of their own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.servers = [
            ScriptedModel(parse_steps(SOLVE), model_names=(n,)) for n in ("toy-policy", "toy-policy-v3")
        ]
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        for server in self.servers:
            asyncio.run_coroutine_threadsafe(server.start(), self.loop).result(30)

    def script(self, task_id: str, steps: list[dict[str, Any]]) -> None:
        for server in self.servers:
            for sample in range(SAMPLES):
                server.set_script(f"{task_id}.s{sample}.a1", parse_steps(steps))

    def stop(self) -> None:
        for server in self.servers:
            asyncio.run_coroutine_threadsafe(server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def collect(executor: Executor, tasks: set[str], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Take batches as they land until every sample of ``tasks`` is in; the rows of those tasks."""
    wave: list[dict[str, Any]] = []
    while len(wave) < len(tasks) * SAMPLES:
        batch = executor.next_batch(timeout_s=600)
        if batch is None:
            raise RuntimeError(f"the run ended before {sorted(tasks)} were in")
        for row in batch.to_pylist():
            rows.append(row)
            wave += [row] if row["task_id"] in tasks else []
            calls = [(c["policy_version"], c["replica"]) for c in row["model_calls"]]
            print(
                f"  {row['rollout_id']:<12} v{row['policy_version']} staleness {row['staleness']} "
                f"{row['decision']:<6} reward {row['reward']}  calls answered by {calls}"
                f"  ({row['decision_reason']})"
            )
    return wave


def main(out: Path, sandboxes: Path | None = None) -> dict[str, Any]:
    models = Models()
    first, second = (s.base_url for s in models.servers)
    models.script("late", [{"type": "wait", "gate": "late", "max_s": 300}, *SOLVE])
    models.script("broken", [{"type": "error", "status": 429}])
    rows: list[dict[str, Any]] = []
    try:
        with Executor(config(out, sandboxes, first), policy_version=1) as executor:
            executor.submit([task("late")])  # held at the model until version 3
            for version, names in WAVES.items():
                if version == 2:
                    executor.update_policy(2)  # new weights, same servers
                if version == 3:
                    executor.update_policy(3, base_url=second, model="toy-policy-v3")
                print(f"policy version {version}: submitting {names}")
                executor.submit([task(n) for n in names])
                if version == 3:
                    models.servers[0].release("late")
                    names = [*names, "late"]
                wave = collect(executor, set(names), rows)
                trained = [r["reward"] for r in wave if r["decision"] == "accept"]
                print(f"  trained version {version} on {len(trained)} rows (mean reward {_mean(trained)})")
            summary = executor.close()
    finally:
        models.stop()
    stale = [r for r in rows if r["decision"] == "mask" and r["decision_reason"].startswith("group: stale")]
    result = {
        "delivered": len(rows),
        "by_decision": dict(Counter(r["decision"] for r in rows)),
        "too_stale": len(stale),
        "versions": summary.versions,
        "pending": summary.pending,
        "run_dir": summary.run_dir,
        "endpoints": [first, second],
    }
    print(json.dumps(result))
    return result


def _mean(values: list[float]) -> str:
    return f"{sum(values) / len(values):.2f}" if values else "-"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("runs"), help="output root (the run: OUT/train-loop)"
    )
    parser.add_argument(
        "--sandboxes", type=Path, default=None, help="where sandboxes go (default: the provider's)"
    )
    args = parser.parse_args()
    if (args.out / "train-loop").exists():
        # Run again, it would resume a finished run: nothing left to deliver, nothing to show.
        done = args.out / "train-loop"
        sys.exit(f"train_loop.py: {done} exists (an earlier toy run): remove it, or pass --out elsewhere")
    main(args.out.resolve(), args.sandboxes.resolve() if args.sandboxes else None)
