"""Chaos at the model endpoint: a 429 outage, reset streams, an endpoint that accepts and says nothing."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from harnesses.testing.scripted_model import ScriptedModel, parse_steps
from tests.chaos.conftest import (
    FAST_INFRA_RETRY,
    OK_SCRIPT,
    figures,
    report,
    rows_of,
    run,
    wait_no_leaks,
    write_config,
    write_tasks,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("codex_installed")]


@pytest.fixture
def outage_model() -> Iterator[ScriptedModel]:
    """A scripted endpoint in this process that answers 429 to every request, so we count each one."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    model = ScriptedModel(
        parse_steps([{"type": "error", "status": 429, "headers": {"Retry-After": "0"}}]),
        model_names=("scripted-model",),
    )
    asyncio.run_coroutine_threadsafe(model.start(), loop).result(30)
    try:
        yield model
    finally:
        asyncio.run_coroutine_threadsafe(model.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_429_to_every_request_stays_within_the_budget_and_loses_nothing(tmp_path, outage_model):
    n, budget, per_session = 6, 4, 4
    tasks = write_tasks(tmp_path / "tasks.jsonl", n, lambda i: OK_SCRIPT)
    cfg = write_config(
        tmp_path,
        "outage",
        tasks,
        model={"provider": "openai", "base_url": outage_model.base_url, "name": "scripted-model"},
        gateway={
            "max_attempts_per_request": 2,
            "max_attempts_per_session": per_session,
            "backoff_base_s": 0.05,
        },
        policy={
            "retry_budget": budget,
            "rules": {"rate_limit_exceeded": {**FAST_INFRA_RETRY, "max_attempts": 3}},
        },
    )
    proc = run(cfg)
    rows = rows_of(tmp_path, "outage")
    upstream = sum(len(outage_model.requests(r["rollout_id"])) for r in rows)
    expected = {(f"t{i:03d}", 0) for i in range(n)}
    fig = figures(rows, expected)
    final = [r for r in rows if r["final"]]
    leaks = wait_no_leaks(str(tmp_path / "sandboxes"))
    report(
        "429-forever",
        f"{n}tasks",
        len(final),
        fig["lost"],
        fig["dup"],
        leaks,
        upstream_requests=upstream,
        attempts=len(rows),
        exit=proc.returncode,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]  # the run completes: every row final, none pending
    # The run retry budget bounds the attempts, the gateway's session budget the requests of each.
    assert len(rows) <= n + budget
    assert sum(r["decision"] == "retry" for r in rows) <= budget
    assert 0 < upstream <= len(rows) * per_session
    assert fig == {"lost": 0, "dup": 0} and leaks == 0
    assert {r["decision"] for r in final} == {"mask"}
    assert all(r["failure_kind"] == "rate_limit_exceeded" and r["reward"] is None for r in rows)
    summary = json.loads((tmp_path / "out" / "outage" / "summary.json").read_text())
    assert summary["reward"]["count"] == 0 and summary["masked"] == n


def test_reset_streams_complete_and_are_recorded_as_transport_errors(tmp_path):
    n = 10
    reset = {0, 3, 6}  # 30% of sessions have their first stream cut with a TCP reset
    tasks = write_tasks(
        tmp_path / "tasks.jsonl",
        n,
        lambda i: ([{"type": "drop", "after_chunks": 1}] if i in reset else []) + OK_SCRIPT,
    )
    proc = run(write_config(tmp_path, "resets", tasks))
    rows = rows_of(tmp_path, "resets")
    fig = figures(rows, {(f"t{i:03d}", 0) for i in range(n)})
    resets = [(r["task_id"], a) for r in rows for a in r["model_calls"] if a["kind"] == "transport_error"]
    leaks = wait_no_leaks(str(tmp_path / "sandboxes"))
    final = [r for r in rows if r["final"]]
    report("stream-reset-30pct", f"{n}tasks", len(resets), fig["lost"], fig["dup"], leaks)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert fig == {"lost": 0, "dup": 0} and leaks == 0
    assert {t for t, _ in resets} == {f"t{i:03d}" for i in reset}
    assert all((r["decision"], r["reward"]) == ("accept", 1.0) for r in final), [
        (r["task_id"], r["failure_kind"], r["error_message"]) for r in final if r["reward"] != 1.0
    ]


def test_an_endpoint_that_accepts_and_says_nothing_is_never_graded_at_the_deadline(tmp_path):
    n, deadline, grace = 6, 4.0, 3.0
    tasks = write_tasks(
        tmp_path / "tasks.jsonl", n, lambda i: [{"type": "hang", "max_s": 600}], deadline_s=deadline
    )
    cfg = write_config(
        tmp_path,
        "silent",
        tasks,
        limits={"deadline_s": 60, "grace_s": grace},
        # Stall bounds far past the deadline: the deadline, not the gateway's timer, ends each session.
        gateway={"first_byte_timeout_s": 600, "chunk_timeout_s": 600},
    )
    proc = run(cfg)
    rows = rows_of(tmp_path, "silent")
    fig = figures(rows, {(f"t{i:03d}", 0) for i in range(n)})
    leaks = wait_no_leaks(str(tmp_path / "sandboxes"))
    longest = max(r["t_agent_s"] for r in rows)
    report(
        "accept-then-silence", f"{n}tasks", len(rows), fig["lost"], fig["dup"], leaks, longest_agent_s=longest
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert fig == {"lost": 0, "dup": 0} and leaks == 0
    for r in rows:
        assert r["failure_kind"] == "model_timeout" and r["timed_out"], r["error_message"]
        assert r["reward"] is None and not r["verified"]
        assert r["t_agent_s"] <= deadline + grace + 5  # the bound the deadline promises, with slack for load
    assert {r["decision"] for r in rows if r["final"]} == {"mask"}


def test_a_third_of_sessions_stalling_forever_are_retried_masked_and_never_graded(tmp_path):
    n, per_request, stall_s = 10, 2, 2.0
    stalled = {1, 4, 7}  # 30%: every model request of these sessions is accepted and never answered
    hang = [{"type": "hang", "max_s": 600}]
    tasks = write_tasks(tmp_path / "tasks.jsonl", n, lambda i: hang if i in stalled else OK_SCRIPT)
    cfg = write_config(
        tmp_path,
        "stall30",
        tasks,
        gateway={
            "max_attempts_per_request": per_request,
            "first_byte_timeout_s": stall_s,
            "chunk_timeout_s": stall_s,
        },
    )
    started = time.monotonic()
    proc = run(cfg)
    wall = time.monotonic() - started
    rows = rows_of(tmp_path, "stall30")
    fig = figures(rows, {(f"t{i:03d}", 0) for i in range(n)})
    leaks = wait_no_leaks(str(tmp_path / "sandboxes"))
    stalled_ids = {f"t{i:03d}" for i in stalled}
    upstream = sum(len(r["model_calls"]) for r in rows if r["task_id"] in stalled_ids)
    kinds = Counter((r["failure_kind"], r["decision"]) for r in rows)
    report(
        "stall-30pct",
        f"{n}tasks",
        sum(r["final"] for r in rows),
        fig["lost"],
        fig["dup"],
        leaks,
        rows_by_kind_and_decision=dict(kinds),
        stalled_upstream_attempts=upstream,
        wall_s=round(wall, 1),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert fig == {"lost": 0, "dup": 0} and leaks == 0
    for r in rows:
        if r["task_id"] in stalled_ids:
            assert r["failure_kind"] == "model_timeout", r["error_message"]
            assert r["reward"] is None and not r["verified"]  # never graded, not even as a zero
            assert len(r["model_calls"]) <= per_request  # the gateway gave up on its first request
        else:
            assert (r["decision"], r["reward"]) == ("accept", 1.0), r["error_message"]
    finals = {r["task_id"]: r["decision"] for r in rows if r["final"]}
    assert {t for t, d in finals.items() if d == "mask"} == stalled_ids
    assert len(rows) == n + len(stalled)  # each stalled sample retried once (max_attempts 2), then masked


def test_the_run_retry_budget_holds_across_a_resume(tmp_path, outage_model):
    budget = 3
    tasks = tmp_path / "tasks.jsonl"
    policy = {
        "retry_budget": budget,
        "rules": {"rate_limit_exceeded": {**FAST_INFRA_RETRY, "max_attempts": 3}},
    }
    model = {"provider": "openai", "base_url": outage_model.base_url, "name": "scripted-model"}
    gateway = {"max_attempts_per_request": 1, "max_attempts_per_session": 2}
    write_tasks(tasks, 2, lambda i: OK_SCRIPT)
    cfg = write_config(tmp_path, "budget", tasks, model=model, gateway=gateway, policy=policy)
    first = run(cfg)
    assert first.returncode == 0, first.stderr[-2000:]
    used = sum(r["decision"] == "retry" for r in rows_of(tmp_path, "budget"))
    assert used == budget  # two tasks would take four retries; the budget stops at three
    write_tasks(tasks, 5, lambda i: OK_SCRIPT)  # the same run, resumed with three more tasks
    again = run(cfg)
    assert again.returncode == 0, again.stderr[-2000:]
    rows = rows_of(tmp_path, "budget")
    fig = figures(rows, {(f"t{i:03d}", 0) for i in range(5)})
    retries = sum(r["decision"] == "retry" for r in rows)
    report("429-budget-across-resume", "2+3tasks", len(rows), fig["lost"], fig["dup"], 0, retries=retries)
    assert fig == {"lost": 0, "dup": 0}
    assert retries == budget  # the resumed run found the budget spent
    for r in rows:
        if r["task_id"] in ("t002", "t003", "t004"):
            assert (r["attempt"], r["decision"]) == (1, "mask")
            assert "budget" in r["decision_reason"]
