"""``rollout status``: what a run has produced so far, read from its part files (so it works mid-run)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from rich.console import Console
from rich.table import Table

from executor.row import columns
from executor.runs import run_state
from executor.storage import Where, locate
from executor.store import iter_batches

COLUMNS = list(columns("status"))
EXAMPLE_CHARS = 120


def _first_line(text: str | None, limit: int = EXAMPLE_CHARS) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class _Tally:
    rows: int = 0
    final: int = 0
    decisions: Counter[str] = field(default_factory=Counter)
    rewards: list[float] = field(default_factory=list)  # accepted, verified rows only

    def add(self, row: dict[str, Any]) -> None:
        self.rows += 1
        self.final += int(bool(row["final"]))
        self.decisions[row["decision"]] += 1
        if row["decision"] == "accept" and row["reward"] is not None:
            self.rewards.append(row["reward"])

    def as_dict(self) -> dict[str, Any]:
        finals = self.decisions["accept"] + self.decisions["mask"]
        return {
            "rows": self.rows,
            "final": self.final,
            "accept": self.decisions["accept"],
            "mask": self.decisions["mask"],
            "retry": self.decisions["retry"],
            "mask_rate": round(self.decisions["mask"] / finals, 4) if finals else None,
            "mean_reward": _mean(self.rewards),
        }


def _batches(run_dir: Where) -> Iterator[pa.RecordBatch]:
    """The status columns, error messages cut short in Arrow: a million rows of 16k-character messages
    must not all become Python strings."""
    for batch in iter_batches(locate(run_dir) / "rows", COLUMNS):
        i = batch.schema.get_field_index("error_message")
        cut = pc.utf8_slice_codeunits(batch.column(i), 0, 4 * EXAMPLE_CHARS)
        yield batch.set_column(i, "error_message", cut)


def status_data(where: Where, slowest: int = 5) -> dict[str, Any]:
    """Everything ``rollout status`` shows, as plain data (``--json``)."""
    run_dir = locate(where)
    rows = [row for batch in _batches(run_dir) for row in batch.to_pylist()]
    state, summary = run_state(run_dir)
    overall = _Tally()
    by_outcome: dict[tuple[str, str, str], _Tally] = defaultdict(_Tally)
    by_placement: dict[tuple[str, str], _Tally] = defaultdict(_Tally)
    examples: dict[str, tuple[int, str]] = {}
    attempts: dict[tuple[str, int], int] = {}
    for row in rows:
        overall.add(row)
        by_outcome[(row["status"], row["failure_kind"], row["decision"])].add(row)
        by_placement[(row["harness"] or "?", row["sandbox_provider"] or "?")].add(row)
        kind = row["failure_kind"]
        if kind != "none":
            count, example = examples.get(kind, (0, ""))
            examples[kind] = (count + 1, example or _first_line(row["error_message"]))
        key = (row["task_id"], row["sample_index"])
        attempts[key] = max(attempts.get(key, 0), row["attempt"])
    timed = [r for r in rows if r["t_total_s"] is not None]
    timed.sort(key=lambda r: r["t_total_s"], reverse=True)
    return {
        "run_id": run_dir.name,
        "state": state,
        "stopped": summary.get("stopped") if state == "stopped" else None,
        "pending": summary.get("pending") if state in ("complete", "incomplete", "stopped") else None,
        **overall.as_dict(),
        "pairs": len(attempts),
        "pairs_retried": sum(1 for a in attempts.values() if a > 1),
        "by_outcome": [
            {"status": s, "failure_kind": k, "decision": d, **t.as_dict()}
            for (s, k, d), t in sorted(by_outcome.items())
        ],
        "by_placement": [
            {"harness": h, "provider": p, **t.as_dict()} for (h, p), t in sorted(by_placement.items())
        ],
        "failures": [
            {"failure_kind": k, "rows": n, "example": e}
            for k, (n, e) in sorted(examples.items(), key=lambda kv: -kv[1][0])
        ],
        "slowest": [
            {
                "rollout_id": r["rollout_id"],
                "status": r["status"],
                "failure_kind": r["failure_kind"],
                "decision": r["decision"],
                "t_total_s": r["t_total_s"],
            }
            for r in timed[:slowest]
        ],
    }


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def counts_table(data: dict[str, Any]) -> Table:
    """Rows by status, failure kind and decision: what ``rollout run`` prints at its end."""
    table = Table(title=f"{data['run_id']}: {data['rows']} rows, {data['final']} final")
    for name in ("status", "failure_kind", "decision", "rows", "final", "mean reward"):
        table.add_column(name, justify="right" if name in ("rows", "final", "mean reward") else "left")
    for g in data["by_outcome"]:
        table.add_row(
            g["status"],
            g["failure_kind"],
            g["decision"],
            str(g["rows"]),
            str(g["final"]),
            _fmt(g["mean_reward"]),
        )
    return table


def print_status(data: dict[str, Any], console: Console) -> None:
    state = data["state"] + (f" ({data['stopped']})" if data["stopped"] else "")
    pending = "-" if data["pending"] is None else str(data["pending"])
    console.print(
        f"[bold]{data['run_id']}[/]: {state}; {data['pairs']} (task, sample) pairs seen, "
        f"{data['final']} final rows, pending {pending}; retried pairs {data['pairs_retried']} "
        f"({data['retry']} retry rows); masked {data['mask']} "
        f"(mask rate {_fmt(data['mask_rate'], '.1%')}); mean reward {_fmt(data['mean_reward'])}",
        highlight=False,
    )
    console.print(counts_table(data))

    placement = Table(title="by harness and provider")
    for name in ("harness", "provider", "rows", "accept", "mask", "retry", "mask rate", "mean reward"):
        placement.add_column(name, justify="left" if name in ("harness", "provider") else "right")
    for g in data["by_placement"]:
        placement.add_row(
            g["harness"],
            g["provider"],
            str(g["rows"]),
            str(g["accept"]),
            str(g["mask"]),
            str(g["retry"]),
            _fmt(g["mask_rate"], ".1%"),
            _fmt(g["mean_reward"]),
        )
    console.print(placement)

    if data["failures"]:
        failures = Table(title="failure kinds (every attempt)")
        failures.add_column("failure_kind")
        failures.add_column("rows", justify="right")
        failures.add_column("first error message")
        for f in data["failures"]:
            failures.add_row(f["failure_kind"], str(f["rows"]), f["example"])
        console.print(failures)

    if data["slowest"]:
        slow = Table(title="slowest rollouts")
        for name in ("rollout_id", "status", "failure_kind", "decision", "total s"):
            slow.add_column(
                name, justify="right" if name == "total s" else "left", no_wrap=name == "rollout_id"
            )
        for r in data["slowest"]:
            slow.add_row(
                r["rollout_id"], r["status"], r["failure_kind"], r["decision"], f"{r['t_total_s']:.1f}"
            )
        console.print(slow)
