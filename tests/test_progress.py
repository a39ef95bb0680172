"""Live progress: its numbers, both renderings, and what it costs the driver per row (printed)."""

from __future__ import annotations

import io
import json
import time

from rich.console import Console

from executor.progress import Progress, render


def _feed(p: Progress) -> None:
    p.record("accept", "none", True, status="completed", harness="codex", provider="local")
    p.record("retry", "rate_limit_exceeded", False, status="failed", harness="codex", provider="local")
    p.record("mask", "rate_limit_exceeded", True, status="failed", harness="codex", provider="local")
    p.record("accept", "agent_timeout", True, status="incomplete", harness="opencode", provider="ecs")


def test_snapshot_counts():
    stream = io.StringIO()
    p = Progress("r", total=10, stream=stream)
    _feed(p)
    p.in_flight, p.waiting_retry = 4, 1
    snap = p.snapshot()
    assert (snap["final"], snap["rows"], snap["queued"]) == (3, 4, 10 - 3 - 4 - 1)
    assert snap["statuses"] == {"completed": 1, "failed": 1, "incomplete": 1}
    assert snap["failure_kinds"] == {"none": 1, "rate_limit_exceeded": 2, "agent_timeout": 1}
    assert snap["mask_rate"] == round(1 / 3, 4)
    assert snap["groups"] == [
        {"harness": "codex", "provider": "local", "accept": 1, "retry": 1, "mask": 1},
        {"harness": "opencode", "provider": "ecs", "accept": 1},
    ]
    assert snap["per_s"] > 0 and snap["eta_s"] is not None


def test_json_lines_off_a_terminal():
    stream = io.StringIO()
    p = Progress("r", total=4, stream=stream, interval_s=3600)
    _feed(p)
    p.tick()  # the first tick always writes
    p.tick()  # throttled
    p.close()  # forced
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    assert lines[-1]["event"] == "progress" and lines[-1]["final"] == 3 and lines[-1]["eta_s"] is not None


def test_live_display_on_a_terminal():
    stream = io.StringIO()
    p = Progress("demo-run", total=4, stream=stream, live=True)
    _feed(p)
    p.close()
    text = stream.getvalue()
    for expected in ("demo-run", "mask rate", "33.3%", "in flight", "queued", "ETA", "opencode", "ecs"):
        assert expected in text, expected


def test_cost_per_row_is_printed():
    """A benchmark, not a timing assertion: what the driver's thread pays per row (record + tick), in
    both modes, and what one terminal frame costs the refresh thread that draws it."""
    rows = 100_000
    for live in (False, True):
        p = Progress("bench", total=rows, stream=io.StringIO(), live=live)
        t0 = time.perf_counter()
        for i in range(rows):
            p.record(
                "accept" if i % 7 else "mask",
                "none",
                True,
                status="completed",
                harness=f"h{i % 4}",
                provider=f"p{i % 3}",
            )
            p.tick()
        per_row = (time.perf_counter() - t0) / rows
        p.close()
        print(f"progress live={live}: driver thread {per_row * 1e6:.2f} us per row (record + tick)")
        assert p.final == rows
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    snap = p.snapshot()
    frames = 20
    t0 = time.perf_counter()
    for _ in range(frames):
        console.print(render(snap))
    print(f"progress: one terminal frame {(time.perf_counter() - t0) / frames * 1e3:.1f} ms (refresh thread)")
