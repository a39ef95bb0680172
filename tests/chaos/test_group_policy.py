"""The group policy through a real run: samples of a task masked together, or resubmitted together."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from tests.chaos.conftest import (
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

N_TASKS, SAMPLES = 4, 3


def _run(tmp_path, mode: str) -> list[dict]:
    tasks = write_tasks(tmp_path / "tasks.jsonl", N_TASKS, lambda i: OK_SCRIPT)
    # A quarter of sandbox starts fail and are not retried per row, so some groups have one masked sample.
    cfg = write_config(
        tmp_path,
        mode,
        tasks,
        samples=SAMPLES,
        sandbox={"inject_start_failures": 0.25},
        policy={
            "group": mode,
            "group_resubmits": 1,
            "rules": {"sandbox_start_failed": {"retry": False}},
        },
    )
    proc = run(cfg)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = rows_of(tmp_path, mode)
    expected = {(f"t{i:03d}", s) for i in range(N_TASKS) for s in range(SAMPLES)}
    fig = figures(rows, expected)
    leaks = wait_no_leaks(str(tmp_path / "sandboxes"))
    grouped = sum(1 for r in rows if (r["decision_reason"] or "").startswith("group:"))
    report(f"group-{mode}", f"{N_TASKS}x{SAMPLES}", grouped, fig["lost"], fig["dup"], leaks)
    assert fig == {"lost": 0, "dup": 0} and leaks == 0
    return rows


def _finals_by_task(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r["final"]:
            out[r["task_id"]].append(r)
    return out


def test_mask_group_masks_every_sample_of_a_task_with_one_masked(tmp_path):
    rows = _run(tmp_path, "mask_group")
    finals = _finals_by_task(rows)
    masked_groups = 0
    for task, group in finals.items():
        decisions = {r["decision"] for r in group}
        assert len(decisions) == 1, (task, [(r["sample_index"], r["decision"]) for r in group])
        if decisions == {"mask"}:
            masked_groups += 1
            assert any(r["failure_kind"] == "sandbox_start_failed" for r in group)
            assert all(r["reward"] is None for r in group)
            siblings = [r for r in group if r["failure_kind"] == "none"]
            assert all(r["decision_reason"].startswith("group:") for r in siblings)
    assert masked_groups >= 1
    summary = json.loads((tmp_path / "out" / "mask_group" / "summary.json").read_text())
    accepted = sum(len(g) for g in finals.values() if g[0]["decision"] == "accept")
    assert summary["reward"]["count"] == accepted and summary["masked"] == masked_groups * SAMPLES


def test_resubmit_group_reruns_the_whole_group_then_decides(tmp_path):
    rows = _run(tmp_path, "resubmit_group")
    resubmitted = {r["task_id"] for r in rows if "resubmitted" in (r["decision_reason"] or "")}
    assert resubmitted, "no group was resubmitted"
    for task in resubmitted:
        first = [r for r in rows if r["task_id"] == task and r["attempt"] == 1]
        assert len(first) == SAMPLES and all(r["decision"] == "retry" and not r["final"] for r in first)
        second = [r for r in rows if r["task_id"] == task and r["attempt"] == 2]
        assert len(second) == SAMPLES  # every sample ran again, not only the masked one
    for task, group in _finals_by_task(rows).items():
        assert len({r["decision"] for r in group}) == 1, task
        assert len(group) == SAMPLES
