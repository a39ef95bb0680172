"""Launch directories no row names: found from their names and the resume state alone."""

from __future__ import annotations

import json

import pytest

from executor.config import RunConfig
from executor.orphans import adopt, find, parse_launch
from executor.schema import rows_to_batch, with_decisions
from executor.session import SessionRequest, lost_row
from executor.storage import locate
from executor.store import ResumeState, RunStore
from executor.tasks import Task
from tests.s3_server import s3_server


def test_a_launch_name_parses_with_dots_in_the_task_id():
    assert parse_launch("repo.v2.fix-1.s3.a12.0a9f3c") == ("repo.v2.fix-1", 3, 12)
    assert parse_launch("t0.s0.a1") is None  # no launch tag: not a launch directory
    assert parse_launch("notes.txt") is None


def test_orphans_are_attempts_without_a_row_and_doubles_are_checked(tmp_path):
    evidence = tmp_path / "evidence"
    names = [
        "done.s0.a1.aaaaaa",  # final: its row names it
        "lost.s0.a1.bbbbbb",  # a row for attempt 1 (retry) names it
        "lost.s0.a2.cccccc",  # no row for attempt 2: adopted
        "lost.s0.a2.dddddd",  # a second launch of the same attempt: removed, the other is adopted
        "rerun.s0.a1.eeeeee",  # attempt 1 has a row, which names one of these two
        "rerun.s0.a1.ffffff",
        "new.s1.a1.123456",  # a sample with no row at all
    ]
    for name in names:
        (evidence / name).mkdir(parents=True)
    state = ResumeState(final={("done", 0)}, last_attempt={("done", 0): 1, ("lost", 0): 1, ("rerun", 0): 1})
    orphans, doubtful = find(locate(evidence), state)
    assert sorted((o.task_id, o.sample_index, o.attempt, o.evidence_dir.name) for o in orphans) == [
        ("lost", 0, 2, "lost.s0.a2.cccccc"),
        ("new", 1, 1, "new.s1.a1.123456"),
    ]
    assert sorted(d.name for d in doubtful) == [
        "lost.s0.a2.dddddd",
        "rerun.s0.a1.eeeeee",
        "rerun.s0.a1.ffffff",
    ]

    # The run's rows: one names rerun's second launch; the task file has "lost", not "new" any more.
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "lost", "prompt": "p"}) + "\n")
    cfg = RunConfig(tasks=str(tmp_path / "tasks.jsonl"), run_id="r")
    rerun = lost_row(SessionRequest("r", Task(id="rerun", prompt="p"), 0, 1), "command", "local", "x")
    rerun["evidence_dir"] = str(evidence / "rerun.s0.a1.ffffff")
    store = RunStore(locate(tmp_path))
    store.append(with_decisions(rows_to_batch([rerun]), {"final": [False]}))
    store.flush()

    written: list[dict] = []
    assert adopt(locate(tmp_path), state, cfg, written.extend) == (2, 2)
    assert sorted(p.name for p in evidence.iterdir()) == sorted(
        set(names) - {"lost.s0.a2.dddddd", "rerun.s0.a1.eeeeee"}
    )
    assert [(r["rollout_id"], r["failure_kind"], r["evidence_dir"]) for r in written] == [
        ("lost.s0.a2", "cancelled", str(evidence / "lost.s0.a2.cccccc"))
    ]
    assert state.last_attempt[("lost", 0)] == 2 and state.last_attempt[("new", 1)] == 1


@pytest.mark.integration
def test_on_an_object_store_too(tmp_path, monkeypatch):
    """A driver killed after a worker put a launch's evidence to S3, before its row was written."""
    with s3_server(tmp_path / "moto.log") as s3:
        s3.client().create_bucket(Bucket="runs")
        for key, value in s3.env().items():
            monkeypatch.setenv(key, value)
        run_dir = locate("s3://runs/r")
        for name in ("t0.s0.a1.aaaaaa", "t0.s0.a1.bbbbbb"):
            (run_dir / "evidence" / name / "harness.stdout.gz").write_bytes(b"x")
        (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "t0", "prompt": "p"}) + "\n")
        cfg = RunConfig(tasks=str(tmp_path / "tasks.jsonl"), run_id="r")
        written: list[dict] = []
        assert adopt(run_dir, ResumeState(), cfg, written.extend) == (1, 1)
        assert [r["evidence_dir"] for r in written] == ["s3://runs/r/evidence/t0.s0.a1.aaaaaa"]
        # (pyarrow keeps the parent "directory" as an empty marker object, r/evidence/)
        files = [k for k in s3.keys("runs") if not k.endswith("/")]
        assert files == ["r/evidence/t0.s0.a1.aaaaaa/harness.stdout.gz"]
