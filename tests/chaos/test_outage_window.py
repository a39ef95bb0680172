"""Chaos at the model endpoint, at full scale: 429 to every request for 20 s, then service as usual.

The endpoint runs in this process, so every upstream request is counted where it lands; the run is a real
`rollout run` (Ray, Codex, local sandboxes) with the gateway's budgets, the policy's backoff and the
driver's adaptive admission all on, as a long provider outage would meet them.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from harnesses.testing.scripted_model import ScriptedModel, parse_steps
from tests.chaos.conftest import (
    OK_SCRIPT,
    REPO,
    env,
    figures,
    report,
    rollout,
    rows_of,
    wait_no_leaks,
    write_config,
    write_tasks,
)

# Long enough that the gateway's retries of a session (3 attempts, 2 s apart) cannot ride it out, so the
# policy's retries and the admission's hold (max_hold_s 10) meet it; 30 s before, which proved no more
# (no row was masked at either) and took 10 s longer.
OUTAGE_S = 20.0
RETRY_AFTER = "2"


@contextmanager
def served(model: ScriptedModel) -> Iterator[ScriptedModel]:
    """The model on an event loop of its own thread, so the test can read its counters while it serves."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(model.start(), loop).result(30)
    try:
        yield model
    finally:
        asyncio.run_coroutine_threadsafe(model.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@pytest.fixture
def ok_model() -> Iterator[ScriptedModel]:
    with served(ScriptedModel(parse_steps(OK_SCRIPT), model_names=("scripted-model",))) as model:
        yield model


def test_an_outage_answers_every_model_request_and_takes_no_script_step(ok_model):
    ok_model.outage(600, 429, {"Retry-After": RETRY_AFTER})
    root = ok_model.base_url.removesuffix("/v1")
    with httpx.Client(timeout=10) as client:
        health = client.get(f"{root}/_ctl/health")
        listed = client.get(f"{ok_model.base_url}/models")
        called = client.post(
            f"{ok_model.base_url}/responses",
            json={"model": "scripted-model", "input": "hi"},
            headers={"x-rollout-session": "s1"},
        )
    assert health.status_code == 200  # control routes stay open, so a test can still drive the model
    assert (listed.status_code, called.status_code) == (429, 429)
    assert called.headers["retry-after"] == RETRY_AFTER
    assert called.json()["error"]["code"] == "rate_limit_exceeded"
    outage = ok_model.outage_report()
    assert outage is not None and outage.answered == 2 and outage.started_at is not None
    assert ok_model.requests("s1") == []  # the script waits untouched for the end of the window
    with pytest.raises(ValueError, match="outage status"):
        ok_model.outage(10, status=700)


def _accepted(row: dict[str, Any]) -> bool:
    return (row["decision"], row["status"], row["failure_kind"], row["reward"]) == (
        "accept",
        "completed",
        "none",
        1.0,
    )


@pytest.mark.integration
@pytest.mark.usefixtures("codex_installed")
def test_429_for_20s_slows_the_run_stays_within_the_budgets_and_loses_nothing(tmp_path, ok_model):
    n, workers, per_worker = 8, 1, 4  # four sessions in flight when admission is wide open
    per_request, per_session, task_attempts, budget = 3, 3, 6, 16
    ok_model.outage(OUTAGE_S, 429, {"Retry-After": RETRY_AFTER})
    tasks = write_tasks(tmp_path / "tasks.jsonl", n, lambda i: OK_SCRIPT)
    cfg = write_config(
        tmp_path,
        "outage20",
        tasks,
        model={"provider": "openai", "base_url": ok_model.base_url, "name": "scripted-model"},
        gateway={
            "max_attempts_per_request": per_request,
            "max_attempts_per_session": per_session,
            "backoff_base_s": 0.5,
            "backoff_cap_s": 4.0,  # Retry-After is the floor of each wait
            "max_retry_after_s": 30,
            "retry_deadline_s": 30,
        },
        policy={
            "retry_budget": budget,
            "rules": {
                "rate_limit_exceeded": {
                    "retry": True,
                    "max_attempts": task_attempts,
                    "backoff_base_s": 2.0,
                    "backoff_cap_s": 10.0,
                }
            },
            # The run makes at most n + budget attempts, so this breaker cannot trip: the behaviour under
            # test is a run that rides the outage out and completes, not one that aborts.
            "breaker": {"max_consecutive_infra": n + budget + 1},
        },
        concurrency={
            "workers": workers,
            "sessions_per_worker": per_worker,
            "admission": {"adaptive": True, "floor": 1, "decrease": 0.5, "cooldown_s": 5, "max_hold_s": 10},
        },
    )
    began = time.monotonic()
    # --no-preflight: the preflight's requests would open the window before Ray starts and meet two of
    # its 429s that are no session's, while this test holds every 429 sent against the gateway's evidence.
    proc = subprocess.run(
        rollout("run", str(cfg), "--no-preflight"),
        capture_output=True,
        text=True,
        timeout=400,
        env=env(),
        cwd=REPO,
    )
    run_s = round(time.monotonic() - began, 1)  # printed, never asserted
    rows = rows_of(tmp_path, "outage20")
    outage = ok_model.outage_report()
    assert outage is not None and outage.ends_at is not None, "the run never reached the endpoint"
    fig = figures(rows, {(f"t{i:03d}", 0) for i in range(n)})
    final = [r for r in rows if r["final"]]
    accepted = [r for r in final if _accepted(r)]
    masked = [r for r in final if r["decision"] == "mask"]
    # Sessions that began once the endpoint was back: every model call of theirs came after the window.
    after = [
        r
        for r in rows
        if r["model_calls"] and min(a["started_at"] for a in r["model_calls"]) >= outage.ends_at
    ]
    pushed_back = sum(a["status"] == 429 for r in rows for a in r["model_calls"])
    retries = sum(r["decision"] == "retry" for r in rows)
    # Each session attempt forwards at most per_session failed calls before the gateway closes it, and the
    # run makes at most n + budget session attempts.
    bound = per_session * (n + budget)
    leaks = wait_no_leaks(str(tmp_path / "sandboxes"))
    report(
        "429-for-20s",
        f"{n}tasks/{workers * per_worker}inflight",
        len(final),
        fig["lost"],
        fig["dup"],
        leaks,
        upstream_during_outage=outage.answered,
        bound=bound,
        accepted=len(accepted),
        masked=len(masked),
        accepted_after_outage=sum(_accepted(r) for r in after),
        attempts=len(rows),
        retries=retries,
        exit=proc.returncode,
        run_s=run_s,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "outage20" / "summary.json").read_text())
    assert summary["stopped_by"] is None and summary["pending"] == 0
    assert fig == {"lost": 0, "dup": 0} and leaks == 0
    assert len(final) == n and len(accepted) + len(masked) == n, [
        (r["task_id"], r["decision"], r["failure_kind"]) for r in final if r not in accepted + masked
    ]
    assert all(r["reward"] is None for r in masked)
    # The outage is the only failure: every retried or masked attempt met the endpoint's 429s.
    assert {r["failure_kind"] for r in rows if not _accepted(r)} <= {"rate_limit_exceeded"}
    assert 0 < outage.answered <= bound
    assert pushed_back == outage.answered  # the gateway's evidence holds every 429 the endpoint sent
    assert len(rows) <= n + budget and retries <= budget
    assert after and all(_accepted(r) for r in after)
